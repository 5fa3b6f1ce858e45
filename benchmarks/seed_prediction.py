"""The seed's headline (21.5x faster Qwen3-30B-A3B decode at batch 64 on v6e-8 against
Transformers' default experts implementation) as a prediction: static estimates, not
measurements.

What Transformers 5.23.0 runs by default (read from the installed package):
  * `PreTrainedModel.get_correct_experts_implementation` (modeling_utils.py:1883-1902)
    picks "grouped_mm" when none is requested; it falls back to eager only if the model
    class lacks `@use_experts_implementation` (`_grouped_mm_can_dispatch`, :1674;
    Qwen3MoeExperts has it: models/qwen3_moe/modeling_qwen3_moe.py:208).
  * `grouped_mm_experts_forward` (integrations/moe.py:424-537): sort the T*K (token,
    expert) pairs, gather the token rows, histc + cumsum offsets, `_grouped_linear` with
    `weight.transpose(-2, -1)` (Qwen3 stores gate_up (E, 2I, H), down (E, H, I)), gate,
    routing weights, unsort, sum over K.
  * On a "tpu" tensor `_can_use_grouped_mm` returns True whenever torch has
    `nn.functional.grouped_mm` (moe.py:316-319; torch 2.13 has it), so the call is
    `torch.nn.functional.grouped_mm`, which TorchTPU 0.2.0 lowers itself
    (`AtenGroupedMm` / `BuildGroupedMmShlo` in csrc/ops/grouped_mm/grouped_mm_aten_kernels.cc;
    the same library carries `chlo::RaggedDot`): here it is written as XLA's
    `jax.lax.ragged_dot`, which XLA compiles for TPU to its own "ragged-dot" Mosaic custom call.
  * Expert parallelism: `base_model_ep_plan` (configuration_qwen3_moe.py:70) marks the
    experts "ep_dispatch_experts"; at inference with ep_size == tp_size the default
    `AutoEP` takes `AllReduceEP` (distributed/expert_parallel.py:262-323): every rank runs
    its own E/ep experts on the whole batch, routes to other ranks' experts get the local
    placeholder id E/ep and weight 0, and an all-reduce sums the outputs.

The per-chip program (one decoder layer, one v6e chip, its share of a v6e-8 step):
  * batch 64 decode (64 new tokens), KV context 2048 tokens per sequence (the paged
    headline's context; pages of 64), bf16.
  * experts: 8-way expert parallel as AllReduceEP runs it: 16 experts per chip, all 64 x
    top-8 = 512 routed rows per chip, about 64 of them to local experts (expected experts
    hit per chip: 16 (1 - (1 - 8/128)^64) = 15.7), the rest placeholders.
  * attention: head-split tensor parallel (AllReduceEP needs every rank of the EP group to
    hold the same batch, so attention cannot be data-parallel over sequences): 4 of the
    32 query heads per chip; the 4 KV heads cannot be split 8 ways, so each KV head is on
    2 chips (the 4 query heads of a chip share one). q/k/v projections column-split,
    o_proj row-split (then an all-reduce), norms and router replicated on the 64 tokens.
  * the two all-reduces of [64, 2048] bf16 (after o_proj, after the experts) and the new
    tokens' KV-cache write are not rated (ICI / a 64-row scatter; the same in both programs).

Both programs share everything but the experts (rms_norm kernels, XLA projections with
Qwen3's q/k norms and RoPE, our paged attention kernel, the XLA router), so the layer ratio
isolates the experts:
  (a) ours:    `moe.moe_experts` (route, gated grouped-matmul kernel, grouped-matmul kernel,
               combine) on the 16 local experts, placeholders past the groups;
  (b) default: `grouped_mm_experts` below, Transformers' grouped_mm forward written in JAX,
               each grouped_mm a `jax.lax.ragged_dot` on the transposed weights
               ("as written": XLA materialises the transpose, a copy of every local
               expert's weights per call, which is what the compiled HLO shows) and, as
               a lower bound for it, on weights already stored (E, in, out) ("no copy").

Rating: each part in its own child process, time = max(static cycles / clock, HBM bytes /
bandwidth), parts summed (experts_layer_estimate's method, whose functions are imported):
  * our kernels: rms_norm by the static estimate of the compiled kernel; paged attention by
    `paged_estimate.estimate`; the experts layer by `experts_layer_estimate.rate_part` on
    an ExpertsLayer of 64 tokens x top-8 over the 16 local experts (every routed row local,
    32 per expert: the same op shapes as the real call, which has ~64 local rows and ~448
    placeholder rows; the kernels' extra rows cost MXU time only, and the placeholder tiles'
    zero visits are not counted);
  * XLA glue (projections, router, the default's sort / gather / gate / combine): static
    estimate of the compiled XLA ops, bytes from cost_analysis (`glue_part`);
  * XLA's ragged_dot: the static estimator crashes on it (as noted in docs/performance.md),
    so the two grouped_mm calls are rated by XLA's cost_analysis (optimal_seconds, bytes
    accessed), as the existing XLA baselines are: a lower bound for XLA.

    python benchmarks/seed_prediction.py            # rate every part (v6e), write the results
    python benchmarks/seed_prediction.py --table    # the docs' table from the results file
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tuning  # noqa: E402  (no jax)

if __name__ == "__main__" and os.environ.get("ESTIMATE_STATIC_PROFILE") == "1":
  tuning.enable_static_profile()   # a part's child: before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, moe, rms_norm  # noqa: E402

import headline  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "seed_prediction.json"
SEED_SPEEDUP = {"Qwen3-30B-A3B": 21.5, "Gemma 4 26B-A4B": 12.8}


@dataclasses.dataclass(frozen=True)
class Layer:
  """One MoE decoder layer at a decode step, and its per-chip split (see the docstring)."""

  model: str = "Qwen3-30B-A3B"
  batch: int = 64             # sequences, one new token each
  context: int = 2048         # cached tokens per sequence
  page_size: int = 64
  experts: int = 128
  top_k: int = 8
  hidden: int = 2048
  width: int = 768            # moe_intermediate_size
  q_heads: int = 32
  kv_heads: int = 4
  head_dim: int = 128
  chips: int = 8              # expert parallel and head split over this many chips
  eps: float = 1e-6
  dtype: str = "bfloat16"

  @property
  def local_experts(self) -> int:
    return self.experts // self.chips

  @property
  def local_q_heads(self) -> int:
    return self.q_heads // self.chips

  @property
  def local_kv_heads(self) -> int:   # a KV head on chips/kv_heads chips when kv_heads < chips
    return max(self.kv_heads // self.chips, 1)

  @property
  def rows(self) -> int:
    return self.batch * self.top_k

  @property
  def local_experts_hit(self) -> float:
    """Expected distinct local experts hit (each token picks top_k distinct of E)."""
    return self.local_experts * (1 - (1 - self.top_k / self.experts) ** self.batch)

  def experts_case(self) -> headline.ExpertsLayer:
    """The local experts call as experts_layer_estimate rates it: all rows over E/ep experts."""
    return headline.ExpertsLayer(self.model, self.batch, self.local_experts, self.top_k,
                                 self.hidden, self.width, self.dtype)

  def paged_case(self) -> headline.PagedDecode:
    return headline.PagedDecode(self.context, batch=self.batch, q_heads=self.local_q_heads,
                                kv_heads=self.local_kv_heads, head_dim=self.head_dim,
                                page_size=self.page_size)

  def experts_min_bytes(self) -> int:
    """Per-chip experts roofline bytes: weights of the local experts hit, hidden in, out."""
    s = headline.ITEMSIZE[self.dtype]
    return round(self.local_experts_hit * 3 * self.hidden * self.width * s
                 + 2 * self.batch * self.hidden * s + self.rows * (4 + s))


QWEN3 = Layer()


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
  import experts_layer_estimate as X
  from tpu_kernels import aot
  if group == "ours":
    return X.rate_part(layer.experts_case(), chip, name, fallback=False)
  if group == WHOLE:
    fn, specs = default_whole_program(layer, copy=name == WHOLE_PARTS[0])
    compiled = jax.jit(fn).trace(*[aot._on_device(s, aot.topology_device(chip))
                                   for s in specs]).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    c = chips.get_chip(chip)
    seconds, how = float(cost["optimal_seconds"]), "optimal_seconds"
    if seconds <= 0:   # as estimate._xla_cost: XLA gives no valid optimal_seconds here
      seconds, how = float(cost["flops"]) / c.bf16_flops_per_s, "flops at peak"
    return dict(cycles=round(seconds * c.clock_hz), hbm_bytes=int(cost["bytes accessed"]),
                method=f"XLA cost_analysis of the whole program ({how}, bytes accessed)")
  if group == "shared":
    fn, specs, how = shared_programs(layer)[name]
  else:
    fn, specs, how = default_programs(layer, copy=group == "default")[name]
  if how == "glue":
    return X.glue_part(fn, specs, chip)
  if how == "cost_analysis":
    part = X.glue_cost_analysis(fn, specs, chip)
    part["method"] = ("XLA cost_analysis (optimal_seconds, bytes accessed; a lower bound "
                      "for XLA): the static estimator crashes on XLA's ragged_dot")
    return part
  if how == "paged":
    import paged_estimate
    r = paged_estimate.estimate(layer.paged_case(), chip)
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
  rows, error = tuning.run_child(__file__, ["--part", group, name, chip],
                                 timeout=PART_TIMEOUT_S,
                                 env=tuning.child_env(ESTIMATE_STATIC_PROFILE=profile))
  if error:
    return dict(error=error)
  return rows[-1]


def finish(part: dict, chip: str) -> dict:
  c = chips.get_chip(chip)
  if "cycles" in part:
    part["compute_us"] = part["cycles"] / c.clock_hz * 1e6
    part["hbm_us"] = part["hbm_bytes"] / c.hbm_bytes_per_s * 1e6
    part["predicted_us"] = max(part["compute_us"], part["hbm_us"])
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


def _us(x) -> str:
  return "not rated" if x is None else f"{x:,.1f}"


def table(results: dict) -> str:
  """The docs' table (static estimates) from the results file."""
  layer = Layer(**results["layer"])
  lines = ["| chip | part | ours µs | default (grouped_mm) µs | default, no weight copy µs |",
           "|---|---|---:|---:|---:|"]
  for chip, parts in results["chips"].items():
    s = summary(results)[chip]
    lines.append(f"| {chip} | shared: norms, attention, router (same in both) "
                 f"| {_us(s['shared_us'])} | {_us(s['shared_us'])} | {_us(s['shared_us'])} |")
    lines.append(f"| {chip} | experts (16 local of 128, 512 routed rows) | "
                 f"{_us(s['ours_experts_us'])} | {_us(s['default_experts_us'])} | "
                 f"{_us(s['default_no_copy_experts_us'])} |")
    layer_us = lambda e: None if e is None or s["shared_us"] is None else s["shared_us"] + e
    lines.append(f"| {chip} | **decoder layer** | {_us(layer_us(s['ours_experts_us']))} | "
                 f"{_us(layer_us(s['default_experts_us']))} | "
                 f"{_us(layer_us(s['default_no_copy_experts_us']))} |")
    ratio = lambda k: f"{s[k]:.2f}x" if s.get(k) else "not rated"
    lines.append(f"| {chip} | predicted speed-up, experts / layer (seed: "
                 f"{SEED_SPEEDUP[layer.model]}x) | | {ratio('default_experts_ratio')} / "
                 f"{ratio('default_layer_ratio')} | {ratio('default_no_copy_experts_ratio')} / "
                 f"{ratio('default_no_copy_layer_ratio')} |")
  return "\n".join(lines)


