"""Bar charts of `benchmarks/bench_kernels.py` rows side by side: kernel us per variant, one
panel per shape and row count, one bar per (labelled JSON, variant); `--metric us_call` for
the call's time (all its kernels) instead.

  python benchmarks/plot_kernels.py --out bm.png --only moe_ \
      s14a=benchmarks/results/session14_h200_2026-12-01/call1_bench_kernels_m2208_bm.json \
      s14b=benchmarks/results/session14_h200_2026-12-01/call2_bench_kernels_gateup_m2208_3072_4096_bm.json

A grouped FP4 row is labelled with the rows per chunk it ran (`bm`, where the JSON records it).
Rows with an error or no kernel time are skipped. Prints the table it draws.
"""

from __future__ import annotations

import argparse
import collections
import math

import bench_util  # (a sibling module: see its docstring)


def load_panels(label_paths, only="", metric="us_kernel"):
  """{panel name: [(bar label, us)]} in first-seen order; a panel is a row name less its
  variant (`<shape>_M<rows>` or `<shape>_B<batch>`); metric: us_kernel or us_call."""
  panels = collections.OrderedDict()
  for label, d in bench_util.labelled_json(label_paths):
    rows = d.get("rows", [])
    for r in rows:
      us, var = r.get(metric), r.get("variant", "")
      if r.get("error") or not us or (only and only not in r["name"]) or math.isnan(us):
        continue
      panel = r["name"][: -len(var) - 1] if var and r["name"].endswith(var) else r["name"]
      bar = f"{label} {var}" + (f" (bm {r['bm']})" if "bm" in r and "_bm" not in var else "")
      panels.setdefault(panel, []).append((bar, us))
  return panels


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("files", nargs="+", help="label=path of bench_kernels JSONs")
  ap.add_argument("--out", required=True, help="PNG path")
  ap.add_argument("--only", default="", help="keep rows whose name holds this substring")
  ap.add_argument("--metric", default="us_kernel", choices=("us_kernel", "us_call"),
                  help="the main kernel's us, or the call's (all its kernels)")
  a = ap.parse_args()
  panels = load_panels(a.files, a.only, a.metric)
  if not panels:
    raise SystemExit("no rows to plot")
  for panel, bars in panels.items():
    print(panel)
    for bar, us in bars:
      print(f"  {us:9.1f} us  {bar}")
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  n = len(panels)
  fig, axes = plt.subplots(n, 1, figsize=(8, 1.2 + 0.35 * sum(len(b) for b in panels.values())
                                          + 0.6 * n), squeeze=False)
  for ax, (panel, bars) in zip(axes[:, 0], panels.items()):
    names, us = zip(*bars)
    ax.barh(range(len(us)), us, color="tab:blue")
    ax.set_yticks(range(len(us)), names, fontsize=8)
    ax.invert_yaxis()
    for i, v in enumerate(us):
      ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
    ax.set_title(panel, fontsize=9)
    ax.set_xlabel(("kernel" if a.metric == "us_kernel" else "call") + " us (CUPTI)", fontsize=8)
    ax.set_xlim(0, max(us) * 1.15)
  fig.tight_layout()
  fig.savefig(a.out, dpi=110)
  print("wrote", a.out)


if __name__ == "__main__":
  main()
