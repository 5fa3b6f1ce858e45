"""The seed prediction's programs and their rating (benchmarks/seed_prediction.py is the
command, and its docstring the method; the layer is cases/seed.py's).

  ours      `moe.moe_experts` (route, gated grouped-matmul kernel, grouped-matmul kernel,
            combine) on the chip's local experts: rating/experts_layer.py's parts
  default   Transformers' grouped_mm experts forward written in JAX (`grouped_mm_experts`:
            sort, gather, histc, two grouped_mm as `jax.lax.ragged_dot`, gate, combine), as
            written (the transposed weights copied) and with no weight copy
  shared    everything else of the layer, the same in both programs: our rms_norm and paged
            attention kernels, the XLA projections with Qwen3's q/k norms and RoPE, the
            XLA router

Each part rates in its own child process (this file as a script: `python
benchmarks/rating/seed_prediction.py --part GROUP PART CHIP`, one ROW line); its time is
max(static cycles / clock, HBM bytes / bandwidth), and the parts of a group are summed
(`totals`, `summary`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import os  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and os.environ.get("ESTIMATE_STATIC_PROFILE") == "1":
  children.enable_static_profile()   # a part's child: before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, moe, rms_norm  # noqa: E402

from benchmarks import RESULTS  # noqa: E402
from benchmarks.cases.seed import QWEN3, Layer  # noqa: E402
from benchmarks.estimator import static_estimate, xla_cost  # noqa: E402
from benchmarks.rating import experts_layer, paged_attention  # noqa: E402
from benchmarks.rating.roofline import prediction  # noqa: E402

RESULTS_FILE = RESULTS / "seed_prediction.json"   # benchmarks/seed_prediction.py writes it


# ----------------------------------------------------------------------------- the programs


def ep_local_routing(top_k_index, top_k_weights, rank: int, num_local: int):
  """AllReduceEP's remap (transformers/distributed/expert_parallel.py:284-294): routes to
  other ranks' experts get the placeholder id num_local and weight 0."""
  off_rank = (top_k_index // num_local) != rank
  local = jnp.where(off_rank, num_local, top_k_index % num_local)
  return local.astype(jnp.int32), jnp.where(off_rank, 0, top_k_weights).astype(top_k_weights.dtype)


def _grouped_mm(x, weight, sizes, copy: bool):
  """torch grouped_mm(x, weight.transpose(-2, -1), offs) for weight (E, out, in), as XLA's
  ragged_dot. copy=False: the weight is taken as already stored (E, in, out)."""
  rhs = jnp.swapaxes(weight, 1, 2) if copy else weight
  return jax.lax.ragged_dot(x, rhs, sizes)


def grouped_mm_route(hidden, top_k_index, num_experts: int):
  """grouped_mm_experts_forward up to the first grouped_mm (moe.py:432-486):
  torch.sort, the row gather, histc + cumsum (here the group sizes ragged_dot takes), the
  EP pre-mask of placeholder rows."""
  top_k = top_k_index.shape[1]
  expert_ids = top_k_index.reshape(-1)
  perm = jnp.argsort(expert_ids, stable=True)
  expert_ids_g = expert_ids[perm]
  x = jnp.take(hidden, perm // top_k, axis=0)
  sizes = jnp.zeros((num_experts,), jnp.int32).at[expert_ids_g].add(1, mode="drop")  # histc
  sentinel = (expert_ids_g >= num_experts)[:, None]
  return jnp.where(sentinel, 0, x), perm, sizes, sentinel


def grouped_mm_gate(proj, sentinel, width: int):
  """The post-mask and `_default_apply_gate`: silu(gate) * up on the chunked halves."""
  proj = jnp.where(sentinel, 0, proj)
  gate, up = proj[:, :width], proj[:, width:]
  return jax.nn.silu(gate) * up


def grouped_mm_combine(y, perm, sentinel, top_k_weights):
  """The post-mask, routing weights, inverse permutation, view + sum over K, in the
  activations' dtype (torch's sum accumulates in f32 and returns bf16)."""
  tokens, top_k = top_k_weights.shape
  y = jnp.where(sentinel, 0, y)
  y = y * top_k_weights.reshape(-1)[perm][:, None]
  inverse = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
  y = y[inverse].reshape(tokens, top_k, -1)
  return y.astype(jnp.float32).sum(axis=1).astype(top_k_weights.dtype)


def grouped_mm_experts(hidden, top_k_index, top_k_weights, gate_up, down, *,
                       num_experts: int, copy: bool = True):
  """Transformers' default experts forward (grouped_mm) in JAX: hidden [T, H], ids [T, K]
  (ids >= num_experts: placeholders), weights [T, K] (hidden's dtype), gate_up (E, 2I, H),
  down (E, H, I) -> [T, H] hidden's dtype. Every grouped_mm returns the input dtype, as
  torch's does."""
  width = (gate_up.shape[1] if copy else gate_up.shape[2]) // 2
  x, perm, sizes, sentinel = grouped_mm_route(hidden, top_k_index, num_experts)
  proj = _grouped_mm(x, gate_up, sizes, copy).astype(hidden.dtype)
  h = grouped_mm_gate(proj, sentinel, width).astype(hidden.dtype)
  y = _grouped_mm(h, down, sizes, copy).astype(hidden.dtype)
  return grouped_mm_combine(y, perm, sentinel, top_k_weights.astype(hidden.dtype))


def ours_experts(hidden, top_k_index, top_k_weights, gate_up, down, *, num_experts: int,
                 chip: str = chips.DEFAULT_CHIP, interpret: bool = False):
  """Our experts op (torch-ext experts_forward's JAX program), same arguments."""
  return moe.moe_experts(hidden, top_k_index, top_k_weights, gate_up, down,
                         num_experts=num_experts, chip=chip, interpret=interpret)


def _rope(x, cos, sin):   # rotate_half RoPE; cos / sin [T, D]
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos[:, None, :] + rotated * sin[:, None, :]).astype(x.dtype)


def qkv_program(layer: Layer):
  """Per chip: q/k/v projections of the local heads, Qwen3's q/k RMSNorms over head_dim
  (rms_norm_reference: plain XLA), RoPE (XLA)."""
  dt, d = jnp.dtype(layer.dtype), layer.head_dim
  hq, hkv = layer.local_q_heads, layer.local_kv_heads

  def fn(x, wq, wk, wv, qn, kn, cos, sin):
    t = x.shape[0]
    q = _rope(rms_norm.rms_norm_reference((x @ wq).reshape(t, hq, d), qn, eps=layer.eps),
              cos, sin)
    k = _rope(rms_norm.rms_norm_reference((x @ wk).reshape(t, hkv, d), kn, eps=layer.eps),
              cos, sin)
    return q, k, (x @ wv).reshape(t, hkv, d)

  s = jax.ShapeDtypeStruct
  return fn, [s((layer.batch, layer.hidden), dt), s((layer.hidden, hq * d), dt),
              s((layer.hidden, hkv * d), dt), s((layer.hidden, hkv * d), dt),
              s((d,), dt), s((d,), dt), s((layer.batch, d), dt), s((layer.batch, d), dt)]


def o_proj_program(layer: Layer):
  """Per chip: o_proj of the local heads (row split: a partial sum, all-reduced after)
  and the residual add (XLA)."""
  dt = jnp.dtype(layer.dtype)
  s = jax.ShapeDtypeStruct
  fn = lambda attn, wo, residual: (attn.reshape(attn.shape[0], -1) @ wo + residual).astype(dt)
  return fn, [s((layer.batch, layer.local_q_heads, layer.head_dim), dt),
              s((layer.local_q_heads * layer.head_dim, layer.hidden), dt),
              s((layer.batch, layer.hidden), dt)]


def router_program(layer: Layer, rank: int = 0):
  """Qwen3MoeTopKRouter (softmax in f32, top-k, renormalised, cast back) and AllReduceEP's
  remap to local ids (XLA), replicated on the 64 tokens."""
  dt = jnp.dtype(layer.dtype)

  def fn(x, gate_w):
    logits = x @ gate_w.T
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top, idx = jax.lax.top_k(probs, layer.top_k)
    top = (top / top.sum(-1, keepdims=True)).astype(dt)
    return ep_local_routing(idx, top, rank, layer.local_experts)

  s = jax.ShapeDtypeStruct
  return fn, [s((layer.batch, layer.hidden), dt), s((layer.experts, layer.hidden), dt)]


def residual_program(layer: Layer):
  dt = jnp.dtype(layer.dtype)
  s = jax.ShapeDtypeStruct((layer.batch, layer.hidden), dt)
  return (lambda a, b: (a + b).astype(dt)), [s, s]


def default_programs(layer: Layer, copy: bool) -> dict:
  """The default experts forward, part by part, with argument specs: (fn, specs, how)."""
  dt, s = jnp.dtype(layer.dtype), jax.ShapeDtypeStruct
  e, t, k, h, i, r = (layer.local_experts, layer.batch, layer.top_k, layer.hidden,
                      layer.width, layer.rows)
  route = lambda hidden, ids: grouped_mm_route(hidden, ids, e)
  gate = lambda proj, sentinel: grouped_mm_gate(proj, sentinel, i).astype(dt)
  tag = "as written: transposed weights copied" if copy else "weights pre-transposed: no copy"
  return {
      "route: sort, gather, histc, EP mask (XLA)": (route, [s((t, h), dt), s((t, k), jnp.int32)],
                                                    "glue"),
      f"gate/up grouped_mm (XLA ragged_dot, {tag})": (
          lambda x, w, n: _grouped_mm(x, w, n, copy).astype(dt),
          [s((r, h), dt), s((e, 2 * i, h) if copy else (e, h, 2 * i), dt), s((e,), jnp.int32)],
          "cost_analysis"),
      "gate: silu(gate) * up, mask (XLA)": (gate, [s((r, 2 * i), dt), s((r, 1), jnp.bool_)],
                                            "glue"),
      f"down grouped_mm (XLA ragged_dot, {tag})": (
          lambda x, w, n: _grouped_mm(x, w, n, copy).astype(dt),
          [s((r, i), dt), s((e, h, i) if copy else (e, i, h), dt), s((e,), jnp.int32)],
          "cost_analysis"),
      "combine: mask, weights, unsort, sum over top-k (XLA)": (
          grouped_mm_combine, [s((r, h), dt), s((r,), jnp.int32), s((r, 1), jnp.bool_),
                               s((t, k), dt)], "glue"),
  }


def default_whole_program(layer: Layer, copy: bool):
  """The default experts forward as one XLA program (fn, specs): a cross-check of the
  part-by-part sum by XLA's cost model."""
  dt, s = jnp.dtype(layer.dtype), jax.ShapeDtypeStruct
  e, t, k, h, i = layer.local_experts, layer.batch, layer.top_k, layer.hidden, layer.width
  fn = lambda hidden, ids, w, gu, dn: grouped_mm_experts(hidden, ids, w, gu, dn,
                                                         num_experts=e, copy=copy)
  return fn, [s((t, h), dt), s((t, k), jnp.int32), s((t, k), dt),
              s((e, 2 * i, h) if copy else (e, h, 2 * i), dt),
              s((e, h, i) if copy else (e, i, h), dt)]


WHOLE = "cross-check: the default experts as one program"


def shared_programs(layer: Layer) -> dict:
  """Everything but the experts, the same in both programs: name -> (fn, specs, how)."""
  dt, s = jnp.dtype(layer.dtype), jax.ShapeDtypeStruct
  norm = (lambda chip: lambda x, w: rms_norm.rms_norm(x, w, eps=layer.eps, chip=chip),
          [s((layer.batch, layer.hidden), dt), s((layer.hidden,), dt)], "kernel")
  return {
      "input norm (rms_norm kernel)": norm,
      "q/k/v projections, q/k norms, RoPE (XLA)": (*qkv_program(layer), "glue"),
      "paged attention (paged_attention kernel)": (None, None, "paged"),
      "o_proj + residual (XLA)": (*o_proj_program(layer), "glue"),
      "post-attention norm (rms_norm kernel)": norm,
      "router: gate, softmax, top-8, EP remap (XLA)": (*router_program(layer), "glue"),
      "residual after the experts (XLA)": (*residual_program(layer), "glue"),
  }


# ----------------------------------------------------------------------------- rating


OURS_EXPERTS = ("gate/up+silu kernel", "down kernel", "route (sort, group sizes, gather)",
                "combine (weights, unsort, sum over top-k)")


def all_parts(layer: Layer) -> list[tuple[str, str]]:
  """(group, part name) of every rated part."""
  return ([("shared", n) for n in shared_programs(layer)]
          + [("ours", n) for n in OURS_EXPERTS]
          + [(f"default{'' if copy else ' (no copy)'}", n)
             for copy in (True, False) for n in default_programs(layer, copy)]
          + [(WHOLE, n) for n in WHOLE_PARTS])


WHOLE_PARTS = ("as written (XLA cost_analysis)", "no weight copy (XLA cost_analysis)")


def rate_part(layer: Layer, group: str, name: str, chip: str) -> dict:
  """One part (in a child: the estimator may abort the process)."""
  from tpu_kernels import aot
  if group == "ours":
    return experts_layer.rate_part(layer.experts_case(), chip, name, fallback=False)
  if group == WHOLE:
    fn, specs = default_whole_program(layer, copy=name == WHOLE_PARTS[0])
    cost = xla_cost.cost_analysis(static_estimate.compile_on_chip(fn, specs, chip))
    c = chips.get_chip(chip)
    seconds, valid = xla_cost.optimal_seconds(cost, c)
    how = "optimal_seconds" if valid else "flops at peak"
    return dict(cycles=round(seconds * c.clock_hz), hbm_bytes=int(cost["bytes accessed"]),
                method=f"XLA cost_analysis of the whole program ({how}, bytes accessed)")
  if group == "shared":
    fn, specs, how = shared_programs(layer)[name]
  else:
    fn, specs, how = default_programs(layer, copy=group == "default")[name]
  if how == "glue":
    return xla_cost.glue_part(fn, specs, chip)
  if how == "cost_analysis":
    part = xla_cost.glue_cost_analysis(fn, specs, chip)
    part["method"] = ("XLA cost_analysis (optimal_seconds, bytes accessed; a lower bound "
                      "for XLA): the static estimator crashes on XLA's ragged_dot")
    return part
  if how == "paged":
    r = paged_attention.estimate(layer.paged_case(), chip)
    return dict(cycles=r["estimated_cycles"], hbm_bytes=r["hbm_bytes"], method=r["method"],
                tiling=dict(block_kv=r["block_kv"], pages_per_block=r["pages_per_block"]))
  report = aot.compile_for_chip(fn(chip), specs, chip)   # our rms_norm kernel
  if not report.ok or not report.estimated_cycles:
    raise RuntimeError(f"{name}: {report.error or 'no estimated_cycles'}")
  rows, width = specs[0].shape
  return dict(cycles=report.estimated_cycles, hbm_bytes=(2 * rows * width + width) * 2,
              method="static estimate of the compiled kernel; bytes: input, weight, output")


PART_TIMEOUT_S = 900


def _part_in_child(group: str, name: str, chip: str) -> dict:
  profile = "0" if name.startswith(("gate/up grouped_mm", "down grouped_mm")) or \
      group == WHOLE else "1"
  rows, error = children.run_child(__file__, ["--part", group, name, chip],
                                   timeout=PART_TIMEOUT_S,
                                   env=children.child_env(ESTIMATE_STATIC_PROFILE=profile))
  if error:
    return dict(error=error)
  return rows[-1]


def finish(part: dict, chip: str) -> dict:
  if "cycles" in part:
    part.update(prediction(part["cycles"], part["hbm_bytes"], chips.get_chip(chip)))
  return part


def rate_all(layer: Layer, chip: str, only=None) -> dict:
  out = {}
  for group, name in all_parts(layer):
    if only and not any(o in f"{group}: {name}" for o in only):
      continue
    print(f"rating {group}: {name} on {chip}", file=sys.stderr, flush=True)
    out.setdefault(group, {})[name] = finish(_part_in_child(group, name, chip), chip)
  return out


def totals(parts: dict) -> dict:
  """Sum of predicted µs per group (None if a part was not rated)."""
  def total(group):
    ps = parts.get(group, {})
    return (sum(p["predicted_us"] for p in ps.values())
            if ps and all("predicted_us" in p for p in ps.values()) else None)
  return {g: total(g) for g in parts}


def summary(results: dict) -> dict:
  """Per chip: experts µs (ours, default, default no copy), layer µs, the ratios."""
  out = {}
  for chip, parts in results["chips"].items():
    t = totals(parts)
    shared = t.get("shared")
    row = dict(shared_us=shared, ours_experts_us=t.get("ours"))
    for key, group in (("default", "default"), ("default_no_copy", "default (no copy)")):
      d = t.get(group)
      row[f"{key}_experts_us"] = d
      if d and t.get("ours"):
        row[f"{key}_experts_ratio"] = d / t["ours"]
        if shared is not None:
          row[f"{key}_layer_ratio"] = (shared + d) / (shared + t["ours"])
    if shared is not None and t.get("ours"):
      row["ours_layer_us"] = shared + t["ours"]
    out[chip] = row
  return out


if __name__ == "__main__":   # --part GROUP NAME CHIP: one part in a child, one ROW line
  _, flag, group_, name_, chip_ = sys.argv
  assert flag == "--part", sys.argv
  children.print_row(rate_part(QWEN3, group_, name_, chip_))
