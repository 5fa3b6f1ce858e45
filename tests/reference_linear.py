"""Independent float64 NumPy references for the linear-attention helpers (no kernel code):
the causal depthwise conv1d (forward with packed sequences, its gradients, the decode update
with its state) and the gated RMSNorm, written token by token from Transformers' definitions.

    conv:   out[b, d, t] = act(bias[d] + sum_{i<W} weight[d, i] * xc[b, d, t - (W-1) + i])
            xc = x rounded to the weight's dtype (Transformers casts x to it); a term whose
            input lies before t = 0 or in an earlier packed sequence is 0.
    update: full = cat(conv_state, x) rounded to the weight's dtype; out over full's last T
            columns; new_state = full's last S columns rounded to the state's dtype.
    gated:  n = x / sqrt(mean(x^2) + eps); h = w * n; y = h * act(gate)
            (with norm_in_input_dtype: n rounded to x's dtype, then w * n to promote(w, x)).

Gradients: the conv's come from the adjoint of the same token loop (each term's partial
derivatives, accumulated term by term), the gated norm's from each row's explicit Jacobian;
`tests/jax/test_causal_conv1d_kernel.py` and `test_rms_norm_gated_kernel.py` check both
against central finite differences of the forward references.

Tolerances (|kernel - reference| <= atol * scale + rtol * |reference|, `reference.assert_close`),
keyed by the coarsest dtype the kernel rounds to. scale is the magnitude of the terms a
value is summed from (returned by the functions below), so that a sum that cancels is judged
against its terms, not its own size.

  conv forward, float32: W products and a bias summed in f32 (error <= W * 2^-24 of the
    terms) and a sigmoid in f32: 2e-5 leaves an order of magnitude of margin.
  conv forward, bfloat16 (weight or x): the kernel rounds z to bf16 (F.conv1d's output),
    then silu(z) to bf16 and, for bf16 x, keeps it: two roundings of 2^-9 relative each,
    the first propagated through silu' (|silu'| <= 1.1), at most 2.1 * 2^-9 = 4.1e-3 of
    |z| <= scale; 1e-2 leaves margin. (The reference does not round z: Transformers' own
    roundings are part of what the tolerance absorbs.)
  conv gradients: dz = dout * act'(z) uses the kernel's rounded z: |silu''| <= 0.5, so
    act' is off by <= 0.5 * 2^-9 |z| (relative to dz's terms, <= 2.5e-3 for |z| <= 2.5
    typical here), then dx / dweight / dbias are rounded once to their dtype (2^-9):
    3e-2 for bfloat16; float32 sums of B*T terms stay below 1e-5 of their terms: 1e-4.
  update: as the forward; the new state is data movement and casts, so it must be exact.
  gated norm: `reference.TOLERANCE` / `GRAD_TOLERANCE` (the RMSNorm's: one rounding of the
    output after f32 math, and a row sum for dx), with the reference rounding n and w * n
    as the definition does (the kernel's f32 n can round to the other bf16 neighbour of
    the f64 one: one more 2^-8 at most, inside 1.6e-2).
"""

from __future__ import annotations

import numpy as np

from reference import NP_DTYPES, f64

CONV_TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "bfloat16": dict(rtol=1e-2, atol=1e-2),
}
CONV_GRAD_TOLERANCE = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "bfloat16": dict(rtol=3e-2, atol=3e-2),
}


def dtype_name(a) -> str:
  return np.dtype(np.asarray(a).dtype).name


def round_to(a, dtype_name_: str) -> np.ndarray:
  """Round float64 values to `dtype_name_` (round to nearest even), back as float64
  (float64: unchanged, for the references' own finite-difference checks)."""
  if dtype_name_ == "float64":
    return f64(a)
  return f64(a).astype(NP_DTYPES[dtype_name_]).astype(np.float64)


def coarsest(*names) -> str:
  return "bfloat16" if "bfloat16" in names else "float32"


def silu(z):
  return z / (1.0 + np.exp(-z))


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def activation(name, z):
  return silu(z) if name in ("silu", "swish") else (sigmoid(z) if name == "sigmoid" else z)


def activation_grad(name, z):
  if name in ("silu", "swish"):
    s = sigmoid(z)
    return s + z * s * (1.0 - s)
  if name == "sigmoid":
    s = sigmoid(z)
    return s * (1.0 - s)
  return np.ones_like(z)


