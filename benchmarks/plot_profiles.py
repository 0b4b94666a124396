"""Decode steps of `profile_decode.py` side by side: one PNG of horizontal bars, us a step per
source of the decode loop's kernels (its `profile.decode_loop.sources`), a bar per profile, the
sources that take the most time in any of them; the legend gives each profile's kernel total.

  python benchmarks/plot_profiles.py a.json,b.json --labels "before,after" --out ab.png

What it is for: reading an A/B of the decode step (a kernel made the default, a fusion lost)
without lining up two listings by hand.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import bench_util


def load(path: str) -> tuple[dict, float]:
  """({source: us a step}, kernel ms a step) of a profile_decode JSON's decode loop."""
  with open(path) as f:
    loop = json.load(f)["profile"]["decode_loop"]
  return ({s["source"]: 1e3 * s["ms_per_step"] for s in loop["sources"]},
          loop["kernel_ms_per_step"])


def plot(paths: list[str], labels: list[str], out: str, top: int = 18, title: str = "") -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  runs = [load(p) for p in paths]
  sources = sorted({s for us, _ in runs for s in us}, key=lambda s: -max(
      us.get(s, 0.0) for us, _ in runs))[:top]
  fig, ax = plt.subplots(figsize=(11, 0.45 * top * max(1, len(runs) / 2) + 1.5))
  height = 0.8 / len(runs)
  y = np.arange(len(sources))
  for i, ((us, total), label) in enumerate(zip(runs, labels, strict=True)):
    ax.barh(y + i * height, [us.get(s, 0.0) for s in sources], height,
            label=f"{label} ({total:.3f} ms of kernels a step)")
  ax.set_yticks(y + 0.4 - height / 2,
                [s.replace("Transformer/layers_#/", "L/")[:60] for s in sources], fontsize=8)
  ax.invert_yaxis()
  ax.set_xlabel("us a decode step (all layers' calls)")
  ax.legend(fontsize=8, loc="lower right")
  bench_util.save_figure(fig, title or "decode loop kernels by source", out)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("profiles", help="comma-separated profile_decode JSONs")
  ap.add_argument("--labels", default="", help="comma-separated, one a profile")
  ap.add_argument("--out", default="profiles.png")
  ap.add_argument("--top", type=int, default=18)
  ap.add_argument("--title", default="")
  a = ap.parse_args()
  paths = a.profiles.split(",")
  labels = a.labels.split(",") if a.labels else paths
  print(plot(paths, labels, a.out, a.top, a.title))


if __name__ == "__main__":
  main()
