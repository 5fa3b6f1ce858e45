# Sourced by setup.sh and test.sh: the environment every command of this project runs in.

# No TPU here: keep JAX on the CPU and TorchTPU from auto-loading (both may otherwise try to
# reach a cloud metadata server). Two libtpu loads in one run must not fight over its lock file.
export JAX_PLATFORMS=cpu
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1
# libtpu otherwise writes its own log files into /tmp/tpu_logs on every load (gigabytes over a
# test run, never cleaned up); its messages still reach stderr.
export TPU_LOG_DIR=disabled

find_python() {  # find_python 3.11 -> path of a python3.11 that runs
  local version=$1 candidate
  for candidate in "python$version" "$(command -v pyenv >/dev/null && pyenv root)/versions/$version"*/bin/"python$version"; do
    if "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.')))" 2>/dev/null; then
      command -v "$candidate" || echo "$candidate"
      return
    fi
  done
  echo "no Python $version found (install it, e.g. with pyenv)" >&2
  return 1
}

offline() {  # offline CMD...: run CMD with no network if this user may cut it, else as is
  if unshare -n true 2>/dev/null; then
    unshare -n "$@"
  else
    echo "(unshare -n not permitted for this user: running with JAX_PLATFORMS=cpu only)" >&2
    "$@"
  fi
}

without_libtpu_noise() {  # run CMD, dropping libtpu's start-up warnings about the absent TPU
  "$@" 2> >(grep -v -E "TPU accelerator type|TPU worker hostnames|Logging before InitGoogle|Source Location Trace|libtpu_init_utils|^=== " >&2)
}
