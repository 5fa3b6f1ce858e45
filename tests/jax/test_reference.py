"""The references themselves: the two gradient routes agree, and match finite differences."""

import numpy as np
import pytest

import reference as ref


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [1, 7, 64])
def test_gradient_routes_agree_with_finite_differences(hidden, offset):
  rng = np.random.default_rng(hidden)
  x, w, g = rng.standard_normal((3, hidden)), rng.standard_normal(hidden), rng.standard_normal((3, hidden))
  eps = 1e-3
  dx, dw, _, _ = ref.rms_norm_grads(x, w, g, eps, offset)
  np.testing.assert_allclose(ref.rms_norm_dx_closed_form(x, w, g, eps, offset), dx,
                             rtol=1e-10, atol=1e-12)

  def loss(x_, w_):
    return float(np.sum(g * ref.rms_norm(x_, w_, eps, offset)))

  h = 1e-6
  for r, j in [(0, 0), (2, hidden - 1), (1, hidden // 2)]:
    e = np.zeros_like(x)
    e[r, j] = h
    np.testing.assert_allclose((loss(x + e, w) - loss(x - e, w)) / (2 * h), dx[r, j],
                               rtol=1e-5, atol=1e-7)
  for j in {0, hidden - 1}:
    e = np.zeros_like(w)
    e[j] = h
    np.testing.assert_allclose((loss(x, w + e) - loss(x, w - e)) / (2 * h), dw[j],
                               rtol=1e-5, atol=1e-7)


def test_forward_definition():
  x = np.array([[3.0, 4.0]])  # mean square 12.5
  out = ref.rms_norm(x, np.array([1.0, 2.0]), eps=0.0)
  np.testing.assert_allclose(out, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]])
  np.testing.assert_allclose(ref.rms_norm(x, np.array([0.0, 1.0]), 0.0, offset=1.0),
                             [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]])


# ----------------------------------------------------------------------------- attention

def _attention_brute_force(q, k, v, *, causal=False, sm_scale=None, sliding_window=None,
                           soft_cap=None, segment_ids=None, sinks=None, q_offset=0):
  """One row at a time with Python scalars: an explicit list of visible keys and a
  hand-written log-sum-exp (a different route from the reference's masked arrays)."""
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  scale = 1.0 / np.sqrt(head_dim) if sm_scale is None else sm_scale
  if segment_ids is None:
    q_seg = kv_seg = np.zeros((batch, max(q_len, kv_len)), int)
  elif isinstance(segment_ids, tuple):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  out = np.zeros(q.shape)
  lse = np.zeros((batch, num_q_heads, q_len))
  for b in range(batch):
    for h in range(num_q_heads):
      kv_head = h * num_kv_heads // num_q_heads
      for i in range(q_len):
        pos = q_offset + i
        keys = [j for j in range(kv_len)
                if (not causal or j <= pos)
                and (sliding_window is None or pos - j < sliding_window)
                and q_seg[b][i] == kv_seg[b][j]]
        logits = []
        for j in keys:
          s = scale * sum(float(q[b, h, i, d]) * float(k[b, kv_head, j, d])
                          for d in range(head_dim))
          logits.append(s if soft_cap is None else soft_cap * np.tanh(s / soft_cap))
        terms = logits + ([] if sinks is None else [float(sinks[h])])
        if not terms:
          lse[b, h, i] = -np.inf
          continue
        top = max(terms)
        lse[b, h, i] = top + np.log(sum(np.exp(x - top) for x in terms))
        for j, s in zip(keys, logits):
          out[b, h, i] += np.exp(s - lse[b, h, i]) * v[b, kv_head, j]
  return out, lse


ATTENTION_CASES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "causal_offset_window_cap": dict(causal=True, q_offset=2, sliding_window=2, soft_cap=1.5),
    # Rows 0..1 see no key (causal, q_offset 0, keys 2.. in other segments): fully masked.
    "segments_pair_sinks": dict(causal=True, sinks=np.array([0.3, -2.0, 4.0, -0.5]),
                                segment_ids=(np.array([[0, 0, 1], [2, 1, 1]]),
                                             np.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1]]))),
    "window_noncausal_scale": dict(sliding_window=3, sm_scale=0.7, q_offset=1),
    "all_masked_sinks": dict(causal=True, sinks=np.array([1.0, 0.0, -1.0, 2.0]),
                             segment_ids=(np.zeros((2, 3), int), np.ones((2, 5), int))),
}


