"""The fused conv + Gated DeltaNet kernel that tpu-inference 0.32.0 ships as `kernels/gdn/v3`
(`wrapper.fused_conv1d_gdn`) and tokamax 0.0.17 forks as `causal_conv1d_gated_delta_rule`
(the same wrapper, metadata and kernels; its op adds a KDA mode and a VMEM tile heuristic):
what both peers' specs share (peers/tpu_inference_ops/gdn.py, peers/tokamax_ops.py).

What it computes, per token of a ragged batch: the width-4 causal conv over the mixed
q / k / v channels (from each sequence's conv state), SiLU, q / k l2-norm, the gates from
the layer's raw inputs (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) and the
gated delta rule (chunks of 64, UT / WY form, blocked forward substitution; one token per
sequence at decode), reading and writing each sequence's conv and recurrent state in a
slot-indexed pool. So its rows cover our `causal_conv1d` forward plus our
`gated_delta_rule` (plus the gate arithmetic, which Transformers does in XLA before our
kernel): compare them with the sum of our conv and GDN rows of the same tokens. Forward
only (no backward).

The estimator cannot see its metadata: one `pallas_call` per mode (BATCHED: one tile of
decode sequences; PER_SEQ: one prefill sequence's chunks, a tile each) runs an
`emit_pipeline` over `num_tiles` tiles, a count it reads from SMEM, and each tile's DMAs
and state slots come from per-tile records in SMEM (packed words: row base, row count,
sequence, first / last tile) and per-sequence tables (state slots, has-initial-state).
Read as 0, every tile count is 0: an empty pipeline. So every read of the metadata
yields max(value, closed form of the case) (`visible.Visible`; the tile count as the
closed form alone, a static grid), the forms checked against the kernel's own builders
(`metadata.compute_per_seq_metadata` / `compute_batched_seq_metadata`) on the case's
concrete arrays in the child. The case: prefill, one sequence of T tokens with no earlier
state (slot 1; slot 0 is the pool's null slot); decode, B sequences of one token each,
each with an earlier state (slots 1..B).

Bytes (`hbm_bytes`): what its kernels must move: qkv (cast to f32 by the wrapper in XLA
before the kernel), a and b (f32, value heads padded to 128 lanes), the output (the input's
dtype), the recurrent state (f32: written at prefill, read and written at decode) and the
conv state (f32, W-1 rows). The wrapper's XLA ops (the f32 casts, pads, the metadata
builders) are not rated, as no peer's glue is.
"""

from __future__ import annotations

import dataclasses
import json

from benchmarks.cases.gated_delta_rule import GdnChunked, GdnDecode
from benchmarks.estimator import visible

LANES = 128


class TypedVisible(visible.Visible):
  """A Visible whose reads keep the ref's dtype (bool tables stay bool); a "const" read is
  the closed form's static value (a static grid)."""

  def __getitem__(self, idx):
    value = super().__getitem__(idx)
    return value if self.mode == "const" else value.astype(self.ref.dtype)


def _word(s_idx, r_size, first, last):
  """PackedPIdRecord.pack of one record (s_idx << 16 | r_size << 2 | last << 1 | first)."""
  return (s_idx << 16) | (r_size << 2) | (last << 1) | first


