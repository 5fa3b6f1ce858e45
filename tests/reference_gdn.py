"""Independent float64 references for the gated delta rule, written from the definition
(Transformers' `torch_recurrent_gated_delta_rule`), token by token; no kernel code, no
chunked form.

    q, k [B, T, Hk, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]; value head h reads key head
    h // (Hv / Hk). Optionally q, k <- x / sqrt(|x|^2 + 1e-6); then q <- scale q
    (scale K^-0.5 by default). Per sequence and value head, from S = initial state (or 0):
        S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;
        o_t = S^T q_t.
    With cu_seqlens [N + 1] (B = 1), sequence s is tokens cu[s]:cu[s + 1] with its own
    initial and final state.

`gated_delta_rule` is NumPy float64. Gradients of sum(do * o) + sum(dht * final) with
respect to q, k, v, g, beta and the initial state come two ways:
  * `gated_delta_rule_vjp`: JAX autodiff (`jax.vjp`, float64 under `jax.enable_x64`) of a
    second token-by-token implementation (a `lax.scan` over tokens). Compiling it takes
    seconds per shape.
  * `gated_delta_rule_grads`: NumPy float64, the reverse recurrence of the token update
    written out by hand (milliseconds; what the kernel tests use).
`tests/jax/test_gated_delta_rule_kernel.py` checks the two forwards against each other, the two
gradients against each other, and the autodiff gradients against central finite
differences.
"""

from __future__ import annotations

import functools

import numpy as np

L2NORM_EPS = 1e-6


def f64(a) -> np.ndarray:
  return np.asarray(a).astype(np.float64)


def _segments(batch: int, seq: int, cu_seqlens):
  """(batch row, start, end, state index) per sequence."""
  if cu_seqlens is None:
    return [(b, 0, seq, b) for b in range(batch)]
  cu = np.asarray(cu_seqlens).astype(np.int64)
  return [(0, int(cu[s]), int(cu[s + 1]), s) for s in range(len(cu) - 1)]


def _prepare(q, k, use_qk_l2norm: bool, scale):
  q, k = f64(q), f64(k)
  if use_qk_l2norm:
    q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS)
    k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return q * scale, k


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, use_qk_l2norm=False, scale=None,
                     cu_seqlens=None):
  """(o [B, T, Hv, V], final states [B or N, Hv, K, V]), both float64."""
  q, k = _prepare(q, k, use_qk_l2norm, scale)
  v, g, beta = f64(v), f64(g), f64(beta)
  batch, seq, num_k_heads, k_dim = q.shape
  num_v_heads, v_dim = v.shape[2:]
  head_key = np.arange(num_v_heads) // (num_v_heads // num_k_heads)
  segments = _segments(batch, seq, cu_seqlens)
  o = np.zeros((batch, seq, num_v_heads, v_dim))
  finals = np.zeros((len(segments), num_v_heads, k_dim, v_dim))
  for b, start, end, s in segments:
    state = (np.zeros((num_v_heads, k_dim, v_dim)) if initial_state is None
             else f64(initial_state)[s].copy())
    for t in range(start, end):
      qt, kt = q[b, t][head_key], k[b, t][head_key]          # [Hv, K]
      state = state * np.exp(g[b, t])[:, None, None]
      kv = np.einsum("hk,hkv->hv", kt, state)
      delta = beta[b, t][:, None] * (v[b, t] - kv)
      state = state + kt[:, :, None] * delta[:, None, :]
      o[b, t] = np.einsum("hk,hkv->hv", qt, state)
    finals[s] = state
  return o, finals


