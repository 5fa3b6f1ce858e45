"""Whole hybrid models of the pinned Transformers (5.25) on the linear-attention kernels,
through Transformers' own kernel hooks, against the same models' stock code (issue 59,
item 4).

Tiny Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo-Hybrid causal LMs built from their own
configs (transformers_integration.tiny_linear_attention_model: one Gated DeltaNet layer and
one full-attention layer, 2 key / 4 value heads of 16, conv over 128 channels, random
weights), float32, CPU (Pallas interpret mode). The recipe (`use_linear_attention_tpu`: the
three repos' layers in the process's kernel mapping, here undone after each test by
`kernel_mapping_scope`) and Transformers' `set_use_kernels(True)` put gated-delta-rule-tpu,
causal-conv1d-tpu and rms-norm-tpu's gated norm under every linear-attention call
(`assert_linear_attention_kernelized` checks each one), and the kernels' custom ops are
seen running (`RecordKernelOps`, a TorchDispatchMode, records them):

  * logits equal the stock model's within 1e-4 of the largest (float32);
  * cached greedy `generate` gives the stock model's tokens (prefill on the chunked kernel
    and the conv, then decode on the recurrent kernel and the in-place conv update);
  * after `train()` (which kernelizes again, in training mode), the gradients of every
    parameter equal the stock model's within 1e-4 of each tensor's largest;
  * packed-sequence training (one row, position_ids restarting and cu_seq_lens_q / _k as
    DataCollatorWithFlattening gives them, use_cache=False: Transformers keeps the
    full-attention layers' sequences apart by their position_ids only without a cache),
    where the stock model raises: logits and gradients equal the stock model run on each
    sequence alone.
"""

import pytest
import torch

import transformers_integration as ti

FAMILIES = ti.LINEAR_ATTENTION_FAMILIES
BOUND = 1e-4
PROMPT = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
# Packed training: three sequences in one row (one longer than the conv's window).
LENGTHS = (5, 9, 3)


@pytest.fixture
def org(manifest, gdn, conv, rms):
  """The hub org of the three repos, with their builds loaded (LOCAL_KERNELS)."""
  return manifest["collection"]["hub-org"]


def _relative(got, want) -> float:
  got, want = got.detach().double(), want.detach().double()
  return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_cached_generate_match_stock(family, org, gdn, conv, rms):
  stock = ti.tiny_linear_attention_model(family)
  model = ti.tiny_linear_attention_model(family)
  with ti.kernel_mapping_scope():
    ti.kernelize_linear_attention(model, org)
    assert {name for _, name, _ in ti.linear_attention_calls(model)} == set(
        ti.LINEAR_ATTENTION_LAYERS)
    with torch.no_grad():
      want = stock(PROMPT).logits
      with ti.RecordKernelOps((gdn, conv, rms)) as ops:
        got = model(PROMPT).logits
    assert {"chunk_gated_delta_rule", "causal_conv1d_forward", "rms_norm_gated"} <= ops.called
    assert _relative(got, want) <= BOUND
    want_tokens = stock.generate(PROMPT, max_new_tokens=4, do_sample=False)
    with ti.RecordKernelOps((gdn, conv, rms)) as ops:
      got_tokens = model.generate(PROMPT, max_new_tokens=4, do_sample=False)
    assert {"fused_recurrent_gated_delta_rule", "causal_conv1d_update"} <= ops.called
    assert torch.equal(got_tokens, want_tokens)


def _grads(model):
  return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_match(got: dict, want: dict):
  assert got.keys() == want.keys()
  bad = {n: f"{_relative(got[n], w):.1e}" for n, w in want.items()
         if w.abs().max() > 0 and _relative(got[n], w) > BOUND}
  assert not bad, bad


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_match_stock(family, org):
  """train() kernelizes again for training (the process's mapping: the kernels stay);
  loss.backward() runs the kernels' backward ops."""
  stock = ti.tiny_linear_attention_model(family).train()
  model = ti.tiny_linear_attention_model(family)
  with ti.kernel_mapping_scope():
    ti.kernelize_linear_attention(model, org)
    model.train()
    ti.assert_linear_attention_kernelized(model, org)
    grads = []
    for m in (stock, model):
      m.zero_grad()
      m(PROMPT, labels=PROMPT).loss.backward()
      grads.append(_grads(m))
    _assert_grads_match(grads[1], grads[0])
    model.eval()
    ti.assert_linear_attention_kernelized(model, org)


def _packed_inputs():
  gen = torch.Generator().manual_seed(1)
  sequences = [torch.randint(3, 128, (1, n), generator=gen) for n in LENGTHS]
  cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()], dtype=torch.int32)
  packed = dict(input_ids=torch.cat(sequences, dim=1),
                position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
                cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS),
                max_length_k=max(LENGTHS), use_cache=False)
  direction = torch.randn(1, sum(LENGTHS), 128, generator=gen)
  return sequences, packed, direction


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequence_training(family, org):
  """Padding-free training: the stock model refuses the packed row (its fallback cannot
  keep the sequences apart); on the kernels, the packed row's logits and parameter
  gradients (of <logits, direction>) equal the stock model's over each sequence alone."""
  sequences, packed, direction = _packed_inputs()
  stock = ti.tiny_linear_attention_model(family).train()
  with pytest.raises(ValueError, match="can't keep packed sequences apart"):
    stock(**packed)
  stock.zero_grad()
  pieces = torch.split(direction, LENGTHS, dim=1)
  want = [stock(input_ids=s).logits for s in sequences]
  sum((w * d).sum() for w, d in zip(want, pieces)).backward()
  model = ti.tiny_linear_attention_model(family).train()
  with ti.kernel_mapping_scope():
    ti.kernelize_linear_attention(model, org)
    got = model(**packed).logits
    (got * direction).sum().backward()
  assert _relative(got, torch.cat(want, dim=1)) <= BOUND
  _assert_grads_match(_grads(model), _grads(stock))
