"""The activation-site NVFP4 quantization kernel (`kernels/row_quant.py`) at the decode step's
sites, per launch shape: check bit for bit against the XLA path, time, one JSON + a PNG.

  PYTHONPATH=. python benchmarks/bench_row_quant.py --out bench_row_quant.json
  python benchmarks/bench_row_quant.py --plot bench_row_quant.json   # the PNG of a saved run

Why: in the 8k-capacity FP4 decode step (H200, session 28's profile, B 256) the kernel took
13.2 us a layer at the experts' down input ([2,048 rows, 768]) and 5.4 us at their input
([256, 2048]), against about 1-2 us of bytes. Rows: `xla` (`quant.quantize_with_value`, the
kernel's definition) and the kernel at `tile_elems` (elements of x a program takes) x
`num_warps`; each kernel row's four outputs are compared with the XLA row's, every bit, on
fresh inputs (`tests/kernels/test_row_quant.rows_case`) in the same run, and timed with CUPTI
(`profiler.measure`, all kernels of the call, median).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import bench_util

SHAPES = {"experts_in_b256": (256, 2048), "down_in_b256": (2048, 768),
          "experts_in_b32": (32, 2048), "down_in_b32": (256, 768)}


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one panel per site shape; PNG beside the JSON (a log scale:
  one warp over 8,192 elements is 30x the rest)."""
  return bench_util.site_bars(json_path, lambda site: f"{site} {SHAPES.get(site, '')}",
                              log=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--out", default="bench_row_quant.json")
  ap.add_argument("--tiles", default="1024,2048,4096,8192", help="tile_elems values")
  ap.add_argument("--warps", default="1,2,4,8", help="num_warps values")
  ap.add_argument("--sites", default=",".join(SHAPES))
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return

  import functools

  import jax
  import jax.numpy as jnp

  from tests.kernels.test_row_quant import rows_case
  from trace_jax import quant as tq
  from trace_jax.kernels import row_quant

  res = bench_util.result_header(
      "bench_row_quant", units=bench_util.CHECKED_TIMING_UNITS,
      defaults=dict(tile_elems=row_quant.TILE_ELEMS, num_warps=row_quant.NUM_WARPS), rows=[])
  t0 = time.time()

  def fields(out):
    q, value = out
    return [np.asarray(a).view(np.uint8) for a in (q.codes, q.scales, q.global_scale, value)]

  for site in args.sites.split(","):
    shape = SHAPES[site]
    x = rows_case(shape, jnp.bfloat16, int(time.time()) % 1000)  # fresh each run
    xla = jax.jit(lambda a: tq.quantize_with_value(a, "nvfp4", second_level="row",
                                                   validate=False))
    want = fields(xla(x))
    variants = {"xla": xla}
    for t in (int(v) for v in args.tiles.split(",")):
      for w in (int(v) for v in args.warps.split(",")):
        variants[f"t{t}_w{w}"] = jax.jit(functools.partial(
            row_quant.quantize_rows, fmt="nvfp4", tile_elems=t, num_warps=w))
    for var, fn in variants.items():
      row = bench_util.checked_timing(dict(site=site, shape=shape, variant=var), fn, (x,), want,
                                      fields, "bits_equal_xla", args.iters)
      bench_util.keep_checked_row(res, row, f"{site:16s} {var:10s}", "bits_equal_xla", t0,
                                  args.out)
  print(plot(args.out))


if __name__ == "__main__":
  main()