def _attention_inputs(seed, batch=2, num_kv_heads=2, group=2, q_len=3, kv_len=5, head_dim=4):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((batch, num_kv_heads * group, q_len, head_dim))
  k = rng.standard_normal((batch, num_kv_heads, kv_len, head_dim))
  v = rng.standard_normal((batch, num_kv_heads, kv_len, head_dim))
  return rng, q, k, v


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_brute_force(case):
  opts = ATTENTION_CASES[case]
  _, q, k, v = _attention_inputs(len(case))
  out, lse = ref.attention(q, k, v, **opts)
  want_out, want_lse = _attention_brute_force(q, k, v, **opts)
  np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
  np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
  masked = ~ref.attention_visible(2, 3, 5, causal=opts.get("causal", False),
                                  sliding_window=opts.get("sliding_window"),
                                  segment_ids=opts.get("segment_ids"),
                                  q_offset=opts.get("q_offset", 0)).any(-1)   # [B, Sq]
  if case in ("segments_pair_sinks", "all_masked_sinks"):
    assert masked.any()
  assert not out[np.broadcast_to(masked[:, None], lse.shape)].any()
  assert np.isfinite(out).all()
  expected_masked_lse = (-np.inf if opts.get("sinks") is None
                         else np.broadcast_to(opts["sinks"][None, :, None], lse.shape))
  np.testing.assert_array_equal(
      lse[np.broadcast_to(masked[:, None], lse.shape)],
      np.broadcast_to(expected_masked_lse, lse.shape)[np.broadcast_to(masked[:, None], lse.shape)])


def test_attention_definition_by_hand():
  # One query, two keys with logits 0 and log 3 (scale 1): weights 1/4, 3/4.
  q = np.array([[[[1.0]]]])
  k = np.array([[[[0.0], [np.log(3.0)]]]])
  v = np.array([[[[2.0], [6.0]]]])
  out, lse = ref.attention(q, k, v, sm_scale=1.0)
  np.testing.assert_allclose(out, [[[[0.25 * 2 + 0.75 * 6]]]])
  np.testing.assert_allclose(lse, [[[np.log(4.0)]]])
  # A sink of logit log 4 takes half the mass: weights 1/8, 3/8.
  out, lse = ref.attention(q, k, v, sm_scale=1.0, sinks=np.array([np.log(4.0)]))
  np.testing.assert_allclose(out, [[[[2 / 8 + 18 / 8]]]])
  np.testing.assert_allclose(lse, [[[np.log(8.0)]]])
  # Window 1 (causal or not): the query at position 1 sees only key 1.
  for causal in (False, True):
    out, _ = ref.attention(q, k, v, sm_scale=1.0, sliding_window=1, q_offset=1, causal=causal)
    np.testing.assert_allclose(out, [[[[6.0]]]])
  # Soft-cap 1: logit log 3 becomes tanh(log 3) = 0.8.
  out, _ = ref.attention(q, k, v, sm_scale=1.0, soft_cap=1.0)
  w = np.exp(0.8) / (1 + np.exp(0.8))
  np.testing.assert_allclose(out, [[[[(1 - w) * 2 + w * 6]]]])


