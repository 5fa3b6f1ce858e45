"""Compiles programs exported by TorchTPU's `jax_op` ahead of time with libtpu, as TorchTPU
would hand them to the TPU runtime. Runs on .venv-jax012 (jax 0.12.1 and libtpu 0.0.52, the
newest libtpu torch-tpu 0.2.0 accepts); no TPU needed.

    python scripts/compile_exported.py PROGRAM.<chip>.jaxexport ...

Each file holds `jax.export.Exported.serialize()` of one program (tests/torchtpu writes
them from the real wheel's export). Prints one JSON line per file: the chip, the
program's platforms, the scoped-VMEM limit each Mosaic kernel asks for, and libtpu's
verdict (tpu_kernels.aot.CompileReport).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import jax  # noqa: E402
from jax import export  # noqa: E402

from tpu_kernels import aot  # noqa: E402


def compile_exported(path: Path) -> dict:
  chip = path.name.split(".")[-2]
  exported = export.deserialize(bytearray(path.read_bytes()))
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in exported.in_avals]
  report = aot.compile_for_chip(exported.call, specs, chip)
  return dict(file=path.name, chip=chip, platforms=list(exported.platforms),
              asked_vmem_bytes=aot.scoped_vmem_asked(exported.mlir_module()),
              report=dataclasses.asdict(report))


if __name__ == "__main__":
  for name in sys.argv[1:]:
    print(json.dumps(compile_exported(Path(name))), flush=True)
