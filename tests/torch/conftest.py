"""Torch-level fixtures (tests/kernel_repos.py): the kernel repos built fresh and loaded with
the real `kernels` loader, as a user gets them."""

from kernel_repos import *  # noqa: F401,F403  (pytest finds fixtures by name)
from kernel_repos import _custom_ops, _get_kernel  # noqa: F401
