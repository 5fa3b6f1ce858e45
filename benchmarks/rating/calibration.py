"""Calibration, the library: tokamax's timed autotuning caches read (`Entry`,
`read_entries`), each plain forward entry rated by this estimator (`rate`: its kernel from
calibration_specs.py at the entry's shape and config), the measured / predicted ratios
summed up per family and chip (`summary`), and the "expected on hardware" factor
(`expected_factor`) that results/estimates.md applies to its static predictions
(reports/estimates.py). The method, family by family, and the command:
benchmarks/calibration.py's docstring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path

from benchmarks import RESULTS, ROOT, read_rows
from benchmarks.peers.tokamax_ops import TOKAMAX_ENVIRONMENTS
from benchmarks.rating import roofline
from benchmarks.rating.calibration_specs import (CalibrationAttention, CalibrationGmm,
                                                 compile_in_child)

TOKAMAX_VERSION, TOKAMAX_VENV = TOKAMAX_ENVIRONMENTS["0.12"]

# Our chip names -> tokamax's cache directories.
CHIP_DIRS = {"v5e": "tpu_v5_lite", "v6e": "tpu_v6_lite", "v5p": "tpu_v5", "v7": "tpu7x"}
FAMILY_FILES = {
    "flash_attention": "pallas_mosaic_tpu_flash_attention.json",
    "splash_attention": "splash_attention.json",
    "ragged_dot": "pallas_mosaic_tpu_ragged_dot.json",
    "ragged_dot_v2": "pallas_mosaic_tpu_v2_ragged_dot.json",
}
# Which calibration families stand for each kernel of estimate.py's table.
# (keys: each case's `kernel` (cases/), the row's "kernel" in estimates.jsonl). Splash
# is reported, not used: its cache records no config ("{}") and its entries run 8-9x slower
# than predicted at the op's heuristic config, 2.7-3.6% of v6e's peak where tokamax's flash
# op reaches 30-64% at similar shapes: the timed config is likely not the one rated.
KERNEL_FAMILIES = {"flash-attention-tpu": ("flash_attention",),
                   "ragged-dot-tpu": ("ragged_dot",)}
V2_NOT_RATED = ("tokamax's gmm v2 kernel picks its tiles at trace time from the group sizes "
                "(its configs are recorded as all-null) and loops over SMEM tile lists; no "
                "visible-SMEM substitution for it exists here yet")
DEFAULT_PER_FAMILY = {"flash_attention": 8, "splash_attention": 3, "ragged_dot": 4}


# ------------------------------------------------------------------------ the caches


def cache_dir() -> Path:
  """tokamax's autotuning data in its venv (.venv-tokamax-jax012)."""
  found = sorted((ROOT / TOKAMAX_VENV / "lib").glob("python3.*/site-packages/tokamax/data/"
                                                     "autotuning"))
  if not found:
    raise RuntimeError(f"tokamax {TOKAMAX_VERSION} is not installed in {TOKAMAX_VENV} "
                       "(scripts/setup.sh makes it)")
  return found[0]


