#!/usr/bin/env bash
# README command 2: the whole test suite, network cut, on both stacks.
#   leg 1: .venv (Python 3.11, jax 0.10.2, torch 2.13.0): every test
#   leg 2: .venv-jax012 (Python 3.12, jax 0.12.0.1, libtpu 0.0.50.1): the JAX-only tests (tests/jax)
# The legs run at the same time (most of each is one busy core; this machine has two):
# leg 2's output is kept in build-reports/test-leg2.log and printed when leg 1 is done.
# Each leg reports its 15 slowest tests, and every test's time in build-reports/junit-leg*.xml.
# Extra arguments go to both pytest runs. HYPOTHESIS_PROFILE=thorough for a deeper run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Leg 2 re-checks kernels leg 1 checks in full, so by default it draws fewer examples and
# runs the ahead-of-time compile matrices (tests/jax/*aot*) for v6e only: leg 1 compiles
# them for v5e and v6e with libtpu 0.0.42; leg 2 adds libtpu 0.0.50's verdict on the chip
# TorchTPU targets. The per-chip VMEM-default check runs for both chips on both legs.
leg2_profile=${HYPOTHESIS_PROFILE:-ci-second-stack}
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
mkdir -p build-reports
leg2_log=build-reports/test-leg2.log

echo "== leg 2 started in the background: Python 3.12, jax 0.12.0.1, libtpu 0.0.50.1 (JAX-only tests)"
start=$SECONDS
( export HYPOTHESIS_PROFILE=$leg2_profile
  offline .venv-jax012/bin/python -m pytest tests/jax \
    -k "not (aot and v5e and not default_scoped_vmem_limit)" --durations=15 \
    --junitxml=build-reports/junit-leg2.xml "$@" > "$leg2_log" 2>&1
  rc=$?
  echo "== leg 2 finished after $(( SECONDS - start )) s" >> "$leg2_log"
  exit $rc ) &
leg2_pid=$!
trap 'kill $leg2_pid 2>/dev/null' EXIT

echo "== leg 1: Python 3.11, jax 0.10.2, torch 2.13.0 (all tests)"
offline .venv/bin/python -m pytest tests --durations=15 --junitxml=build-reports/junit-leg1.xml "$@"
leg1=$?
echo "== leg 1 finished after $(( SECONDS - start )) s; waiting for leg 2"
wait $leg2_pid
leg2=$?
trap - EXIT
echo "== leg 2: Python 3.12, jax 0.12.0.1, libtpu 0.0.50.1 (JAX-only tests), its output:"
cat "$leg2_log"
echo "== legs: main=$leg1 jax012=$leg2"
exit $(( leg1 != 0 || leg2 != 0 ))
