"""Tensor parallelism for flash attention: the checks run by test_flash_attention_sharded.py.

Run in its own process (the 4 CPU host devices must be requested before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/jax/flash_attention_sharded.py cpu
    python tests/jax/flash_attention_sharded.py aot

The program: `jax.shard_map` over a head axis "h" of 4 devices. q [B, Hq, S, D] is split
on Hq and k / v [B, Hkv, S, D] on Hkv, so each device holds Hq / 4 query heads and
their Hkv / 4 KV heads: whole GQA groups (query head h uses KV head h // G, and the
blocks of Hq / 4 = (Hkv / 4) * G consecutive query heads are exactly the groups of the
device's KV heads). sinks [Hq] are split like q's heads; segment ids are replicated.
Each device calls the unchanged kernel on its heads; out and lse come back split on
heads. Heads are independent, so no collective is needed, forward or backward.

  cpu: Pallas interpret mode, float32, B=2, Hq / Hkv = 12 / 4 (G = 3, one KV head per
       device), Sq = Skv = 300 (not a block multiple: padded) with 128-blocks (so the
       causal / window block skipping is exercised), D = 40; variants causal, causal +
       sliding window, causal + soft-cap, causal + sinks, and all of them with segment
       ids. Forward (out, lse) and the gradients w.r.t. q, k, v, sinks (cotangents on
       both out and lse) equal the unsharded kernel's and the float64 reference
       (tests/reference.py `attention` / `attention_grads`).
  aot: the same program, interpret=False, chip="v6e", compiled ahead of time on a
       v6e:2x2 topology mesh (4 chips), forward and backward, bf16: B=1, 32 / 8 heads
       (8 / 2 per chip), S=8192, D=128, causal; and gpt-oss-like (64 / 8 heads, D=64,
       sliding_window=128, sinks sharded on Hq), backward (which holds the forward
       kernel). Checked: the expected Mosaic kernels by name, each chip's kernels see
       only its heads, the scoped-VMEM limit is attention_tiling's, no collective.
Prints one line per check; exits non-zero (AssertionError) on the first failure.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import reference as ref  # noqa: E402
from tpu_kernels import aot, flash_attention as FA  # noqa: E402

AXIS = "h"
NUM_SHARDS = 4

# name -> (options, sinks, segment ids)
CONFIGS = {
    "causal": (dict(causal=True), False, False),
    "causal+window": (dict(causal=True, sliding_window=100), False, False),
    "causal+soft_cap": (dict(causal=True, soft_cap=5.0), False, False),
    "causal+sinks": (dict(causal=True), True, False),
    "causal+window+soft_cap+sinks+segments": (
        dict(causal=True, sliding_window=100, soft_cap=5.0), True, True),
}
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute",
               "reduce-scatter")


def _split(args, has_sinks, has_segments):
  """(q, k, v, sinks or None, segment_ids or None) from the positional arguments."""
  q, k, v, *rest = args
  sinks = rest.pop(0) if has_sinks else None
  segment_ids = rest.pop(0) if has_segments else None
  return q, k, v, sinks, segment_ids


def attention(op, has_sinks, has_segments):
  """f(q, k, v[, sinks][, segment_ids]) -> (out, lse), unsharded."""
  def f(*args):
    q, k, v, sinks, segment_ids = _split(args, has_sinks, has_segments)
    return op(q, k, v, sinks=sinks, segment_ids=segment_ids, return_lse=True)
  return f


def sharded(op, mesh, has_sinks, has_segments):
  """The same f under shard_map: q, k, v, sinks split on heads, segment ids replicated."""
  heads = P(None, AXIS)
  in_specs = (heads, heads, heads) + ((P(AXIS),) if has_sinks else ()) + \
      ((P(),) if has_segments else ())
  # check_vma=False: the kernel's pallas_calls declare their out_shape without a varying-
  # manual-axes type, which shard_map's default check_vma=True rejects (ValueError:
  # "`manual_axis_type` on `jax.ShapeDtypeStruct` must not be `None`"); the same as the
  # grouped matmul's expert-parallel program.
  return jax.shard_map(attention(op, has_sinks, has_segments), mesh=mesh, in_specs=in_specs,
                       out_specs=(heads, heads), check_vma=False)


def grads_of(f, num_args):
  """(out, lse, d_q, d_k, d_v[, d_sinks]) of sum(ct * out) + sum(ct_lse * lse); the
  segment ids (last argument when present) get no gradient."""
  def run(ct, ct_lse, *args):
    (out, lse), vjp = jax.vjp(f, *args)
    return (out, lse) + tuple(vjp((ct, ct_lse))[:num_args])
  return run


def _d_sinks_reorder_bound(full, sinks, ct, ct_lse):
  """Per head: how far two float32 evaluations of d_sinks[h] = -sum_{b, i} t[b, i] with
  t = exp(sinks[h] - lse) * di, di = sum_d(ct * out) - ct_lse, may differ when XLA sums
  in another order: log2(n) * eps32 * sum |t| (pairwise summation's error bound, n = B * S
  terms), from the unsharded kernel's out and lse in float64."""
  out, lse = (np.asarray(a, np.float64) for a in full[:2])
  di = np.sum(ct.astype(np.float64) * out, axis=-1) - ct_lse            # [B, Hq, S]
  terms = np.exp(sinks.astype(np.float64)[None, :, None] - lse) * di
  num_terms = terms.shape[0] * terms.shape[2]
  return np.log2(num_terms) * np.finfo(np.float32).eps * np.sum(np.abs(terms), axis=(0, 2))


