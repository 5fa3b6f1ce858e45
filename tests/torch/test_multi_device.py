"""Experts and attention on the kernels under Transformers' own tensor- and expert-parallel
plans: torch.distributed on gloo across 2 CPU processes equals the single-process model.

Each plan is Transformers' own: the model's `base_model_tp_plan` / `base_model_ep_plan`,
resolved and applied by `PreTrainedModel.prepare_distribute_model` and
`maybe_distribute_model` (the two steps `from_pretrained(distributed_config=...)` runs; with
a DistributedConfig, `from_pretrained` itself also wants `accelerate`, which this project
does not install, so the model is loaded plainly and then sharded by those two functions).
Cases (one tiny checkpoint per family, saved by the test and loaded by every process):
  ep       Qwen3-MoE, DistributedConfig(tp_size=2, ep_size=2, tp_plan={}): the EP plan
           alone (4 of 8 experts per rank, "grouped_gemm" + "ep_dispatch_experts"), no TP
           rule (attention whole on each rank). Both ranks hold the batch, so inference
           takes AllReduceEP (expert-parallel placeholder ids == num_local_experts with
           weight 0) and training AllToAllEP.
  tp_ep    Qwen3-MoE, DistributedConfig(tp_size=2, ep_size=2): the EP plan on the experts,
           TP on the rest (attention heads split in two: "colwise" / "rowwise").
  fsdp_ep  gpt-oss (sinks, biases, clamped SwiGLU), DistributedConfig(fsdp_size=2,
           ep_size=2): the EP plan on the experts (2 of 4 per rank), FSDP2 on the rest
           (gpt-oss has no TP plan). Both ranks get the same batch.
Transformers 5.25 no longer splits experts under TP (Qwen3-MoE's base_model_tp_plan has
no expert rule, and the "moe_tp_experts" style is deprecated for removal in 5.28): with
tp_size=2 alone its experts are whole on every rank, so that case tests nothing tp_ep's
attention and ep's experts do not. And 5.25 builds EP without TP rules (tp_plan={}; on
5.23 that raised "has no tp_plan"), which the ep case runs in place of 5.23's tp case.

Every rank loads the checkpoint with experts_implementation="tpu_ragged_dot" and
attn_implementation="tpu_attention", and again with "eager" for both, shards it and runs:
logits without gradients, then logits and the gradient of every parameter (DTensor
gradients gathered) of <logits, direction>, on a left-padded batch (so the kernel's mask
function runs under the plans too; padding positions' logits are not compared). The
parent compares both ranks against the single-process model loaded from the same
checkpoint: the kernel against the kernel, eager against eager (so the plan itself is
exact here and the kernel comparison means something), f32 within 1e-4 (|got - ref| <=
atol * max|ref| + rtol * |ref|, per tensor; the plans only change the order of sums:
observed <= 1e-6 of max|ref| for every tensor, kernel and eager). Each rank also reports
its local shard shapes (the plan really split heads and experts) and what the kernels'
ops got: each layer's expert weights as the local shard, the attention heads as the
rank's share.

The two processes run in a network namespace of their own with only loopback up (gloo
needs TCP; `offline` runs the suite in a namespace whose loopback is down), rendezvous
through a file:// init_method in tmp_path, and GLOO_SOCKET_IFNAME=lo (tests/torch/gloo_ranks.py,
shared with test_flash_attention_diffusers_tp.py). The kernels are
loaded in each process with the real loader (get_kernel, LOCAL_KERNELS from the fixture).
One launch runs every case, so the start-up (torch, JAX, Transformers) is paid once.
"""

from pathlib import Path

import pytest

import gloo_ranks

WORLD = 2
EXPERTS_IMPL, ATTN_IMPL = "tpu_ragged_dot", "tpu_attention"
IMPLEMENTATIONS = {"kernel": (EXPERTS_IMPL, ATTN_IMPL), "eager": ("eager", "eager")}
TOL = dict(rtol=1e-4, atol=1e-4)
CASES = {  # name -> (family, DistributedConfig arguments)
  "ep": ("qwen3_moe", dict(tp_size=2, ep_size=2, tp_plan={})),
  "tp_ep": ("qwen3_moe", dict(tp_size=2, ep_size=2)),
  "fsdp_ep": ("gpt_oss", dict(fsdp_size=2, ep_size=2)),
}
BATCH, SEQ, PAD = 2, 6, 2  # PAD: left padding of the second row
LAUNCH_TIMEOUT_S = 900


