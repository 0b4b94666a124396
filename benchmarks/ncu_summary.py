"""What bounds a kernel, from Nsight Compute's CSV exports (stage `s23b` of `h200_rollout.sh`
writes them: `ncu -i R.ncu-rep --page raw --csv`, `--page source --csv --print-source sass`).

  python benchmarks/ncu_summary.py RUN_raw.csv [RUN_sass.csv] [--top 8] [--json out.json]

Prints the kernel's duration and DRAM throughput, how busy the issue slots and each pipe were,
the warp stall reasons per issued instruction (largest first) and, from the SASS page, the
instructions holding the most stall samples with their main reason: where the time goes inside
the kernel, which A/B timings alone do not say.
"""

from __future__ import annotations

import argparse
import csv
import json
import re

_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio$")
_PIPE = re.compile(r"^sm__inst_executed_pipe_(\w+)\.avg\.pct_of_peak_sustained_active$")


def _number(text: str) -> float | None:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return None


def raw_summary(path: str) -> dict:
  """From a `--page raw --csv` export (header row, units row, one row per kernel: the first):
  duration (us), DRAM throughput (% of peak), issue slots busy (%), pipes (% of peak, active
  cycles), stall reasons (warps stalled per issued instruction)."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  if len(rows) < 3:
    raise ValueError(f"{path}: no kernel row (ncu profiled nothing?)")
  head, units, vals = rows[0], rows[1], rows[2]
  metric = {h: (_number(v), u) for h, u, v in zip(head, units, vals)}

  def get(name):
    v, _ = metric.get(name, (None, ""))
    return v

  dur, unit = metric.get("gpu__time_duration.sum", (None, ""))
  scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(unit, 1.0)
  pipes = {}
  for name, (v, _) in metric.items():
    m = _PIPE.match(name)
    if m and v is not None:
      pipes[m.group(1)] = v
  stalls = {}
  for name, (v, _) in metric.items():
    m = _STALL.match(name)
    if m and v:
      stalls[m.group(1)] = v
  return dict(
      kernel=next((v for h, v in zip(head, vals) if h == "Kernel Name"), ""),
      duration_us=None if dur is None else dur * scale,
      dram_pct=get("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
      issue_active_pct=get("smsp__issue_active.avg.pct_of_peak_sustained_active"),
      pipes_pct=dict(sorted(pipes.items(), key=lambda kv: -kv[1])),
      stalls_per_issue=dict(sorted(stalls.items(), key=lambda kv: -kv[1])))


def sass_hotspots(path: str, top: int = 8) -> dict:
  """From a `--page source --csv --print-source sass` export: total stall samples, and the `top`
  instructions by samples with their address, executions and largest stall reason."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  start = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
  head, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
  col = {h: i for i, h in enumerate(head)}
  samples = col["Warp Stall Sampling (All Samples)"]
  reasons = [h for h in head if h.startswith("stall_") and not h.endswith("(Not Issued)")]
  total = sum(_number(r[samples]) or 0.0 for r in data)
  hot = sorted(data, key=lambda r: -(_number(r[samples]) or 0.0))[:top]
  out = []
  for r in hot:
    by_reason = {h[len("stall_"):]: _number(r[col[h]]) or 0.0 for h in reasons}
    main = max(by_reason, key=by_reason.get) if by_reason else ""
    out.append(dict(address=r[col["Address"]], source=r[col["Source"]].strip(),
                    samples=_number(r[samples]) or 0.0,
                    executed=_number(r[col["Instructions Executed"]]) or 0.0,
                    main_reason=main))
  return dict(total_samples=total, hotspots=out)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("raw", help="the --page raw --csv export")
  ap.add_argument("sass", nargs="?", help="the --page source --csv --print-source sass export")
  ap.add_argument("--top", type=int, default=8, help="instructions listed from the SASS page")
  ap.add_argument("--json", default="", help="also write the summary here")
  args = ap.parse_args()
  s = raw_summary(args.raw)
  fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
  print(f"{s['kernel'][:60]}: {fmt(s['duration_us'])} us, DRAM {fmt(s['dram_pct'])}% of peak, "
        f"issue slots {fmt(s['issue_active_pct'])}% busy")
  print("  pipes (% of peak): " + ", ".join(f"{k} {v:.0f}" for k, v in s["pipes_pct"].items()
                                             if v >= 1))
  print("  stalls per issued instruction: " + ", ".join(
      f"{k} {v:.2f}" for k, v in s["stalls_per_issue"].items() if v >= 0.05))
  if args.sass:
    h = sass_hotspots(args.sass, args.top)
    s["sass"] = h
    print(f"  stall samples by instruction ({h['total_samples']:.0f} in all):")
    for r in h["hotspots"]:
      share = 100 * r["samples"] / max(h["total_samples"], 1)
      print(f"    {share:5.1f}%  {r['main_reason']:18s} x{r['executed']:<9.0f} {r['source'][:60]}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(s, f, indent=1)


if __name__ == "__main__":
  main()