def _attention_loss(q, k, v, sinks, g, gl, opts):
  out, lse = ref.attention(q, k, v, **{**opts, "sinks": sinks})
  return float(np.sum(g * out) + np.sum(np.where(np.isfinite(lse), gl * lse, 0.0)))


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_grads_match_finite_differences(case):
  """Every element of dq, dk, dv, dsinks against float64 central differences of
  sum(g * out) + sum(g_lse * lse) (tiny shapes: GQA with two heads per KV head)."""
  opts = dict(ATTENTION_CASES[case])
  sinks = opts.pop("sinks", None)
  rng, q, k, v = _attention_inputs(len(case) + 1)
  g = rng.standard_normal(q.shape)
  gl = rng.standard_normal(q.shape[:3])
  grads = ref.attention_grads(q, k, v, g, grad_lse=gl, sinks=sinks, **opts)
  assert (grads["dsinks"] is None) == (sinks is None)
  args = dict(dq=q, dk=k, dv=v, **({} if sinks is None else {"dsinks": sinks}))
  h = 1e-6
  for name, a in args.items():
    numeric = np.zeros(a.shape)
    for idx in np.ndindex(a.shape):
      e = np.zeros(a.shape)
      e[idx] = h
      plus = {n: x + e if n == name else x for n, x in args.items()}
      minus = {n: x - e if n == name else x for n, x in args.items()}
      numeric[idx] = (_attention_loss(plus["dq"], plus["dk"], plus["dv"], plus.get("dsinks"),
                                      g, gl, opts)
                      - _attention_loss(minus["dq"], minus["dk"], minus["dv"],
                                        minus.get("dsinks"), g, gl, opts)) / (2 * h)
    np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-8, err_msg=name)
    assert np.abs(numeric).max() > 0 or case == "all_masked_sinks"


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_grads_match_explicit_jacobian(case):
  """dL/dlogits from each row's explicit softmax Jacobian over {sink} + visible keys
  (diag(P) - P P^T, the sink entry without a value), then the matmul chain by loops."""
  opts = dict(ATTENTION_CASES[case])
  rng, q, k, v = _attention_inputs(len(case) + 2)
  g = rng.standard_normal(q.shape)
  gl = rng.standard_normal(q.shape[:3])
  grads = ref.attention_grads(q, k, v, g, grad_lse=gl, **opts)
  batch, num_q_heads, q_len, head_dim = q.shape
  group = num_q_heads // k.shape[1]
  scale = opts.get("sm_scale") or 1.0 / np.sqrt(head_dim)
  cap = opts.get("soft_cap")
  sinks = opts.get("sinks")
  vis = ref.attention_visible(batch, q_len, k.shape[2], causal=opts.get("causal", False),
                              sliding_window=opts.get("sliding_window"),
                              segment_ids=opts.get("segment_ids"),
                              q_offset=opts.get("q_offset", 0))
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  dsinks = np.zeros(num_q_heads)
  for b in range(batch):
    for h in range(num_q_heads):
      kh = h // group
      for i in range(q_len):
        keys = np.flatnonzero(vis[b, i])
        u = scale * k[b, kh, keys] @ q[b, h, i]
        t = u if cap is None else cap * np.tanh(u / cap)
        logits = np.concatenate([[-np.inf if sinks is None else sinks[h]], t])
        if not np.isfinite(logits).any():
          continue
        p = np.exp(logits - logits.max())
        p /= p.sum()
        jac = np.diag(p) - np.outer(p, p)                   # dP_a / dt_c
        d_p = np.concatenate([[0.0], v[b, kh, keys] @ g[b, h, i]])
        dt = jac.T @ d_p + gl[b, h, i] * p                  # dlse / dt_c = P_c
        dsinks[h] += dt[0]
        du = dt[1:] if cap is None else dt[1:] * (1 - np.tanh(u / cap) ** 2)
        dq[b, h, i] += scale * du @ k[b, kh, keys]
        dk[b, kh, keys] += scale * np.outer(du, q[b, h, i])
        dv[b, kh, keys] += np.outer(p[1:], g[b, h, i])
  np.testing.assert_allclose(grads["dq"], dq, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(grads["dk"], dk, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(grads["dv"], dv, rtol=1e-10, atol=1e-12)
  if sinks is not None:
    np.testing.assert_allclose(grads["dsinks"], dsinks, rtol=1e-10, atol=1e-12)


def _flash_model(q, k, v, g, gl, bf16, opts, block_k=128, cap_grad="sech2"):
  """A NumPy model of a flash kernel's roundings (not of its code): f32 logits and
  statistics, a blocked online softmax, P rounded to bf16 before the PV matmul, out
  rounded to bf16; backward with D from the rounded out, P and dS rounded to bf16
  before their matmuls, gradients rounded to bf16. The cap's slope in f32: "sech2"
  (1 / cosh^2, its full precision), "one_minus_tanh2" (1 - tanh^2, which cancels once
  tanh rounds to 1: the flash backward before issue 61) or None (dropped). Returns
  (out, lse, grads)."""
  import ml_dtypes
  rnd = (lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)) if bf16 else (
      lambda a: a.astype(np.float32))
  f32 = np.float32
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  scale = f32(opts.get("sm_scale") or 1 / np.sqrt(head_dim))
  q = q.astype(f32)
  k, v = np.repeat(k, group, 1).astype(f32), np.repeat(v, group, 1).astype(f32)
  s = u = np.einsum("bhid,bhjd->bhij", q, k) * scale
  cap = opts.get("soft_cap")
  if cap is not None:
    s = f32(cap) * np.tanh(u / f32(cap))
  vis = ref.attention_visible(batch, q_len, kv_len, causal=opts.get("causal", False),
                              sliding_window=opts.get("sliding_window"),
                              q_offset=opts.get("q_offset", 0))[:, None]
  s = np.where(vis, s, -np.inf).astype(f32)
  sinks = opts.get("sinks")
  shape = (batch, num_q_heads, q_len)
  m = np.full(shape, -np.inf, f32) if sinks is None else np.broadcast_to(
      sinks.astype(f32)[None, :, None], shape).copy()
  l = np.zeros(shape, f32) if sinks is None else np.ones(shape, f32)
  acc = np.zeros(q.shape, f32)
  for j0 in range(0, kv_len, block_k):
    blk = s[..., j0:j0 + block_k]
    m_new = np.maximum(m, blk.max(-1))
    m_safe = np.where(np.isfinite(m_new), m_new, 0).astype(f32)
    alpha = np.exp(np.where(np.isfinite(m), m - m_safe, -np.inf)).astype(f32)
    p = np.exp(blk - m_safe[..., None]).astype(f32)
    l = alpha * l + p.sum(-1, dtype=f32)
    acc = alpha[..., None] * acc + np.einsum("bhij,bhjd->bhid", rnd(p), v[:, :, j0:j0 + block_k])
    m = m_new
  out = rnd(np.where(l[..., None] > 0, acc / np.where(l > 0, l, 1)[..., None], 0))
  lse = np.where(l > 0, np.where(np.isfinite(m), m, 0) + np.log(np.where(l > 0, l, 1)),
                 -np.inf).astype(f32)
  g = g.astype(f32)
  p = np.exp(s - np.where(np.isfinite(lse), lse, 0)[..., None]).astype(f32)
  d_row = (g * out).sum(-1, dtype=f32)
  ds = p * (np.einsum("bhid,bhjd->bhij", g, v) - d_row[..., None] + gl[..., None])
  if cap is not None and cap_grad == "sech2":
    with np.errstate(over="ignore"):
      ds = ds * (1 / np.cosh(u / f32(cap)) ** 2).astype(f32)
  elif cap is not None and cap_grad == "one_minus_tanh2":
    ds = ds * (1 - np.tanh(u / f32(cap)) ** 2).astype(f32)
  fold = lambda a: a.reshape(batch, num_kv_heads, group, kv_len, head_dim).sum(2)
  grads = dict(dq=rnd(np.einsum("bhij,bhjd->bhid", rnd(ds), k) * scale),
               dk=rnd(fold(np.einsum("bhij,bhid->bhjd", rnd(ds), q) * scale)),
               dv=rnd(fold(np.einsum("bhij,bhid->bhjd", rnd(p), g))), dsinks=None)
  if sinks is not None:
    grads["dsinks"] = -(np.exp(sinks.astype(f32)[None, :, None] - lse)
                        * (d_row - gl)).sum((0, 2))
  return out, lse, grads


def _model_problem(seed):
  import ml_dtypes
  rng = np.random.default_rng(seed)
  dtype = ["float32", "bfloat16"][seed % 2]
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  kv_len = int(rng.choice([1, 7, 200, 300]))
  num_kv_heads, group = int(rng.integers(1, 3)), int(rng.integers(1, 5))
  q_len, head_dim = int(rng.choice([1, 5, 130])), int(rng.choice([64, 256]))
  opts = dict(causal=bool(rng.integers(2)), q_offset=int(rng.integers(0, 20)),
              sliding_window=None if rng.integers(2) else int(rng.integers(1, kv_len + 10)),
              soft_cap=None if rng.integers(2) else float(rng.choice([5.0, 30.0])),
              sm_scale=None if rng.integers(2) else float(rng.choice([0.05, 0.3, 1.0])),
              sinks=None if rng.integers(2) else (rng.standard_normal(num_kv_heads * group)
                                                  * rng.choice([1, 20])).astype(np.float32))
  q = rng.standard_normal((2, num_kv_heads * group, q_len, head_dim)).astype(np_dtype)
  k, v = (rng.standard_normal((2, num_kv_heads, kv_len, head_dim)).astype(np_dtype)
          for _ in range(2))
  g = rng.standard_normal(q.shape).astype(np_dtype)
  gl = rng.standard_normal(q.shape[:3]).astype(np.float32)
  return dtype, opts, q, k, v, g, gl


def _failures(dtype, opts, q, k, v, g, gl, out, lse, grads):
  return ref.attention_mismatches(dtype, q, k, v, out, lse, grads, grad_out=g, grad_lse=gl,
                                  **opts)


@pytest.mark.parametrize("seed", range(16))
def test_attention_tolerances_admit_a_flash_kernels_roundings(seed):
  """The tolerances are not tighter than the roundings every flash kernel makes."""
  dtype, opts, q, k, v, g, gl = _model_problem(seed)
  out, lse, grads = _flash_model(q, k, v, g, gl, dtype == "bfloat16", opts)
  assert not _failures(dtype, opts, q, k, v, g, gl, out, lse, grads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mistake, expected", [
    ("window_off_by_one", "lse"), ("causal_off_by_one", "lse"), ("no_sink", "lse"),
    ("no_cap_derivative", "dq")])
