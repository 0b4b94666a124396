"""The expert down input's kernel (`kernels/swiglu_quant.py`: SwiGLU of the gate/up kernel's
chunk rows, the site's NVFP4 row quantization, the down kernel's operand) per launch shape,
against the XLA ops it replaces: check bit for bit, time, one JSON + a PNG.

  PYTHONPATH=. python benchmarks/bench_swiglu_quant.py --out bench_swiglu_quant.json
  python benchmarks/bench_swiglu_quant.py --plot bench_swiglu_quant.json   # the PNG of a run

Why: in the 8k-capacity FP4 decode step (H200, B 256, session 37's 4-layer profile) the ops
this kernel replaces took 13.2 us a layer (row quantization 5.8, the SwiGLU product 4.8, the
operand's gather 2.7) and the kernel's first form 9.1 us. Shapes: the decode step's gate/up
rows at B 256 and B 64 (30B-A3B: F 768, 128 experts, chunks of 32 rows, slots from
`fp4_mgpu.chunk_tables` over random group sizes). Rows: `xla` (the reference: gather,
`swiglu`, `quantize_with_value`, `permute_k_rows`), `xla_model` (the model's own XLA ops,
`nn.silu(g) * u` in place of `swiglu`: timed and checked the same way) and the kernel at
`tile_elems` x `num_warps`, its rows in one tile and split (`_split`: F 768 as three tiles of
16 blocks, no idle lanes); every row's outputs (codes, scales, row scales, operand) against
the reference's, every bit, on fresh inputs in the same run, timed with CUPTI
(`profiler.measure`, all kernels of the call, median).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import bench_util

# (rows m = batch x top-8, its chunk rows C x 32)
SHAPES = {"down_in_b256": 2048, "down_in_b64": 512}
F_DIM, EXPERTS, BM = 768, 128, 32


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one panel per shape; PNG beside the JSON."""
  return bench_util.site_bars(
      json_path, lambda site: f"{site} ({SHAPES.get(site, '')} rows x {F_DIM})")


def case(m: int, seed: int):
  """gate/up chunk rows as the decode step's gate/up call leaves them, and their slots."""
  import jax.numpy as jnp

  from tests.kernels.test_swiglu_quant import chunk_rows_case
  from trace_jax.kernels import fp4_mgpu, layout

  rng = np.random.default_rng(seed)
  sizes = np.bincount(rng.integers(0, EXPERTS, m), minlength=EXPERTS)
  _, _, slot = fp4_mgpu.chunk_tables(jnp.asarray(sizes, jnp.int32), m, BM)
  src = fp4_mgpu.chunk_count(m, EXPERTS, BM) * BM
  rows = chunk_rows_case(src, 2 * F_DIM, F_DIM, 8, seed).rows  # values only: slots are real
  return layout.ChunkRows(rows, slot, 2 * F_DIM), fp4_mgpu.operand_rows(m, BM)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--out", default="bench_swiglu_quant.json")
  ap.add_argument("--tiles", default="1024,2048,4096,8192", help="tile_elems values")
  ap.add_argument("--warps", default="2,4,8", help="num_warps values")
  ap.add_argument("--splits", default="off,on",
                  help="rows in one tile (off) and in tiles with no idle blocks (on)")
  ap.add_argument("--sites", default=",".join(SHAPES))
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return

  import functools

  import jax

  from trace_jax import quant as tq
  from trace_jax.kernels import layout, swiglu_quant

  res = bench_util.result_header(
      "bench_swiglu_quant", units=bench_util.CHECKED_TIMING_UNITS,
      defaults=dict(tile_elems=swiglu_quant.TILE_ELEMS, num_warps=swiglu_quant.NUM_WARPS),
      rows=[])
  t0 = time.time()

  def fields(out):
    q, op = out
    return [np.asarray(a).view(np.uint8) for a in (q.codes, q.scales, q.global_scale, op.data)]

  for site in args.sites.split(","):
    gu, n_rows = case(SHAPES[site], int(time.time()) % 1000)  # fresh each run
    kw = dict(f=F_DIM, fmt="nvfp4", n_rows=n_rows, k_pad=F_DIM)
    ref = jax.jit(functools.partial(swiglu_quant.swiglu_quantize_rows_ref, **kw))

    def model_ops(g):  # what the model runs without the kernel
      x = g.gather()
      q, value = tq.quantize_with_value(jax.nn.silu(x[:, :F_DIM]) * x[:, F_DIM:], "nvfp4",
                                        second_level="row", validate=False)
      return q, layout.OperandRows(layout.permute_k_rows(
          jax.numpy.pad(value, ((0, n_rows - value.shape[0]), (0, 0))), None, n_rows, F_DIM),
          value.shape[0])

    want = fields(ref(gu))
    variants = {"xla": ref, "xla_model": jax.jit(model_ops)}
    for split in args.splits.split(","):
      for t in (int(v) for v in args.tiles.split(",")):
        for w in (int(v) for v in args.warps.split(",")):
          variants[f"t{t}_w{w}" + ("_split" if split == "on" else "")] = jax.jit(
              functools.partial(swiglu_quant.swiglu_quantize_rows, tile_elems=t, num_warps=w,
                                split=split == "on", **kw))
    for var, fn in variants.items():
      row = bench_util.checked_timing(dict(site=site, rows=SHAPES[site], variant=var), fn, (gu,),
                                      want, fields, "bits_equal_ref", args.iters)
      bench_util.keep_checked_row(res, row, f"{site:14s} {var:10s}", "bits_equal_ref", t0,
                                  args.out)
  print(plot(args.out))


if __name__ == "__main__":
  main()
