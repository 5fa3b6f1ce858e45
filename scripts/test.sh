#!/usr/bin/env bash
# README command 2: the whole test suite, network cut, on both stacks.
#   leg 1: .venv (Python 3.11, jax 0.10.2, torch 2.13.0): every test but a few, in two runs:
#          1a tests/jax but two AOT modules (RMSNorm, paged), which 1b runs before
#          tests/torch and tests/release (the split that makes 1a, 1b and leg 2 take about
#          as long). The exceptions: v5e's flash tuning-table and gated-delta-rule training
#          programs compile on leg 2 instead
#   leg 2: .venv-jax012 (Python 3.12, jax 0.12.1, libtpu 0.0.52): the JAX-only tests (tests/jax)
#   leg 3: .venv-torchtpu (Python 3.11, the real torch-tpu 0.2.0 wheel, never autoloaded):
#          tests/torchtpu, every op through TorchTPU's jax_op up to the device call; the
#          programs it exports are compiled for v5e / v6e by .venv-jax012's libtpu. Then,
#          on .venv, tests/torch/test_clean_exit.py (which 1b leaves out)
# 1a, 1b and leg 2 go at the same time, and leg 3 once leg 2 is done: each run is mostly one
# busy core and this machine has two, so no core idles while the longest run finishes (as it
# did when leg 1 was one run), and no more than three runs share them.
# 1b's and leg 2's output is kept in build-reports/test-leg1b.log and test-leg2.log and
# printed when 1a is done. Each run reports its 15 slowest tests, and every test's time in
# build-reports/junit-leg*.xml. Extra arguments go to every pytest run.
# HYPOTHESIS_PROFILE=thorough for a deeper run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Leg 2 re-checks kernels leg 1 checks in full, so by default it draws fewer examples and
# compiles ahead of time (tests/jax/*aot*) for v6e only, the chip TorchTPU targets: leg 1
# compiles every matrix for v5e and v6e with libtpu 0.0.42 (but v5e's flash tuning table,
# below); leg 2 adds libtpu 0.0.52's
# verdict on the feature programs, the paged tuning table, the quantized and sharded
# programs, and of the default-shape matrices the headline column: flash attention at
# head_dim 128 (whose v6e tiling is a tuning-table entry), paged decode at 32/8 heads x
# 128, RMSNorm at hidden 1000, 4096 and 16384, ragged-dot at Qwen3-30B-A3B. The rest
# (other head dims, head counts, hidden sizes and models, v6e's flash tuning table) leg 1
# compiles. The per-chip VMEM-default check runs
# for both chips on both legs. The sharded programs and the MoE composition (test_moe) are
# leg 1's only (they were 790 s of leg 2): how the kernels compose under shard_map and
# routing is then not re-checked on the second stack by default; pass a -k of your own to
# run them there. A -k of yours replaces this selection on leg 2 (pytest keeps the last -k).
# One compile set moves the other way: v5e's flash tuning-table programs (18 backward
# programs, ~690 s of leg 1a's critical path on 2026-12-03) compile on leg 2 only, with
# libtpu 0.0.52, the compiler TorchTPU runs them with; leg 1 compiles v6e's table.
# v7's compiles (tests/jax/test_v7_aot.py) run on leg 2, with libtpu 0.0.52, the newer
# compiler for the newest chip (0.0.42.1 compiles them too: 22 passed on 2026-12-06).
# Likewise v5e's gated-delta-rule training programs (the chunked backward at T = 4096, plain
# and packed: ~60 s of leg 1a alone, ~90 s under CI's load on 2026-12-07) compile on leg 2,
# and so does the head-parallel flash program on a v6e 2x2 mesh (100 s of 1a, ~50 s with
# libtpu 0.0.52), the one sharded test leg 2 runs.
# Long sweeps' extra columns are marked `thorough` and run under HYPOTHESIS_PROFILE=thorough
# only (tests/profiles.py; each AOT module's docstring says which columns CI compiles).
leg1_deselect=("tests/jax/test_flash_attention_aot.py::test_tuning_table_entries_compile[v5e]"
               "tests/jax/test_flash_attention_sharded.py::test_head_parallel_compiles_on_v6e_2x2"
               "tests/jax/test_gated_delta_rule_aot.py::test_model_shapes_compile[train_bwd-v5e]"
               "tests/jax/test_gated_delta_rule_aot.py::test_model_shapes_compile[train_bwd_packed-v5e]"
               "tests/jax/test_v7_aot.py")
