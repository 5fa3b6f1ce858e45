"""The paged kernel at Gemma 4's full-attention layers, for serving (issue 60, item 3).

Gemma 4's full-attention layers (transformers 5.25, `Gemma4TextAttention`) have head_dim
512 (`global_head_dim`), scale 1.0 (q and k are RMS-normed instead) and, with
`attention_k_eq_v`, keys and values from one projection; 26B-A4B has 16 query heads and
2 KV heads there (group 8). Two checks:

  * decode in interpret mode against the float64 reference (tests/reference.py, through
    the kernel tests' own helpers): one new token per sequence at head_dim 512, group 8,
    sm_scale 1.0, lengths below, at and across a page, also with one cache passed as both
    k_pages and v_pages (a server keeping one cache for a K = V layer);
  * the default tiling of Gemma 4 26B-A4B's batch-64 decode at head_dim 512 (16 / 2
    heads, 32k tokens of context, page size 16, bf16) compiles ahead of time for v5e and
    v6e, one program per chip, under the checks of test_paged_attention_aot.py.

q is scaled by 2 / sqrt(D) (logits of standard deviation ~2, as RMS-normed q and k with
trained norm weights give; the reference's tolerances are derived for logits O(1..30)).
"""

import numpy as np
import pytest

import reference as ref
from aot_pool import compile_pool
from paged_attention_cases import AOT_CHIPS, Config, Program, compile_case
from test_paged_attention_aot import _check as check_compiled_program
from test_paged_attention_kernel import _check, _inputs, _problem, _run

GLOBAL_HEAD_DIM = 512
# Gemma 4 26B-A4B's full-attention layers at batch-64 decode.
GEMMA4_DECODE = Config("gemma4 26B-A4B full-attention decode", batch=64, context=32768,
                       q_heads=16, kv_heads=2, head_dim=GLOBAL_HEAD_DIM)


def _gemma4_decode(dtype, seed, page_size=16):
  p = _problem(kv_lens=[page_size + 5, 1, page_size, 3 * page_size - 1],
               q_lens=[1, 1, 1, 1], page_size=page_size, head_dim=GLOBAL_HEAD_DIM,
               num_kv_heads=1, group=8, sm_scale=1.0, dtype=dtype, seed=seed)
  x = _inputs(p)
  x["q"] = (x["q"].astype(np.float32) * (2.0 / np.sqrt(GLOBAL_HEAD_DIM))).astype(x["q"].dtype)
  return p, x


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_at_head_dim_512(dtype):
  p, x = _gemma4_decode(dtype, seed=512)
  _check(p, x, _run(p, x))


def test_one_cache_as_keys_and_values():
  p, x = _gemma4_decode("bfloat16", seed=513)
  x["v_pages"] = x["k_pages"]
  _check(p, x, _run(p, x))
  # The scale matters on these inputs: the default 1 / sqrt(D) is far outside tolerance.
  out = np.asarray(_run(dict(p, sm_scale=None), x))
  with pytest.raises(AssertionError):
    ref.assert_close(out, ref.paged_attention(
        x["q"], x["k_pages"], x["v_pages"], x["kv_lens"], x["page_indices"], x["cu_q_lens"],
        sm_scale=1.0), ref.PAGED_TOLERANCE[p["dtype"]])


@pytest.mark.aot
@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_gemma4_decode_compiles_ahead_of_time(chip, record_property):
  """Batch 64, 16 / 2 heads of 512, 32k context: the default tiling compiles for the chip
  (in a worker process: libtpu stays out of the test process), one Mosaic kernel, under
  the scoped VMEM it asked for, VMEM and SMEM plans within budget. One test per chip, so
  that the second CI leg's v6e-only selection (scripts/test.sh) applies."""
  program = Program(GEMMA4_DECODE)
  with compile_pool() as pool:
    report = pool.submit(compile_case, program, chip).result()
  record_property(f"{program.label} {chip}", program.plan(chip))
  check_compiled_program(program, report, chip)
