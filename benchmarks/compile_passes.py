"""Where XLA's compile time goes: sums XLA's scoped logging timers (each HLO pass, the GPU
compiler's phases) from a log made with

  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1 \
    python benchmarks/compile_time.py ... 2> log.txt
  python benchmarks/compile_passes.py log.txt --out passes.json

XLA prints `<label> time: <elapsed> (cumulative: ..., #called: N)` when a timer ends; labels
that name a module ("... for jit_generate_program") are folded into one label.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0,
          "hours": 3600.0}
_LINE = re.compile(r"\] (?P<label>.+?) time: (?P<num>[0-9.]+) ?(?P<unit>[a-z]+)")


def seconds(num: str, unit: str) -> float:
  if unit not in _UNITS:
    raise ValueError(f"unknown time unit {unit!r}")
  return float(num) * _UNITS[unit]


def fold(label: str) -> str:
  """One label per pass or phase, whatever module or instruction it ran on."""
  label = re.sub(r" for \S+.*$", "", label)
  return re.sub(r"\s+\(.*$", "", label).strip()


def aggregate(lines) -> dict[str, dict]:
  totals: dict[str, dict] = collections.defaultdict(lambda: {"seconds": 0.0, "calls": 0})
  for line in lines:
    m = _LINE.search(line)
    if not m:
      continue
    t = totals[fold(m.group("label"))]
    t["seconds"] += seconds(m.group("num"), m.group("unit"))
    t["calls"] += 1
  return dict(sorted(totals.items(), key=lambda kv: -kv[1]["seconds"]))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("log")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  with open(a.log, errors="replace") as f:
    totals = aggregate(f)
  for label, t in list(totals.items())[:a.top]:
    print(f"{t['seconds']:9.2f} s  {t['calls']:6d}  {label}")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(totals, f, indent=1)


if __name__ == "__main__":
  main()