@dataclasses.dataclass(frozen=True)
class FusedGdnSpec:
  """A spec (peers/protocol.py) of the fused kernel on a GdnChunked "fwd" or GdnDecode case.
  Subclasses give `package` (the module path of the fork), `python`, `lowering`, `key`,
  `implementation`, `tiles(chip)` (decode_tile_size, mixed_tile_size) and `call(wrapper,
  **inputs)` (the function as the peer's users call it)."""

  case: object

  truncations = (["whole case"],)

  @property
  def prefill(self) -> bool:
    return isinstance(self.case, GdnChunked)

  @property
  def tokens(self) -> int:
    return self.case.tokens if self.prefill else self.case.batch

  @property
  def num_seqs(self) -> int:
    return 1 if self.prefill else self.case.batch

  @property
  def method(self) -> str:
    return ("static estimate of the whole case (both of its kernels, BATCHED and PER_SEQ), "
            "its SMEM metadata made visible (closed forms of the case's tile count, tile "
            "records and state slots, checked against its own metadata builders)")

  @property
  def note(self) -> str:
    return ("Fused: conv1d + SiLU + l2norm + gates + GDN in one kernel (ours: the conv and "
            "the GDN rows of the same tokens, summed); forward only. Its wrapper's XLA ops "
            "(qkv / a / b cast to f32, pads, the metadata builders) are not rated; hbm_bytes "
            "count its kernels' reads and writes (qkv as f32).")

  def validate(self) -> None:
    """Checked in the child, where the peer imports (`build`)."""

  def hbm_bytes(self) -> int:
    L, t = self.case.layer, self.tokens
    state = self.num_seqs * L.value_heads * L.head_dim * L.head_dim * 4
    conv_state = self.num_seqs * (L.conv_width - 1) * L.conv_dim * 4
    moved = (t * L.conv_dim * 4                                  # qkv (f32)
             + 2 * t * -(-L.value_heads // LANES) * LANES * 4    # a, b (f32, lane-padded)
             + t * L.value_heads * L.head_dim * 2                # out (bf16)
             + state * (1 if self.prefill else 2)                 # written / read + written
             + 2 * conv_state)
    return moved

  def hand(self, chip) -> dict:
    return dict(hand_us=self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6,
                hand_count="its kernels' bytes (hbm_bytes) at full HBM bandwidth")

  def extrapolate(self, cycles: dict) -> float:
    return cycles[json.dumps(self.truncations[0])]

  # -- the case's inputs and its metadata's closed forms

  def concrete_metadata_inputs(self):
    """(query_start_loc, state_indices, distribution, seq_lens) of the case (numpy int32)."""
    import numpy as np
    n, t = self.num_seqs, self.tokens
    if self.prefill:   # one prefill sequence, no earlier state: distribution [0, 1, 1]
      return (np.array([0, t], np.int32), np.array([1], np.int32),
              np.array([0, 1, 1], np.int32), np.array([t], np.int32))
    context = 2048     # any length > 1: each decode sequence has an earlier state
    return (np.arange(n + 1, dtype=np.int32), np.arange(1, n + 1, dtype=np.int32),
            np.array([n, n, n], np.int32), np.full((n,), context, np.int32))

  def forms(self, mode: str, tile: int) -> dict:
    """{field of MetadataRef: closed form} for the kernel of `mode` ("batched" / "per_seq")
    at its tile size; a field left out reads 0 (its value in the case)."""
    import jax.numpy as jnp
    n, t = self.num_seqs, self.tokens
    if mode == "per_seq" and self.prefill:
      tiles = -(-t // tile)

      def record(i):   # i = 2 * tile + field: [r_base, word]
        i = jnp.asarray(i, jnp.int32)   # a Python int where the pipeline's index is static
        r = i >> 1
        word = _word(0, tile, (r == 0).astype(jnp.int32), (r == tiles - 1).astype(jnp.int32))
        return jnp.where((i & 1) == 0, r * tile, word)
      return dict(num_tiles=tiles, records=record, s_idx_to_state_indices=lambda s: 1,
                  s_idx_to_read_indices=lambda s: 1)
    if mode == "batched" and not self.prefill:
      def record(i):   # record r is sequence r (one token at row r)
        i = jnp.asarray(i, jnp.int32)
        r = i >> 1
        return jnp.where((i & 1) == 0, r, _word(r, 1, 1, 1))
      return dict(num_tiles=-(-n // tile), records=record,
                  s_idx_has_initial_state=lambda s: 1,
                  s_idx_to_state_indices=lambda s: s + 1,
                  s_idx_to_read_indices=lambda s: s + 1)
    return dict(num_tiles=0)   # the other mode's kernel has no tiles in this case

  def check_forms(self, metadata_module, config_module, mode: str, cfg) -> None:
    """The closed forms against the kernel's own builder on the case's arrays: every record
    a tile reads, and the per-sequence tables."""
    import jax
    with jax.ensure_compile_time_eval():   # called while the kernel is traced
      self._check_forms(metadata_module, mode, cfg)

  def _check_forms(self, metadata_module, mode: str, cfg) -> None:
    import inspect
    import jax.numpy as jnp
    import numpy as np
    qsl, slots, dist, seq_lens = (jnp.asarray(a) for a in self.concrete_metadata_inputs())
    if mode == "batched":
      meta = metadata_module.compute_batched_seq_metadata(
          cfg=cfg, seq_lens=seq_lens, query_start_loc=qsl, state_indices=slots,
          read_offsets=jnp.zeros_like(slots), end_seq=dist[0], read_indices=slots)
    else:
      # tokamax's fork also takes read_offsets here (zeros without speculative decoding)
      offsets = ({"read_offsets": jnp.zeros_like(slots)} if "read_offsets" in
                 inspect.signature(metadata_module.compute_per_seq_metadata).parameters else {})
      meta = metadata_module.compute_per_seq_metadata(
          cfg=cfg, seq_lens=seq_lens, query_start_loc=qsl, state_indices=slots,
          start_seq=dist[0], end_seq=dist[-1], read_indices=slots, **offsets)
    forms = self.forms(mode, cfg.tile_size)
    tiles = int(np.asarray(meta.num_tiles).reshape(-1)[0])
    assert tiles == forms["num_tiles"], (mode, tiles, forms["num_tiles"])
    if not tiles:   # an empty pipeline reads nothing more
      return
    read = 2 * tiles * cfg.seq_tile_size    # the records the tiles read
    want = forms.get("records", lambda i: 0 * i)
    got = np.asarray(meta.records)[:read]
    np.testing.assert_array_equal(got, np.asarray(want(jnp.arange(read, dtype=jnp.int32))),
                                  err_msg=f"{mode} records")
    for field in ("s_idx_has_initial_state", "s_idx_to_state_indices", "s_idx_to_read_offset",
                  "s_idx_to_read_indices"):
      values = np.asarray(getattr(meta, field)).astype(np.int32)[:self.num_seqs]
      form = forms.get(field, lambda s: 0)
      np.testing.assert_array_equal(values, [form(s) for s in range(self.num_seqs)],
                                    err_msg=f"{mode} {field}")

  def visible_outer(self, wrapper, metadata_module, config_module):
    """wrapper.outer_kernel with its metadata refs made visible (checked first)."""
    original = wrapper.outer_kernel

    def outer_kernel(metadata_ref, *rest, cfg, **scratches):
      mode = "per_seq" if cfg.mode == config_module.GDNMode.PER_SEQ else "batched"
      self.check_forms(metadata_module, config_module, mode, cfg)
      forms = self.forms(mode, cfg.tile_size)
      tiles = forms.pop("num_tiles")
      if not tiles:   # SMEM's 0 is the case's value: left as is (Pallas refuses a grid (0,))
        return original(metadata_ref, *rest, cfg=cfg, **scratches)
      fields = {name: TypedVisible(getattr(metadata_ref, name), form)
                for name, form in forms.items()}
      fields["num_tiles"] = TypedVisible(metadata_ref.num_tiles, lambda *_: tiles, "const")
      return original(dataclasses.replace(metadata_ref, **fields), *rest, cfg=cfg, **scratches)

    return outer_kernel

  def build(self, trunc, chip: str = "v6e"):
    """The fused op on the case's inputs, its metadata visible (the whole case)."""
    del trunc
    import importlib
    from unittest import mock
    import jax
    import jax.numpy as jnp
    wrapper = importlib.import_module(f"{self.package}.wrapper")
    metadata_module = importlib.import_module(f"{self.package}.metadata")
    config_module = importlib.import_module(f"{self.package}.config")
    L, t, n = self.case.layer, self.tokens, self.num_seqs
    S = jax.ShapeDtypeStruct
    decode_tile, mixed_tile = self.tiles(chip)
    outer = self.visible_outer(wrapper, metadata_module, config_module)

    def fn(qkv, b, a, conv_state, recurrent_state, conv_weight, a_log, dt_bias, qsl, slots,
           dist, seq_lens):
      with mock.patch.object(wrapper, "outer_kernel", outer):
        return self.call(wrapper, qkv=qkv, b=b, a=a, conv_state=conv_state,
                         recurrent_state=recurrent_state, conv_weight=conv_weight,
                         conv_bias=None, a_log=a_log, dt_bias=dt_bias, query_start_loc=qsl,
                         state_indices=slots, distribution=dist, seq_lens=seq_lens,
                         read_state_indices=slots, n_kq=L.key_heads, n_v=L.value_heads,
                         d_k=L.head_dim, d_v=L.head_dim, kernel_size=L.conv_width,
                         decode_tile_size=decode_tile, mixed_tile_size=mixed_tile)

    i32 = jnp.int32
    specs = [S((t, L.conv_dim), jnp.bfloat16), S((t, L.value_heads), jnp.bfloat16),
             S((t, L.value_heads), jnp.bfloat16),
             S((n + 1, L.conv_width - 1, L.conv_dim), jnp.bfloat16),
             S((n + 1, L.value_heads, L.head_dim, L.head_dim), jnp.float32),
             S((L.conv_dim, 1, L.conv_width), jnp.bfloat16),
             S((L.value_heads,), jnp.float32), S((L.value_heads,), jnp.float32),
             S((n + 1,), i32), S((n,), i32), S((3,), i32), S((n,), i32)]
    return fn, specs


def applies(case) -> bool:
  """The cases the fused kernel is rated on: prefill forward and decode (it has no backward)."""
  return (isinstance(case, GdnChunked) and not case.training) or isinstance(case, GdnDecode)