def check_cpu():
  assert jax.device_count() >= NUM_SHARDS, (
      f"needs {NUM_SHARDS} host devices (XLA_FLAGS=--xla_force_host_platform_device_count"
      f"={NUM_SHARDS}), have {jax.device_count()}")
  mesh = Mesh(np.array(jax.devices()[:NUM_SHARDS]), (AXIS,))
  rng = np.random.default_rng(0)
  batch, q_heads, kv_heads, seq, head_dim = 2, 12, 4, 300, 40
  blocks = dict(block_q=128, block_k=128)
  for name, (options, has_sinks, has_segments) in CONFIGS.items():
    q = rng.standard_normal((batch, q_heads, seq, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, kv_heads, seq, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, kv_heads, seq, head_dim)).astype(np.float32)
    args = [q, k, v]
    sinks = segment_ids = None
    if has_sinks:
      sinks = rng.standard_normal(q_heads).astype(np.float32)
      args.append(sinks)
    if has_segments:   # packed sequences: three segments per row, cut at different places
      segment_ids = np.stack([np.repeat([0, 1, 2], [90, 130, 80]),
                              np.repeat([0, 1, 2], [150, 50, 100])]).astype(np.int32)
      args.append(segment_ids)
    ct = rng.standard_normal(q.shape).astype(np.float32)
    ct_lse = rng.standard_normal(q.shape[:3]).astype(np.float32)
    op = functools.partial(FA.flash_attention, interpret=True, **options, **blocks)
    num_args = 4 if has_sinks else 3
    got = jax.jit(grads_of(sharded(op, mesh, has_sinks, has_segments), num_args))(
        ct, ct_lse, *args)
    full = jax.jit(grads_of(attention(op, has_sinks, has_segments), num_args))(
        ct, ct_lse, *args)
    ref_options = dict(options, sinks=sinks, segment_ids=segment_ids)
    want_out, want_lse = ref.attention(q, k, v, **ref_options)
    want_grads = ref.attention_grads(q, k, v, ct, grad_lse=ct_lse, **ref_options)
    want = [want_out, want_lse] + [want_grads[n] for n in ("dq", "dk", "dv", "dsinks")]
    names = ["out", "lse", "d_q", "d_k", "d_v", "d_sinks"]
    assert len(got) == len(full) == num_args + 2
    for what, g, f, r in zip(names, got, full, want):
      # Sharded vs unsharded kernel: the same per-head arithmetic (each device runs the
      # kernel on whole KV groups), so only XLA's glue could reorder a sum. The one sum
      # in the glue is d_sinks (a sum over batch and queries, on a differently shaped
      # array per device), held to the bound of a reordered float32 sum.
      if what == "d_sinks":
        bound = _d_sinks_reorder_bound(full, sinks, ct, ct_lse)
        diff = np.abs(np.asarray(g, np.float64) - np.asarray(f, np.float64))
        assert np.all(diff <= bound), (
            f"{name} d_sinks: sharded vs unsharded kernel differ by {diff} per head, more "
            f"than a reordered float32 sum can ({bound})")
        print(f"cpu  {name}: d_sinks sharded - unsharded at most "
              f"{np.max(diff / bound):.3f} of the reordering bound", flush=True)
      else:
        np.testing.assert_allclose(np.asarray(g), np.asarray(f), rtol=1e-6, atol=1e-6,
                                   err_msg=f"{name} {what}: sharded vs unsharded kernel")
      if what == "out":
        tol, scale = ref.ATTENTION_TOLERANCE["float32"], None
      elif what == "lse":   # absolute in logit units (see reference.py)
        tol = ref.ATTENTION_LSE_TOLERANCE["float32"]
        scale = max(float(np.max(np.abs(r))), 1.0)
      else:
        tol, scale = ref.ATTENTION_GRAD_TOLERANCE["float32"], None
      ref.assert_close(g, r, tol, what=f"{name} {what} (sharded) vs float64 reference",
                       scale=scale)
    print(f"cpu  {name}: sharded == unsharded == float64 reference "
          f"(out, lse, d_q, d_k, d_v{', d_sinks' if has_sinks else ''})", flush=True)