def _jax_forward(q, k, v, g, beta, h0, *, use_qk_l2norm, scale, cu_seqlens):
  """The same definition in jnp (float64 when called under enable_x64): a lax.scan over
  each sequence's tokens. h0 [num_states, Hv, K, V]."""
  import jax
  import jax.numpy as jnp

  if use_qk_l2norm:
    q = q / jnp.sqrt(jnp.sum(q * q, axis=-1, keepdims=True) + L2NORM_EPS)
    k = k / jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True) + L2NORM_EPS)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  q = q * scale
  batch, seq, num_k_heads, _ = q.shape
  num_v_heads = v.shape[2]
  head_key = np.arange(num_v_heads) // (num_v_heads // num_k_heads)

  def token(state, x):
    qt, kt, vt, gt, bt = x
    qt, kt = qt[head_key], kt[head_key]
    state = state * jnp.exp(gt)[:, None, None]
    kv = jnp.einsum("hk,hkv->hv", kt, state)
    delta = bt[:, None] * (vt - kv)
    state = state + kt[:, :, None] * delta[:, None, :]
    return state, jnp.einsum("hk,hkv->hv", qt, state)

  finals = []
  o = jnp.zeros(v.shape, v.dtype)
  for b, start, end, s in _segments(batch, seq, cu_seqlens):
    xs = tuple(a[b, start:end] for a in (q, k, v, g, beta))
    final, ob = jax.lax.scan(token, h0[s], xs)
    o = o.at[b, start:end].set(ob)
    finals.append(final)
  return o, jnp.stack(finals)


def gated_delta_rule_jax(q, k, v, g, beta, *, initial_state=None, use_qk_l2norm=False,
                         scale=None, cu_seqlens=None):
  """The jnp token-by-token forward in float64: (o, finals) as NumPy arrays."""
  import jax

  with jax.enable_x64(True):
    args, h0 = _x64_args(q, k, v, g, beta, initial_state, cu_seqlens)
    o, finals = jax.jit(functools.partial(_jax_forward, use_qk_l2norm=use_qk_l2norm,
                                          scale=scale, cu_seqlens=cu_seqlens))(*args, h0)
    return np.asarray(o), np.asarray(finals)


def _x64_args(q, k, v, g, beta, initial_state, cu_seqlens):
  import jax.numpy as jnp

  args = tuple(jnp.asarray(f64(a)) for a in (q, k, v, g, beta))
  num_states = q.shape[0] if cu_seqlens is None else len(cu_seqlens) - 1
  h0 = (jnp.zeros((num_states, v.shape[2], q.shape[3], v.shape[3]), jnp.float64)
        if initial_state is None else jnp.asarray(f64(initial_state)))
  return args, h0


def gated_delta_rule_vjp(q, k, v, g, beta, do, *, initial_state=None, dht=None,
                         use_qk_l2norm=False, scale=None, cu_seqlens=None):
  """Gradients of sum(do * o) + sum(dht * final) with respect to q, k, v, g, beta and the
  initial state (zeros when None), by jax.vjp of the float64 token-by-token forward.
  Returns a dict of float64 NumPy arrays: dq, dk, dv, dg, dbeta, dh0."""
  import jax
  import jax.numpy as jnp

  with jax.enable_x64(True):
    args, h0 = _x64_args(q, k, v, g, beta, initial_state, cu_seqlens)

    def f(q, k, v, g, beta, h0):
      return _jax_forward(q, k, v, g, beta, h0, use_qk_l2norm=use_qk_l2norm, scale=scale,
                          cu_seqlens=cu_seqlens)

    (o, finals), vjp = jax.vjp(jax.jit(f), *args, h0)
    ct_final = jnp.zeros_like(finals) if dht is None else jnp.asarray(f64(dht))
    grads = vjp((jnp.asarray(f64(do)), ct_final))
    return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), (np.asarray(x) for x in grads)))