# ----------------------------------------------------------------------------- packing


def sequence_ids(batch, seqlen, cu_seqlens=None, seq_idx=None) -> np.ndarray:
  """[B, T] int: which packed sequence each token belongs to, token by token.

  cu_seqlens [N + 1] (batch 1): a new sequence starts at every cu_seqlens[j] < T (tokens
  past cu_seqlens[-1] continue as one more sequence). seq_idx [B, T]: a new sequence
  starts wherever the id changes. Neither: one sequence per row.
  """
  ids = np.zeros((batch, seqlen), np.int64)
  if cu_seqlens is not None:
    starts = set(int(c) for c in np.asarray(cu_seqlens))
    current = 0
    for t in range(seqlen):
      if t in starts and t > 0:
        current += 1
      ids[0, t] = current
  elif seq_idx is not None:
    seq_idx = np.asarray(seq_idx)
    for b in range(batch):
      current = 0
      for t in range(seqlen):
        if t > 0 and seq_idx[b, t] != seq_idx[b, t - 1]:
          current += 1
        ids[b, t] = current
  return ids


# ----------------------------------------------------------------------------- conv


def causal_conv1d(x, weight, bias=None, activation_name=None, cu_seqlens=None, seq_idx=None):
  """(out, z, scale): x [B, D, T], weight [D, W]; out and z (pre-activation) float64
  [B, D, T]; scale = max over outputs of |bias| + sum |weight * x| (the terms)."""
  c = dtype_name(weight)
  xc = round_to(x, c)
  w = f64(weight)
  b = np.zeros(w.shape[0]) if bias is None else f64(bias)
  batch, dim, seqlen = xc.shape
  width = w.shape[1]
  ids = sequence_ids(batch, seqlen, cu_seqlens, seq_idx)
  z = np.zeros((batch, dim, seqlen))
  mag = np.zeros((batch, dim, seqlen))
  for bi in range(batch):
    for t in range(seqlen):
      acc, acc_abs = b.copy(), np.abs(b)
      for i in range(width):
        s = t - (width - 1) + i
        if s < 0 or ids[bi, s] != ids[bi, t]:
          continue
        acc = acc + w[:, i] * xc[bi, :, s]
        acc_abs = acc_abs + np.abs(w[:, i] * xc[bi, :, s])
      z[bi, :, t] = acc
      mag[bi, :, t] = acc_abs
  return activation(activation_name, z), z, float(np.max(mag, initial=0.0))


def causal_conv1d_grads(x, weight, bias, activation_name, grad_out, cu_seqlens=None,
                        seq_idx=None):
  """(dx, dweight, dbias or None, scales) of sum(grad_out * causal_conv1d(...)).

  The adjoint of the token loop above: every used term weight[d, i] * xc[b, d, s] of output
  (b, d, t) sends dz[b, d, t] * weight[d, i] to dx[b, d, s] and dz * xc[b, d, s] to
  dweight[d, i]. dx is with respect to x through the cast (the cast's gradient is 1).
  scales: the largest sum of |contributions| each of dx, dweight, dbias is made of.
  """
  _, z, _ = causal_conv1d(x, weight, bias, activation_name, cu_seqlens, seq_idx)
  c = dtype_name(weight)
  xc = round_to(x, c)
  w = f64(weight)
  dz = f64(grad_out) * activation_grad(activation_name, z)
  batch, dim, seqlen = xc.shape
  width = w.shape[1]
  ids = sequence_ids(batch, seqlen, cu_seqlens, seq_idx)
  dx = np.zeros_like(xc)
  dx_abs = np.zeros_like(xc)
  dw = np.zeros_like(w)
  dw_abs = np.zeros_like(w)
  for bi in range(batch):
    for t in range(seqlen):
      for i in range(width):
        s = t - (width - 1) + i
        if s < 0 or ids[bi, s] != ids[bi, t]:
          continue
        dx[bi, :, s] += dz[bi, :, t] * w[:, i]
        dx_abs[bi, :, s] += np.abs(dz[bi, :, t] * w[:, i])
        dw[:, i] += dz[bi, :, t] * xc[bi, :, s]
        dw_abs[:, i] += np.abs(dz[bi, :, t] * xc[bi, :, s])
  db = dz.sum(axis=(0, 2)) if bias is not None else None
  scales = dict(dx=float(np.max(dx_abs, initial=0.0)), dweight=float(np.max(dw_abs, initial=0.0)),
                dbias=float(np.max(np.abs(dz).sum(axis=(0, 2)), initial=0.0)))
  return dx, dw, db, scales


