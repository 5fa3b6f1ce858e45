#!/usr/bin/env bash
# README command 2: the whole test suite, network cut, on both stacks.
#   leg 1: .venv (Python 3.11, jax 0.10.2, torch 2.13.0): every test
#   leg 2: .venv-jax012 (Python 3.12, jax 0.12.0.1, libtpu 0.0.50.1): the JAX-only tests (tests/jax)
# Extra arguments go to both pytest runs. HYPOTHESIS_PROFILE=thorough for a deeper run.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}

echo "== leg 1: Python 3.11, jax 0.10.2, torch 2.13.0 (all tests)"
offline .venv/bin/python -m pytest tests "$@"
leg1=$?
echo "== leg 2: Python 3.12, jax 0.12.0.1, libtpu 0.0.50.1 (JAX-only tests)"
offline .venv-jax012/bin/python -m pytest tests/jax "$@"
leg2=$?
echo "== legs: main=$leg1 jax012=$leg2"
exit $(( leg1 != 0 || leg2 != 0 ))
