"""Bar chart of `launch/bench_rollout.py` results side by side: tokens/s and the share of the
bytes-moved floor per (policy, prompt length), one bar per labelled JSON (e.g. one per session).

  python benchmarks/plot_rollout.py --out rollout.png \
      s3=benchmarks/results/bench_rollout_h200_2026-11-30/bench_rollout_12l_b64_s3.json \
      s6=benchmarks/results/session6_h200_2026-11-30/bench_rollout_12l_b64.json

Rows are matched by (policy, batch, prompt length); rows with an error are skipped. Prints the
table it draws.
"""

from __future__ import annotations

import argparse

import bench_util  # (a sibling module: see its docstring)


def load_rows(label_paths):
  """[(label, {(policy, batch, prompt_len): row})] from `label=path` strings, in first-seen
  label order; files with the same label (e.g. one per prompt length) are merged."""
  out: dict = {}
  for label, d in bench_util.labelled_json(label_paths):
    rows = out.setdefault(label, {})
    for r in d.get("results", []):
      if r.get("error") or not r.get("tokens_per_s"):
        continue
      rows[(r["policy"], r["batch"], d.get("prompt_len"))] = r
  return list(out.items())


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="PNG path")
  ap.add_argument("--title", default="Rollout, 12 layers of the Qwen3-30B-A3B shape (H200)")
  ap.add_argument("files", nargs="+", help="label=path of bench_rollout JSONs")
  a = ap.parse_args()
  runs = load_rows(a.files)
  keys = sorted({k for _, rows in runs for k in rows}, key=lambda k: (k[2] or 0, k[0], k[1]))
  print(f"{'policy':8} {'B':>3} {'prompt':>6} " + " ".join(f"{lab:>16}" for lab, _ in runs))
  def cell(row):  # HF peer rows (hf_static, hf_eager) have no floor
    floor = row.get("floor_over_measured")
    return f"{row['tokens_per_s']:8.0f} " + (f"({floor:.2f})" if floor is not None else "(  - )")

  for k in keys:
    cells = [cell(rows[k]) if k in rows else " " * 16 for _, rows in runs]
    print(f"{k[0]:8} {k[1]:>3} {k[2]:>6} " + " ".join(f"{c:>16}" for c in cells))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  width = 0.8 / len(runs)
  names = [f"{p}\nB{b} prompt {pl}" for p, b, pl in keys]
  for ax, field, ylabel in ((axes[0], "tokens_per_s", "generated tokens / s"),
                            (axes[1], "floor_over_measured", "share of the bytes-moved floor")):
    for i, (label, rows) in enumerate(runs):
      xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(keys))]
      ys = [(rows[k].get(field) or 0.0) if k in rows else 0.0 for k in keys]
      bars = ax.bar(xs, ys, width, label=label)
      for bar, y in zip(bars, ys):
        if y:
          ax.annotate(f"{y:.0f}" if field == "tokens_per_s" else f"{y:.2f}",
                      (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                      fontsize=7)
    ax.set_xticks(range(len(keys)), names, fontsize=8)
    ax.set_ylabel(ylabel)
  axes[1].axhline(0.5, color="gray", ls="--", lw=1)
  axes[0].legend(fontsize=8)
  bench_util.save_figure(fig, a.title, a.out)


if __name__ == "__main__":
  main()
