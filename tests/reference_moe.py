"""Independent float64 NumPy references for ragged-dot-tpu, written from the definitions.

    ragged_dot: rows [start_g, start_g + size_g) of lhs multiply rhs[g - group_offset]
                (for the groups this shard owns); every other row, and every row past
                sum(group_sizes), is zero.
    moe_experts: out[t] = sum_k w[t, k] * down_e(act_gate(gate_up_e(hidden[t])))
                 with e = idx[t, k], skipping e outside [0, num_experts); a per-token
                 loop, no sort.

No kernel code, no sorting, no grouping: loops over groups and over tokens.
"""

from __future__ import annotations

import math

import numpy as np


def f64(a) -> np.ndarray:
  if hasattr(a, "detach"):  # torch tensor
    a = a.detach().float().numpy() if a.dtype.is_floating_point else a.detach().numpy()
  return np.asarray(a).astype(np.float64)


def _erf(x):
  return np.vectorize(math.erf)(x)


def activation(name, x):
  x = np.asarray(x, np.float64)
  if name in (None, "identity"):
    return x
  if name == "silu":
    return x / (1.0 + np.exp(-x))
  if name == "gelu":
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
  if name == "gelu_tanh":
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
  if name == "relu":
    return np.maximum(x, 0.0)
  if name == "relu2":
    return np.maximum(x, 0.0) ** 2
  raise ValueError(name)


def dequantize(weight, scale, transposed_out_last: bool):
  """weight * per-output-channel scale. transposed_out_last: weight is [E, in, out]."""
  w = f64(weight)
  if scale is None:
    return w
  s = f64(scale)
  return w * (s[:, None, :] if transposed_out_last else s[:, :, None])


def ragged_dot(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False, rhs_scale=None,
               bias=None, act=None):
  """[m, n] float64: the grouped matmul by its definition (loop over groups)."""
  lhs, sizes = f64(lhs), np.asarray(group_sizes, np.int64)
  w = dequantize(rhs, rhs_scale, transposed_out_last=not transpose_rhs)  # [G, k, n] or [G, n, k]
  if transpose_rhs:
    w = np.swapaxes(w, 1, 2)
  m, n = lhs.shape[0], w.shape[2]
  out = np.zeros((m, n))
  start = 0
  for g, size in enumerate(sizes):
    local = g - group_offset
    if 0 <= local < w.shape[0] and size:
      y = lhs[start:start + size] @ w[local]
      if bias is not None:
        y = y + f64(bias)[local]
      out[start:start + size] = activation(act, y)
    start += size
  return out


def gate(name, gate_up, *, concatenated=True, alpha=1.702, limit=7.0):
  """act(gate) * up (or gpt-oss's clamped gate) of a [.., 2I] gate/up projection."""
  half = gate_up.shape[-1] // 2
  if concatenated:
    g, u = gate_up[..., :half], gate_up[..., half:]
  else:
    g, u = gate_up[..., 0::2], gate_up[..., 1::2]
  if name == "gpt_oss":
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))
  if name == "clamped_silu":  # transformers' DeepseekV4Experts._apply_gate (act_fn silu)
    return activation("silu", np.minimum(g, limit)) * np.clip(u, -limit, limit)
  return activation(name, g) * u


def quantize_row_int8(v) -> np.ndarray:
  """One row through symmetric int8 quantization and back (lhs_quant="int8"), from the
  definition: scale = max|v| / 127 in float32 (1 for zeros), codes = v / scale in float32
  rounded half to even; returns codes * scale in float64."""
  v32 = np.asarray(v, np.float32)
  amax = np.abs(v32).max(initial=np.float32(0))
  scale = amax / np.float32(127) if amax > 0 else np.float32(1)
  return np.clip(np.rint(v32 / scale), -127, 127).astype(np.float64) * np.float64(scale)


def moe_experts(hidden, top_k_index, top_k_weights, gate_up_weight, down_weight, *,
                gate_up_bias=None, down_bias=None, gate_up_scale=None, down_scale=None,
                num_experts, has_gate=True, is_transposed=False, is_concatenated=True,
                activation_name="silu", alpha=1.702, limit=7.0, lhs_quant=None):
  """[T, H] float64: per token, per chosen expert, the expert MLP weighted and summed.
  lhs_quant "int8": the token's row and the expert's h (rounded to hidden's dtype first, as
  the op hands it on) go through `quantize_row_int8` before their projections."""
  h_dtype = np.float32 if "float32" in str(hidden.dtype) else np.dtype("bfloat16") \
      if "bfloat16" in str(hidden.dtype) else hidden.dtype   # numpy or torch input
  requant = (lambda v: quantize_row_int8(np.asarray(v).astype(h_dtype))) if lhs_quant \
      else (lambda v: v)
  x, idx, wts = f64(hidden), np.asarray(top_k_index, np.int64), f64(top_k_weights)
  # Weights as [E, in, out] (the orientation `x @ w` wants).
  gu = dequantize(gate_up_weight, gate_up_scale, transposed_out_last=is_transposed)
  dn = dequantize(down_weight, down_scale, transposed_out_last=is_transposed)
  if not is_transposed:
    gu, dn = np.swapaxes(gu, 1, 2), np.swapaxes(dn, 1, 2)
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k in range(idx.shape[1]):
      e = idx[t, k]
      if not 0 <= e < num_experts:
        continue
      a = requant(x[t]) @ gu[e]
      if gate_up_bias is not None:
        a = a + f64(gate_up_bias)[e]
      if has_gate:
        h = gate(activation_name, a, concatenated=is_concatenated, alpha=alpha, limit=limit)
      else:
        h = activation(activation_name, a)
      y = requant(h) @ dn[e]
      if down_bias is not None:
        y = y + f64(down_bias)[e]
      out[t] += wts[t, k] * y
  return out


def assert_close(got, want, *, rtol, atol, scale=None, what="out"):
  """|got - want| <= atol * scale + rtol * |want|, scale = max|want| unless given; all finite."""
  got, want = f64(got), f64(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert np.all(np.isfinite(got)), f"{what}: non-finite values"
  if scale is None:
    scale = float(np.max(np.abs(want), initial=0.0))
  err = np.abs(got - want)
  bound = atol * scale + rtol * np.abs(want)
  worst = float(np.max(err - bound, initial=-1.0))
  assert worst <= 0, (f"{what}: max |err| {float(err.max(initial=0)):.3g} exceeds the bound "
                      f"(atol {atol} * scale {scale:.3g} + rtol {rtol} * |ref|) by {worst:.3g}")
