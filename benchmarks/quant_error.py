"""Relative RMSE of every format on N(0,1) and Student-t(3) tensors; writes one JSON file.

  python benchmarks/quant_error.py --out benchmarks/results/quant_error_cpu.json
"""

import argparse
import json

from trace_jax.provenance import run_info
from trace_jax.quant import error_stats


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out", default="quant_error.json")
  ap.add_argument("--rows", type=int, default=1024)
  ap.add_argument("--cols", type=int, default=4096)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  shape = (args.rows, args.cols)
  results = {}
  for scope in ("row", "tensor"):
    results[scope] = error_stats.error_table(shape=shape, seed=args.seed,
                                             second_level=scope)
  out = dict(
      benchmark="quant_error", **run_info(), shape=list(shape),
      unit="relative RMSE = ||Q(x) - x|| / ||x||, blocks along the last axis",
      second_level_note="NVFP4 second-level scale per row ('row') or per tensor ('tensor')",
      relative_rmse=results)
  with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"{'scope':7s} {'dist':11s} " + " ".join(f"{k:>11s}" for k in results["row"]["normal"]))
  for scope, table in results.items():
    for dist, row in table.items():
      print(f"{scope:7s} {dist:11s} " + " ".join(f"{v:11.5f}" for v in row.values()))


if __name__ == "__main__":
  main()
