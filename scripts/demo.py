"""The main job: build the kernel repos, load one as a user would, run a kernelized model,
and show that every kernel compiles for each TPU generation.

    python scripts/demo.py [--dist DIR]

1. scripts/build.py writes dist/<kernel>/ for every ready kernel of build.toml.
2. `get_kernel("<org>/rms-norm-tpu", version=1)` loads it through the real `kernels`
   loader (LOCAL_KERNELS points the repo id at dist/, since the Hub is not reachable here).
3. The RMSNorm recipe (transformers 5.25): rms-norm-tpu's layers registered in the
   process's kernel mapping, then a tiny randomly initialised Qwen3 saved and loaded with
   `from_pretrained`, which kernelizes it on load (its RMSNorms run the Pallas kernel, in
   interpret mode on this CPU, and still do after train() / eval(), which kernelize
   again); it generates tokens next to the same checkpoint loaded with use_kernels=False.
4. `get_kernel("<org>/ragged-dot-tpu", version=1)` is registered as a Transformers experts
   implementation; a tiny randomly initialised Qwen3-MoE generates with it (grouped matmul
   kernels in interpret mode) next to the stock "eager" experts.
5. `get_kernel("<org>/flash-attention-tpu", version=1)` registers its attention with
   Transformers; a tiny randomly initialised gpt-oss (attention sinks, sliding window
   smaller than the text) generates with attn_implementation="tpu_attention" next to
   "eager".
6. `get_kernel("<org>/paged-attention-tpu", version=1)` becomes the attention of
   Transformers' continuous batching (set_continuous_batching_attention); a tiny
   randomly initialised Llama serves three prompts with `model.generate_batch`, next to
   `model.generate` on each prompt alone.
7. The same flash-attention-tpu as a Diffusers attention backend
   (`set_diffusers_backend`): a tiny randomly initialised Flux and a tiny Qwen-Image
   transformer (padded text tokens) run on it next to Diffusers' "native" attention.
8. `get_kernel("<org>/gated-delta-rule-tpu", version=1)` and `("<org>/causal-conv1d-tpu")`
   load the linear-attention kernels; with them and rms-norm-tpu's gated norm registered
   in the process's kernel mapping (transformers_integration.use_linear_attention_tpu), a
   tiny randomly initialised Qwen3.5 (one Gated DeltaNet layer, one attention layer) is
   saved and loaded with `from_pretrained`, which kernelizes it: its logits and greedy
   tokens (prefill on the chunked kernel and the conv, decode on the recurrent kernel and
   the in-place conv update) next to the same checkpoint loaded with use_kernels=False.
9. Each kernel is compiled ahead of time with libtpu for v5e / v6e / v5p (no TPU needed).
Exits non-zero if the tokens, the logits or the Diffusers outputs differ or a compile fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build  # noqa: E402


def tiny_qwen3_moe(dtype):
  """A 2-layer Qwen3-MoE (hidden 64, 8 experts of width 32, top-2), random weights, eval."""
  import torch
  from transformers import AutoModelForCausalLM, Qwen3MoeConfig

  config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=64,
                          moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, max_position_embeddings=128, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
  torch.manual_seed(0)
  return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def moe_generates_like_stock(repo_id: str, prompt) -> bool:
  """The user flow of ragged-dot-tpu: register experts_forward, load with
  from_pretrained(..., experts_implementation=...) (Transformers 5.25 kernelizes on load;
  the experts stay the kernel's), generate, compare with the checkpoint's eager experts."""
  import tempfile

  import torch
  from transformers import AutoModelForCausalLM

  import transformers_integration as ti

  ragged = ti.register_ragged_experts(repo_id)
  print(f"   loaded {ragged.__name__}; registered experts implementation '{ti.EXPERTS_NAME}'")
  with tempfile.TemporaryDirectory() as path:
    tiny_qwen3_moe(torch.float32).save_pretrained(path)
    stock = AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager")
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=ti.EXPERTS_NAME)
  start = time.perf_counter()
  expected = stock.generate(prompt, max_new_tokens=8, do_sample=False)
  got = model.generate(prompt, max_new_tokens=8, do_sample=False)
  same = torch.equal(got, expected)
  print(f"   stock experts:  {expected[0, prompt.shape[1]:].tolist()}")
  print(f"   ragged_dot:     {got[0, prompt.shape[1]:].tolist()}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
  return same


def attention_generates_like_eager(repo_id: str, prompt) -> bool:
  """The user flow of flash-attention-tpu: register_attention, load with
  from_pretrained(..., attn_implementation="tpu_attention"), generate, compare with the
  checkpoint's eager attention."""
  import tempfile

  import torch
  from transformers import AutoModelForCausalLM

  import transformers_integration as ti

  kernel = ti.register_tpu_attention(repo_id)
  print(f"   loaded {kernel.__name__}; registered attention implementation "
        f"'{kernel.DEFAULT_ATTENTION_NAME}'")
  # Seed 1: this random gpt-oss does not fall into repeating one token (tiny Gemma 2
  # models do, for every seed tried), so the comparison sees 8 different decisions.
  eager = ti.tiny_attention_model("gpt_oss", torch.float32, seed=1)
  with tempfile.TemporaryDirectory() as path:
    eager.save_pretrained(path)
    tpu = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=kernel.DEFAULT_ATTENTION_NAME)
  start = time.perf_counter()
  expected = eager.generate(prompt, max_new_tokens=8, do_sample=False)
  got = tpu.generate(prompt, max_new_tokens=8, do_sample=False)
  same = torch.equal(got, expected)
  print(f"   eager attention:  {expected[0, prompt.shape[1]:].tolist()}")
  print(f"   tpu_attention:    {got[0, prompt.shape[1]:].tolist()}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
  return same


def generate_batch_matches_generate(repo_id: str) -> bool:
  """The user flow of paged-attention-tpu: set_continuous_batching_attention, then
  generate_batch (prefill and decode mixed over the engine's paged cache), compared with
  generate one prompt at a time."""
  import torch
  from kernels import get_kernel
  from transformers import ContinuousBatchingConfig, GenerationConfig

  import transformers_integration as ti

  paged = get_kernel(repo_id, version=1)
  model = ti.tiny_attention_model("llama", torch.float32)
  prompts = [[5, 17, 42, 99, 7, 64], [3, 8, 120, 77, 15, 9, 31, 100, 4, 56, 23, 90, 14],
             [11, 22, 33]]
  config = GenerationConfig(do_sample=False, max_new_tokens=8,
                            eos_token_id=model.config.eos_token_id, pad_token_id=0)
  start = time.perf_counter()
  expected = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist()
              for p in prompts]
  name = paged.set_continuous_batching_attention(model)
  print(f"   loaded {paged.__name__}; continuous-batching attention '{name}'")
  outputs = model.generate_batch(
      prompts, generation_config=config, warmup=False,
      continuous_batching_config=ContinuousBatchingConfig(page_size=16, num_blocks=8,
                                                          max_batch_tokens=32))
  model.set_attn_implementation("eager")
  got = [output.generated_tokens for output in outputs.values()]
  same = got == expected
  print(f"   generate, one prompt at a time: {expected}")
  print(f"   generate_batch on the kernel:   {got}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
  return same


def diffusers_matches_native(repo_id: str) -> bool:
  """The user flow of flash-attention-tpu in Diffusers: set_diffusers_backend on tiny
  Flux and Qwen-Image transformers, compared with Diffusers' native attention (float32,
  diffusers_integration.F32_TOLERANCE)."""
  import torch
  from kernels import get_kernel

  import diffusers_integration as di

  flash = get_kernel(repo_id, version=1)
  same = True
  for family in ("flux", "qwen_image"):
    model = di.tiny_transformer(family)
    inputs = di.tiny_inputs(family, padded=family == "qwen_image")
    start = time.perf_counter()
    with torch.no_grad():
      model.set_attention_backend("native")
      want = model(**inputs, return_dict=False)[0]
      name = flash.set_diffusers_backend(model)
      got = model(**inputs, return_dict=False)[0]
    ok, error = di.matches_native(got, want)
    print(f"   {family}: attention backend '{name}', max error {error:.1e} of max|native|: "
          f"{'agrees with native' if ok else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
    same = same and ok
  return same


def rms_norm_generates_like_stock(repo_id: str, prompt) -> bool:
  """The user flow of rms-norm-tpu on transformers 5.25: register its layers in the
  process's kernel mapping (transformers_integration.use_rms_norm_tpu), load with
  from_pretrained (kernelized on load; train() / eval() kernelize again), generate, compare
  with the checkpoint loaded without kernels. Raises if any RMSNorm is not the kernel's."""
  import tempfile

  import torch
  from transformers import AutoModelForCausalLM

  import transformers_integration as ti

  # The mapping ends with this step (a user's lasts): the other steps' models keep their norms.
  with ti.kernel_mapping_scope(), tempfile.TemporaryDirectory() as path:
    ti.tiny_model("qwen3", torch.float32).save_pretrained(path)
    stock = AutoModelForCausalLM.from_pretrained(path, use_kernels=False)
    ti.use_rms_norm_tpu(repo_id)
    kernelized = AutoModelForCausalLM.from_pretrained(path)
    count = ti.assert_rms_norms_kernelized(kernelized, repo_id)
    kernelized.train()
    kernelized.eval()
    ti.assert_rms_norms_kernelized(kernelized, repo_id)
  print(f"   {count} RMSNorm modules run the Pallas kernel after from_pretrained, and after "
        "train() / eval() (interpret mode on CPU)")
  start = time.perf_counter()
  expected = stock.generate(prompt, max_new_tokens=8, do_sample=False)
  got = kernelized.generate(prompt, max_new_tokens=8, do_sample=False)
  same = torch.equal(got, expected)
  print(f"   stock:      {expected[0, prompt.shape[1]:].tolist()}")
  print(f"   kernelized: {got[0, prompt.shape[1]:].tolist()}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
  return same


def linear_attention_generates_like_stock(org: str) -> bool:
  """The user flow of the linear-attention kernels on transformers 5.25: load both repos
  with get_kernel, register the three repos' layers in the process's kernel mapping
  (transformers_integration.use_linear_attention_tpu), load a tiny Qwen3.5 with
  from_pretrained (kernelized on load), and compare its logits and cached greedy tokens
  with the checkpoint loaded without kernels. Raises if any linear-attention call is not
  the kernels'."""
  import tempfile

  import torch
  from kernels import get_kernel
  from transformers import AutoModelForCausalLM

  import transformers_integration as ti

  loaded = [get_kernel(f"{org}/{name}", version=1)
            for name in ("gated-delta-rule-tpu", "causal-conv1d-tpu", "rms-norm-tpu")]
  for kernel in loaded[:2]:
    print(f"   loaded {kernel.__name__} from {Path(kernel.__file__).parent}")
  prompt = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
  # The mapping ends with this step (a user's lasts): the other steps' models are untouched.
  with ti.kernel_mapping_scope(), tempfile.TemporaryDirectory() as path:
    ti.tiny_linear_attention_model("qwen3_5").save_pretrained(path)
    stock = AutoModelForCausalLM.from_pretrained(path, use_kernels=False)
    ti.use_linear_attention_tpu(org)
    kernelized = AutoModelForCausalLM.from_pretrained(path)
    count = ti.assert_linear_attention_kernelized(kernelized, org)
    start = time.perf_counter()
    with torch.no_grad():
      want = stock(prompt).logits
      with ti.RecordKernelOps(loaded) as ops:
        got = kernelized(prompt).logits
    error = float((got - want).abs().max() / want.abs().max())
    close = error <= 1e-4
    print(f"   {count} linear-attention calls run the kernels ({', '.join(sorted(ops.called))}); "
          f"logits within {error:.1e} of max|stock|: {'agree' if close else 'DIFFER'}")
    expected = stock.generate(prompt, max_new_tokens=6, do_sample=False)
    with ti.RecordKernelOps(loaded) as ops:
      tokens = kernelized.generate(prompt, max_new_tokens=6, do_sample=False)
  same = torch.equal(tokens, expected)
  print(f"   generate ran {', '.join(sorted(ops.called))}")
  print(f"   stock:      {expected[:, prompt.shape[1]:].tolist()}")
  print(f"   kernelized: {tokens[:, prompt.shape[1]:].tolist()}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")
  return same and close


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where to build")
  dist = parser.parse_args(argv).dist.resolve()
  manifest = build.load_manifest()
  org = manifest["collection"]["hub-org"]
  print("== 1. building the kernel repos")
  ready = build.ready_kernels(manifest)
  for name in ready:
    print(f"   {name}: {build.build_kernel(name, manifest, dist)}")
  os.environ["LOCAL_KERNELS"] = ":".join(f"{org}/{n}={dist / n}" for n in ready)

  print(f"== 2. get_kernel('{org}/rms-norm-tpu', version=1)")
  import torch
  from kernels import get_kernel

  rms = get_kernel(f"{org}/rms-norm-tpu", version=1)
  print(f"   loaded {rms.__name__} from {Path(rms.__file__).parent}")

  print("== 3. rms-norm-tpu under every RMSNorm of a tiny Qwen3 (random weights) through "
        "Transformers' kernelize on from_pretrained; generate greedily on CPU")
  prompt = torch.tensor([[5, 17, 42, 99, 7, 64]])
  same = rms_norm_generates_like_stock(f"{org}/rms-norm-tpu", prompt)

  print(f"== 4. get_kernel('{org}/ragged-dot-tpu', version=1) as the experts of a tiny "
        "Qwen3-MoE (random weights)")
  same_moe = moe_generates_like_stock(f"{org}/ragged-dot-tpu", prompt)
  same = same and same_moe

  print(f"== 5. get_kernel('{org}/flash-attention-tpu', version=1) as the attention of a "
        "tiny gpt-oss (random weights; sinks, window 8)")
  same_attention = attention_generates_like_eager(f"{org}/flash-attention-tpu", prompt)
  same = same and same_attention

  print(f"== 6. get_kernel('{org}/paged-attention-tpu', version=1) as the attention of "
        "Transformers' continuous batching (generate_batch), tiny Llama (random weights)")
  same_serving = generate_batch_matches_generate(f"{org}/paged-attention-tpu")
  same = same and same_serving

  print(f"== 7. get_kernel('{org}/flash-attention-tpu', version=1) as a Diffusers attention "
        "backend: tiny Flux and Qwen-Image transformers (random weights) vs native")
  same_diffusers = diffusers_matches_native(f"{org}/flash-attention-tpu")
  same = same and same_diffusers

  print(f"== 8. get_kernel('{org}/gated-delta-rule-tpu', version=1) and "
        f"get_kernel('{org}/causal-conv1d-tpu', version=1) under a tiny Qwen3.5 (random "
        "weights) through Transformers' kernelize on from_pretrained")
  same_linear = linear_attention_generates_like_stock(org)
  same = same and same_linear

  print("== 9. ahead-of-time compiles with libtpu (the real TPU compiler; no TPU here)")
  import aot_summary

  compile_failures = aot_summary.main()
  print("== summary: " + ("tokens match, all kernels compile" if same and not compile_failures
                          else "FAILED"))
  return 0 if same and not compile_failures else 1


if __name__ == "__main__":
  sys.exit(main())
