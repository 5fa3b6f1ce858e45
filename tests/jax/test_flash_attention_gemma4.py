"""Flash attention at Gemma 4's attention shapes, in interpret mode, against the float64
reference (issue 60, item 3). JAX only.

Gemma 4 (transformers 5.25, models/gemma4/modeling_gemma4.py, `Gemma4TextAttention`):
  * full-attention layers: head_dim `global_head_dim` = 512 and, with `attention_k_eq_v`,
    no v_proj: keys and values come from one projection p = k_proj(x), as
    k = rope(k_norm(p)) and v = v_norm(p) (v_norm has no weight). In 26B-A4B the full
    layers have 16 query heads and 2 KV heads (`num_global_key_value_heads`).
  * sliding layers: head_dim 256, their own v_proj, a window.
  * both: `scaling = 1.0` (q and k are RMS-normed instead of scaled), causal.
So the kernel is called with sm_scale=1.0 at head_dim 512 and 256. K = V taken to its
end, one array passed as both k and v (a server that keeps one cache for such a layer),
is `test_keys_as_values`: the output is attention with v = k and the array's gradient is
dk + dv.

Inputs: RMS-normed q and k give logits q . k of standard deviation ~sqrt(D) * |w_q| |w_k|
(the norms' weights); trained models keep them O(1..10). The reference's tolerances are
derived for logits O(1..30) (reference.ATTENTION_TOLERANCE), so q is drawn with standard
deviation 2 / sqrt(D) (logits of standard deviation ~2 for unit-normal k) and k, v unit
normal: sm_scale = 1.0 against the default 1 / sqrt(D) moves every logit by a factor of
22.6 at D = 512, far outside any tolerance, so a dropped scale fails.
Few, small cases: interpret mode compiles each shape, and D = 512 is the widest block.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import reference as ref
from tpu_kernels import flash_attention as FA

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
CHIP = "v6e"
GLOBAL_HEAD_DIM, SLIDING_HEAD_DIM = 512, 256


def _draw(rng, shape, dtype, std=1.0):
  return (std * rng.standard_normal(shape)).astype(NP[dtype])


@functools.partial(jax.jit, static_argnames=("options",))
def _run(q, k, v, grad_out, grad_lse, options):
  """(out, lse, dict(dq, dk, dv)) of flash_attention with return_lse, one jit."""
  def f(q, k, v):
    return FA.flash_attention(q, k, v, return_lse=True, interpret=True, chip=CHIP,
                              **dict(options))

  (out, lse), vjp = jax.vjp(f, q, k, v)
  dq, dk, dv = vjp((grad_out, grad_lse))
  return out, lse, dict(dq=dq, dk=dk, dv=dv, dsinks=None)


@functools.partial(jax.jit, static_argnames=("options",))
def _run_shared_kv(q, kv, grad_out, grad_lse, options):
  """(out, lse, dq, dkv) of flash_attention(q, kv, kv): one array as keys and values."""
  def f(q, kv):
    return FA.flash_attention(q, kv, kv, return_lse=True, interpret=True, chip=CHIP,
                              **dict(options))

  (out, lse), vjp = jax.vjp(f, q, kv)
  dq, dkv = vjp((grad_out, grad_lse))
  return out, lse, dq, dkv


# (name, dtype, batch, q heads, kv heads, q_len, kv_len, head_dim, sliding window, blocks):
# the full layers' 8:1 head ratio of 26B-A4B (16 / 2) scaled down to 4 / 1 (group 4) and
# 2 / 1; lengths not multiples of the forced 128 blocks (several blocks and a tail) and a
# chunk whose queries start inside the keys (q_len < kv_len: decode-like rows at the end).
CASES = [
    ("full-512-f32", "float32", 1, 4, 1, 136, 136, GLOBAL_HEAD_DIM, None, 128),
    ("full-512-bf16-chunk", "bfloat16", 1, 2, 1, 72, 200, GLOBAL_HEAD_DIM, None, None),
    ("sliding-256-f32", "float32", 1, 4, 2, 136, 136, SLIDING_HEAD_DIM, 48, 128),
    ("sliding-256-bf16-chunk", "bfloat16", 2, 2, 1, 40, 168, SLIDING_HEAD_DIM, 48, None),
]


def _problem(case, seed):
  name, dtype, batch, hq, hkv, q_len, kv_len, head_dim, window, block = case
  rng = np.random.default_rng(seed)
  q = _draw(rng, (batch, hq, q_len, head_dim), dtype, std=2.0 / np.sqrt(head_dim))
  k = _draw(rng, (batch, hkv, kv_len, head_dim), dtype)
  v = _draw(rng, (batch, hkv, kv_len, head_dim), dtype)
  grad_out = _draw(rng, q.shape, dtype)
  grad_lse = rng.standard_normal(q.shape[:3]).astype(np.float32)
  # Queries are the last q_len positions of the keys (chunked prefill / decode).
  options = dict(causal=True, sm_scale=1.0, sliding_window=window,
                 q_offset=kv_len - q_len)
  blocks = () if block is None else (("block_q", block), ("block_k", block))
  static = tuple(options.items()) + blocks
  return dtype, q, k, v, grad_out, grad_lse, options, static


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_gemma4_attention_forward_and_backward(case):
  """out, lse, dq, dk, dv at Gemma 4's head dims with scale 1.0 against the reference."""
  dtype, q, k, v, grad_out, grad_lse, options, static = _problem(case, seed=0)
  out, lse, grads = _run(*map(jnp.asarray, (q, k, v, grad_out, grad_lse)), options=static)
  assert out.shape == q.shape and out.dtype == q.dtype
  failures = ref.attention_mismatches(dtype, q, k, v, out, lse, grads, grad_out=grad_out,
                                      grad_lse=grad_lse, **options)
  assert not failures, "\n".join([case[0], *failures.values()])