leg2_skip=(  # -k takes one line: one clause per line here, joined below
  "aot and v5e and not default_scoped_vmem_limit and not (test_flash_attention_aot and tuning_table_entries) and not (test_gated_delta_rule_aot and train_bwd)"
  "test_flash_attention_aot and (tuning_table_entries and not v5e or default_shapes and not [128-v6e])"
  "test_paged_attention_aot and decode_defaults and not [32-8-128-v6e]"
  "test_aot_compile and model_shapes and not ([1000-v6e] or [4096-v6e] or [16384-v6e])"
  "test_ragged_dot_aot and model_shapes and not [qwen3-30b-a3b-v6e]"
  "test_flash_attention_sharded and not head_parallel_compiles_on_v6e_2x2 or test_ragged_dot_sharded or test_moe")
leg2_select=$(printf ' and not (%s)' "${leg2_skip[@]}"); leg2_select=${leg2_select# and }
leg2_profile=${HYPOTHESIS_PROFILE:-ci-second-stack}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
mkdir -p build-reports
start=$SECONDS

background() {  # background NAME CMD...: run CMD with its output in build-reports/test-NAME.log
  local name=$1; shift
  ( "$@" > "build-reports/test-$name.log" 2>&1
    rc=$?
    echo "== $name finished after $(( SECONDS - start )) s" >> "build-reports/test-$name.log"
    exit $rc ) &
}

after() {  # after PID CMD...: run CMD once process PID has ended
  local pid=$1; shift
  while kill -0 "$pid" 2>/dev/null; do sleep 5; done
  "$@"
}

echo "== leg 2 started in the background: Python 3.12, jax 0.12.1, libtpu 0.0.52 (tests/jax)"
echo "   then leg 3: Python 3.11, torch-tpu 0.2.0 (tests/torchtpu), and the exit check on .venv"
HYPOTHESIS_PROFILE=$leg2_profile background leg2 offline .venv-jax012/bin/python -m pytest \
  tests/jax -k "$leg2_select" --durations=15 \
  --junitxml=build-reports/junit-leg2.xml "$@"
leg2_pid=$!
# Leg 3 waits for leg 2 (the shortest of the long runs) so that three runs, not four, share
# the two cores (`after`: a background run cannot `wait` for its sibling, so it polls).
# It also takes the exit check (tests/torch/test_clean_exit.py, on .venv: 30 fresh
# interpreters, 778 s of leg 1b under load on 2026-12-04), which fits in the time leg 2
# leaves before 1a ends.
exit_check=tests/torch/test_clean_exit.py
leg3() {  # tests/torchtpu on the real wheel, then the exit check; fails if either fails
  offline .venv-torchtpu/bin/python -m pytest tests/torchtpu --durations=15 \
    --junitxml=build-reports/junit-leg3.xml "$@"
  local torchtpu=$?
  offline .venv/bin/python -m pytest "$exit_check" --durations=5 \
    --junitxml=build-reports/junit-leg3-exit.xml "$@"
  local exits=$?
  return $(( torchtpu != 0 || exits != 0 ))
}
background leg3 after "$leg2_pid" leg3 "$@"
leg3_pid=$!
leg1b_files=(tests/jax/test_aot_compile.py tests/jax/test_paged_attention_aot.py
             tests/torch tests/release)
echo "== leg 1b started in the background: Python 3.11, torch 2.13.0 (${leg1b_files[*]})"
background leg1b offline .venv/bin/python -m pytest "${leg1b_files[@]}" --ignore="$exit_check" \
  --durations=15 --junitxml=build-reports/junit-leg1b.xml "$@"
leg1b_pid=$!
trap 'kill $leg2_pid $leg1b_pid $leg3_pid 2>/dev/null' EXIT

echo "== leg 1a: Python 3.11, jax 0.10.2 (tests/jax but the modules 1b runs)"
offline .venv/bin/python -m pytest tests/jax "${leg1b_files[@]/#/--ignore=}" \
  "${leg1_deselect[@]/#/--deselect=}" --durations=15 \
  --junitxml=build-reports/junit-leg1a.xml "$@"
leg1a=$?
echo "== leg 1a finished after $(( SECONDS - start )) s; waiting for 1b and leg 2"
wait $leg1b_pid
leg1b=$?
wait $leg2_pid
leg2=$?
wait $leg3_pid
leg3=$?
trap - EXIT
echo "== leg 1b: Python 3.11, torch 2.13.0 (${leg1b_files[*]}), its output:"
cat build-reports/test-leg1b.log
echo "== leg 2: Python 3.12, jax 0.12.1, libtpu 0.0.52 (tests/jax), its output:"
cat build-reports/test-leg2.log
echo "== leg 3: Python 3.11, torch-tpu 0.2.0 (tests/torchtpu), then $exit_check, its output:"
cat build-reports/test-leg3.log
echo "== runs: 1a=$leg1a 1b=$leg1b leg2=$leg2 leg3=$leg3 (0 = passed); all done after $(( SECONDS - start )) s"
exit $(( leg1a != 0 || leg1b != 0 || leg2 != 0 || leg3 != 0 ))
