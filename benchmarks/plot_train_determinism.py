"""Bars of the train step's time per variant for `benchmarks/train_determinism.py` JSONs (several
files: their variants side by side, each labelled by its file's label), with the variants that
did not repeat their hashes hatched. Prints the table it draws.

  R=benchmarks/results/session50_h100_2026-12-06
  python benchmarks/plot_train_determinism.py --out train_determinism.png \\
      xla_options=$R/train_determinism_s50c.json \\
      take_rows=$R/train_determinism_take_rows_repeatable.json
"""

from __future__ import annotations

import argparse

import bench_util  # (a sibling module: see its docstring)


def rows(labelled_paths):
  out = []
  for label, res in bench_util.labelled_json(labelled_paths):
    for name, v in res["variants"].items():
      if "step_s_median" in v:
        out.append((f"{label}: {name}", v["step_s_median"], v["repeatable"],
                    res.get("device_kind", res["device"])))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("json", nargs="+", help="LABEL=PATH")
  a = ap.parse_args()
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  data = rows(a.json)
  for name, s, rep, dev in data:
    print(f"{name:40s} {s:8.3f} s  repeatable={rep}  ({dev})")
  fig, ax = plt.subplots(figsize=(7, 0.45 * len(data) + 1.2))
  ys = range(len(data))
  ax.barh(list(ys), [s for _, s, _, _ in data],
          hatch=["" if rep else "//" for _, _, rep, _ in data], color="#4c72b0")
  ax.set_yticks(list(ys), [n for n, *_ in data])
  ax.invert_yaxis()
  ax.set_xlabel("train step, s (median)")
  bench_util.save_figure(fig, "RL train step by XLA option / gather", a.out)


if __name__ == "__main__":
  main()
