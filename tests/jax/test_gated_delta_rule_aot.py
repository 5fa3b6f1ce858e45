"""The gated delta rule kernels compile ahead of time for v5e and v6e at the Gated DeltaNet
shapes of Qwen3.5-9B and Qwen3-Next-80B-A3B (libtpu, no TPU).

Both models' linear-attention layers (Transformers' `Qwen3_5Config` and `Qwen3NextConfig`
defaults, checked below where Transformers is installed) have 16 key heads and 32 value
heads of K = V = 128, so one set of programs serves both. Inputs as the models pass them:
q, k, v and beta bf16, g float32, l2-norm in the kernel, float32 states.

Programs (per chip):
  * prefill_fwd: batch 1, T = 4096, no initial state, the final state returned (the cache);
  * prefill_fwd_packed: the same tokens as 8 packed sequences (cu_seqlens, traced), with
    initial states;
  * train_bwd: the gradients of q, k, v, g and beta at batch 1, T = 4096 (the chunked
    backward: its states kernel and its reverse kernel);
  * train_bwd_packed: the same with cu_seqlens and initial states (their gradient too);
  * decode: batch 64, one token each, the states donated.

Checked per program: it compiles; it holds exactly the Mosaic kernels expected; every
kernel compiled under the scoped-VMEM limit the tiling asked for (v6e: the default 32 MiB;
v5e: raised to 19 MiB for the chunked kernels, 17 MiB for decode), within the chip's
allowance, and the tiling's plan fits half that limit. For decode, also that the states
are updated in place: donated, they are aliased to the output, inside the kernel too, and
move only by bitcasts (no copy or transpose of [64, 32, 128, 128] float32).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from tpu_kernels import aot, chips, gated_delta_rule as GDN, vmem

pytestmark = pytest.mark.aot

AOT_CHIPS = ["v5e", "v6e"]
S = jax.ShapeDtypeStruct
BF16, F32 = jnp.bfloat16, jnp.float32
# (linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim)
MODELS = {"Qwen3.5-9B": (16, 32, 128, 128), "Qwen3-Next-80B-A3B": (16, 32, 128, 128)}
HK, HV, K, V = MODELS["Qwen3.5-9B"]
T_PREFILL, NUM_SEQS, DECODE_BATCH = 4096, 8, 64

Q = S((1, T_PREFILL, HK, K), BF16)
VV = S((1, T_PREFILL, HV, V), BF16)
GATE, BETA = S((1, T_PREFILL, HV), F32), S((1, T_PREFILL, HV), BF16)
CU = S((NUM_SEQS + 1,), jnp.int32)
H0_PACKED = S((NUM_SEQS, HV, K, V), F32)


def _chunk(chip, **kw):
  return functools.partial(GDN.chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True, chip=chip,
                           **kw)


def _programs(chip):
  """name -> (fn, arg specs, expected kernel names, tiling)."""
  fwd = _chunk(chip, output_final_state=True)

  def fwd_packed(q, k, v, g, beta, cu, h0):
    return fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)

  def bwd(q, k, v, g, beta, do):
    return jax.vjp(_chunk(chip), q, k, v, g, beta)[1]((do, None))

  def bwd_packed(q, k, v, g, beta, cu, h0, do, dht):
    f = lambda q, k, v, g, beta, h0: fwd(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0)
    return jax.vjp(f, q, k, v, g, beta, h0)[1]((do, dht))

  dq = S((DECODE_BATCH, 1, HK, K), BF16)
  decode_specs = [dq, dq, S((DECODE_BATCH, 1, HV, V), BF16), S((DECODE_BATCH, 1, HV), F32),
                  S((DECODE_BATCH, 1, HV), BF16), S((DECODE_BATCH, HV, K, V), F32)]
  chunk_t = GDN.gdn_tiling(HK, HV, K, V, dtype=BF16, chip=chip)
  decode_t = GDN.decode_tiling(HK, HV, K, V, 1, dtype=BF16, chip=chip)
  backward = (GDN.STATES_KERNEL, GDN.BACKWARD_KERNEL)
  return {
      "prefill_fwd": (fwd, [Q, Q, VV, GATE, BETA], (GDN.FORWARD_KERNEL,), chunk_t),
      "prefill_fwd_packed": (fwd_packed, [Q, Q, VV, GATE, BETA, CU, H0_PACKED],
                             (GDN.FORWARD_KERNEL,), chunk_t),
      "train_bwd": (bwd, [Q, Q, VV, GATE, BETA, VV], backward, chunk_t),
      "train_bwd_packed": (bwd_packed, [Q, Q, VV, GATE, BETA, CU, H0_PACKED, VV, H0_PACKED],
                           backward, chunk_t),
      "decode": (_decode(chip), decode_specs, (GDN.DECODE_KERNEL,), decode_t),
  }


def _decode(chip):
  def decode(q, k, v, g, beta, h0):
    return GDN.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, chip=chip)
  return decode


PROGRAMS = list(_programs("v6e"))


def _compile(fn, specs, chip, donate=()):
  device = aot.topology_device(chip)
  placed = [aot._on_device(s, device) for s in specs]
  return jax.jit(fn, donate_argnums=donate).trace(*placed).lower().compile().as_text()


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_model_shapes_compile(name, chip, record_property):
  fn, specs, kernels, tiling = _programs(chip)[name]
  what = f"{name} on {chip}"
  donate = (5,) if name == "decode" else ()
  try:
    text = _compile(fn, specs, chip, donate)
  except Exception as e:  # the compiler's verdict, in the failure message
    pytest.fail(f"{what}: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
  names = aot.kernel_names(text)
  assert len(names) == len(kernels) and all(
      want in got for want, got in zip(kernels, names)), f"{what}: Mosaic kernels {names}"
  per_kernel = aot.scoped_vmem_per_kernel(text)
  record_property(f"{name} {chip}", f"{tiling}; compiled under {per_kernel}")
  assert per_kernel == [tiling.vmem_limit_bytes] * len(kernels), (
      f"{what}: compiled under {per_kernel} bytes of scoped VMEM, the tiling asked for "
      f"{tiling.vmem_limit_bytes}")
  assert tiling.vmem_limit_bytes <= chips.get_chip(chip).max_vmem_limit_bytes, what
  assert tiling.vmem_plan_bytes <= tiling.vmem_limit_bytes * vmem.BUDGET_FRACTION, (
      f"{what}: {tiling}")
  if name == "decode":
    _check_in_place(text, what)


def _check_in_place(text, what):
  """The donated states (parameter 5) are the program's output 1, aliased by the kernel,
  and no instruction copies, transposes or fuses an array of their shape."""
  assert re.search(r"input_output_alias=\{[^}]*\{1\}: \(5, \{\}", text), (
      f"{what}: states not aliased to the output")
  kernel = [line for line in text.splitlines()
            if 'custom_call_target="tpu_custom_call"' in line]
  assert len(kernel) == 1 and re.search(r"output_to_operand_aliasing=\{\{1\}: \(\d+, \{\}\)\}",
                                        kernel[0]), f"{what}: the kernel does not alias it"
  shapes = (f"[{DECODE_BATCH},{HV},{K},{V}]", f"[{DECODE_BATCH * HV * K},{V}]")
  moves = []
  for line in text.splitlines():
    match = re.search(r"= (.*?) (copy|copy-start|copy-done|transpose|fusion)\(", line)
    if match and any(s in match.group(1) for s in shapes):
      moves.append(line.strip()[:160])
  assert not moves, f"{what}: the states are copied: {moves}"


def test_scoped_vmem_limits():
  """The limits the programs above compiled under: v6e's default 32 MiB for all; on v5e
  the tilings raise its default 16 MiB to 19 MiB (the chunked kernels' 4 heads per step)
  and 17 MiB (decode's 32 heads), what their plans need at half the limit."""
  want = {"v6e": dict(chunk=32, decode=32), "v5e": dict(chunk=19, decode=17)}
  for chip in AOT_CHIPS:
    for name, (_, _, _, tiling) in _programs(chip).items():
      kind = "decode" if name == "decode" else "chunk"
      assert tiling.vmem_limit_bytes == want[chip][kind] << 20, (name, chip, tiling)


@pytest.mark.parametrize("model", list(MODELS))
def test_model_shapes_are_transformers_defaults(model):
  """The shapes above are the Gated DeltaNet defaults of the models' configs (Transformers
  documents them as the released checkpoints' shapes). Needs Transformers (leg 1 only)."""
  configs = pytest.importorskip("transformers")
  cls = {"Qwen3.5-9B": "Qwen3_5TextConfig", "Qwen3-Next-80B-A3B": "Qwen3NextConfig"}[model]
  config = getattr(configs, cls)()
  got = (config.linear_num_key_heads, config.linear_num_value_heads,
         config.linear_key_head_dim, config.linear_value_head_dim)
  assert got == MODELS[model]
