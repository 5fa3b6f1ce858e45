"""The tables benchmarks/wallclock.py prints from its rows: the kernels against their XLA
baselines, and the end-to-end decode rows (time on a device, or in smoke mode on CPU: then
not a performance number)."""

from __future__ import annotations


def _fmt(x, spec):
  return "" if x is None else format(x, spec)


def markdown(rows: list[dict], kernel_experts: str) -> str:
  """Kernel rows and end-to-end rows as two markdown tables (`kernel_experts`: the experts
  implementation name of the kernel's end-to-end row, whose tokens the others match)."""
  lines = []
  kernel_rows = [r for r in rows if "experts" not in r]
  if kernel_rows:
    lines += ["| case | impl | run shape | median µs | min µs | TFLOP/s | GB/s | of roofline "
              "| check |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in kernel_rows:
      check = r.get("check")
      verdict = "" if check is None else (
          "n/a" if check["passed"] is None else
          f"{'ok' if check['passed'] else 'FAIL'} (max err {check.get('max_abs_err', 0):.2g})")
      if r["error"]:
        lines.append(f"| {r['case']} | {r['implementation']} | {r['shape']} | failed: "
                     f"{r['error']} ||||| {verdict} |")
        continue
      lines.append(
          f"| {r['case']} | {r['implementation']} | {r['shape']} | {r['median_us']:,.1f} "
          f"| {r['min_us']:,.1f} | {r['tflops_per_s']:.3g} | {r['gb_per_s']:.3g} "
          f"| {_fmt(r.get('roofline_fraction'), '.2f')} | {verdict} |")
  e2e_rows = [r for r in rows if "experts" in r]
  if e2e_rows:
    if lines:
      lines.append("")
    lines += ["| model | experts | shape | median s | tokens/s | decode tokens/s | "
              "same tokens as kernel |", "|---|---|---|---:|---:|---:|---|"]
    match = e2e_rows[0].get("tokens_match", {})
    for r in e2e_rows:
      if r["error"]:
        lines.append(f"| {r['case']} | {r['implementation']} | failed: {r['error']} |||||")
        continue
      same = "(kernel)" if r["experts"] == kernel_experts else str(match.get(r["experts"]))
      lines.append(f"| {r['case']} | {r['implementation']} | {r['shape']} "
                   f"| {r['median_us'] * 1e-6:.3f} | {r['tokens_per_s']:.1f} "
                   f"| {_fmt(r['decode_tokens_per_s'], '.1f')} | {same} |")
  return "\n".join(lines) + "\n"