def gated_delta_rule_grads(q, k, v, g, beta, do, *, initial_state=None, dht=None,
                           use_qk_l2norm=False, scale=None, cu_seqlens=None):
  """Gradients of sum(do * o) + sum(dht * final) by the hand-written reverse recurrence
  (NumPy float64). Per token t and value head, with S_prev the state before the token:
      Sa = exp(g) S_prev;  kv = Sa^T k;  delta = beta (v - kv);  S = Sa + k delta^T;
      o = S^T q.
  Reverse, from dS (the gradient of S): dS += q do^T; dq = S do; dk = dS delta;
  ddelta = dS^T k; dv = beta ddelta; dbeta = ddelta . (v - kv); dkv = -beta ddelta;
  dSa = dS + k dkv^T; dk += Sa dkv; dg = sum(dSa * Sa); dS_prev = exp(g) dSa. Then q's
  scale and the l2 norm's backward, and each key head sums its value heads.
  Returns a dict of float64 arrays: dq, dk, dv, dg, dbeta, dh0."""
  q_raw, k_raw = f64(q), f64(k)
  qs, ks = _prepare(q_raw, k_raw, use_qk_l2norm, scale)
  v, g, beta, do = f64(v), f64(g), f64(beta), f64(do)
  batch, seq, num_k_heads, k_dim = qs.shape
  num_v_heads, v_dim = v.shape[2:]
  group = num_v_heads // num_k_heads
  head_key = np.arange(num_v_heads) // group
  segments = _segments(batch, seq, cu_seqlens)
  dq_h = np.zeros((batch, seq, num_v_heads, k_dim))
  dk_h = np.zeros((batch, seq, num_v_heads, k_dim))
  dv, dg, dbeta = np.zeros_like(v), np.zeros_like(g), np.zeros_like(beta)
  dh0 = np.zeros((len(segments), num_v_heads, k_dim, v_dim))
  for b, start, end, s in segments:
    state = (np.zeros((num_v_heads, k_dim, v_dim)) if initial_state is None
             else f64(initial_state)[s].copy())
    saved = []
    for t in range(start, end):
      saved.append(state)
      kt = ks[b, t][head_key]
      sa = state * np.exp(g[b, t])[:, None, None]
      delta = beta[b, t][:, None] * (v[b, t] - np.einsum("hk,hkv->hv", kt, sa))
      state = sa + kt[:, :, None] * delta[:, None, :]
    ds = np.zeros_like(state) if dht is None else f64(dht)[s].copy()
    for t in reversed(range(start, end)):
      qt, kt = qs[b, t][head_key], ks[b, t][head_key]
      decay = np.exp(g[b, t])[:, None, None]
      sa = saved[t - start] * decay
      kv = np.einsum("hk,hkv->hv", kt, sa)
      delta = beta[b, t][:, None] * (v[b, t] - kv)
      s_t = sa + kt[:, :, None] * delta[:, None, :]
      ds = ds + qt[:, :, None] * do[b, t][:, None, :]
      dq_h[b, t] = np.einsum("hkv,hv->hk", s_t, do[b, t])
      dk_h[b, t] = np.einsum("hkv,hv->hk", ds, delta)
      ddelta = np.einsum("hkv,hk->hv", ds, kt)
      dv[b, t] = beta[b, t][:, None] * ddelta
      dbeta[b, t] = np.sum(ddelta * (v[b, t] - kv), axis=-1)
      dkv = -beta[b, t][:, None] * ddelta
      dsa = ds + kt[:, :, None] * dkv[:, None, :]
      dk_h[b, t] += np.einsum("hkv,hv->hk", sa, dkv)
      dg[b, t] = np.sum(dsa * sa, axis=(1, 2))
      ds = dsa * decay
    dh0[s] = ds
  dq_s = dq_h.reshape(batch, seq, num_k_heads, group, k_dim).sum(3)
  dk_n = dk_h.reshape(batch, seq, num_k_heads, group, k_dim).sum(3)
  scale = k_dim ** -0.5 if scale is None else scale
  dq_n = dq_s * scale
  if use_qk_l2norm:
    def l2_bwd(dxn, x):
      inv = 1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)
      xn = x * inv
      return inv * (dxn - xn * np.sum(xn * dxn, axis=-1, keepdims=True))
    dq_n, dk_n = l2_bwd(dq_n, q_raw), l2_bwd(dk_n, k_raw)
  return dict(dq=dq_n, dk=dk_n, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0)