def test_attention_tolerances_reject_masking_mistakes(dtype, mistake, expected):
  """... and not so loose that an off-by-one mask or a dropped term passes."""
  import ml_dtypes
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  rng = np.random.default_rng(7)
  q = rng.standard_normal((1, 2, 200, 64)).astype(np_dtype)
  k, v = (rng.standard_normal((1, 1, 200, 64)).astype(np_dtype) for _ in range(2))
  g = rng.standard_normal(q.shape).astype(np_dtype)
  gl = rng.standard_normal(q.shape[:3]).astype(np.float32)
  opts = dict(causal=True, sliding_window=150, soft_cap=2.0, sinks=np.array([0.5, -1.0]))
  wrong = dict(opts)
  if mistake == "window_off_by_one":
    wrong["sliding_window"] = 151
  elif mistake == "causal_off_by_one":
    wrong["q_offset"] = 1      # each query sees one key too many
  elif mistake == "no_sink":
    wrong["sinks"] = np.array([-50.0, -50.0])
  out, lse, grads = _flash_model(q, k, v, g, gl, dtype == "bfloat16", wrong,
                                 cap_grad=None if mistake == "no_cap_derivative" else "sech2")
  assert expected in _failures(dtype, opts, q, k, v, g, gl, out, lse, grads)


