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
"""

from __future__ import annotations

import argparse
import json
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("csv")
  ap.add_argument("--json", default="")
  ap.add_argument("--busy_util", type=float, default=50.0)
  args = ap.parse_args(argv)
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
