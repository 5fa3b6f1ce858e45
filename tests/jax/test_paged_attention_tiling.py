"""Paged attention's tiling: the tuning table's keys are reachable, its entries are used
and fit; budgets bound VMEM and SMEM. Pure Python (no kernel runs, no compile): the
entries' compiles are in test_paged_attention_aot.py."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernels import chips, paged_attention as PA, vmem

TABLE = PA.TUNED_BLOCK_KV


def _key(entry) -> PA.TuningKey:
  return PA.TuningKey(*entry)


def test_the_table_is_not_empty_and_covers_the_headline_decode_shape():
  assert ("v6e", "bfloat16", 16, 128, 8) in TABLE     # Llama-3-8B-like, page 16


@pytest.mark.parametrize("entry", sorted(TABLE), ids=lambda e: "-".join(map(str, e)))
def test_every_key_is_produced_by_the_lookup(entry):
  """A key the lookup can never produce would be dead data (pytorch/xla#9497). The key's
  own fields, and every shape in its bucket, map back to it."""
  key = _key(entry)
  assert PA.tuning_key(key.chip, jnp.dtype(key.kv_dtype), key.page_size, key.head_dim,
                       key.num_kv_heads) == key
  smaller_dims = [d for d in (key.head_dim // 2 + 1, key.head_dim) if d >= 1]
  smaller_heads = [h for h in (key.num_kv_heads // 2 + 1, key.num_kv_heads) if h >= 1]
  for d, h in itertools.product(smaller_dims, smaller_heads):
    assert PA.tuning_key(key.chip, jnp.dtype(key.kv_dtype), key.page_size, d, h) == key


@pytest.mark.parametrize("entry", sorted(TABLE), ids=lambda e: "-".join(map(str, e)))
def test_every_entry_is_a_legal_block_that_fits_and_is_used(entry):
  key, block_kv = _key(entry), TABLE[entry]
  assert block_kv % key.page_size == 0
  assert block_kv // key.page_size <= PA._MAX_PAGES_PER_BLOCK
  chip = chips.get_chip(key.chip)
  for group in (1, 4, 8):
    t = PA.paged_tiling(64, 64, 8192 // key.page_size, key.page_size, key.head_dim,
                        num_kv_heads=key.num_kv_heads, group=group, q_dtype=jnp.bfloat16,
                        kv_dtype=jnp.dtype(key.kv_dtype), chip=key.chip)
    assert t.block_q == 1                                   # decode
    assert t.block_kv == block_kv, (group, t)               # the table decided
    assert t.vmem_plan_bytes <= vmem.vmem_budget(chip, None)
    assert t.vmem_limit_bytes == chip.default_scoped_vmem_bytes


def test_lookup_outside_the_buckets_falls_back_to_the_heuristic():
  assert PA.tuning_key("v6e", jnp.bfloat16, 48, 128, 8) is None      # not a power of two
  assert PA.tuning_key("v6e", jnp.bfloat16, 16, 320, 8) is None      # D > 256
  assert PA.tuning_key("v6e", jnp.bfloat16, 16, 128, 32) is None     # Hkv > 16
  t = PA.paged_tiling(64, 64, 512, 48, 128, num_kv_heads=8, group=4, q_dtype=jnp.bfloat16,
                      kv_dtype=jnp.bfloat16, chip="v6e")
  assert t.block_kv % 48 == 0 and t.vmem_plan_bytes <= vmem.vmem_budget(
      chips.get_chip("v6e"), None)


def test_prefill_shapes_do_not_take_decode_entries():
  """The table is for decode (block_q 1); a prefill-heavy batch keeps the heuristic, which
  plans against the larger many-rows limit and raises the scoped limit only as far as the
  plan needs."""
  t = PA.paged_tiling(8192, 1, 512, 16, 128, num_kv_heads=8, group=4, q_dtype=jnp.bfloat16,
                      kv_dtype=jnp.bfloat16, chip="v6e")
  assert t.block_q > 1
  assert t.vmem_plan_bytes <= int(PA._MANY_ROWS_VMEM_LIMIT * vmem.BUDGET_FRACTION)
  default = chips.get_chip("v6e").default_scoped_vmem_bytes
  assert t.vmem_limit_bytes == max(
      default, vmem.round_up(int(t.vmem_plan_bytes / vmem.BUDGET_FRACTION), vmem.MiB))


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_many_token_items_take_the_rated_tiles(chip):
  """Items of many tokens (prefill chunks, mixed steps): at most _MAX_ITEM_ROWS q rows per
  KV head, and block_kv from the many-rows budget. At the mixed step the constants' comment
  rates (60 decodes + 4 x 512, 32/8 heads, page 64) that is block_q 64, block_kv 1024 on
  both chips; before, the default scoped limit held block_kv to 256 (v5e) / 512 (v6e) and
  v5e's block_q to 32."""
  group = 4
  for num_tokens, num_seqs in [(60 + 4 * 512, 64), (8192, 1), (4096, 8)]:
    t = PA.paged_tiling(num_tokens, num_seqs, 32, 64, 128, num_kv_heads=8, group=group,
                        q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, chip=chip)
    assert group * t.block_q == PA._MAX_ITEM_ROWS
  t = PA.paged_tiling(60 + 4 * 512, 64, 32, 64, 128, num_kv_heads=8, group=group,
                      q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, chip=chip)
  assert (t.block_q, t.block_kv) == (64, 1024)
  assert t.vmem_limit_bytes <= chips.get_chip(chip).max_vmem_limit_bytes


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("num_tokens, num_seqs", [(1, 1), (64, 64), (256, 256), (4152, 64),
                                                  (8192, 1)])
def test_default_tiling_fits_the_budgets(chip, num_tokens, num_seqs):
  chip_ = chips.get_chip(chip)
  for page_size, head_dim, heads in itertools.product((16, 64, 256), (64, 128, 256),
                                                      ((32, 8), (64, 8), (16, 1))):
    t = PA.paged_tiling(num_tokens, num_seqs, 131072 // page_size, page_size, head_dim,
                        num_kv_heads=heads[1], group=heads[0] // heads[1],
                        q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, chip=chip)
    assert t.vmem_plan_bytes <= int(t.vmem_limit_bytes * vmem.BUDGET_FRACTION) or \
        t.vmem_limit_bytes > chip_.default_scoped_vmem_bytes
    assert t.vmem_limit_bytes <= chip_.max_vmem_limit_bytes
    assert t.smem_plan_words <= vmem.smem_budget_words(chip_)
    assert t.rows % vmem.sublane_multiple(jnp.bfloat16) == 0
    assert t.block_kv % page_size == 0


def test_bad_tiling_arguments():
  common = dict(num_kv_heads=8, group=4, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    PA.paged_tiling(64, 64, 128, 16, 128, block_q=3, **common)
  with pytest.raises(ValueError, match="block_kv must be a positive multiple"):
    PA.paged_tiling(64, 64, 128, 16, 128, block_kv=24, **common)
  with pytest.raises(ValueError, match="items_per_call must be an int >= 1"):
    PA.paged_tiling(64, 64, 128, 16, 128, items_per_call=0, **common)
  with pytest.raises(ValueError, match="does not fit"):
    PA.paged_tiling(1, 1, 10**6, 16, 128, **common)        # one page-table row > SMEM budget
