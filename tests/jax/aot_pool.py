"""The worker pool the ahead-of-time compile tests share.

libtpu's compile is single-threaded, so the AOT tests queue their compiles on spawned
worker processes (at most two: this machine and CI have two cores). Each worker loads its
own libtpu (ALLOW_MULTIPLE_LIBTPU_LOAD=1 is set by tests/conftest.py and inherited, as
are JAX_PLATFORMS=cpu and sys.path).
"""

import concurrent.futures
import contextlib
import multiprocessing
import os


@contextlib.contextmanager
def compile_pool():
  """A ProcessPoolExecutor of spawned workers; pending compiles are cancelled on exit."""
  workers = max(1, min(2, os.cpu_count() or 1))
  with concurrent.futures.ProcessPoolExecutor(
      workers, mp_context=multiprocessing.get_context("spawn")) as executor:
    try:
      yield executor
    finally:
      executor.shutdown(wait=True, cancel_futures=True)
