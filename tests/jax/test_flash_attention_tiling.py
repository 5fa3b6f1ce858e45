"""Flash attention's tiling: the tuning table's keys are reachable, its entries are used
and fit the VMEM budget, and shapes outside the table keep the heuristic. Pure Python
(no kernel runs, no compile): the entries' compiles are in test_flash_attention_aot.py."""

import jax.numpy as jnp
import pytest

from tpu_kernels import chips, flash_attention as F, vmem

TABLE = F.TUNED_BLOCKS
ENTRIES = sorted(TABLE)


def _key(entry) -> F.TuningKey:
  return F.TuningKey(*entry)


def test_the_table_covers_the_headline_prefill_shapes():
  for seq in (4096, 32768):   # causal B=1, H=32/8, D=128 (issue 6's headline cases)
    assert ("v6e", "bfloat16", 128, 4, seq) in TABLE


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: "-".join(map(str, e)))
def test_every_key_is_produced_by_the_lookup(entry):
  """A key the lookup can never produce is dead data. The key's own fields, and shapes
  inside its bucket, map back to it."""
  key = _key(entry)
  dtype = jnp.dtype(key.dtype)
  lower_seq = max(F._MAX_SINGLE_BLOCK + 1, key.seq // 2 + 1)
  for seq in (lower_seq, key.seq):
    for d in (key.head_dim // 2 + 1, key.head_dim):
      for g in (key.group // 2 + 1, key.group):
        assert F.tuning_key(key.chip, dtype, seq, seq, d, g, causal=True) == key


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: "-".join(map(str, e)))
def test_every_entry_fits_and_is_used(entry):
  key, (block_q, block_k, limit) = _key(entry), TABLE[entry]
  chip = chips.get_chip(key.chip)
  assert chip.default_scoped_vmem_bytes <= limit <= chip.max_vmem_limit_bytes
  t = F.attention_tiling(key.seq, key.seq, key.head_dim, group=key.group,
                         dtype=jnp.dtype(key.dtype), chip=key.chip, causal=True)
  assert (t.block_q, t.block_k, t.vmem_limit_bytes) == (block_q, block_k, limit)
  assert t.vmem_plan_bytes <= vmem.vmem_budget(chip, limit)
  # A limit above the default is only asked for where the plan needs it.
  if limit > chip.default_scoped_vmem_bytes:
    assert t.vmem_plan_bytes > vmem.vmem_budget(chip, limit - vmem.MiB)
  # A caller's own limit wins: the tuned blocks only if they fit under it.
  small = F.attention_tiling(key.seq, key.seq, key.head_dim, group=key.group,
                             dtype=jnp.dtype(key.dtype), chip=key.chip, causal=True,
                             vmem_limit_bytes=chip.default_scoped_vmem_bytes)
  assert small.vmem_limit_bytes == chip.default_scoped_vmem_bytes
  assert small.vmem_plan_bytes <= vmem.vmem_budget(chip, chip.default_scoped_vmem_bytes)


def test_lookup_outside_the_table_falls_back_to_the_heuristic():
  assert F.tuning_key("v6e", jnp.bfloat16, 4096, 4096, 128, 4, causal=False) is None
  assert F.tuning_key("v6e", jnp.bfloat16, 4096, 4096, 128, 4, causal=True,
                      sliding_window=128) is None
  assert F.tuning_key("v6e", jnp.bfloat16, 4096, 2048, 128, 4, causal=True) is None
  assert F.tuning_key("v6e", jnp.bfloat16, 512, 512, 128, 4, causal=True) is None  # one block
  assert F.tuning_key("v6e", jnp.bfloat16, 4096, 4096, 320, 4, causal=True) is None
  assert F.tuning_key("v6e", jnp.bfloat16, 131072, 131072, 128, 4, causal=True) is None
  plain = F.attention_tiling(4096, 4096, 128, group=4, dtype=jnp.bfloat16, chip="v6e")
  windowed = F.attention_tiling(4096, 4096, 128, group=4, dtype=jnp.bfloat16, chip="v6e",
                                causal=True, sliding_window=128)
  assert plain == windowed      # both the heuristic


def test_a_tuned_pair_that_is_not_valid_for_the_length_is_not_used():
  """Inside a bucket the real length may not allow the tuned blocks (a block may pad a
  sequence by at most 1/8): the heuristic decides then, and its blocks are legal."""
  for entry in ENTRIES:
    key = _key(entry)
    seq = key.seq // 2 + 136        # in the bucket, not a multiple of the larger blocks
    t = F.attention_tiling(seq, seq, key.head_dim, group=key.group,
                           dtype=jnp.dtype(key.dtype), chip=key.chip, causal=True)
    for block in (t.block_q, t.block_k):
      assert vmem.round_up(seq, block) - seq <= seq // 8 or block == 128


def test_explicit_blocks_override_the_table():
  t = F.attention_tiling(4096, 4096, 128, group=4, dtype=jnp.bfloat16, chip="v6e",
                         causal=True, block_q=256, block_k=256)
  assert (t.block_q, t.block_k) == (256, 256)