def test_keys_as_values():
  """attention_k_eq_v: one array passed as k and v at head_dim 512, scale 1.0. The output
  is attention with v = k, and the array's gradient is the sum of the key and value
  gradients (each judged against its own scale, so the sum against the sum of scales)."""
  case = ("full-512-shared", "bfloat16", 1, 4, 1, 136, 136, GLOBAL_HEAD_DIM, None, 128)
  dtype, q, kv, _, grad_out, grad_lse, options, static = _problem(case, seed=1)
  out, lse, dq, dkv = _run_shared_kv(*map(jnp.asarray, (q, kv, grad_out, grad_lse)),
                                     options=static)
  failures = ref.attention_mismatches(dtype, q, kv, kv, out, lse, None, **options)
  assert not failures, "\n".join(failures.values())
  want = ref.attention_grads(q, kv, kv, grad_out, grad_lse=grad_lse, **options)
  scales = ref.attention_grad_scales(q, kv, kv, grad_out, grad_lse=grad_lse, **options)
  tolerance = ref.ATTENTION_GRAD_TOLERANCE[dtype]
  ref.assert_close(dq, want["dq"], tolerance, what="dq", scale=scales["dq"])
  ref.assert_close(dkv, want["dk"] + want["dv"], tolerance, what="dk + dv",
                   scale=scales["dk"] + scales["dv"])


def test_the_scale_matters_on_these_inputs():
  """The checks above can fail on a dropped scale: on the same inputs the reference at
  the default scale 1 / sqrt(D) is far outside the tolerance of the reference at 1.0."""
  for case in CASES:
    dtype, q, k, v, _, _, options, _ = _problem(case, seed=0)
    default_scale, _ = ref.attention(q, k, v, **dict(options, sm_scale=None))
    failures = ref.attention_mismatches(dtype, q, k, v, default_scale, **options)
    assert set(failures) == {"out"}, case[0]
