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

# Set to 1 to compile every program of the default-shape matrices, not one per kernel
# (`largest_per_kernel`): the deeper run, about twice the compiles.
FULL_MATRIX = os.environ.get("TPU_KERNELS_AOT_FULL_MATRIX") == "1"


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


@contextlib.contextmanager
def module_compiles(request, group_of, programs_of, compile_case, chip_of):
  """Every compile of the module's selected tests (after -k / -m), queued at once in test
  order, so both workers stay busy across tests instead of idling at the end of each
  test's few programs. `group_of(item)` names the programs a test item compiles (or None),
  `programs_of(group)` lists them, `chip_of(group)` gives their chip. A program two
  groups share (equal programs, same chip) is compiled once and its report read by both.
  Yields {group: [(program, future of compile_case(program, chip))]}."""
  groups = [g for item in request.session.items
            if getattr(item, "module", None) is request.module and (g := group_of(item))]
  with compile_pool() as executor:
    submitted = {}

    def compile_once(program, chip):
      if (program, chip) not in submitted:
        submitted[program, chip] = executor.submit(compile_case, program, chip)
      return submitted[program, chip]

    futures = {g: [(p, compile_once(p, chip_of(g))) for p in programs_of(g)]
               for g in dict.fromkeys(groups)}
    try:
      yield futures
    finally:
      for pending in futures.values():   # a failed test leaves its compiles unread
        for _, future in pending:
          future.cancel()


def largest_per_kernel(programs, kernel_of, size_of):
  """The programs of a default-shape matrix worth compiling: for each distinct kernel
  (`kernel_of(program)`: its blocks, VMEM limit and whatever else shapes the Mosaic body),
  the one program with the largest `size_of(program)` (its sequence length, or the words of
  its SMEM tables), in the matrix's order. Why this covers the rest: programs that share a
  kernel differ only in grid extent and in the size of the scalar tables in SMEM, and the
  largest of them has the largest tables (VMEM does not depend on the grid). Every
  program, with TPU_KERNELS_AOT_FULL_MATRIX=1."""
  if FULL_MATRIX:
    return list(programs)
  largest = {}
  for program in programs:
    kernel = kernel_of(program)
    if kernel not in largest or size_of(program) > size_of(largest[kernel]):
      largest[kernel] = program
  chosen = set(largest.values())
  return [p for p in programs if p in chosen]


def check_compiled(pending, chip: str, check, record_property) -> None:
  """Waits for each (program, future of its CompileReport), records the program's VMEM
  plan as a test property, and runs `check(program, report, chip)` on all of them; then
  fails once, listing every failing case (a matrix is surveyed whole, not to its first
  failure)."""
  assert pending, "no programs to compile"
  failures = []
  for program, future in pending:
    report = future.result()
    record_property(f"{program.label} {chip}", program.plan(chip))
    try:
      check(program, report, chip)
    except AssertionError as e:
      failures.append(str(e))
  assert not failures, "\n".join(failures)