_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]$")


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
  """"bf16[32,512,32,64]" -> ("bf16", (32, 512, 32, 64))."""
  m = _SHAPE.match(text)
  if not m:
    raise ValueError(f"not a tokamax shape string: {text!r}")
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One timed (arguments, config) of a tokamax cache file."""

  family: str
  chip: str
  key: str          # the cache's JSON key (the op's arguments)
  config: str       # the cache's JSON config ("{}": the op's own choice)
  times_ms: tuple[float, ...]

  @property
  def args(self) -> dict:
    return json.loads(self.key)

  @property
  def cfg(self) -> dict:
    return json.loads(self.config)

  @property
  def measured_us(self) -> float:
    return statistics.median(self.times_ms) * 1e3

  @property
  def name(self) -> str:
    a = self.args
    if self.family.startswith("ragged_dot"):
      groups = a["group_sizes"]
      g = groups["num_groups"] if isinstance(groups, dict) else len(groups)
      return f"{a['lhs']} x {a['rhs']} G={g}" + (" +res" if a.get("return_residuals") else "")
    mask = a["mask"]
    causal = bool(mask.get("causal_mask") or mask.get("is_causal"))
    return (f"q {a['q']} k {a['k']} v {a['v']} {'causal' if causal else 'full'}"
            + (" +res" if a.get("return_residuals") else ""))


def read_entries(chip: str, family: str, directory: Path | None = None) -> list[Entry]:
  """Every timed (key, config) of `family` on `chip`, sorted by key (deterministic)."""
  path = (directory or cache_dir()) / CHIP_DIRS[chip] / FAMILY_FILES[family]
  if not path.exists():
    return []
  data = json.loads(path.read_text())
  out = [Entry(family, chip, key, config, tuple(result["evaluation_times_ms"]))
         for key, configs in data.items() for config, result in configs.items()
         if result.get("evaluation_times_ms")]
  return sorted(out, key=lambda e: (e.key, e.config))


def subset(entries: list[Entry], n: int) -> list[Entry]:
  """n entries spread evenly over the sorted list (all of them if n >= len)."""
  if n >= len(entries):
    return list(entries)
  return [entries[round(i * (len(entries) - 1) / (n - 1))] if n > 1 else entries[0]
          for i in range(n)]


def model_flops(entry: Entry) -> int | None:
  """The entry's useful flops (2 per multiply-add): attention's QK^T and PV over the visible
  (causal: on-or-below-diagonal) pairs, or the ragged dot's m x k x n; None if not plain."""
  a = entry.args
  try:
    if entry.family.startswith("ragged_dot"):
      (_, (m, k)), (_, (_, _, n)) = parse_shape(a["lhs"]), parse_shape(a["rhs"])
      return 2 * m * k * n
    if entry.family == "flash_attention":
      _, (*batch, tq, hq, d) = parse_shape(a["q"])
      _, (*_, tk, _, dv) = parse_shape(a["v"])
      causal = bool(a["mask"].get("causal_mask"))
    else:
      _, (hq, tq, d) = parse_shape(a["q"])
      _, (_, tk, dv) = parse_shape(a["v"])
      batch, causal = [], bool(a["mask"].get("is_causal"))
  except (TypeError, ValueError):   # quantized operands: not plain shape strings
    return None
  visible = tq * (tq + 1) // 2 if causal else tq * tk
  return 2 * math.prod(batch) * hq * visible * (d + dv)


def peak_fraction(entry: Entry) -> float | None:
  """Measured fraction of the chip's bf16 peak (chips.py): model_flops / measured time / peak."""
  from tpu_kernels import chips
  flops = model_flops(entry)
  if flops is None:
    return None
  return flops / (entry.measured_us * 1e-6) / chips.get_chip(entry.chip).bf16_flops_per_s


def measured_ceilings(chips_: tuple[str, ...] = ("v5e", "v6e", "v5p", "v7")) -> list[dict]:
  """Per chip x attention family x head_dim x mask: the best and worst measured fraction of
  the bf16 peak over every plain bf16 timed entry (no estimator: tokamax's times alone)."""
  groups: dict[tuple, list[tuple[float, str]]] = {}
  for chip in chips_:
    for family in ("flash_attention", "splash_attention"):
      for e in read_entries(chip, family):
        if why_not_rated(e) is not None:
          continue
        a = e.args
        d = parse_shape(a["q"])[1][-1]
        causal = bool(a["mask"].get("causal_mask") or a["mask"].get("is_causal"))
        groups.setdefault((chip, family, d, causal), []).append((peak_fraction(e), e.name))
  out = []
  for (chip, family, d, causal), values in groups.items():
    best, worst = max(values), min(values)
    out.append(dict(chip=chip, family=family, head_dim=d, causal=causal, entries=len(values),
                    best=best[0], best_entry=best[1], worst=worst[0]))
  return out


# ------------------------------------------------------------------------ entry -> spec


def why_not_rated(entry: Entry) -> str | None:
  """None if the entry is the plain forward kernel rated here, else why it is not."""
  a = entry.args
  if entry.family == "ragged_dot_v2":
    return V2_NOT_RATED
  if entry.family == "ragged_dot":
    dims = a["ragged_dot_dimension_numbers"]
    if dims != {"dot_dimension_numbers": [[[1], [1]], [[], []]], "lhs_ragged_dimensions": [0],
                "rhs_group_dimensions": [0]}:
      return "not the forward layout (a backward-pass ragged dot)"
    if not all(isinstance(a[x], str) and parse_shape(a[x])[0] == "bf16" for x in ("lhs", "rhs")):
      return "operands not plain bf16 (quantized)"
    if a.get("return_residuals"):
      return "return_residuals keys time more than the forward product (1.4x the same shape)"
    if a.get("activation") or a.get("fuse_gateup_activation") or a.get("group_offset"):
      return "fused activation / group offset"
    return None
  if not all(isinstance(a[x], str) and parse_shape(a[x])[0] == "bf16" for x in ("q", "k", "v")):
    return "operands not plain bf16"
  if a.get("bias") or a.get("dropout_rate") or a.get("segment_ids") or a.get("sinks") \
      or a.get("logits_soft_cap") or a.get("attn_logits_soft_cap") or a.get("paging_info") \
      or a.get("q_indices") or a.get("k_indices"):
    return "bias / dropout / segments / sinks / soft-cap / paging: not the plain kernel"
  mask = a["mask"]
  if mask.get("bool_mask") or mask.get("q_start") or mask.get("q_end") or mask.get("k_start") \
      or mask.get("k_end"):
    return "a boolean or ranged mask"
  causal = mask.get("causal_mask")
  if causal and (causal.get("offset") or causal.get("window_size")):
    return "offset / windowed causal mask"
  if entry.family == "flash_attention" and not a.get("normalize_output", True):
    return "unnormalized output"
  return None


