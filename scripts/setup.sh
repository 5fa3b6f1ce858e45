#!/usr/bin/env bash
# README command 1: set everything up from nothing, build every kernel repo, run the main job.
#
#   .venv/          Python 3.11, requirements.txt (jax 0.10.2, libtpu 0.0.42.1, torch 2.13.0 CPU, ...)
#   .venv-jax012/   Python 3.12, requirements-jax012.txt (jax 0.12.1, libtpu 0.0.52): the newest
#                   jax and the libtpu TorchTPU runs with; the JAX-only tests run there too (scripts/test.sh)
#   .venv-torchtpu/ Python 3.11, requirements-torchtpu.txt: the real TorchTPU 0.2.0 wheel (torch-tpu,
#                   cp311 only) on torch 2.13.0 CPU, jax 0.10.2, libtpu 0.0.52 and kernels 0.19.1; never autoloaded
#                   (TORCH_DEVICE_BACKEND_AUTOLOAD=0): tests/torchtpu runs there (scripts/test.sh)
#   .venv-tokamax/  Python 3.11, requirements-tokamax.txt (tokamax 0.0.12 on the main stack's jax and
#                   libtpu): only the tokamax peer's children run there (benchmarks/peers/)
#   .venv-tokamax-jax012/  Python 3.12, requirements-tokamax-jax012.txt (tokamax 0.0.17 on the
#                   TorchTPU stack): the same, for benchmarks/estimate.py run from .venv-jax012
#   .venv-tpu-inference/  Python 3.12, requirements-tpu-inference.txt (tpu-inference 0.32.0, vLLM's
#                   TPU kernels, on the jax 0.11.2 / libtpu 0.0.48 it pins), installed --no-deps:
#                   only the tpu-inference peer's children run there (benchmarks/peers/tpu_inference_ops/,
#                   from either stack)
#
# Only pip reaches the network (the package index): the installs, and the dry run that checks the
# README's TPU-VM install line (scripts/check_install_line.py). Everything after it runs with
# JAX_PLATFORMS=cpu and, where this user may, with the network cut (`unshare -n`).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

# Every venv: DIR PYTHON_VERSION LOCKFILE [NO_DEPS_PACKAGE] (see make_venv)
VENVS=".venv 3.11 requirements.txt
.venv-jax012 3.12 requirements-jax012.txt
.venv-torchtpu 3.11 requirements-torchtpu.txt
.venv-tokamax 3.11 requirements-tokamax.txt
.venv-tokamax-jax012 3.12 requirements-tokamax-jax012.txt
.venv-tpu-inference 3.12 requirements-tpu-inference.txt tpu-inference"

venv_stamp() {  # venv_stamp LOCKFILE PYTHON_VERSION -> what DIR/.installed holds once installed
  echo "$(sha256sum "$1" | cut -c1-16)-$2"
}

venv_is_current() {  # venv_is_current DIR PYTHON_VERSION LOCKFILE: installed from this lock
  [[ -f "$1/.installed" && "$(cat "$1/.installed")" == "$(venv_stamp "$3" "$2")" ]]
}

all_venvs_installed() {  # true when no make_venv call below has work to do
  local dir version lock
  while read -r dir version lock _; do
    venv_is_current "$dir" "$version" "$lock" || return 1
  done <<< "$VENVS"
}

make_venv() {  # make_venv DIR PYTHON_VERSION LOCKFILE [NO_DEPS_PACKAGE]
  # NO_DEPS_PACKAGE: install the lock with --no-deps (it pins everything that runs); pip check
  # then tolerates that one package's declared requirements that the lock leaves out.
  local dir=$1 version=$2 lock=$3 no_deps=${4:-} python problems
  if venv_is_current "$dir" "$version" "$lock"; then
    echo "== $dir is up to date ($lock)"
    return
  fi
  python=$(find_python "$version")
  echo "== creating $dir with $python from $lock"
  rm -rf "$dir"
  "$python" -m venv "$dir"
  # (grep drops pip's warnings about this machine's local index mirrors lacking a package)
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
    ${no_deps:+--no-deps} -r "$lock" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  if [[ -z $no_deps ]]; then
    "$dir/bin/python" -m pip check
  else
    problems=$("$dir/bin/python" -m pip check | grep -v -i "^$no_deps " || true)
    if [[ -n $problems ]]; then echo "$problems" >&2; return 1; fi
  fi
  venv_stamp "$lock" "$version" > "$dir/.installed"
}

# The six venvs take about 11 GB, and pip unpacks each wheel in a temporary directory first. A
# full disk otherwise shows up minutes in as pip's "[Errno 28] No space left on device" in
# whichever venv it reached (a CI run failed that way on 2026-12-04).
required_free_gb=14
free_gb=$(( $(df --output=avail -k . | tail -1) / 1024 / 1024 ))
if (( free_gb < required_free_gb )) && ! all_venvs_installed; then
  echo "setup needs about $required_free_gb GB free for the venvs; $(pwd) has $free_gb GB" >&2
  exit 1
fi

# The README's TPU-VM install line, resolved as a user's pip would (a dry run against the
# index, about 1-2 minutes of network waits): in the background while the venvs install.
mkdir -p build-reports
python3_11=$(find_python 3.11)
"$python3_11" scripts/check_install_line.py --python "$python3_11" \
  > build-reports/install-line.log 2>&1 &
install_line_check=$!

while read -r dir version lock no_deps <&3; do
  make_venv "$dir" "$version" "$lock" $no_deps
done 3<<< "$VENVS"

echo "== the README's TPU-VM install line against the index (scripts/check_install_line.py)"
if ! wait $install_line_check; then
  grep -v "is ignored: it is neither a file nor a directory" build-reports/install-line.log >&2
  exit 1
fi
grep -v "is ignored: it is neither a file nor a directory" build-reports/install-line.log

echo "== main job (builds every kernel repo into dist/, then runs them)"
without_libtpu_noise offline .venv/bin/python scripts/demo.py
