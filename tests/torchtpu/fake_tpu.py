"""Running the built packages' public API on FakeTensors on device "tpu" (tests/torchtpu).

Under FakeTensorMode a custom op's fake runs instead of its implementation; to reach
TorchTPU, `recording_public_ops(kernel, through_tpu=True)` points each public op's fake at
its own implementation (torch layer, shim, the real jax_op, whose fake exports the kernel
for TPU). With through_tpu=False the package's own fakes run, as shipped.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch._library import custom_ops
from torch_tpu._internal.pallas import pallas as torch_tpu_pallas


def ops_module_of(kernel):
  return sys.modules[f"{kernel.__name__}._custom_ops"]


def jax_kernels_of(kernel):
  """name -> JaxKernel of a loaded package: every one its _custom_ops module defines."""
  dispatch = sys.modules[f"{kernel.__name__}._shim.dispatch"]
  return {k.qualname: k for k in vars(ops_module_of(kernel)).values()
          if isinstance(k, dispatch.JaxKernel)}


def public_ops_of(kernel):
  return [op for op in vars(ops_module_of(kernel)).values()
          if isinstance(op, custom_ops.CustomOpDef)]


@contextlib.contextmanager
def recording_public_ops(kernel, *, through_tpu: bool):
  """Under FakeTensorMode: each public op call is recorded as (op, inputs, output), and
  runs its implementation (torch layer, shim, jax_op) if through_tpu, else its own fake."""
  calls = []
  saved = [(op, op._abstract_fn) for op in public_ops_of(kernel)]

  def recorder(op, fake):
    run = op._init_fn if through_tpu else fake
    signature = inspect.signature(op._init_fn)

    def call(*args, **kwargs):
      output = run(*args, **kwargs)
      calls.append((op, tuple(signature.bind(*args, **kwargs).args), output))
      return output
    return call
  try:
    for op, fake in saved:
      op._abstract_fn = recorder(op, fake)
    yield calls
  finally:
    for op, fake in saved:
      op._abstract_fn = fake


def on_device(device):
  """t(shape, dtype): a zero tensor on `device` (a FakeTensor under FakeTensorMode)."""
  def t(shape, dtype):
    return torch.zeros(shape, dtype=dtype, device=device)
  return t


def _default_gate(self, gate_up):   # Transformers' default _apply_gate, [gate | up]
  gate, up = gate_up.chunk(2, dim=-1)
  return self.act_fn(gate) * up


def _gpt_oss_gate(self, gate_up):   # GptOssExperts._apply_gate: interleaved, clamped
  gate, up = gate_up[..., ::2], gate_up[..., 1::2]
  gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
  return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def experts_module(kind: str, t, *, experts=6, hidden=128, intermediate=128,
                   dtype=torch.float32, quantized=None):
  """A Transformers-layout experts module (what `self` is in experts_forward), tensors
  made by t(shape, dtype). kind: "silu" (Qwen3-MoE), "gpt_oss" (transposed, interleaved,
  biased, clamped gate), "no_gate" (Nemotron-H's layout, with relu: transformers is not
  installed here, and experts_forward fuses an activation module only by its class, so the
  torch class nn.ReLU stands in for Transformers' ReLUSquaredActivation). The gates are
  Transformers' formulas: experts_forward recognises a gate by what it computes. quantized:
  a weight dtype (int8 / float8_e4m3fn), with float32 per-output-channel scales."""
  E, H, I = experts, hidden, intermediate
  cls = type("GptOssExperts" if kind == "gpt_oss" else "Qwen3MoeExperts", (torch.nn.Module,),
             {"_apply_gate": _gpt_oss_gate if kind == "gpt_oss" else _default_gate})
  m = cls()
  m.num_experts, m.has_gate = E, kind != "no_gate"
  m.has_bias = m.is_transposed = kind == "gpt_oss"
  m.is_concatenated = kind != "gpt_oss"
  m.alpha, m.limit = 1.702, 7.0
  m.act_fn = torch.nn.SiLU() if kind == "silu" else torch.nn.ReLU()
  up = "gate_up_proj" if m.has_gate else "up_proj"
  width = 2 * I if m.has_gate else I
  shapes = {up: (E, H, width) if m.is_transposed else (E, width, H),
            "down_proj": (E, I, H) if m.is_transposed else (E, H, I)}
  for name, shape in shapes.items():
    if quantized:
      setattr(m, name, t(shape, quantized))
      setattr(m, f"{name}_scale", t((E, shape[2] if m.is_transposed else shape[1]),
                                    torch.float32))
    else:
      setattr(m, name, torch.nn.Parameter(t(shape, dtype)))
  if m.has_bias:
    m.gate_up_proj_bias = torch.nn.Parameter(t((E, width), dtype))
    m.down_proj_bias = torch.nn.Parameter(t((E, H), dtype))
  return m


class Boundary:
  """What jax_op handed over: every `jax.export.Exported` it made (its fake and its real
  kernel both export), and the programs registered / calls made at the native boundary."""

  def __init__(self):
    self.exported = []     # (op name, jax.export.Exported)
    self.registered = []   # (op name, kernel key, serialized StableHLO bytes)
    self.calls = []        # dict(name, inputs, output_shapes, donate_argnums)


current_boundaries: list[Boundary] = []   # the running test's, if it asked for one


def device_call_stubs(record: Boundary) -> dict:
  """Stand-ins for the two pybind functions of `torch_tpu_pallas.tpu_torch_pallas` that
  need a device, by name: `register_custom_kernel` (stores the serialized program under a
  key; recorded) and `call_custom_kernel` (runs it on the chip: recorded, then raises, as
  there is no chip to run it on)."""
  def register_custom_kernel(name, kernel_key, *, serialized_mlir_module):
    record.registered.append((name, kernel_key, serialized_mlir_module))

  def call_custom_kernel(name, kernel_key, *, inputs, output_shapes, donate_argnums=(),
                         device_assignment=()):
    record.calls.append(dict(name=name, inputs=list(inputs), output_shapes=list(output_shapes),
                             donate_argnums=list(donate_argnums)))
    raise RuntimeError("call_custom_kernel needs a TPU (stubbed in tests/torchtpu)")

  return {"register_custom_kernel": register_custom_kernel,
          "call_custom_kernel": call_custom_kernel}


def _recording_init(init):
  """JaxCallable.__init__, then its export function wrapped to report to the running test
  (a jax_op is built once per process: the wrapper outlives the test that built it)."""
  def recording_init(self, *args, **kwargs):
    init(self, *args, **kwargs)
    export = self.exported

    def exported(*a, **k):
      program = export(*a, **k)
      if current_boundaries:
        current_boundaries[-1].exported.append((self.name, program))
      return program
    self.exported = exported
  return recording_init


torch_tpu_pallas.JaxCallable.__init__ = _recording_init(torch_tpu_pallas.JaxCallable.__init__)