def causal_conv1d_update(x, conv_state, weight, bias=None, activation_name=None):
  """(out, new_state, scale): x [B, D, T], conv_state [B, D, S]. out float64 [B, D, T];
  new_state [B, D, S] as float64 holding exactly the values the state's dtype stores."""
  c = dtype_name(weight)
  full = round_to(np.concatenate([f64(conv_state), f64(x)], axis=-1), c)
  w = f64(weight)
  b = np.zeros(w.shape[0]) if bias is None else f64(bias)
  batch, dim, seqlen = np.shape(x)
  state_len = np.shape(conv_state)[-1]
  width = w.shape[1]
  z = np.zeros((batch, dim, seqlen))
  mag = np.zeros((batch, dim, seqlen))
  for t in range(seqlen):
    z[:, :, t] = b
    mag[:, :, t] = np.abs(b)
    for i in range(width):
      col = state_len + t - (width - 1) + i
      z[:, :, t] += w[:, i] * full[:, :, col]
      mag[:, :, t] += np.abs(w[:, i] * full[:, :, col])
  new_state = round_to(full[:, :, -state_len:], dtype_name(conv_state))
  return activation(activation_name, z), new_state, float(np.max(mag, initial=0.0))


# ----------------------------------------------------------------------------- gated RMSNorm


def rms_norm_gated(x, gate, weight, eps, activation_name="silu", norm_in_input_dtype=True):
  """(y float64, scale): Transformers' RMSNormGated with its roundings (see the module
  docstring); the final rounding to x's dtype is left to the tolerance. scale = max |y|
  computed without the roundings' effect on the magnitude (max |w * n * act(gate)|)."""
  xd, wd = dtype_name(x), dtype_name(weight)
  xv, w, g = f64(x), f64(weight), f64(gate)
  n = xv / np.sqrt(np.mean(xv * xv, axis=-1, keepdims=True) + eps)
  if norm_in_input_dtype:
    promoted = np.promote_types(np.dtype(NP_DTYPES[xd]), np.dtype(NP_DTYPES[wd]))
    h = round_to(w * round_to(n, xd), np.dtype(promoted).name)
  else:
    h = w * n
  a = activation(activation_name, g)
  return h * a, float(np.max(np.abs(w * n * a), initial=0.0))


def rms_norm_gated_grads(x, gate, weight, grad_out, eps, activation_name="silu"):
  """(dx, dgate, dweight, scales) of sum(grad_out * y), y = w * n(x) * act(gate) in exact
  arithmetic (roundings have no derivative). dx from each row's explicit Jacobian of n."""
  xv, w, g, dy = f64(x), f64(weight), f64(gate), f64(grad_out)
  hidden = xv.shape[-1]
  x2, g2, dy2 = xv.reshape(-1, hidden), g.reshape(-1, hidden), dy.reshape(-1, hidden)
  inv = 1.0 / np.sqrt(np.mean(x2 * x2, axis=-1, keepdims=True) + eps)
  n = x2 * inv
  a = activation(activation_name, g2)
  dh = dy2 * a                                   # gradient of h = w * n
  dx = np.empty_like(x2)
  for r in range(x2.shape[0]):
    # d n_j / d x_k = inv * delta_jk - x_j x_k inv^3 / hidden
    jac = inv[r] * np.eye(hidden) - np.outer(x2[r], x2[r]) * inv[r] ** 3 / hidden
    dx[r] = (dh[r] * w) @ jac
  dgate = dy2 * w * n * activation_grad(activation_name, g2)
  dweight = np.sum(dh * n, axis=0)
  scales = dict(dx=float(np.max(np.abs(dh * w * inv), initial=0.0)),
                dgate=float(np.max(np.abs(dgate), initial=0.0)),
                dweight=float(np.max(np.sum(np.abs(dh * n), axis=0), initial=0.0)))
  return (dx.reshape(xv.shape), dgate.reshape(xv.shape), dweight, scales)

