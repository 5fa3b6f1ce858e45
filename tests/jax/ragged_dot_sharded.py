"""Expert parallelism for the grouped matmul: the checks run by test_ragged_dot_sharded.py.

Run in its own process (the 4 CPU host devices must be requested before jax starts):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/jax/ragged_dot_sharded.py cpu
    python tests/jax/ragged_dot_sharded.py aot

The program: `jax.shard_map` over an expert axis "e" of 4 devices. Each shard holds
G / 4 experts of the weight (and bias), lhs and group_sizes are replicated, the shard
calls the kernel with group_offset = axis_index("e") * G_local (rows of other shards'
groups come out as zeros), and the partial outputs are summed with psum.

  cpu: Pallas interpret mode, small odd shapes (an empty group, rows past
       sum(group_sizes), m / k / n not multiples of 8 or 128), float32: forward and the
       gradients w.r.t. lhs, weight and bias equal the unsharded kernel's and the float64
       NumPy reference (tests/reference.py).
  aot: the same program, interpret=False, chip="v6e", compiled ahead of time on a
       v6e:2x2 topology mesh (4 chips), forward and backward, at m=512 with Qwen3-30B-A3B's
       shapes (128 experts, 32 per chip; gated gate/up and down) and gpt-oss-20b's down
       projection (32 experts, 8 per chip, with bias, untransposed). gpt-oss's interleaved
       gate/up is left out here for time (about 30 s of compile; its unsharded kernels are
       in test_ragged_dot_aot.py).
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
from tpu_kernels import aot, ragged_dot as R  # noqa: E402

AXIS = "e"
NUM_SHARDS = 4

# (name, op kwargs, reference kwargs, transpose_rhs, gated, bias)
CONFIGS = {
    "plain": (dict(), dict(), False, False, False),
    "transposed+bias+gelu": (dict(activation="gelu_tanh"), dict(activation_name="gelu_tanh"),
                             True, False, True),
    "gated silu (Qwen3 layout)": (dict(activation="silu"), dict(gated_name="silu"), True, True,
                                  False),
    "gated gpt_oss interleaved+bias": (
        dict(activation="gpt_oss", layout="interleaved"),
        dict(gated_name="gpt_oss", layout="interleaved"), False, True, True),
}


def _op(gated, transpose_rhs, kwargs, **static):
  fn = R.gated_ragged_dot if gated else R.ragged_dot
  return functools.partial(fn, transpose_rhs=transpose_rhs, **kwargs, **static)


def sharded(op, mesh, num_groups, has_bias):
  """f(lhs, w, group_sizes[, bias]) over the expert axis: weights split by expert."""
  g_local = num_groups // NUM_SHARDS

  def shard(lhs, w, gs, *bias):
    offset = jax.lax.axis_index(AXIS) * g_local
    out = op(lhs, w, gs, group_offset=offset, bias=bias[0] if bias else None)
    return jax.lax.psum(out, AXIS)

  in_specs = (P(), P(AXIS), P()) + ((P(AXIS),) if has_bias else ())
  # check_vma=False: the kernel's pallas_call declares its out_shape without a varying-
  # manual-axes type, which shard_map's default check_vma=True rejects (ValueError:
  # "`manual_axis_type` on `jax.ShapeDtypeStruct` must not be `None`").
  return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)


def unsharded(op):
  return lambda lhs, w, gs, *bias: op(lhs, w, gs, bias=bias[0] if bias else None)


def grads_of(f, has_bias):
  """(out, d_lhs, d_w[, d_bias]) of sum(ct * f(...))."""
  argnums = (0, 1, 3) if has_bias else (0, 1)

  def run(ct, *args):
    out, vjp = jax.vjp(lambda *a: f(*a), *args)
    return (out,) + tuple(g for i, g in enumerate(vjp(ct)) if i in argnums)

  return run


def check_cpu():
  assert jax.device_count() >= NUM_SHARDS, (
      f"needs {NUM_SHARDS} host devices (XLA_FLAGS=--xla_force_host_platform_device_count"
      f"={NUM_SHARDS}), have {jax.device_count()}")
  mesh = Mesh(np.array(jax.devices()[:NUM_SHARDS]), (AXIS,))
  rng = np.random.default_rng(0)
  num_groups, m, k, n = 8, 53, 40, 72     # 2 experts per shard; odd m, k, n
  # Shard 1's experts (2, 3): one empty; 5 rows past sum(group_sizes).
  group_sizes = np.array([7, 9, 0, 11, 3, 6, 8, 4], np.int32)
  assert group_sizes.sum() == m - 5
  for name, (kwargs, ref_kwargs, transpose_rhs, gated, has_bias) in CONFIGS.items():
    n_full = 2 * n if gated else n
    w_shape = (num_groups, n_full, k) if transpose_rhs else (num_groups, k, n_full)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(k)).astype(np.float32)
    args = [lhs, w, group_sizes]
    if has_bias:
      args.append((0.1 * rng.standard_normal((num_groups, n_full))).astype(np.float32))
    ct = rng.standard_normal((m, n)).astype(np.float32)
    op = _op(gated, transpose_rhs, kwargs, interpret=True)
    got = jax.jit(grads_of(sharded(op, mesh, num_groups, has_bias), has_bias))(ct, *args)
    full = jax.jit(grads_of(unsharded(op), has_bias))(ct, *args)
    bias = args[3] if has_bias else None
    want_out = ref.ragged_dot(lhs, w, group_sizes, transpose_rhs=transpose_rhs, bias=bias,
                              **ref_kwargs)
    d_lhs, d_w, d_bias = ref.ragged_dot_grads(lhs, w, group_sizes, ct,
                                              transpose_rhs=transpose_rhs, bias=bias,
                                              **ref_kwargs)
    want = [want_out, d_lhs, d_w] + ([d_bias] if has_bias else [])
    names = ["out", "d_lhs", "d_w", "d_bias"]
    for what, g, f, r in zip(names, got, full, want):
      # Sharded vs unsharded kernel: the same per-group arithmetic; the psum adds exact
      # zeros from the other shards, so only the reduction order of XLA's glue differs.
      np.testing.assert_allclose(np.asarray(g), np.asarray(f), rtol=1e-6, atol=1e-6,
                                 err_msg=f"{name} {what}: sharded vs unsharded kernel")
      tol = ref.RAGGED_TOLERANCE["float32"] if what == "out" else \
          ref.RAGGED_GRAD_TOLERANCE["float32"]
      ref.assert_close(g, r, tol, what=f"{name} {what} (sharded) vs float64 reference")
    assert np.all(np.asarray(got[0])[m - 5:] == 0), f"{name}: rows past the groups not zero"
    print(f"cpu  {name}: sharded == unsharded == float64 reference (out, grads)", flush=True)


def check_aot():
  from jax.experimental import topologies

  topo = topologies.get_topology_desc("v6e:2x2", "tpu")
  mesh = Mesh(np.array(topo.devices[:NUM_SHARDS]), (AXIS,))
  cases = [
      # (label, G, k, n_full, m, transpose_rhs, gated, kwargs, bias)
      ("qwen3-30b-a3b gate_up", 128, 2048, 2 * 768, 512, True, True,
       dict(activation="silu"), False),
      ("qwen3-30b-a3b down", 128, 768, 2048, 512, True, False, dict(), False),
      ("gpt-oss-20b down", 32, 2880, 2880, 512, False, False, dict(), True),
  ]
  for label, groups, k, n_full, m, transpose_rhs, gated, kwargs, has_bias in cases:
    op = _op(gated, transpose_rhs, kwargs, chip="v6e", interpret=False)
    f = sharded(op, mesh, groups, has_bias)
    n = n_full // 2 if gated else n_full
    w_shape = (groups, n_full, k) if transpose_rhs else (groups, k, n_full)
    spec = lambda shape, dtype, p: jax.ShapeDtypeStruct(shape, dtype,
                                                        sharding=NamedSharding(mesh, p))
    args = [spec((m, k), jnp.bfloat16, P()), spec(w_shape, jnp.bfloat16, P(AXIS)),
            spec((groups,), jnp.int32, P())]
    if has_bias:
      args.append(spec((groups, n_full), jnp.bfloat16, P(AXIS)))
    ct = spec((m, n), jnp.bfloat16, P())
    for direction, fn, fn_args, kernels in (
        ("fwd", f, args, 1),
        ("bwd", grads_of(f, has_bias), [ct] + args, 4 if gated else 3)):
      compiled = jax.jit(fn).trace(*fn_args).lower().compile()
      text = compiled.as_text()
      found = len([n for n in aot.kernel_names(text) if R.VISIT_TABLE_KERNEL not in n])
      assert found == kernels, f"{label} {direction}: {found} Mosaic kernels, want {kernels}"
      assert "all-reduce" in text, f"{label} {direction}: no all-reduce (psum) in the program"
      # Each chip's kernels see only its G/4 experts.
      assert f"{groups // NUM_SHARDS},{n_full if transpose_rhs else k}," in text.replace(
          " ", ""), f"{label} {direction}: no per-shard weight of {groups // NUM_SHARDS} experts"
      print(f"aot  {label} {direction} on v6e:2x2: compiled, {found} Mosaic kernel(s) per chip, "
            "psum -> all-reduce", flush=True)


if __name__ == "__main__":
  {"cpu": check_cpu, "aot": check_aot}[sys.argv[1]]()
