"""tpu-inference's fused_moe v1 (`FusedMoeSpec`, on experts-layer cases): the whole experts layer
(routing, gather, gate/up, activation, down, combine) in one kernel, its routing scratch in
SMEM read as closed forms. libtpu 0.0.48's estimator rates it 0 cycles: benchmarks/probes/
fused_moe.py shows where it gives up (docs/performance/tpu-inference.md)."""

from __future__ import annotations

import dataclasses
from unittest import mock

from benchmarks.peers.tpu_inference_ops.common import (VERSION, STACK, TpuInferenceSpec,
                                                        kernel_module)


class ScratchView:
  """An SMEM scratch ref whose element reads yield `closed_form(*idx)` (a constant of the
  batch); everything else (.at for DMAs, writes, shape) is the ref's own."""

  def __init__(self, ref, closed_form):
    self._ref, self._closed_form = ref, closed_form

  def __getitem__(self, idx):
    return self._closed_form(*(idx if isinstance(idx, tuple) else (idx,)))

  def __setitem__(self, idx, value):
    self._ref[idx] = value

  def __getattr__(self, name):
    return getattr(self._ref, name)


@dataclasses.dataclass(frozen=True)
class FusedMoeSpec(TpuInferenceSpec):
  """fused_ep_moe on one chip (a 1 x 1 mesh, expert parallelism of 1) for an experts-layer
  case (attributes tokens, experts, top_k, hidden, width): gating [T, E] in, top-k routing,
  scatter, gate/up + silu, down and the weighted combine in one kernel.

  It computes the routing in the kernel and keeps it in SMEM scratch, which the estimator
  reads as 0 (every expert empty: no matmul rated). Here the reads of that scratch yield the
  batch's values under round-robin routing (token t's k-th expert (t * top_k + k) % E, so
  each expert gets ceil(T * top_k / E) rows: exact when E divides T * top_k, an upper bound
  otherwise): t2e_routing, expert_starts (e * rows), expert_sizes and d2e_count (rows). Its
  own writes still happen; a2a_s_sends (remote sends: 0 on one chip) is left alone.

  libtpu 0.0.48's estimator rates the program 0 cycles (a row error); T = 1 and gpt-oss's
  2880-wide layers are refused by the kernel. `benchmarks/probes/fused_moe.py` shows where the
  estimator gives up."""

  case: object
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-fused-moe:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tpu-inference fused_moe v1 (tpu-inference {VERSION}, {STACK}, its block sizes, "
            f"1-chip mesh, round-robin routing)")

  truncations = ([0],)

  method = "static estimate of the whole kernel (one compile, no extrapolation)"

  @property
  def note(self) -> str:
    return ("Routing read from SMEM as round-robin closed forms (see FusedMoeSpec); gating "
            "[T, E] bf16 in, softmax scoring; no renormalisation of the top-k weights; "
            "every expert's weights are fetched whether routed to or not (the kernel's loop "
            "over local experts fetches unconditionally)")

  @property
  def rows_per_expert(self) -> int:
    c = self.case
    return -(-c.tokens * c.top_k // c.experts)

  def _specs(self):
    import jax
    import jax.numpy as jnp
    c = self.case
    S = jax.ShapeDtypeStruct
    return [S((c.tokens, c.hidden), jnp.bfloat16),
            S((c.experts, 2, c.hidden, c.width), jnp.bfloat16),
            S((c.experts, c.width, c.hidden), jnp.bfloat16),
            S((c.tokens, c.experts), jnp.bfloat16)]

  def _mesh(self, chip: str):
    import jax
    import numpy as np
    from tpu_kernels import aot
    return jax.sharding.Mesh(np.array([[aot.topology_device(chip)]]), ("data", "model"))

  def choose(self, chip: str) -> dict:
    """The block sizes fused_ep_moe settles on for the case (its tuned table or default, then
    its overrides), read from the kernel it builds (traced, not compiled)."""
    import jax
    M = kernel_module("fused_moe.v1.kernel")
    picked = {}
    real = M._fused_ep_moe_kernel

    def capture(*args, **kw):
      picked.update({k: kw[k] for k in ("bt", "bf", "bd1", "bd2", "btc", "bfc", "bd1c", "bd2c")})
      return real(*args, **kw)
    with mock.patch.object(M, "_fused_ep_moe_kernel", capture):
      jax.jit(lambda *a: M.fused_ep_moe(self._mesh(chip), *a, self.case.top_k)).trace(
          *self._specs())
    return picked

  def build(self, trunc, chip: str = "v6e"):
    import inspect
    import jax.numpy as jnp
    M = kernel_module("fused_moe.v1.kernel")
    c, rows = self.case, self.rows_per_expert
    chosen = self.config_for(chip)
    forms = {
        "t2e_routing_x2_smem": lambda b, t, k: (t * c.top_k + k) % c.experts,
        "expert_starts_x2_smem": lambda b, z, e: e * rows,
        "expert_sizes_x2_smem": lambda b, z, e: jnp.int32(rows),
        "d2e_count_x2_smem": lambda b, d, z, e: jnp.int32(rows),
    }
    real = M._fused_ep_moe_kernel
    signature = inspect.signature(real)

    def visible_kernel(*args, **kw):
      bound = signature.bind(*args, **kw)
      for name, form in forms.items():
        bound.arguments[name] = ScratchView(bound.arguments[name], form)
      return real(*bound.args, **bound.kwargs)

    def fn(tokens, w1, w2, gating):
      with mock.patch.object(M, "_fused_ep_moe_kernel", visible_kernel):
        return M.fused_ep_moe(self._mesh(chip), tokens, w1, w2, gating, c.top_k, **chosen)
    return fn, self._specs()

  def extrapolate(self, cycles: dict) -> float:
    (value,) = cycles.values()
    return value

  def hbm_bytes(self) -> int:
    """Per block of bt tokens: every expert's w1 (gate and up) and w2; the block's gating;
    each routed row read from the tokens (scatter), written to and read back from its HBM
    staging buffer (gather); the output written once."""
    c = self.case
    blocks = -(-c.tokens // self.get("bt"))
    weights = blocks * c.experts * 3 * c.hidden * c.width * 2
    routed = c.tokens * c.top_k * c.hidden * 2
    return weights + c.tokens * c.experts * 2 + 3 * routed + c.tokens * c.hidden * 2

  def hand(self, chip) -> dict:
    c = self.case
    flops = 2 * c.experts * self.rows_per_expert * 3 * c.hidden * c.width
    return dict(hand_us=max(flops / chip.bf16_flops_per_s,
                            self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6,
                hand_count="every expert's weights per token block at HBM bandwidth vs the "
                           "routed rows' flops at bf16 peak")