def _saturating_problem(dtype, seed=3, head_dim=64):
  """Issue 61's inputs (splash attention's backward test data): uniform [0, 1) q, k, v,
  dout and lse cotangent, sm_scale 1, so logits of ~D / 4 that a cap of 1-10 saturates."""
  import ml_dtypes
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  rng = np.random.default_rng(seed)
  q = rng.random((1, 2, 130, head_dim)).astype(np_dtype)
  k, v = (rng.random((1, 1, 130, head_dim)).astype(np_dtype) for _ in range(2))
  g = rng.random(q.shape).astype(np_dtype)
  gl = rng.random(q.shape[:3]).astype(np.float32)
  return q, k, v, g, gl


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_tolerances_reject_a_cancelling_cap_slope(dtype):
  """Where unscaled logits saturate the cap, a backward that takes the cap's slope as
  1 - tanh^2 (0 once tanh rounds to 1 in f32) fails the gradient tolerances, and one that
  keeps the slope's digits passes: `attention_grad_scales` weighs the rounding of
  rowsum(dO * O) by the slope, so the scale does not swamp the error (without that
  weight it was ~1e6x max|dq| here)."""
  q, k, v, g, gl = _saturating_problem(dtype)
  opts = dict(sm_scale=1.0, soft_cap=1.0, causal=True)       # x = u / cap ~ 16 +- 4
  bf16 = dtype == "bfloat16"
  assert not _failures(dtype, opts, q, k, v, g, gl,
                       *_flash_model(q, k, v, g, gl, bf16, opts, cap_grad="sech2"))
  failures = _failures(dtype, opts, q, k, v, g, gl,
                       *_flash_model(q, k, v, g, gl, bf16, opts, cap_grad="one_minus_tanh2"))
  assert "dq" in failures and "dk" in failures, failures