def _check_compiled(label, text, kernels, tiling, local_q5):
  names = aot.kernel_names(text)
  assert len(names) == len(kernels) and all(
      len([n for n in names if want in n]) == 1 for want in kernels), (
      f"{label}: Mosaic kernels {names}, expected one each of {kernels}")
  limits = set(aot.scoped_vmem_per_kernel(text))
  assert limits == {tiling.vmem_limit_bytes}, (
      f"{label}: scoped VMEM {limits}, attention_tiling asked for {tiling.vmem_limit_bytes}")
  # Each chip's kernels see only its heads: q viewed as [B, Hkv / 4, G, S, D].
  assert local_q5 in text.replace(" ", ""), f"{label}: no per-chip q block {local_q5}"
  found = [c for c in COLLECTIVES if c in text]
  assert not found, f"{label}: heads are independent, yet the program holds {found}"


def check_aot():
  from jax.experimental import topologies

  topo = topologies.get_topology_desc("v6e:2x2", "tpu")
  mesh = Mesh(np.array(topo.devices[:NUM_SHARDS]), (AXIS,))
  cases = [
      # (label, Hq, Hkv, S, D, options, sinks, directions)
      ("32/8 heads S=8192 D=128 causal", 32, 8, 8192, 128, dict(causal=True), False,
       ("fwd", "bwd")),
      ("gpt-oss-like 64/8 heads S=8192 D=64 causal window=128 sinks", 64, 8, 8192, 64,
       dict(causal=True, sliding_window=128), True, ("bwd",)),
  ]
  for label, q_heads, kv_heads, seq, head_dim, options, has_sinks, directions in cases:
    op = functools.partial(FA.flash_attention, chip="v6e", interpret=False, **options)
    f = sharded(op, mesh, has_sinks, False)
    spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(shape, dtype,
                                                        sharding=NamedSharding(mesh, p))
    heads = P(None, AXIS)
    args = [spec((1, q_heads, seq, head_dim), jnp.bfloat16, heads),
            spec((1, kv_heads, seq, head_dim), jnp.bfloat16, heads),
            spec((1, kv_heads, seq, head_dim), jnp.bfloat16, heads)]
    if has_sinks:
      args.append(spec((q_heads,), jnp.float32, P(AXIS)))
    ct = spec((1, q_heads, seq, head_dim), jnp.bfloat16, heads)
    ct_lse = spec((1, q_heads, seq), jnp.float32, heads)
    group, local_kv = q_heads // kv_heads, kv_heads // NUM_SHARDS
    tiling = FA.attention_tiling(seq, seq, head_dim, group=group, dtype=jnp.bfloat16,
                                 chip="v6e", causal=options.get("causal", False),
                                 sliding_window=options.get("sliding_window"))
    local_q5 = f"bf16[1,{local_kv},{group},{seq},{head_dim}]"
    programs = {"fwd": (f, args, (FA.FORWARD_KERNEL,)),
                "bwd": (grads_of(f, len(args)), [ct, ct_lse] + args,
                        (FA.FORWARD_KERNEL, FA.DQ_KERNEL, FA.DKV_KERNEL))}
    for direction in directions:
      fn, fn_args, kernels = programs[direction]
      text = jax.jit(fn).trace(*fn_args).lower().compile().as_text()
      _check_compiled(f"{label} {direction}", text, kernels, tiling, local_q5)
      print(f"aot  {label} {direction} on v6e:2x2: compiled, {len(kernels)} Mosaic "
            f"kernel(s) per chip on {local_q5} (block_q {tiling.block_q}, block_k "
            f"{tiling.block_k}, {tiling.vmem_limit_bytes >> 20} MiB), no collective",
            flush=True)


if __name__ == "__main__":
  {"cpu": check_cpu, "aot": check_aot}[sys.argv[1]]()
