"""The MoE routing tables (`kernels/routing.py`) at decode sizes: the Pallas kernel against
the XLA path (`dispatch._routed_by_counts`), checked table by table, timed, one JSON + a PNG.

  PYTHONPATH=. python benchmarks/bench_routing.py --out bench_routing.json
  python benchmarks/bench_routing.py --plot bench_routing.json   # the PNG of a saved run

Why: in the 8k-capacity FP4 decode step (H200, session 32's profile, B 256, 2,048 rows over
128 experts) the XLA path's reductions over [2,176 x 2,048] terms and its small kernels took
~13 us a layer. Rows: `xla` and the kernel at `num_warps`; each kernel row's seven tables are
compared with the XLA row's on fresh ids (top-k distinct experts a token, from a skewed
distribution) in the same run, and timed with CUPTI (`profiler.measure`, all kernels of the
call, median).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import bench_util

EXPERTS, TOP_K = 128, 8


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one group per row count; PNG beside the JSON."""
  plt, res, rows = bench_util.timed_rows_for_plot(json_path)
  sizes = sorted({r["rows"] for r in rows})
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / len(variants)
  for v_i, var in enumerate(variants):
    us = {r["rows"]: r["us"] for r in rows if r["variant"] == var}
    ax.bar([i + v_i * width for i in range(len(sizes))], [us.get(s, 0) for s in sizes], width,
           label=var, color="tab:gray" if var == "xla" else None)
  ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))])
  ax.set_xticklabels([f"{s} rows\n(B {s // TOP_K})" for s in sizes])
  ax.set_ylabel("us a call (CUPTI, all kernels)")
  ax.legend()
  out = json_path.rsplit(".", 1)[0] + ".png"
  bench_util.save_figure(fig, f"routing tables, {EXPERTS} experts - {res.get('device')} jax "
                         f"{res.get('jax_version')} {res.get('git_commit')} "
                         f"{res.get('date', '')[:10]}", out)
  return out


def _ids(tokens: int, seed: int):
  """top-k distinct experts a token, experts drawn with a skew (some hot, some rare)."""
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.full(EXPERTS, 0.5))
  logits = np.log(p)[None, :] + rng.gumbel(size=(tokens, EXPERTS))
  return np.argsort(-logits, axis=1)[:, :TOP_K].reshape(-1).astype(np.int32)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--out", default="bench_routing.json")
  ap.add_argument("--rows", default="256,512,2048,4096", help="rows (B x top-8)")
  ap.add_argument("--warps", default="4,8,16", help="num_warps values")
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return

  import functools

  import jax
  import jax.numpy as jnp

  from trace_jax.kernels import dispatch, fp4_mgpu, routing

  res = bench_util.result_header(
      "bench_routing", units=bench_util.CHECKED_TIMING_UNITS,
      experts=EXPERTS, top_k=TOP_K, tile=routing.TILE, rows=[])
  t0 = time.time()

  def xla_tables(ids):
    order, inverse, gs, (_, ce, row0, slot, total) = dispatch._routed_by_counts(ids, EXPERTS)
    return order, inverse, gs, ce, row0, slot, total[:1]

  for m in (int(v) for v in args.rows.split(",")):
    ids = jnp.asarray(_ids(m // TOP_K, int(time.time()) % 1000 + m))  # fresh each run
    bm = fp4_mgpu.grouped_bm(m, EXPERTS)
    variants = {"xla": jax.jit(xla_tables)}
    for w in (int(v) for v in args.warps.split(",")):
      variants[f"kernel_w{w}"] = jax.jit(functools.partial(
          routing.routing_tables, num_groups=EXPERTS, bm=bm, num_warps=w,
          n_chunks=fp4_mgpu.chunk_count(m, EXPERTS, bm)))
    tables = lambda out: [np.asarray(a) for a in out]  # noqa: E731
    want = tables(variants["xla"](ids))
    for var, fn in variants.items():
      row = bench_util.checked_timing(dict(rows=m, variant=var, bm=bm), fn, (ids,), want,
                                      tables, "tables_equal_xla", args.iters)
      bench_util.keep_checked_row(res, row, f"{m:5d} rows {var:10s}", "tables_equal_xla", t0,
                                  args.out)
  print(plot(args.out))


if __name__ == "__main__":
  main()
