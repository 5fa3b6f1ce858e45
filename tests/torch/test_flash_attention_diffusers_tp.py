"""flash-attention-tpu's Diffusers backend under Diffusers' tensor parallelism: tiny Flux and
Qwen-Image transformers (scripts/diffusers_integration.py, built from their own configs,
f32, 2 heads of 128) sharded over 2 processes (torch.distributed, gloo, CPU) by their own
`_tp_plan`, on the "flash_tpu" backend, equal the single-process model on Diffusers'
"native" attention (diffusers_integration.F32_TOLERANCE, as the other Diffusers tests).

How the plan is applied: diffusers 0.42.1 refuses CPU for tensor parallelism.
`enable_parallelism(config=TensorParallelConfig(...))` (and `from_pretrained(...,
parallel_config=...)`, through the same `_resolve_parallel_config`) takes the device from
`torch.accelerator`, `rank % torch.accelerator.device_count()`, a ZeroDivisionError with
no accelerator; `apply_tensor_parallel` refuses a mesh whose device type is not cuda,
neuron, tpu or xpu. Rank 0 checks both refusals (so this test says when they go). The
ranks therefore apply the model's own `_tp_plan` as `apply_tensor_parallel` does after
its device check: Diffusers' `_check_tp_supported` and `resolve_tp_shard_specs` (heads and
every sharded block divisible by the TP degree), then one torch `parallelize_module` per
block with Diffusers' own grouping (`_resolve_tp_plan`) and styles (`_styles`: colwise /
rowwise, and Flux's packed rowwise for its single-stream `proj_out`), on a CPU mesh of the
2 ranks. On a TPU mesh Diffusers' own entry points do exactly this.

Each rank loads the same checkpoint (random weights saved once by the test), shards it,
then switches it with `set_diffusers_backend` (as a user does after loading) and runs one
forward on the same inputs (saved once by the test) (Qwen-Image with its padded, holed text mask: segment ids under
TP too). Besides the output, each rank reports its kernel calls and its shard of to_q:
  * the to_q shard holds heads / 2 heads, and every kernel call got heads / 2 query and
    key heads, one call per attention module (a module that stayed on SDPA fails);
  * rank r's calls got exactly heads [r * H/2, (r + 1) * H/2) of the single-process
    kernel calls' q, k, v (same weights, same inputs), and returned those heads' output,
    within the same tolerance: the rank's attention computed its own share of the heads.

The ranks' process setup (network namespace with loopback only, file:// rendezvous,
GLOO_SOCKET_IFNAME=lo, the kernel loaded in each with the real loader via LOCAL_KERNELS)
is tests/torch/gloo_ranks.py, shared with test_multi_device.py. One launch runs both
families.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import gloo_ranks

WORLD = 2
BACKEND = "flash_tpu"
FAMILIES = ("flux", "qwen_image")
PADDED = {"flux": False, "qwen_image": True}   # Qwen-Image's pipeline passes a text mask
ATTENTION_MODULES = {"flux": 2, "qwen_image": 1}  # Flux: 1 double + 1 single block
Q_WEIGHT = "transformer_blocks.0.attn.to_q.weight"
LAUNCH_TIMEOUT_S = 600


def _model_class(family: str):
  from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel

  return {"flux": FluxTransformer2DModel, "qwen_image": QwenImageTransformer2DModel}[family]


def _load(work: Path, family: str):
  """The checkpoint the test saved, float32, eval (from_pretrained's mode). Loaded whole
  (low_cpu_mem_usage=False: what from_pretrained falls back to, with a warning, without
  `accelerate`, which this project does not install)."""
  return _model_class(family).from_pretrained(work / family, low_cpu_mem_usage=False)


def _inputs(work: Path, family: str) -> dict:
  """The family's tiny inputs (diffusers_integration.tiny_inputs), as the test saved them
  for every process."""
  import torch

  return torch.load(work / f"{family}_inputs.pt")


def _forward(model, inputs: dict):
  """The model's output [B, S_image, C]."""
  import torch

  with torch.no_grad():
    return model(**inputs, return_dict=False)[0]


def _recording(flash, calls: list):
  """A stand-in for the kernel's op that calls it and records (q, k, v, out) of each call,
  all [B, H, S, D] (the op's layout)."""
  op = flash.flash_attention_op

  def recording(*args):
    out, lse = op(*args)
    calls.append(tuple(t.detach().clone() for t in (args[0], args[1], args[2], out)))
    return out, lse

  return recording


def apply_tp_plan(model, mesh) -> None:
  """Shards `model` by its own `_tp_plan` on `mesh`: Diffusers' `apply_tensor_parallel`
  after its device check (which refuses CPU meshes), with Diffusers' own checks, grouping
  and styles, and torch's `parallelize_module`."""
  from diffusers import TensorParallelConfig
  from diffusers.hooks.tensor_parallel import (_check_tp_supported, _resolve_tp_plan, _styles,
                                               resolve_tp_shard_specs)
  from torch.distributed.tensor.parallel import parallelize_module

  plan = type(model)._tp_plan
  _check_tp_supported(type(model).__name__, plan, model.config.num_attention_heads,
                      TensorParallelConfig(mesh=mesh), model=model)
  resolve_tp_shard_specs(model, plan, mesh.size())
  for block, block_plan in _resolve_tp_plan(model, plan):
    parallelize_module(block, mesh, _styles(block_plan))


def _diffusers_refusals(work: Path, mesh) -> dict:
  """What Diffusers' own TP entry points raise on this CPU mesh: {entry: "Type: message"}
  (empty for an entry that no longer refuses)."""
  import torch
  from diffusers import TensorParallelConfig
  from diffusers.hooks.tensor_parallel import apply_tensor_parallel

  refusals = {}
  model = _load(work, "flux")
  try:
    model.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
  except Exception as e:  # noqa: BLE001  (recorded for the parent to judge)
    refusals["enable_parallelism"] = f"{type(e).__name__}: {e}"
  config = TensorParallelConfig(mesh=mesh)
  config.setup(torch.distributed.get_rank(), WORLD, torch.device("cpu"), mesh)
  try:
    apply_tensor_parallel(_load(work, "flux"), config, type(model)._tp_plan)
  except Exception as e:  # noqa: BLE001
    refusals["apply_tensor_parallel"] = f"{type(e).__name__}: {e}"
  return refusals


def _rank_main(rank: int, work: Path, repos: dict) -> None:
  """One process: join the gloo group, load the kernel, shard, switch and run each family."""
  import torch
  import torch.distributed as dist
  from torch.distributed.device_mesh import init_device_mesh
  from torch.distributed.tensor import DTensor

  gloo_ranks.join(rank, WORLD, work)
  from kernels import get_kernel

  flash = get_kernel(repos["flash"], version=1)
  calls = []
  flash.flash_attention_op = _recording(flash, calls)
  mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
  results = {"refusals": _diffusers_refusals(work, mesh) if rank == 0 else None}
  for family in FAMILIES:
    model = _load(work, family)
    apply_tp_plan(model, mesh)
    assert flash.set_diffusers_backend(model) == BACKEND
    calls.clear()
    q_weight = dict(model.named_parameters())[Q_WEIGHT]
    assert isinstance(q_weight, DTensor), f"{family}: the plan did not shard {Q_WEIGHT}"
    results[family] = {"output": _forward(model, _inputs(work, family)), "calls": list(calls),
                       "q_shard": tuple(q_weight.to_local().shape)}
    dist.barrier()
  torch.save(results, work / f"rank{rank}.pt")
  dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """A directory with each family's tiny transformer (random weights) and inputs, saved
  once for every process."""
  import torch

  import diffusers_integration as di

  work = tmp_path_factory.mktemp("diffusers_tp")
  for family in FAMILIES:
    di.tiny_transformer(family).save_pretrained(work / family)
    torch.save(di.tiny_inputs(family, padded=PADDED[family]), work / f"{family}_inputs.pt")
  return work


@pytest.fixture(scope="module")
def ranks(checkpoints, local_kernels_env, repo_id):
  """Each rank's results (both families), from one launch of WORLD processes."""
  import torch

  repos = {"flash": repo_id("flash-attention-tpu")}
  gloo_ranks.run_ranks(__file__, checkpoints, repos, LAUNCH_TIMEOUT_S)
  return [torch.load(checkpoints / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(scope="module")
def single_process(checkpoints, flash):
  """{family: (native output, the kernel's calls)} of the unsharded model in this process:
  on "native", then switched with set_diffusers_backend (Diffusers' process-wide active
  backend and the kernel's op put back afterwards)."""
  from diffusers.models.attention_dispatch import _AttentionBackendRegistry

  active, op = _AttentionBackendRegistry._active_backend, flash.flash_attention_op
  results = {}
  try:
    for family in FAMILIES:
      model = _load(checkpoints, family)
      model.set_attention_backend("native")
      inputs = _inputs(checkpoints, family)
      native = _forward(model, inputs)
      calls = []
      flash.flash_attention_op = _recording(flash, calls)
      assert flash.set_diffusers_backend(model) == BACKEND
      _forward(model, inputs)
      flash.flash_attention_op = op
      results[family] = (native, calls)
  finally:
    flash.flash_attention_op = op
    _AttentionBackendRegistry.set_active_backend(active)
  return results


def test_diffusers_refuses_cpu_for_tensor_parallelism(ranks):
  """Why the ranks apply the plan themselves: the day this fails, Diffusers takes CPU
  meshes, and the ranks should call enable_parallelism instead."""
  refusals = ranks[0]["refusals"]
  assert refusals.get("enable_parallelism", "").startswith("ZeroDivisionError"), refusals
  assert "not supported on device type 'cpu'" in refusals.get("apply_tensor_parallel", ""), (
      refusals)


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_on_the_backend_equals_single_process_native(ranks, single_process, checkpoints,
                                                         family):
  import diffusers_integration as di
  import reference as ref

  config = _model_class(family).load_config(checkpoints / family)
  heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
  local_heads = heads // WORLD
  native, whole_calls = single_process[family]
  assert len(whole_calls) == ATTENTION_MODULES[family], len(whole_calls)
  for rank, results in enumerate(ranks):
    result, what = results[family], f"{family} rank {rank}"
    assert result["q_shard"][0] == local_heads * head_dim, (what, result["q_shard"])
    ref.assert_close(result["output"], native, di.F32_TOLERANCE, what=f"{what} output")
    calls = result["calls"]
    assert len(calls) == ATTENTION_MODULES[family], (what, len(calls))
    share = slice(rank * local_heads, (rank + 1) * local_heads)
    for index, (call, whole) in enumerate(zip(calls, whole_calls)):
      for name, got, want in zip(("q", "k", "v", "out"), call, whole):
        assert got.shape[1] == local_heads, (what, index, name, tuple(got.shape))
        ref.assert_close(got, want[:, share], di.F32_TOLERANCE,
                         what=f"{what} call {index} {name} (heads {share.start}:{share.stop})")


if __name__ == "__main__":
  gloo_ranks.main(__file__, WORLD, _rank_main)
