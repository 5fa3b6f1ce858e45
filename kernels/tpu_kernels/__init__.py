"""Pallas TPU kernels of the collection: pure JAX, no torch.

One module per kernel (``rms_norm``), plus the pieces every kernel shares:
``chips`` (the TPU generations), ``vmem`` (budgets and tile arithmetic) and
``aot`` (ahead-of-time compiles for a chip without a TPU), and ``tuning_tables``
(the reader of the autotuned tables, ``tuned/<kernel>.<chip>.json``). The build vendors
this package into every Hub kernel repo, so modules import each other relatively.
"""
