"""Decode-attention rows of several `bench_attention.py` runs side by side (e.g. the kernel
before and after a change): per row name, one bar per labelled JSON, kernel time and call time.

  python benchmarks/plot_attention.py --out attention.png \
      before=benchmarks/results/session19_h200_2026-12-01/call1_bench_attention_old.json \
      after=benchmarks/results/session19_h200_2026-12-01/call2_bench_attention_new.json

Rows are matched by name (e.g. `B16_S8192_nvfp4_mosaic`); rows without timings are skipped.
`--kv` keeps the rows of the named KV kinds only. Prints the table it draws, with each run's
kernel time over the first run's.
"""

from __future__ import annotations

import argparse

import bench_util  # (a sibling module: see its docstring)


def load_rows(label_paths, kinds=()):
  """[(label, {row name: row})] in argument order, timed decode rows only."""
  out = []
  for label, d in bench_util.labelled_json(label_paths):
    rows = {r["name"]: r for r in d.get("rows", [])
            if r.get("us_kernel") and r.get("kind", "decode") in ("decode", "decode_live")
            and (not kinds or r.get("kv") in kinds)}
    out.append((label, rows))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", required=True, help="PNG path")
  ap.add_argument("--title", default="Decode attention (H200)")
  ap.add_argument("--kv", default="", help="comma-separated KV kinds to keep, e.g. nvfp4_mosaic")
  ap.add_argument("files", nargs="+", help="label=path of bench_attention JSONs")
  a = ap.parse_args()
  runs = load_rows(a.files, tuple(filter(None, a.kv.split(","))))
  names = [n for n in dict.fromkeys(n for _, rows in runs for n in rows)]
  print(f"{'row':34} " + " ".join(f"{lab:>22}" for lab, _ in runs))
  for n in names:
    base = runs[0][1].get(n, {}).get("us_kernel")
    cells = []
    for _, rows in runs:
      r = rows.get(n)
      if r is None:
        cells.append(f"{'-':>22}")
        continue
      ratio = f" ({r['us_kernel'] / base:.2f}x)" if base else ""
      cells.append(f"{r['us_kernel']:8.1f}/{r['us_call']:6.1f}{ratio:>8}")
    print(f"{n:34} " + " ".join(cells))

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.4 * len(names) + 4), 4.5))
  width = 0.8 / len(runs)
  x = np.arange(len(names))
  for ax, key, what in zip(axes, ("us_kernel", "us_call"), ("kernel", "call")):
    for i, (label, rows) in enumerate(runs):
      vals = [rows[n][key] if n in rows else np.nan for n in names]
      ax.bar(x + (i - (len(runs) - 1) / 2) * width, vals, width, label=label)
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"us per {what} (median, CUPTI)")
    ax.set_yscale("log")
    ax.set_title(what)
    ax.legend(fontsize=8)
  bench_util.save_figure(fig, a.title, a.out)


if __name__ == "__main__":
  main()