def spec_for(entry: Entry):
  a = entry.args
  if entry.family == "ragged_dot":
    _, (m, k) = parse_shape(a["lhs"])
    _, (groups, k2, n) = parse_shape(a["rhs"])
    assert k == k2, (k, k2)
    sizes = a["group_sizes"]
    sizes = tuple(group_sizes_of(sizes["total_size"], sizes["num_groups"])
                  if isinstance(sizes, dict) else sizes)
    c = entry.cfg
    return CalibrationGmm(m=m, part="calibration", tiling_name="tokamax cache",
                          groups=groups, k_dim=k, n_dim=n, group_sizes=sizes,
                          tile=(c["tile_m"], c["tile_k"], c["tile_n"]),
                          input_buffers=c["input_buffer_count"])
  if entry.family == "flash_attention":   # [*B, T, H, D]
    _, (*batch, tq, hq, d) = parse_shape(a["q"])
    _, (*_, tk, hk, _) = parse_shape(a["k"])
    _, (*_, _, _, dv) = parse_shape(a["v"])
    config = entry.cfg
    glue = True
    causal = bool(a["mask"].get("causal_mask"))
  else:                                  # splash: [H, T, D]
    _, (hq, tq, d) = parse_shape(a["q"])
    _, (hk, tk, _) = parse_shape(a["k"])
    _, (_, _, dv) = parse_shape(a["v"])
    batch = []
    config = splash_heuristic_config(tq, tk)
    glue = False
    causal = bool(a["mask"].get("is_causal"))
  return CalibrationAttention(
      batch=math.prod(batch), q_heads=hq, kv_heads=hk, seq_q=tq, seq_kv=tk, head_dim=d,
      head_dim_v=dv, causal=causal, residuals=bool(a.get("return_residuals")),
      config=tuple(sorted(config.items())), glue=glue)


def splash_heuristic_config(seq_q: int, seq_kv: int) -> dict:
  """tokamax 0.0.17 experimental splash op's `_get_heuristics_config` (what "{}" means in its
  cache), restated so the parent needs no tokamax; the child checks it against tokamax's."""
  bq = 1024 if seq_q >= 1024 and seq_q % 1024 == 0 else 128
  bkv, bkvc = (1024, 512) if seq_kv >= 1024 and seq_kv % 1024 == 0 else (128, 128)
  return dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, q_layout=1, k_layout=1,
              v_layout=1, use_experimental_scheduler=True)


def group_sizes_of(total: int, groups: int) -> list[int]:
  """tokamax's representative group sizes for {num_groups, total_size}: its
  base.generate_group_sizes (uniform multinomial draw, seed 0)."""
  import numpy as np
  rng = np.random.default_rng(0)
  ids = rng.choice(groups, (total,), p=None, replace=True)
  return [int(x) for x in np.bincount(ids, minlength=groups)]


# ------------------------------------------------------------------------ rating


def rate(entry: Entry) -> dict:
  """One row: the entry, its measured time, our prediction and the ratio (or why not)."""
  from tpu_kernels import chips
  start = time.time()
  row = dict(family=entry.family, chip=entry.chip, entry=entry.name, config=entry.cfg,
             measured_us=entry.measured_us, times_ms=list(entry.times_ms),
             measured_peak_fraction=peak_fraction(entry), tokamax=TOKAMAX_VERSION)
  reason = why_not_rated(entry)
  if reason:
    return dict(row, rated=False, error=f"not rated: {reason}")
  try:
    spec = spec_for(entry)
    spec.validate()
    c = chips.get_chip(entry.chip)
    hbm, glue = spec.hbm_bytes(), spec.glue_bytes()
    results = {json.dumps(t): compile_in_child(spec, entry.chip, t) for t in spec.truncations}
    if any(r["cycles"] == 0 for r in results.values()):
      raise RuntimeError("the estimator rated the kernel 0 cycles")
    cycles = spec.extrapolate({t: r["cycles"] for t, r in results.items()})
  except Exception as e:  # noqa: BLE001  (a failed rating is a row)
    msg = str(e).strip().splitlines()
    return dict(row, rated=False, error=f"{type(e).__name__}: {msg[0][:300] if msg else ''}",
                rate_seconds=round(time.time() - start, 1))
  row.update(rated=True, error=None, method=spec.method, note=spec.note,
             estimated_cycles=int(round(cycles)), hbm_bytes=hbm, glue_bytes=glue,
             truncated=[dict(trunc=json.loads(t), **r) for t, r in results.items()])
  row.update(predicted(row, c))
  row["rate_seconds"] = round(time.time() - start, 1)
  return row


