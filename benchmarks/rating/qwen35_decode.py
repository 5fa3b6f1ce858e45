"""Qwen3.5-9B's decode step, part by part, with our kernels and as the default torch path
compiles (benchmarks/qwen35_decode_prediction.py is the command and its docstring the
method; the step's shapes are cases/seed.py's `Qwen35DecodeStep`).

A part is one call of the step with how many times the step makes it (`Part.count`). It is
either shared (the same XLA program in both: projections, MLP, lm_head) or a pair: ours (a
kernel of this project) and the default (what Transformers' torch fallback is, written in
jnp, as XLA compiles it on a TPU):

  norms              rms_norm kernel (offset 1)     | the zero-centred norm in f32 (XLA)
  causal_conv1d      causal_conv1d_update kernel    | torch_causal_conv1d_update (XLA)
  gated delta rule   fused_recurrent kernel         | torch_recurrent_gated_delta_rule (XLA)
  gated norm         rms_norm_gated kernel          | Qwen3_5RMSNormGated (XLA)
  attention          paged_attention kernel         | SDPA over a dense cache, GQA (XLA)

Each part rates in its own child process (this file as a script, `--part NAME SIDE CHIP`,
one ROW line), by the method of the row it matches in estimates.jsonl where there is one
(rating/linear_attention.py, rating/paged_attention.py, peers/xla_ops.py: re-rated, not
read from the file, so that one command makes the whole prediction from today's code), else
`xla_cost.glue_part` (XLA programs) or the compiled kernel's static estimate. A part's time
is max(compute, HBM bytes / bandwidth) (rating/roofline.py's `prediction`); the step's is
the sum of count x time.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import dataclasses  # noqa: E402
import os  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and os.environ.get("ESTIMATE_STATIC_PROFILE") == "1":
  children.enable_static_profile()   # a part's child: before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, rms_norm  # noqa: E402

from benchmarks import RESULTS  # noqa: E402
from benchmarks.cases.headline import RmsNorm, RmsNormGated  # noqa: E402
from benchmarks.cases.seed import QWEN3_5_STEP, Qwen35DecodeStep  # noqa: E402
from benchmarks.estimator import static_estimate, xla_cost  # noqa: E402
from benchmarks.peers import xla_ops  # noqa: E402
from benchmarks.rating import linear_attention, paged_attention  # noqa: E402
from benchmarks.rating.roofline import hbm_us, prediction  # noqa: E402

RESULTS_FILE = RESULTS / "qwen35_decode_prediction.json"
SHARED, OURS, DEFAULT = "shared", "ours", "default"
S = jax.ShapeDtypeStruct
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Part:
  name: str
  count: int        # calls per decode step
  sides: tuple      # (SHARED,) or (OURS, DEFAULT)


def parts(step: Qwen35DecodeStep) -> list[Part]:
  g, a, n = step.gdn_layers, step.attention_layers, step.layers
  pair = (OURS, DEFAULT)
  return [
      Part("RMSNorm (input, post-attention, final)", 2 * n + 1, pair),
      Part("Gated DeltaNet in-projections qkv / z / b / a, g and beta", g, (SHARED,)),
      Part("causal_conv1d_update", g, pair),
      Part("gated delta rule, one token", g, pair),
      Part("gated RMSNorm", g, pair),
      Part("Gated DeltaNet out_proj + residual", g, (SHARED,)),
      Part("attention q (gated) / k / v projections, q / k norms, partial RoPE", a, (SHARED,)),
      Part("attention over the KV cache", a, pair),
      Part("output gate, o_proj + residual", a, (SHARED,)),
      Part("MLP gate / up / down + residual", n, (SHARED,)),
      Part("lm_head", 1, (SHARED,)),
  ]


# ----------------------------------------------------------------------------- the programs


def _dt(step):
  return jnp.dtype(step.dtype)


def zero_centred_norm(x, w, eps):
  """Qwen3_5RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) in f32, cast back (the plain-XLA
  norm of kernels/tpu_kernels/rms_norm.py, offset 1)."""
  return rms_norm.rms_norm_reference(x, w, eps=eps, offset=1.0)


def in_projections(step):
  """GatedDeltaNet's four input projections and its gates (g = -exp(A_log) softplus(a +
  dt_bias) in f32, beta = sigmoid(b))."""
  L, dt = step.gdn, _dt(step)
  key_dim, value_dim = L.key_heads * L.head_dim, L.value_heads * L.head_dim

  def fn(x, w_qkv, w_z, w_b, w_a, a_log, dt_bias):
    qkv, z = x @ w_qkv, x @ w_z
    beta = jax.nn.sigmoid((x @ w_b).astype(F32)).astype(dt)
    g = -jnp.exp(a_log.astype(F32)) * jax.nn.softplus((x @ w_a).astype(F32)
                                                      + dt_bias.astype(F32))
    return qkv, z, beta, g

  h, b, hv = step.hidden, step.batch, L.value_heads
  return fn, [S((b, h), dt), S((h, 2 * key_dim + value_dim), dt), S((h, value_dim), dt),
              S((h, hv), dt), S((h, hv), dt), S((hv,), F32), S((hv,), dt)]


def out_projection(width: int):
  def build(step):
    dt = _dt(step)
    fn = lambda y, w, residual: (y @ w + residual).astype(dt)
    return fn, [S((step.batch, width), dt), S((width, step.hidden), dt),
                S((step.batch, step.hidden), dt)]
  return build


def attention_projections(step):
  """Qwen3_5Attention before the attention: q_proj (query and output gate), k_proj, v_proj,
  the zero-centred q / k norms over head_dim, RoPE on the first rotary_dim channels."""
  dt, d, r = _dt(step), step.head_dim, step.rotary_dim
  hq, hkv = step.q_heads, step.kv_heads

  def rope(x, cos, sin):
    rot, keep = x[..., :r], x[..., r:]
    half = r // 2
    turned = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    rot = rot * cos[:, None, :] + turned * sin[:, None, :]
    return jnp.concatenate([rot.astype(x.dtype), keep], axis=-1)

  def fn(x, wq, wk, wv, qn, kn, cos, sin):
    t = x.shape[0]
    q_gate = (x @ wq).reshape(t, hq, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:]
    q = rope(zero_centred_norm(q, qn, step.eps), cos, sin)
    k = rope(zero_centred_norm((x @ wk).reshape(t, hkv, d), kn, step.eps), cos, sin)
    return q, k, (x @ wv).reshape(t, hkv, d), gate

  b, h = step.batch, step.hidden
  return fn, [S((b, h), dt), S((h, 2 * hq * d), dt), S((h, hkv * d), dt),
              S((h, hkv * d), dt), S((d,), dt), S((d,), dt), S((b, r), dt), S((b, r), dt)]


def output_gate_o_proj(step):
  dt = _dt(step)

  def fn(attn, gate, wo, residual):
    y = attn * jax.nn.sigmoid(gate.astype(F32)).astype(dt)
    return (y.reshape(y.shape[0], -1) @ wo + residual).astype(dt)

  b, hq, d = step.batch, step.q_heads, step.head_dim
  return fn, [S((b, hq, d), dt), S((b, hq, d), dt), S((hq * d, step.hidden), dt),
              S((b, step.hidden), dt)]


def mlp(step):
  dt = _dt(step)
  fn = lambda x, wg, wu, wd, residual: (
      (jax.nn.silu(x @ wg) * (x @ wu)) @ wd + residual).astype(dt)
  b, h, i = step.batch, step.hidden, step.intermediate
  return fn, [S((b, h), dt), S((h, i), dt), S((h, i), dt), S((i, h), dt), S((b, h), dt)]


def lm_head(step):
  dt = _dt(step)
  return (lambda x, w: x @ w), [S((step.batch, step.hidden), dt),
                                S((step.hidden, step.vocab), dt)]


def default_norm(step):
  dt = _dt(step)
  return (lambda x, w: zero_centred_norm(x, w, step.eps)), [S((step.batch, step.hidden), dt),
                                                            S((step.hidden,), dt)]


def default_gated_norm(step):
  """Qwen3_5RMSNormGated: weight * norm(x) * silu(z), the norm in f32 rounded to x's dtype
  before the weight (norm_in_input_dtype), the gate in f32, cast back; rows of head_dim.
  The plain-XLA gated norm of kernels/tpu_kernels/rms_norm.py, which has those roundings."""
  dt, L = _dt(step), step.gdn
  fn = lambda x, z, w: rms_norm.rms_norm_gated_reference(x, z, w, eps=step.eps)
  rows = step.batch * L.value_heads
  return fn, [S((rows, L.head_dim), dt), S((rows, L.head_dim), dt), S((L.head_dim,), dt)]


def default_attention(step):
  """SDPA at decode over Transformers' dense cache [B, Hkv, context, D] with GQA (no mask at
  an even batch, so `use_gqa_in_sdpa` holds): softmax(q k^T / sqrt(D)) v, f32 softmax."""
  dt, g = _dt(step), step.q_heads // step.kv_heads

  def fn(q, k, v):
    b, hkv, ctx, d = k.shape
    qg = q.reshape(b, hkv, g, d)
    s = jnp.einsum("bhgd,bhcd->bhgc", qg, k, preferred_element_type=F32) / d ** 0.5
    p = jax.nn.softmax(s, axis=-1).astype(dt)
    return jnp.einsum("bhgc,bhcd->bhgd", p, v).reshape(b, hkv * g, d)

  cache = S((step.batch, step.kv_heads, step.context, step.head_dim), dt)
  return fn, [S((step.batch, step.q_heads, step.head_dim), dt), cache, cache]


SHARED_PROGRAMS = {
    "Gated DeltaNet in-projections qkv / z / b / a, g and beta": in_projections,
    "Gated DeltaNet out_proj + residual": lambda s: out_projection(
        s.gdn.value_heads * s.gdn.head_dim)(s),
    "attention q (gated) / k / v projections, q / k norms, partial RoPE": attention_projections,
    "output gate, o_proj + residual": output_gate_o_proj,
    "MLP gate / up / down + residual": mlp,
    "lm_head": lm_head,
}


# ----------------------------------------------------------------------------- rating


def _cycles_row(row: dict) -> dict:
  """A part from a ratings row (estimated_cycles, or cost_analysis's compute_us)."""
  if row.get("error"):
    raise RuntimeError(row["error"])
  part = dict(hbm_bytes=row["hbm_bytes"], method=row["method"])
  if row.get("estimated_cycles") is not None:
    part["cycles"] = row["estimated_cycles"]
  else:
    part["compute_us"] = row["compute_us"]
  return part


def _kernel_part(fn, specs, chip: str, hbm_bytes: int) -> dict:
  return _cycles_row(static_estimate.whole_program(fn, specs, chip, hbm_bytes))


def rate_part(step: Qwen35DecodeStep, name: str, side: str, chip: str) -> dict:
  """One part on one side (in a child: the estimator may abort the process)."""
  dt, L = _dt(step), step.gdn
  if side == SHARED:
    return xla_cost.glue_part(*SHARED_PROGRAMS[name](step), chip)
  if name.startswith("RMSNorm"):
    if side == DEFAULT:
      return xla_cost.glue_part(*default_norm(step), chip)
    _, specs = default_norm(step)
    fn = lambda x, w: rms_norm.rms_norm(x, w, eps=step.eps, offset=1.0, chip=chip)
    return _kernel_part(fn, specs, chip, RmsNorm(step.batch, step.hidden, step.dtype).min_bytes())
  if name == "causal_conv1d_update":
    case = step.conv_update_case()
    if side == DEFAULT:   # as peers/xla_ops.py rates it: the whole program's static estimate
      return _kernel_part(*xla_ops.conv_update_program(case), chip, case.min_bytes())
    return _cycles_row(linear_attention.rate(case, chip))
  if name == "gated delta rule, one token":
    case = step.gdn_decode_case()
    if side == DEFAULT:
      return _cycles_row(xla_cost.xla_cost(lambda: xla_ops.gdn_decode_program(case), chip,
                                           case.min_bytes()))
    return _cycles_row(linear_attention.rate(case, chip))
  if name == "gated RMSNorm":
    fn, specs = default_gated_norm(step)
    if side == DEFAULT:
      return xla_cost.glue_part(fn, specs, chip)
    rows = step.batch * L.value_heads
    kernel = lambda x, z, w: rms_norm.rms_norm_gated(x, z, w, eps=step.eps, chip=chip)
    return _kernel_part(kernel, specs, chip,
                        RmsNormGated(rows, L.head_dim, step.dtype).min_bytes())
  if name == "attention over the KV cache":
    if side == DEFAULT:
      fn, specs = default_attention(step)
      return xla_cost.glue_part(fn, specs, chip, min_bytes=step.paged_case().min_bytes())
    r = paged_attention.estimate(step.paged_case(), chip)
    return dict(cycles=r["estimated_cycles"], hbm_bytes=r["hbm_bytes"], method=r["method"],
                tiling=dict(block_kv=r["block_kv"], pages_per_block=r["pages_per_block"]))
  raise KeyError(f"no part {name!r} on side {side!r}")


PART_TIMEOUT_S = 900
# Rated by XLA's cost_analysis: their children run without the static profile (rating
# plain XLA by cost_analysis is what peers/xla_ops.py does for this case).
COST_ANALYSIS = {("gated delta rule, one token", DEFAULT)}


def _part_in_child(name: str, side: str, chip: str) -> dict:
  profile = "0" if (name, side) in COST_ANALYSIS else "1"
  rows, error = children.run_child(__file__, ["--part", name, side, chip],
                                   timeout=PART_TIMEOUT_S,
                                   env=children.child_env(ESTIMATE_STATIC_PROFILE=profile))
  return dict(error=error) if error else rows[-1]


def finish(part: dict, chip: str) -> dict:
  """Adds compute_us, hbm_us, predicted_us = max of the two."""
  c = chips.get_chip(chip)
  if "cycles" in part:
    part.update(prediction(part["cycles"], part["hbm_bytes"], c))
  elif "compute_us" in part:
    part["hbm_us"] = hbm_us(part["hbm_bytes"], c)
    part["predicted_us"] = max(part["compute_us"], part["hbm_us"])
  return part


def rate_all(step: Qwen35DecodeStep, chip: str) -> dict:
  """{part name: {side: rated part}} for every part of the step on `chip`."""
  out = {}
  for part in parts(step):
    for side in part.sides:
      print(f"rating {part.name} ({side}) on {chip}", file=sys.stderr, flush=True)
      out.setdefault(part.name, {})[side] = finish(_part_in_child(part.name, side, chip), chip)
  return out


UNRATED_OURS_NOTE = ("ours not rated ({error}); counted at the default's time (no gain "
                     "claimed for this part)")


def step_totals(step: Qwen35DecodeStep, rated: dict) -> dict:
  """Per side, the step's µs (sum of count x predicted µs), or None if a part of it has no
  rating. Where ours has no rating but the default has, ours takes the default's time
  (noted in `substituted`), so the ratio never credits a part we could not rate."""
  totals = {OURS: 0.0, DEFAULT: 0.0}
  differing = {OURS: 0.0, DEFAULT: 0.0}   # the pairs only: what the kernels change
  substituted = []
  for part in parts(step):
    got = rated.get(part.name, {})
    for side in (OURS, DEFAULT):
      p = got.get(SHARED) if part.sides == (SHARED,) else got.get(side)
      if side == OURS and part.sides != (SHARED,) and "predicted_us" not in (p or {}):
        if "predicted_us" in got.get(DEFAULT, {}):
          substituted.append(f"{part.name}: " + UNRATED_OURS_NOTE.format(
              error=children.short_error((p or {}).get("error", "missing"))))
          p = got[DEFAULT]
      for sums, counted in ((totals, True), (differing, part.sides != (SHARED,))):
        if not counted:
          continue
        if sums[side] is not None and p is not None and "predicted_us" in p:
          sums[side] += part.count * p["predicted_us"]
        else:
          sums[side] = None
  ratio = lambda t: t[DEFAULT] / t[OURS] if t[OURS] and t[DEFAULT] else None
  return dict(ours_us=totals[OURS], default_us=totals[DEFAULT], speedup=ratio(totals),
              ours_differing_us=differing[OURS], default_differing_us=differing[DEFAULT],
              differing_speedup=ratio(differing), substituted=substituted)


if __name__ == "__main__":   # --part NAME SIDE CHIP: one part in a child, one ROW line
  _, flag, name_, side_, chip_ = sys.argv
  assert flag == "--part", sys.argv
  children.print_row(rate_part(QWEN3_5_STEP, name_, side_, chip_))
