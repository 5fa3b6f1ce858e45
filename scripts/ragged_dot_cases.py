"""The grouped-matmul (ragged-dot-tpu) programs compiled ahead of time at real MoE shapes.

Shared by tests/jax/test_ragged_dot_aot.py and scripts/aot_summary.py (one definition of
the matrix). Weight layouts are Transformers' expert layouts:

  * Qwen3-30B-A3B, Mixtral-8x7B: gate_up (G, 2I, H), down (G, H, I), no bias ->
    `transpose_rhs=True`, concatenated gate/up, silu.
  * gpt-oss-20b: gate_up (G, H, 2I) with interleaved gate/up columns, down (G, I, H),
    both with bias -> `transpose_rhs=False`, layout "interleaved", activation "gpt_oss".
  * int8 / float8_e4m3fn weights (`quantized_programs`): (G, in, out) for every model, as
    the op's `quantize_experts_` stores them -> `transpose_rhs=False`.

Per model and m: four programs, `gate_up fwd`, `down fwd` (inference) and `gate_up bwd`,
`down bwd` (jax.grad of 0.5 * sum(out^2) w.r.t. lhs, weight and bias, so the forward
kernel is part of the backward program too). `tilings(chip)` replays the kernel's own
tile choice for every Mosaic kernel of the program (ragged_dot.gmm_tiling / tgmm_tiling
called with the arguments the kernel passes them).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, ragged_dot as R  # noqa: E402

S = jax.ShapeDtypeStruct
AOT_CHIPS = ["v5e", "v6e"]
ROWS = [8, 64, 512, 4096, 65536]   # token-expert rows (tokens x top_k)
QUANT_M = 512                      # rows of the quantized-weight compiles


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  experts: int           # G
  hidden: int            # H
  width: int             # I, one expert's intermediate size
  transposed: bool       # weights stored (G, out, in): transpose_rhs=True
  layout: str            # gate/up columns: "concatenated" or "interleaved"
  activation: str
  bias: bool


MODELS = {m.name: m for m in (
    Model("qwen3-30b-a3b", 128, 2048, 768, True, "concatenated", "silu", False),
    Model("mixtral-8x7b", 8, 4096, 14336, True, "concatenated", "silu", False),
    Model("gpt-oss-20b", 32, 2880, 2880, False, "interleaved", "gpt_oss", True),
)}


@dataclasses.dataclass(frozen=True)
class Program:
  """One program compiled for a chip: a projection of one model, forward or backward."""

  model: Model
  m: int
  projection: str        # "gate_up" or "down"
  direction: str         # "fwd" or "bwd"
  weight_dtype: str = "bfloat16"
  dtype: str = "bfloat16"
  out_dtype: str | None = None   # None: dtype (float32: moe_experts' down)

  @property
  def gated(self) -> bool:
    return self.projection == "gate_up"

  @property
  def k(self) -> int:     # lhs width
    return self.model.hidden if self.gated else self.model.width

  @property
  def n_full(self) -> int:  # weight output columns (2I for gate/up)
    return 2 * self.model.width if self.gated else self.model.hidden

  @property
  def label(self) -> str:
    w = "" if self.weight_dtype == self.dtype else f" {self.weight_dtype} weights"
    out = f" {self.out_dtype} out" if self.out_dtype else ""
    return f"{self.model.name} {self.projection} {self.direction} m={self.m}{w}{out}"

  @property
  def transposed(self) -> bool:
    """Weights (G, out, in): the model's bf16 layout; quantized weights are always
    (G, in, out), as the op's quantize_experts_ stores them."""
    return self.model.transposed and self.weight_dtype == self.dtype

  @property
  def gate_up_route(self) -> str | None:
    """The gated forward's route (ragged_dot.gate_up_route), None for the down projection."""
    if not self.gated:
      return None
    md = self.model
    weight_bytes = md.experts * self.k * self.n_full * jnp.dtype(self.weight_dtype).itemsize
    return R.gate_up_route(self.m, self.n_full, md.layout, weight_bytes)

  def num_kernels(self, chip: str) -> int:
    """Mosaic kernels: forward 1, and 1 more where the "gate_pass" route gates by a kernel
    of its own (`ragged_dot.gate_pass_rows`: interleaved columns within VMEM); backward
    adds d_lhs and d_rhs, and for the gated projection the recomputed pre-activation z
    (the epilogue's derivative needs it). When the forward kernel already is that z (gated
    after it), the recompute is the same pallas_call again: XLA does not merge the two
    custom calls, so it still counts."""
    gate_kernel = self.gate_up_route == "gate_pass" and R.gate_pass_rows(
        self.m, self.model.width, self.model.layout,
        jnp.dtype(self.out_dtype or self.dtype), chip) is not None
    forward = 1 + gate_kernel
    if self.direction == "fwd":
      return forward
    return forward + 2 + (1 if self.gated else 0)

  def _specs(self):
    md = self.model
    quantized = self.weight_dtype != self.dtype
    shape = (md.experts, self.n_full, self.k) if self.transposed else (md.experts, self.k,
                                                                        self.n_full)
    specs = [S((self.m, self.k), jnp.dtype(self.dtype)), S(shape, jnp.dtype(self.weight_dtype)),
             S((md.experts,), jnp.int32)]
    if md.bias:
      specs.append(S((md.experts, self.n_full), jnp.dtype(self.dtype)))
    if quantized:
      specs.append(S((md.experts, self.n_full), jnp.float32))
    return specs

  def function(self, chip: str):
    """fn(lhs, weight, group_sizes[, bias][, scale]) -> output (m, I or H)."""
    md = self.model
    kw = dict(transpose_rhs=self.transposed, chip=chip)
    if self.gated:
      op = functools.partial(R.gated_ragged_dot, activation=md.activation, layout=md.layout,
                             **kw)
    else:
      op = functools.partial(R.ragged_dot, out_dtype=self.out_dtype, **kw)
    has_scale = self.weight_dtype != self.dtype

    def fn(x, w, gs, *rest):
      rest = list(rest)
      bias = rest.pop(0) if md.bias else None
      scale = rest.pop(0) if has_scale else None
      return op(x, w, gs, bias=bias, rhs_scale=scale)

    return fn

  def build(self, chip: str):
    """(fn, arg specs) of the compiled program."""
    fn, specs = self.function(chip), self._specs()
    if self.direction == "fwd":
      return fn, specs
    argnums = (0, 1, 3) if self.model.bias else (0, 1)

    def loss(*args):
      out = fn(*args).astype(jnp.float32)
      return 0.5 * jnp.sum(out * out)

    return jax.grad(loss, argnums=argnums), specs

  def tilings(self, chip: str) -> list[tuple[str, R.Tiling]]:
    """(kernel, tiling) of each Mosaic kernel of the program, as the kernel chooses them."""
    md, m, k, n_full = self.model, self.m, self.k, self.n_full
    dt, wdt = jnp.dtype(self.dtype), jnp.dtype(self.weight_dtype)
    common = dict(num_groups=md.experts, lhs_dtype=dt, chip=chip)
    route = self.gate_up_route
    if route == "gate_pass":
      fwd = R.gmm_tiling(m, k, n_full, rhs_dtype=wdt, out_dtype=jnp.float32, **common)
    elif route is not None:
      fwd = R.gmm_tiling(m, k, n_full // 2, rhs_dtype=wdt, out_dtype=dt, num_rhs=2,
                         n_must_divide=n_full // 2 if route == "blocks" else None,
                         interleaved=route == "lanes", **common)
    else:
      fwd = R.gmm_tiling(m, k, n_full, rhs_dtype=wdt, out_dtype=jnp.dtype(self.out_dtype or dt),
                         **common)
    out = [("fwd", fwd)]
    if self.direction == "bwd":
      if self.gated:
        out.append(("z", R.gmm_tiling(m, k, n_full, rhs_dtype=wdt, out_dtype=jnp.float32,
                                      **common)))
      out.append(("d_lhs", R.gmm_tiling(m, n_full, k, rhs_dtype=wdt, out_dtype=dt, **common)))
      tk, tn = (n_full, k) if self.transposed else (k, n_full)
      out.append(("d_rhs", R.tgmm_tiling(m, tk, tn, grad_dtype=dt, out_dtype=wdt, **common)))
    return out

  def plan(self, chip: str) -> str:
    """The tiling of each kernel: name bm x bk x bn [x2 visits a step] @ limit MiB (plan MiB)."""
    return "; ".join(
        f"{name} {t.block_m}x{t.block_k}x{t.block_n}"
        f"{f' x{t.visits_per_step} visits a step' if t.visits_per_step > 1 else ''} "
        f"@{t.vmem_limit_bytes / 2**20:.0f} MiB (plan {t.vmem_plan_bytes / 2**20:.1f})"
        for name, t in self.tilings(chip))


def model_programs(model: str, m: int, directions=("fwd", "bwd")) -> list[Program]:
  md = MODELS[model]
  return [Program(md, m, p, d) for d in directions for p in ("gate_up", "down")]


def quantized_programs(model: str, m: int = QUANT_M) -> list[Program]:
  md = MODELS[model]
  return [Program(md, m, p, "fwd", weight_dtype=w)
          for w in ("int8", "float8_e4m3fn") for p in ("gate_up", "down")]


def all_programs() -> list[Program]:
  return [p for model in MODELS for m in ROWS for p in model_programs(model, m)] + \
      [p for model in MODELS for p in quantized_programs(model)]


def compile_case(program: Program, chip: str) -> aot.CompileReport:
  fn, specs = program.build(chip)
  return aot.compile_for_chip(fn, specs, chip)
