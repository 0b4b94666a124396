"""What the GPU's clocks, power and temperature did during a run: a summary of `nvidia-smi`
samples taken beside it (`h200_rollout.sh` starts the sampler around its rollouts and profiles).

Why: the decode kernels are bound by instruction issue and latency, not bytes (Nsight Compute,
sessions 23 and 34), so their time follows the SM clock. The 4-layer decode step's kernels run
in bursts of a few seconds; the 48-layer rollout keeps the GPU busy for ~40 s. In session 41 the
4-layer step's 3.5% kernel cut of session 40 did not show in the 48-layer rollout (window share
0.459 against 0.458-0.467 before), and its steps were ~7% longer than the 4-layer kernels
predict. Whether the clock drops under the long load is what this records.

  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
utilization.gpu,clocks_event_reasons.active --format=csv,noheader,nounits -lms 250 > s.csv &
  python3 benchmarks/gpu_clocks.py s.csv --json s.json
  python3 benchmarks/gpu_clocks.py a.csv b.csv --plot clocks.png   # SM clock and power in time
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
          "utilization.gpu", "clocks_event_reasons.active")

# NVML's clock event (throttle) reason bits, as `clocks_event_reasons.active` prints them
REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap",
    0x8: "hw_slowdown", 0x10: "sync_boost", 0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def reason_names(mask: int) -> list[str]:
  """The names of the reason bits set in `mask` (unknown bits as hex)."""
  names = [name for bit, name in REASONS.items() if mask & bit]
  rest = mask & ~sum(REASONS)
  return names + ([hex(rest)] if rest else [])


def parse(lines) -> list[dict]:
  """Samples from `nvidia-smi --format=csv,noheader,nounits` lines of `FIELDS`; lines that are
  not samples (a header, an error, "[N/A]" values) are skipped."""
  samples = []
  for line in lines:
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
      continue
    try:
      samples.append(dict(
          time=parts[0], sm_mhz=float(parts[1]), mem_mhz=float(parts[2]),
          power_w=float(parts[3]), temp_c=float(parts[4]), util=float(parts[5]),
          reasons=int(parts[6], 16)))
    except ValueError:
      continue
  return samples


def summarize(samples: list[dict], busy_util: float = 50.0) -> dict:
  """Clock, power and temperature figures over the samples in which the GPU was busy
  (utilization >= busy_util; idle samples, the compile and host phases, would pull the figures
  toward the idle clock), and how often each reason was active there."""
  busy = [s for s in samples if s["util"] >= busy_util]
  out = dict(samples=len(samples), busy_samples=len(busy))
  if not busy:
    return out
  for key in ("sm_mhz", "mem_mhz", "power_w", "temp_c"):
    v = [s[key] for s in busy]
    out[key] = dict(min=min(v), median=statistics.median(v), max=max(v))
  seen: dict[str, int] = {}
  for s in busy:
    for name in reason_names(s["reasons"]):
      seen[name] = seen.get(name, 0) + 1
  out["reason_share"] = {k: round(v / len(busy), 4) for k, v in sorted(seen.items())}
  return out


def seconds(samples: list[dict]) -> list[float]:
  """Each sample's time in seconds after the first (`nvidia-smi`'s "YYYY/MM/DD HH:MM:SS.mmm")."""
  t = [datetime.datetime.strptime(s["time"], "%Y/%m/%d %H:%M:%S.%f") for s in samples]
  return [(x - t[0]).total_seconds() for x in t]


def plot(paths: list[str], out: str, busy_util: float = 50.0) -> str:
  """One panel a CSV: the SM clock and the board's power over time, samples in which the power
  cap held the clock (`sw_power_cap`) marked; PNG at `out`."""
  import matplotlib  # noqa: PLC0415 - plotting only
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, axes = plt.subplots(len(paths), 1, figsize=(10, 3.2 * len(paths)), squeeze=False)
  for ax, path in zip(axes[:, 0], paths):
    with open(path) as f:
      samples = parse(f)
    if not samples:
      raise ValueError(f"{path}: no nvidia-smi samples in it")
    t = seconds(samples)
    ax.plot(t, [s["sm_mhz"] for s in samples], color="tab:blue", lw=1, label="SM clock, MHz")
    capped = [(x, s["sm_mhz"]) for x, s in zip(t, samples)
              if s["util"] >= busy_util and "sw_power_cap" in reason_names(s["reasons"])]
    if capped:
      ax.scatter(*zip(*capped), s=6, color="tab:red", zorder=3,
                 label="busy, held by the power cap")
    busy = [s["sm_mhz"] for s in samples if s["util"] >= busy_util]
    if busy:  # the busy range in view (the idle clock at the start would flatten it)
      ax.set_ylim(min(busy) - 150, max(s["sm_mhz"] for s in samples) + 30)
    ax.set_ylabel("SM clock, MHz")
    ax.set_xlabel("s after the first sample")
    ax.set_title(os.path.basename(path), fontsize=9)
    right = ax.twinx()
    right.plot(t, [s["power_w"] for s in samples], color="tab:orange", lw=1, alpha=0.7,
               label="power, W")
    right.set_ylabel("power, W")
    lines = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="center left")
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("csv", nargs="+")
  ap.add_argument("--json", default="")
  ap.add_argument("--busy_util", type=float, default=50.0)
  ap.add_argument("--plot", default="", help="draw every CSV given into this PNG and exit")
  args = ap.parse_args(argv)
  if args.plot:
    print(plot(args.csv, args.plot, args.busy_util))
    return 0
  if len(args.csv) > 1:
    ap.error("one CSV a summary (several only with --plot)")
  args.csv = args.csv[0]
  with open(args.csv) as f:
    summary = summarize(parse(f), args.busy_util)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=1)
  line = f"{summary['busy_samples']} busy of {summary['samples']} samples"
  for key in ("sm_mhz", "power_w", "temp_c"):
    if key in summary:
      v = summary[key]
      line += f"; {key} {v['min']:g}/{v['median']:g}/{v['max']:g}"
  print(line + (f"; reasons {summary['reason_share']}" if summary.get("reason_share") else ""))
  return 0


if __name__ == "__main__":
  sys.exit(main())
