"""A short user script that must exit 0 every time (issue 31): run by tests/torch/test_clean_exit.py
in fresh subprocesses, never imported by pytest.

    LOCAL_KERNELS=... python tests/torch/exit_check.py cpu        # the issue's reproducer
    LOCAL_KERNELS=... python tests/torch/exit_check.py main-job   # plus the main job's steps

cpu: loads ragged-dot-tpu with get_kernel(version=1), runs experts_forward on the experts
  module of tiny random Mixtral, Qwen3-MoE and gpt-oss models (each against the module's
  own "eager" loop, f32, 1e-4), checks that libtpu was never loaded (interpret mode on CPU
  does not need it), prints one line and returns: the interpreter's own shutdown follows.
main-job: the same, then what the main job does besides: flash attention on CPU tensors
  and an ahead-of-time compile for v6e, which loads libtpu (so its threads are alive at
  exit, as in the main job and in every AOT test process).
"""

import sys
from pathlib import Path

import torch
from kernels import get_kernel
from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
from transformers import AutoModelForCausalLM

ORG = "tpu-kernels"
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16)
CONFIGS = {
    "mixtral": MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                             num_experts_per_tok=2),
    "qwen3_moe": Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2),
    "gpt_oss": GptOssConfig(**COMMON, intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2),
}


def libtpu_loaded() -> bool:
  return "libtpu" in Path("/proc/self/maps").read_text()


def experts_match(ragged) -> None:
  for family, config in CONFIGS.items():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))
    hidden = torch.randn(5, config.hidden_size)
    top_k_index = torch.randint(0, 4, (5, 2))
    top_k_weights = torch.rand(5, 2)
    with torch.no_grad():
      want = experts(hidden, top_k_index, top_k_weights)
      got = ragged.experts_forward(experts, hidden, top_k_index, top_k_weights)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=family)


def main_job_steps() -> None:
  import jax
  import jax.numpy as jnp

  flash = get_kernel(f"{ORG}/flash-attention-tpu", version=1)
  q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
  want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
  torch.testing.assert_close(flash.flash_attention(q, k, v, causal=True), want,
                             rtol=1e-4, atol=1e-4)

  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))
  from tpu_kernels import aot, rms_norm

  report = aot.compile_for_chip(
      lambda x, w: rms_norm.rms_norm(x, w, chip="v6e"),
      [jax.ShapeDtypeStruct((64, 512), jnp.bfloat16), jax.ShapeDtypeStruct((512,), jnp.bfloat16)],
      "v6e")
  assert report.ok, report.error
  assert libtpu_loaded(), "the AOT compile was expected to load libtpu"


def main(mode: str) -> None:
  ragged = get_kernel(f"{ORG}/ragged-dot-tpu", version=1)
  experts_match(ragged)
  assert not libtpu_loaded(), "libtpu was loaded on the CPU (interpret-mode) path"
  if mode == "main-job":
    main_job_steps()
  print(f"exit_check {mode}: results match; libtpu loaded: {libtpu_loaded()}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1])