def test_attention_grads_keep_their_digits_where_the_cap_saturates():
  """The reference's cap slope (1 / cosh^2) against sech^2 = 4 e^(-2|x|) / (1 + e^(-2|x|))^2,
  each key by hand, at x = u / cap from ~20 to ~80 (slopes 1e-17 down to 1e-69): every
  element of dq and dk to 1e-9 relative. 1 - tanh^2 in float64 is 0 there (tanh rounds
  to 1 past |x| ~ 19): checked, so the test tells the two apart."""
  rng = np.random.default_rng(11)
  q, k = (0.5 + 0.5 * rng.random((1, 1, n, 4)) for n in (3, 6))
  v, g = rng.random((1, 1, 6, 4)), rng.random((1, 1, 3, 4))
  opts = dict(sm_scale=20.0, soft_cap=1.0)
  grads = ref.attention_grads(q, k, v, g, **opts)
  u = 20.0 * q[0, 0] @ k[0, 0].T                                     # [3, 6]
  assert u.min() > 19.5, u.min()
  t = np.tanh(u)
  p = np.exp(t - t.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  dp = g[0, 0] @ v[0, 0].T
  dt = p * (dp - (p * dp).sum(-1, keepdims=True))
  e = np.exp(-2 * np.abs(u))
  du = dt * 4 * e / (1 + e) ** 2
  np.testing.assert_allclose(grads["dq"][0, 0], 20.0 * du @ k[0, 0], rtol=1e-9, atol=0)
  np.testing.assert_allclose(grads["dk"][0, 0], 20.0 * du.T @ q[0, 0], rtol=1e-9, atol=0)
  assert grads["dq"].any() and not (1 - t**2).any()


# ----------------------------------------------------------------------------- paged attention


def _paged_problem(seed, kv_lens, q_lens, *, num_kv_heads=2, group=2, head_dim=8,
                   page_size=4, pages_per_seq=None, shuffle=True, extra_pages=3, pad=2):
  """A packed batch with each sequence's K/V ([Hkv, kv_len, D] float64) scattered over
  the pages of a cache (page order shuffled or one contiguous run per sequence); unused
  page-table entries hold -1 / out-of-range junk and unused cache slots hold NaN."""
  rng = np.random.default_rng(seed)   # the data: the same whatever the layout
  kv_lens, q_lens = np.asarray(kv_lens), np.asarray(q_lens)
  seq_k = [rng.standard_normal((num_kv_heads, n, head_dim)) for n in kv_lens]
  seq_v = [rng.standard_normal((num_kv_heads, n, head_dim)) for n in kv_lens]
  cu = np.concatenate([[0], np.cumsum(q_lens)])
  q = rng.standard_normal((int(cu[-1]) + pad, num_kv_heads * group, head_dim))
  rng = np.random.default_rng([seed, page_size, shuffle])   # the layout
  need = [-(-int(n) // page_size) for n in kv_lens]
  pages_per_seq = pages_per_seq or max(max(need), 1) + 1
  num_pages = sum(need) + extra_pages
  ids = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
  k_pages = np.full((num_pages, num_kv_heads, page_size, head_dim), np.nan)
  v_pages = np.full_like(k_pages, np.nan)
  table = rng.choice([-1, num_pages, 10**6], size=(len(kv_lens), pages_per_seq))
  used = 0
  for s, n in enumerate(kv_lens):
    for j in range(n):
      if j % page_size == 0:
        table[s, j // page_size] = ids[used]
        used += 1
      k_pages[table[s, j // page_size], :, j % page_size] = seq_k[s][:, j]
      v_pages[table[s, j // page_size], :, j % page_size] = seq_v[s][:, j]
  return dict(q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens, page_indices=table,
              cu_q_lens=cu), seq_k, seq_v


PAGED_OPTIONS = {
    "plain": {},
    "window": dict(sliding_window=3),
    "window_1": dict(sliding_window=1),
    "cap_scale": dict(soft_cap=2.0, sm_scale=0.9),
    "sinks": dict(sinks=np.array([0.5, -1.0, 3.0, 0.0])),
    "everything": dict(sinks=np.array([1.5, -2.0, 0.0, 4.0]), sliding_window=6,
                       soft_cap=5.0, sm_scale=0.4),
}
# Decode, empty, prefill-only, chunked prefill, a decode at position 0, an empty padding
# sequence with no KV at all.
PAGED_KV_LENS, PAGED_Q_LENS = [9, 5, 7, 13, 1, 0], [1, 0, 7, 4, 1, 0]


@pytest.mark.parametrize("case", PAGED_OPTIONS)
def test_paged_attention_is_causal_attention_per_sequence(case):
  """Each sequence's rows equal `attention` (causal, q_offset = kv_len - q_len) on its own
  contiguous K/V; padding rows past cu_q_lens[-1] are exactly 0; NaN in unused slots and
  junk page ids past the used ones change nothing."""
  opts = PAGED_OPTIONS[case]
  x, seq_k, seq_v = _paged_problem(len(case), PAGED_KV_LENS, PAGED_Q_LENS)
  out = ref.paged_attention(**x, **opts)
  assert out.shape == x["q"].shape and np.isfinite(out).all()
  cu = x["cu_q_lens"]
  for s, (kv_len, q_len) in enumerate(zip(PAGED_KV_LENS, PAGED_Q_LENS)):
    if q_len == 0:
      continue
    q = x["q"][cu[s]:cu[s + 1]].transpose(1, 0, 2)[None]
    want, _ = ref.attention(q, seq_k[s][None], seq_v[s][None], causal=True,
                            q_offset=kv_len - q_len, **opts)
    np.testing.assert_allclose(out[cu[s]:cu[s + 1]], want[0].transpose(1, 0, 2),
                               rtol=1e-12, atol=1e-12)
  assert not out[cu[-1]:].any()


@pytest.mark.parametrize("case", PAGED_OPTIONS)
def test_paged_attention_pages_order_and_layout_do_not_matter(case):
  """The same sequences laid out in shuffled pages, in contiguous runs, and with a page
  size that does not divide their lengths give the same output."""
  opts = PAGED_OPTIONS[case]
  outs = []
  for shuffle, page_size in ((True, 4), (False, 4), (True, 3), (False, 16)):
    x, _, _ = _paged_problem(7, PAGED_KV_LENS, PAGED_Q_LENS, page_size=page_size,
                             shuffle=shuffle)
    outs.append(ref.paged_attention(**x, **opts))
  for other in outs[1:]:
    np.testing.assert_allclose(other, outs[0], rtol=1e-12, atol=1e-12)


def test_paged_attention_decode_is_last_row_of_prefill():
  """A decode step (q_len 1) equals the last row of a full causal prefill of the same KV,
  and a chunked prefill equals the matching rows of the full prefill."""
  kv_len = 11
  x, _, _ = _paged_problem(3, [kv_len], [kv_len], pad=0)
  for opts in PAGED_OPTIONS.values():
    full = ref.paged_attention(**x, **opts)
    for q_len in (1, 4):
      chunk = dict(x, q=x["q"][kv_len - q_len:], cu_q_lens=np.array([0, q_len]))
      np.testing.assert_allclose(ref.paged_attention(**chunk, **opts), full[kv_len - q_len:],
                                 rtol=1e-12, atol=1e-12)


def test_paged_attention_shared_pages():
  """Two sequences whose page tables share their prefix pages (prefix caching): the
  second's decode sees the shared prefix, then its own last page."""
  x, _, _ = _paged_problem(5, [10], [10], page_size=4, pad=0)   # pages of 4, 4, 2 tokens
  table = x["page_indices"]
  # Sequence 1: the same first 8 tokens (pages table[0, :2]), then 1 token on a new page.
  spare = next(p for p in range(x["k_pages"].shape[0]) if p not in table[0, :3])
  k_pages, v_pages = x["k_pages"].copy(), x["v_pages"].copy()
  rng = np.random.default_rng(0)
  k_pages[spare, :, 0], v_pages[spare, :, 0] = rng.standard_normal((2, 2, 8))
  two = dict(x, k_pages=k_pages, v_pages=v_pages, kv_lens=np.array([10, 9]),
             page_indices=np.stack([table[0], [table[0, 0], table[0, 1], spare, -1]]),
             q=np.concatenate([x["q"], x["q"][:1]]), cu_q_lens=np.array([0, 10, 11]))
  out = ref.paged_attention(**two)
  np.testing.assert_allclose(out[:10], ref.paged_attention(**x), rtol=1e-12, atol=1e-12)
  prefix = lambda pages: pages[table[0, :2]].transpose(1, 0, 2, 3).reshape(2, 8, 8)
  ks = np.concatenate([prefix(x["k_pages"]), k_pages[spare, :, :1]], 1)
  vs = np.concatenate([prefix(x["v_pages"]), v_pages[spare, :, :1]], 1)
  want, _ = ref.attention(x["q"][:1].transpose(1, 0, 2)[None], ks[None], vs[None])
  np.testing.assert_allclose(out[10], want[0, :, 0], rtol=1e-12, atol=1e-12)


def test_paged_attention_by_hand():
  """One sequence, page size 2, two KV tokens with logits 0 and log 3 (sm_scale 1):
  weights 1/4, 3/4; a sink of logit log 4 halves them; window 1 keeps the last key."""
  q = np.array([[[1.0]], [[9.0]]])                          # token 1 is padding
  k_pages = np.array([[[[np.nan], [np.nan]]], [[[0.0], [np.log(3.0)]]]])   # page 1 used
  v_pages = np.array([[[[np.nan], [np.nan]]], [[[2.0], [6.0]]]])
  args = (q, k_pages, v_pages, [2], [[1, -1]], [0, 1])
  np.testing.assert_allclose(ref.paged_attention(*args, sm_scale=1.0), [[[6.5 - 1.5]], [[0]]])
  np.testing.assert_allclose(ref.paged_attention(*args, sm_scale=1.0,
                                                 sinks=np.array([np.log(4.0)])),
                             [[[2 / 8 + 18 / 8]], [[0.0]]])
  np.testing.assert_allclose(ref.paged_attention(*args, sm_scale=1.0, sliding_window=1),
                             [[[6.0]], [[0.0]]])


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("per_head", [False, True])
def test_paged_attention_dequantizes_exactly(dtype, per_head):
  """A quantized cache gives what the float64 cache of its dequantized values gives,
  with scale h_kv applied to KV head h_kv."""
  import ml_dtypes
  x, _, _ = _paged_problem(11, PAGED_KV_LENS, PAGED_Q_LENS)
  rng = np.random.default_rng(1)
  k_scale = np.array([0.03, 0.2]) if per_head else 0.05
  v_scale = np.array([0.5, 0.011]) if per_head else 0.3
  if dtype == "int8":
    kq, vq = (rng.integers(-127, 128, x["k_pages"].shape).astype(np.int8) for _ in range(2))
  else:
    kq, vq = (rng.uniform(-448, 448, x["k_pages"].shape).astype(ml_dtypes.float8_e4m3fn)
              for _ in range(2))
    kq[np.isnan(x["k_pages"])] = np.nan           # e4m3fn has a NaN: unused slots hold it
  out = ref.paged_attention(**dict(x, k_pages=kq, v_pages=vq), k_scale=k_scale,
                            v_scale=v_scale)
  head_scale = lambda s: np.broadcast_to(np.asarray(s, float), (2,))[None, :, None, None]
  want = ref.paged_attention(**dict(x, k_pages=kq.astype(np.float64) * head_scale(k_scale),
                                    v_pages=vq.astype(np.float64) * head_scale(v_scale)))
  np.testing.assert_array_equal(out, want)
  assert np.isfinite(out).all() and not out[x["cu_q_lens"][-1]:].any()


def test_write_kv_cache_reference():
  """Per token and head: the slot's page and offset; negative slots skipped; int8 rounds
  half to even and clips at +-127; fp8 clips at +-448; other slots untouched."""
  import ml_dtypes
  k = np.zeros((3, 2, 4, 2), np.float32)          # [num_pages, Hkv, page_size, D]
  v = np.ones_like(k)
  new_k = np.arange(3 * 2 * 2, dtype=np.float32).reshape(3, 2, 2) + 100
  new_v = -new_k
  out_k, out_v = ref.write_kv_cache(k, v, new_k, new_v, np.array([5, -1, 11]))
  want_k, want_v = k.copy(), v.copy()
  want_k[1, :, 1], want_v[1, :, 1] = new_k[0], new_v[0]
  want_k[2, :, 3], want_v[2, :, 3] = new_k[2], new_v[2]
  np.testing.assert_array_equal(out_k, want_k)
  np.testing.assert_array_equal(out_v, want_v)
  assert not k.any() and (v == 1).all()            # the inputs are left alone
  x = np.array([[[2.5, -3.5]], [[1000.0, -1000.0]], [[0.26, -0.74]]], np.float32)  # [3, 1, 2]
  q8 = np.zeros((1, 1, 4, 2), np.int8)
  out, _ = ref.write_kv_cache(q8, q8, x, x, np.array([0, 1, 2]), k_scale=1.0, v_scale=1.0)
  np.testing.assert_array_equal(out[0, 0, :3], [[2, -4], [127, -127], [0, -1]])
  f8 = np.zeros((1, 1, 4, 2), ml_dtypes.float8_e4m3fn)
  out, _ = ref.write_kv_cache(f8, f8, x, x, np.array([3, 2, -5]), k_scale=0.5, v_scale=0.5)
  np.testing.assert_array_equal(out[0, 0].astype(np.float64),
                                [[0, 0], [0, 0], [448, -448], [5, -7]])


def _paged_kernel_model(x, bf16_kv, opts, shift=0):
  """A NumPy model of a paged kernel's roundings for bf16 q: K/V dequantized into bf16
  (`bf16_kv`: [num_pages, Hkv, ps, D] float64 before rounding), then per sequence the
  flash model (f32 logits, blocked online softmax, bf16 P and out)."""
  import ml_dtypes
  bf = lambda a: a.astype(ml_dtypes.bfloat16)
  out = np.zeros(x["q"].shape, np.float64)
  cu, ps = x["cu_q_lens"], x["k_pages"].shape[2]
  for s, kv_len in enumerate(x["kv_lens"]):
    if cu[s + 1] == cu[s]:
      continue
    k, v = (bf(ref.gather_kv(pages, x["page_indices"][s], kv_len, ps))[None]
            for pages in bf16_kv)
    q = x["q"][cu[s]:cu[s + 1]].transpose(1, 0, 2)[None]
    o, _, _ = _flash_model(q, k, v, np.zeros(q.shape, np.float32),
                           np.zeros(q.shape[:3], np.float32), True,
                           dict(opts, causal=True, q_offset=kv_len - q.shape[2] + shift),
                           block_k=16)
    out[cu[s]:cu[s + 1]] = o[0].transpose(1, 0, 2)
  return out


@pytest.mark.parametrize("seed", range(4))
def test_paged_tolerance_admits_bf16_dequantization(seed):
  """bf16 q with an int8 / fp8 cache and non-power-of-two scales: a kernel that rounds the
  dequantized K/V to bf16, P to bf16 and out to bf16 lands within PAGED_TOLERANCE of the
  exact reference; a causal mask one key off does not."""
  import ml_dtypes
  rng = np.random.default_rng(seed)
  kv_lens, q_lens = [300, 77, 130], [1, 77, 40]
  x, _, _ = _paged_problem(seed, kv_lens, q_lens, num_kv_heads=2, group=4, head_dim=128,
                           page_size=16, pad=3)
  x["q"] = x["q"].astype(ml_dtypes.bfloat16)
  name = ["int8", "float8_e4m3fn"][seed % 2]
  k_scale, v_scale = rng.uniform(0.003, 0.02, 2), rng.uniform(0.003, 0.02, 2)
  if name == "int8":
    quant = lambda a: np.clip(np.round(np.nan_to_num(a) * 40), -127, 127).astype(np.int8)
  else:
    quant = lambda a: np.nan_to_num(a * 100).astype(ml_dtypes.float8_e4m3fn)
  kq, vq = quant(x["k_pages"]), quant(x["v_pages"])
  opts = [dict(sinks=np.array([0.5, -1, 2, 0, 1, 1, -3, 0.2])), dict(sliding_window=100),
          dict(soft_cap=5.0), {}][seed]
  deq = lambda a, s: a.astype(np.float64) * s[None, :, None, None]
  model = _paged_kernel_model(x, (deq(kq, k_scale), deq(vq, v_scale)), opts)
  want = ref.paged_attention(**dict(x, k_pages=kq, v_pages=vq), k_scale=k_scale,
                             v_scale=v_scale, **opts)
  ref.assert_close(model, want, ref.PAGED_TOLERANCE["bfloat16"], "model")
  wrong = _paged_kernel_model(x, (deq(kq, k_scale), deq(vq, v_scale)), opts, shift=1)
  with pytest.raises(AssertionError):
    ref.assert_close(wrong, want, ref.PAGED_TOLERANCE["bfloat16"], "model")