def parts_table(results: dict) -> str:
  """Every rated part: µs, how."""
  lines = ["| chip | program | part | µs | compute µs | HBM µs | method |", "|---|---|---|---:|---:|---:|---|"]
  for chip, parts in results["chips"].items():
    for group, ps in parts.items():
      for name, p in ps.items():
        if "predicted_us" not in p:
          lines.append(f"| {chip} | {group} | {name} | not rated: {p.get('error', '')[:100]} |||")
          continue
        lines.append(f"| {chip} | {group} | {name} | {p['predicted_us']:,.1f} | "
                     f"{p['compute_us']:,.1f} | {p['hbm_us']:,.1f} | {p['method'][:90]} |")
  return "\n".join(lines)


def main(argv) -> int:
  if argv[:1] == ["--part"]:   # one part in a child: one ROW line
    _, group, name, chip = argv
    tuning.print_row(rate_part(QWEN3, group, name, chip))
    return 0
  if argv[:1] == ["--table"]:
    results = json.loads(RESULTS.read_text())
    print(table(results) + "\n\n" + parts_table(results))
    return 0
  chips_ = [a for a in argv if a in ("v5e", "v6e")] or ["v6e"]
  only = [a for a in argv if a not in ("v5e", "v6e")]
  results = json.loads(RESULTS.read_text()) if RESULTS.exists() else dict(chips={})
  results["layer"] = dataclasses.asdict(QWEN3)
  for chip in chips_:
    rated = rate_all(QWEN3, chip, only)
    for group, ps in rated.items():
      results["chips"].setdefault(chip, {}).setdefault(group, {}).update(ps)
  results["summary"] = summary(results)
  results["seed_speedup"] = SEED_SPEEDUP   # the claims the prediction is set against
  RESULTS.write_text(json.dumps(results, indent=1, default=float) + "\n")
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