def _inputs(vocab_size: int):
  """(input_ids [B, S] int64, attention_mask [B, S] int64, direction [B, S, vocab] float32,
  zero at the padding): a left-padded batch, the same in every process."""
  import torch

  gen = torch.Generator().manual_seed(1)
  ids = torch.randint(3, vocab_size, (BATCH, SEQ), generator=gen)
  mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
  mask[1, :PAD] = 0
  ids[1, :PAD] = 0
  direction = torch.randn(BATCH, SEQ, vocab_size, generator=gen) * mask[..., None]
  return ids, mask, direction


def _load(path: Path, impl: str):
  """The checkpoint with `impl`'s experts and attention, chosen at load time (as a user
  does: from_pretrained(..., experts_implementation=..., attn_implementation=...))."""
  import torch
  from transformers import AutoModelForCausalLM

  experts, attention = IMPLEMENTATIONS[impl]
  return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              experts_implementation=experts,
                                              attn_implementation=attention)


def _run(model) -> dict:
  """Logits without gradients, then logits and every parameter's gradient (full tensors)."""
  import torch
  from torch.distributed.tensor import DTensor

  ids, mask, direction = _inputs(model.config.vocab_size)
  with torch.no_grad():
    inference_logits = model(input_ids=ids, attention_mask=mask).logits
  model.zero_grad(set_to_none=True)
  logits = model(input_ids=ids, attention_mask=mask).logits
  (logits * direction).sum().backward()
  grads = {}
  for name, p in model.named_parameters():
    if p.grad is not None:
      grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
      grads[name] = grad.detach().clone()
  # logits at the padding positions: garbage that nothing reads
  valid = mask.bool()
  return {"inference_logits": inference_logits[valid].detach().clone(),
          "logits": logits[valid].detach().clone(), "grads": grads}


def _local_shapes(model) -> dict:
  """Each parameter's local shard shape, and the experts modules' num_experts."""
  from torch.distributed.tensor import DTensor

  shapes = {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
            for n, p in model.named_parameters()}
  experts = {n: int(m.num_experts) for n, m in model.named_modules()
             if hasattr(m, "has_gate") and hasattr(m, "num_experts")}
  return {"shapes": shapes, "num_experts": experts}


def _rank_main(rank: int, work: Path, repos: dict) -> None:
  """One process: join the gloo group, load the kernels, shard and run every case."""
  import torch
  import torch.distributed as dist

  gloo_ranks.join(rank, WORLD, work)
  from kernels import get_kernel
  from transformers.distributed import DistributedConfig
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  ragged = get_kernel(repos["ragged"], version=1)
  flash = get_kernel(repos["flash"], version=1)
  ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, ragged.experts_forward)
  assert flash.register_attention() == ATTN_IMPL
  # what the kernels' ops got: expert weight shapes (gate/up, down), attention heads (q, k)
  calls = {"experts": [], "attention": []}
  experts_op, attention_op = ragged.experts_op, flash.flash_attention_op

  def counting_experts_op(*args):
    calls["experts"].append((tuple(args[3].shape), tuple(args[4].shape)))
    return experts_op(*args)

  def counting_attention_op(*args):
    calls["attention"].append((args[0].shape[1], args[1].shape[1]))
    return attention_op(*args)

  ragged.experts_op, flash.flash_attention_op = counting_experts_op, counting_attention_op
  results = {}
  for case, (family, parallel) in CASES.items():
    results[case] = {}
    for impl in IMPLEMENTATIONS:
      model = _load(work / family, impl)
      config, _, meshes = type(model).prepare_distribute_model(DistributedConfig(**parallel))
      model = type(model).maybe_distribute_model(model, config, meshes)
      calls.update(experts=[], attention=[])
      results[case][impl] = _run(model) | _local_shapes(model) | {"calls": dict(calls)}
    dist.barrier()
  torch.save(results, work / f"rank{rank}.pt")
  dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """A directory with one tiny checkpoint per family (random weights, biases and norms)."""
  import torch
  from test_moe_experts import _tiny

  work = tmp_path_factory.mktemp("multi_device")
  for family in sorted({family for family, _ in CASES.values()}):
    _tiny(family, torch.float32).save_pretrained(work / family)
  return work