def predicted(row: dict, chip) -> dict:
  """compute / HBM / glue / predicted microseconds and the measured / predicted ratio."""
  compute_us = roofline.compute_us(row["estimated_cycles"], chip)
  hbm_us = roofline.hbm_us(row["hbm_bytes"], chip)
  glue_us = roofline.hbm_us(row.get("glue_bytes", 0), chip)
  predicted_us = max(compute_us, hbm_us) + glue_us
  return dict(compute_us=compute_us, hbm_us=hbm_us, glue_us=glue_us, predicted_us=predicted_us,
              ratio=row["measured_us"] / predicted_us,
              kernel_only_ratio=row["measured_us"] / max(compute_us, hbm_us))


# ------------------------------------------------------------------------ summaries


def summary(rows: list[dict]) -> list[dict]:
  """Per (family, chip): count, median ratio, spread (min, max, and the 25-75% range)."""
  out = []
  for family, chip in dict.fromkeys((r["family"], r["chip"]) for r in rows):
    ratios = sorted(r["ratio"] for r in rows if r["family"] == family and r["chip"] == chip
                    and r.get("rated"))
    listed = sum(1 for r in rows if r["family"] == family and r["chip"] == chip)
    s = dict(family=family, chip=chip, rated=len(ratios), listed=listed)
    if ratios:
      q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
      s.update(median=statistics.median(ratios), min=ratios[0], max=ratios[-1],
               q25=q[0], q75=q[2],
               kernel_only_median=statistics.median(
                   r.get("kernel_only_ratio", r["ratio"]) for r in rows
                   if r["family"] == family and r["chip"] == chip and r.get("rated")))
    out.append(s)
  return out


def expected_factor(chip: str, kernel: str, path: Path | None = None) -> tuple[float, str] | None:
  """The "expected on hardware" factor for estimate.py's rows of `kernel` on `chip`: the median
  measured / predicted ratio of the calibration families that stand for that kernel
  (KERNEL_FAMILIES), read from calibration.jsonl. Returns
  (factor, what it rests on), or None where no tokamax timing calibrates that kernel / chip."""
  path = path or RESULTS / "calibration.jsonl"
  if kernel not in KERNEL_FAMILIES or not Path(path).exists():
    return None
  rows = [r for r in read_rows(path) if r.get("rated") and r["chip"] == chip
          and r["family"] in KERNEL_FAMILIES[kernel]]
  if not rows:
    return None
  factor = statistics.median(r["ratio"] for r in rows)
  families = "+".join(dict.fromkeys(r["family"] for r in rows))
  return factor, f"median of {len(rows)} {families} entries on {chip}"


MAX_DEFAULT_STEPS = 10   # per head: the estimator's time and memory grow with grid steps
                         # (a 36-step head of 2048^2 blocks took over 600 s at 4 heads, 8 GB)


def cheap(entry: Entry) -> bool:
  """In the default subset: attention whose rated grid has at most MAX_DEFAULT_STEPS steps
  a head (every ragged dot: rated at 4 and 8 visits)."""
  if entry.family.startswith("ragged_dot"):
    return True
  spec = spec_for(entry)
  return spec.rows * (spec.nk if not spec.causal else (spec.nq + 1) / 2) <= MAX_DEFAULT_STEPS


def chosen_entries(chips: list[str], families: list[str], thorough: bool) -> list[Entry]:
  out = []
  for chip in chips:
    for family in families:
      entries = read_entries(chip, family)
      if thorough or family == "ragged_dot_v2":
        out += entries
        continue
      ratable = [e for e in entries if why_not_rated(e) is None and cheap(e)]
      out += subset(ratable, DEFAULT_PER_FAMILY.get(family, 4))
  return out
