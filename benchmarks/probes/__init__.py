"""Probes: one-off evidence behind a sentence of the docs, not part of any results file.
Each prints its ratings (ROW lines and a table); tests run a small case of each.

    python benchmarks/probes/mxu.py          how much of the MXU one attention matmul gets
    python benchmarks/probes/row_gather.py   the experts layer's row gather as row DMAs
    .venv-tpu-inference/bin/python benchmarks/probes/fused_moe.py
                                             where the estimator gives up on fused_moe
"""