@pytest.fixture(scope="module")
def distributed(checkpoints, local_kernels_env, repo_id):
  """Runs every case on WORLD ranks: (the checkpoints' directory, [each rank's results])."""
  import torch

  work = checkpoints
  repos = {"ragged": repo_id("ragged-dot-tpu"), "flash": repo_id("flash-attention-tpu")}
  gloo_ranks.run_ranks(__file__, work, repos, LAUNCH_TIMEOUT_S)
  return work, [torch.load(work / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single_process(checkpoints, ragged, flash):
  """{family: {"kernel": ..., "eager": ...}} of the unsharded model in this process."""
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPL, ragged.experts_forward)
  assert flash.register_attention() == ATTN_IMPL
  return {family: {impl: _run(_load(checkpoints / family, impl)) for impl in IMPLEMENTATIONS}
          for family in sorted({family for family, _ in CASES.values()})}


def _assert_matches(got: dict, want: dict, what: str):
  import reference_moe as ref

  ref.assert_close(got["inference_logits"], want["inference_logits"],
                   what=f"{what} logits (no grad)", **TOL)
  ref.assert_close(got["logits"], want["logits"], what=f"{what} logits", **TOL)
  assert set(got["grads"]) == set(want["grads"]), what
  assert any(".experts." in n for n in want["grads"]), "no expert weight got a gradient"
  for name, grad in want["grads"].items():
    ref.assert_close(got["grads"][name], grad, what=f"{what} grad {name}", **TOL)


def _expected_local_shapes(case: str, config) -> dict:
  """Layer 0's local shard shapes the case's plan must give each of the 2 ranks."""
  heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                               config.head_dim)
  experts, hidden = config.num_local_experts, config.hidden_size
  inner = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
  prefix = "model.layers.0."
  # expert parallel: half of the experts, each whole (gpt-oss: [E, in, out])
  qwen = case in ("ep", "tp_ep")
  shapes = {prefix + "mlp.experts.gate_up_proj": (experts // 2, 2 * inner, hidden)
            if qwen else (experts // 2, hidden, 2 * inner),
            prefix + "mlp.experts.down_proj": (experts // 2, hidden, inner)
            if qwen else (experts // 2, inner, hidden)}
  if case == "fsdp_ep":
    shapes[prefix + "mlp.experts.gate_up_proj_bias"] = (experts // 2, 2 * inner)
  if case == "tp_ep":   # heads split
    shapes[prefix + "self_attn.q_proj.weight"] = (heads // 2 * head_dim, hidden)
    shapes[prefix + "self_attn.k_proj.weight"] = (kv_heads // 2 * head_dim, hidden)
    shapes[prefix + "self_attn.o_proj.weight"] = (hidden, heads // 2 * head_dim)
  if case == "ep":      # no TP rule: attention whole
    shapes[prefix + "self_attn.q_proj.weight"] = (heads * head_dim, hidden)
  return shapes


@pytest.mark.parametrize("case", list(CASES))
def test_plan_on_kernels_equals_single_process(distributed, single_process, case):
  from transformers import AutoConfig

  work, ranks = distributed
  family, _ = CASES[case]
  config = AutoConfig.from_pretrained(work / family)
  want_experts = config.num_local_experts // 2
  layers = config.num_hidden_layers
  # FSDP gathers the attention weights for compute, ep leaves them whole: TP splits the heads
  heads = (config.num_attention_heads, config.num_key_value_heads)
  heads = heads if case != "tp_ep" else (heads[0] // 2, heads[1] // 2)
  experts = "model.layers.0.mlp.experts."
  for rank, results in enumerate(ranks):
    for impl in IMPLEMENTATIONS:
      result, what = results[case][impl], f"{case} rank {rank} {impl}"
      shapes = result["shapes"]
      for name, shape in _expected_local_shapes(case, config).items():
        assert shapes[name] == shape, (what, name, shapes[name])
      assert set(result["num_experts"].values()) == {want_experts}, (what, result["num_experts"])
      # the kernels ran on the local shards: each layer once in the forward without grad
      # and once in the one with; eager never calls them
      weights = (shapes[experts + "gate_up_proj"], shapes[experts + "down_proj"])
      want_calls = {"experts": [weights] * 2 * layers, "attention": [heads] * 2 * layers}
      assert result["calls"] == (want_calls if impl == "kernel" else
                                 {"experts": [], "attention": []}), (what, result["calls"])
      _assert_matches(result, single_process[family][impl], what)


if __name__ == "__main__":
  gloo_ranks.main(__file__, WORLD, _rank_main)
