"""Runs a test's ranks as torch.distributed processes on gloo (CPU) from inside the suite,
whose network is cut. Shared by test_multi_device.py (Transformers' TP / EP / FSDP plans)
and test_flash_attention_diffusers_tp.py (Diffusers' tensor-parallel plans).

How a test uses it: the test file is also the ranks' program. A module fixture calls
`run_ranks(__file__, work, payload, timeout_s)`; the file's `__main__` calls
`main(__file__, world, rank_main)`, which starts the ranks and runs
`rank_main(rank, work, payload)` in each (payload: a JSON-able dict, e.g. the kernels'
repo ids). Each rank calls `join(rank, world, work)` first.

The ranks run in a network namespace of their own with only loopback up: gloo needs TCP,
and `offline` runs the suite in a namespace whose loopback is down. They rendezvous through
a file:// init_method in the work directory, with GLOO_SOCKET_IFNAME=lo. One launch runs
every case of a test file, so the start-up (torch, JAX, the libraries) is paid once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path


def loopback(set_up: bool = False) -> bool:
  """Whether lo is up in this process's network namespace (ioctl SIOCGIFFLAGS: /sys shows
  the namespace sysfs was mounted in); with set_up, sets IFF_UP first if it is down (what
  `ip link set lo up` does; a fresh namespace's lo is down)."""
  import fcntl
  import socket
  import struct

  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    flags = struct.unpack("16sH", fcntl.ioctl(sock, 0x8913, struct.pack("16sH", b"lo", 0))[:18])[1]
    if set_up and not flags & 1:
      fcntl.ioctl(sock, 0x8914, struct.pack("16sH", b"lo", flags | 1))
      return loopback()
    return bool(flags & 1)


def loopback_only() -> list[str]:
  """Command prefix giving the ranks a network namespace of their own (the launcher sets
  its loopback up, the only interface it has); empty where namespaces are not permitted
  (then this namespace's loopback must be up)."""
  if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
    return ["unshare", "-n"]
  assert loopback(), ("gloo needs a loopback interface: lo is down and `unshare -n` is not "
                      "permitted to make a namespace with one")
  return []


def launch(script: str, world: int, args: list[str]) -> None:
  """Starts `world` ranks, `script rank <r> <args...>` (this process is already in their
  network namespace), and exits with the worst rank's exit code."""
  assert loopback(set_up=True), "could not set the loopback interface up"
  env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
  procs = [subprocess.Popen([sys.executable, script, "rank", str(rank), *args], env=env)
           for rank in range(world)]
  # A rank that fails leaves the others waiting in a collective: end them at once.
  while any(p.poll() is None for p in procs):
    if any(p.returncode for p in procs):
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.2)
  sys.exit(max(abs(p.returncode) for p in procs))


def run_ranks(script: str, work: Path, payload: dict, timeout_s: float) -> None:
  """From the test process: runs `script launch <work> <payload>` in a namespace of its own
  and waits for its ranks; fails the test if any rank failed (its traceback is in the
  captured stderr) and kills the whole launch if it overruns `timeout_s`."""
  command = [*loopback_only(), sys.executable, script, "launch", str(work), json.dumps(payload)]
  proc = subprocess.Popen(command, start_new_session=True)
  try:
    code = proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, 9)
    raise
  assert code == 0, f"a rank failed (exit {code}): its traceback is in the captured stderr"


def join(rank: int, world: int, work: Path) -> None:
  """In a rank: one thread for torch (the ranks share the machine's cores), then the gloo
  group through the file:// rendezvous in `work`."""
  import torch
  import torch.distributed as dist

  torch.set_num_threads(1)
  dist.init_process_group("gloo", init_method=f"file://{Path(work) / 'rendezvous'}", rank=rank,
                          world_size=world, timeout=timedelta(minutes=5))


def main(script: str, world: int, rank_main) -> None:
  """The `__main__` of a test file that is its ranks' program: `launch <work> <payload>`
  starts `world` ranks; `rank <r> <work> <payload>` runs `rank_main(r, Path(work),
  json.loads(payload))`."""
  mode, *args = sys.argv[1:]
  if mode == "launch":
    launch(script, world, args)
  else:
    rank_main(int(args[0]), Path(args[1]), json.loads(args[2]))
