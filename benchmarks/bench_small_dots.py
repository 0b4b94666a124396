"""The small products of a batch-1 decode step on the GPU, each way it can be written: check,
time, one JSON file + a table.

  PYTHONPATH=. python benchmarks/bench_small_dots.py --out bench_small_dots.json [--rows 1,8]
  python benchmarks/bench_small_dots.py --plot bench_small_dots.json   # the PNG of a saved run

Why: in the 12-layer 30B-A3B decode step at batch 1 (H200, session 16 profiles) the MoE router's
float32 dot ran as two kernels of 3.2 us a layer (XLA:GPU rewrites a one-row dot as a multiply
and a reduction), and the bf16 attention projections ran at about half of their weight bytes'
time (9.7 us for the fused q/k/v, 7.4 us for o_proj). Rows:
- `router_*`: float32 x [R, 2048] (bf16 values, as the model's router input) @ w [2048, 128] at
  HIGHEST precision: `dot` (as the model wrote it), `pad2` (`dispatch.float32_dot`: a zero
  second row when R = 1 on the GPU), `bcast2` (the row broadcast to two: no concatenate kernel
  if XLA fuses the broadcast into the product), `mulsum` (multiply and sum over K: one
  reduction kernel), `x6` / `x3` (XLA's dot algorithms BF16_BF16_F32_X6 / _X3: the operands
  split into bf16 parts in the product's kernel, on tensor cores; X6 keeps every product of a
  bf16 x with w's three parts, X3 drops w's lowest), `split3` (w's three bf16 parts side by side,
  made once as a weight sync would: one bf16 product [R, 2048] @ [2048, 384] with float32
  accumulation and the parts' sum).
- `qkv_*` / `o_*`: bf16 x [R, K] @ w [K, N] with float32 accumulation, bf16 out, at the 30B-A3B
  q/k/v (2048 x 5120) and o (4096 x 2048) shapes: `xla` (`dispatch.xla_matmul`: the zero second
  row at R = 1), `xla_nopad` (the one-row dot as written), `xla_bcast2` (the row broadcast to
  two), `mgpu` (the bf16 grouped Mosaic kernel, `bf16_mgpu.grouped_matmul`, with one group), and
  from 128 rows `mgpu_bm{rows a chunk}_wg{warpgroups}_kb{K tiles a step}_s{K splits}` (the same
  kernel with 128 / 256 rows a chunk, `bf16_mgpu.dense_matmul`),
  `mgpu_cluster_bm*_s{splits}_wg*_kb*` (K split in a thread block cluster, the parts added inside
  the kernel, `bf16_mgpu.cluster_matmul`), `xla_cublas` / `xla_cublaslt` (`xla` compiled with
  XLA's Triton GEMM fusions off: at 256 rows on an H100 8-31% slower than XLA's choice, session
  43).
- `router_bf16`: the router's operands as bf16 (the rollout's), one bf16 product with float32
  accumulation (`dispatch.bf16_operands_dot`: the products exact, as in float32).
- `route_tail`: softmax, top-8 and the weights' normalization of router logits [R, 128], as the
  model does them (for its kernel count); `route_topk{n}`: the same in one kernel
  (`router_topk.py`) with n tokens a program.

Each is checked against a float64 numpy product (max |got - ref| / max |ref|) and timed with
CUPTI device time (`profiler.measure`, all kernels of the call, median over iterations), the
weights rotated over copies larger than the L2. GB/s on the weight bytes.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time

import numpy as np

import bench_util


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one panel per product and row count; PNG beside the JSON."""
  plt, res, timed = bench_util.timed_rows_for_plot(json_path)
  groups: dict = {}
  for r in timed:
    name, rows = r["name"].rsplit("_r", 1)
    prod = "route" if name.startswith("route_") else name.split("_")[0]
    tag = name[len(prod) + 1:] or prod
    groups.setdefault((prod, int(rows)), []).append((tag, r["us"]))
  order = sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0]))
  most = max(len(v) for _, v in order)  # horizontal bars: long variant names stay legible
  fig, axes = plt.subplots(2, -(-len(order) // 2), figsize=(3.2 * len(order), 1.2 + 0.5 * most),
                           squeeze=False)
  for ax, ((prod, rows), vals) in zip(axes.ravel(), order):
    ax.barh([t for t, _ in vals], [u for _, u in vals], color="tab:blue")
    ax.invert_yaxis()
    ax.set_title(f"{prod}, {rows} row(s)", fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
  for ax in axes[-1, :]:
    ax.set_xlabel("us a call (CUPTI, all kernels)")
  fig.suptitle(f"{res.get('device')} jax {res.get('jax_version')} {res.get('git_commit')} "
               f"{res.get('date', '')[:10]}", fontsize=9)
  fig.tight_layout()
  out = json_path.rsplit(".", 1)[0] + ".png"
  fig.savefig(out, dpi=110)
  return out


def _hopper_variants(rows: int) -> dict:
  """JAX's Mosaic GPU bf16 matmul (`pallas.ops.gpu.hopper_matmul_mgpu`, a persistent kernel,
  no K split) at a few tilings whose CTA rows divide `rows`: a peer for XLA's dot at decode
  batches of 64-256 rows (not in the engine)."""
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  dims = hm.MatmulDimension
  configs = {"hopper_m128n64_wgM": (128, 64, dims.M), "hopper_m128n128_wgM": (128, 128, dims.M),
             "hopper_m64n128_wgN": (64, 128, dims.N), "hopper_m64n64_wgN": (64, 64, dims.N)}
  out = {}
  for tag, (tm, tn, wg) in configs.items():
    if rows % (tm * (2 if wg == dims.M else 1)):
      continue
    cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=4,
                          epi_tile_m=64, epi_tile_n=64, wg_dimension=wg)
    out[tag] = lambda x, w, cfg=cfg: hm.matmul(x, w, None, cfg)
  return out


# (rows a chunk, compute warpgroups of 64 columns, 64-wide K tiles a step, K splits) of the
# `mgpu_bm*` rows: wgmma N 128 / 256 with the weight read once or twice at 256 rows. (128, 2,
# *, 4) (session 49, not run yet): o's 32 column tiles x chunks times 4 K parts fill 128 of the
# 132 SMs, where 2 parts left half of them idle and XLA's cuBLAS launch runs 32 CTAs
DENSE_LAUNCHES = [(256, 2, 1, 1), (256, 2, 1, 2), (256, 2, 1, 4), (256, 1, 1, 1),
                  (256, 1, 1, 2), (128, 2, 1, 1), (128, 2, 1, 2), (128, 1, 1, 1),
                  (128, 2, 2, 1), (128, 2, 1, 4), (128, 2, 2, 4)]


# Launches of the `mgpu_cluster_*` rows (`bf16_mgpu.cluster_matmul`: the K parts added through
# distributed shared memory inside the kernel) (rows a chunk, K splits = cluster size, compute
# warpgroups, 64-wide K tiles a step)
CLUSTER_LAUNCHES = [(256, 8, 2, 1), (256, 4, 2, 1), (256, 2, 2, 1), (256, 8, 1, 1),
                    (256, 4, 1, 1), (256, 4, 1, 2), (256, 8, 1, 2), (128, 4, 2, 1),
                    (128, 2, 2, 1), (128, 8, 2, 1), (128, 4, 2, 2), (128, 4, 1, 1)]


def _dense_launch(rows: int, k: int, n: int) -> dict:
  """n_inner 1 and the most K splits with every chunk's column tiles in one wave of SMs."""
  from trace_jax.kernels import bf16_mgpu, fp4_mgpu
  chunks = -(-rows // fp4_mgpu.grouped_bm(rows, 1))
  ctas, steps = chunks * (n // (64 * bf16_mgpu.WGS)), k // (64 * bf16_mgpu.KB)
  splits = max(s for s in range(1, steps + 1) if steps % s == 0 and ctas * s <= fp4_mgpu.NUM_SMS
               or s == 1)
  return dict(n_inner=1, splits=splits)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--out", default="bench_small_dots.json")
  ap.add_argument("--rows", default="1,8")
  ap.add_argument("--hopper", action="store_true",
                  help="also JAX's hopper_matmul_mgpu at the q/k/v and o shapes")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--products", default="router,route_tail,qkv,o",
                  help="which products' rows to run")
  ap.add_argument("--only", default="",
                  help="a regex: only the qkv / o variants whose tag it finds")
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return

  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler

  from trace_jax.kernels import bf16_mgpu, dispatch, router_topk

  t0 = time.time()
  res = bench_util.result_header(
      "bench_small_dots",
      units=dict(us="microseconds of CUPTI device time a call (all its kernels), median",
                 GBps="weight bytes / us"),
      read_ceiling_TBps=bench_util.READ_CEILING_TBPS, rows=[])

  def timed(fn, x, copies, options=None):
    multi = jax.jit(lambda x, ws: [fn(x, w) for w in ws], compiler_options=options)
    compiled = multi.lower(x, copies).compile()
    _, tim = profiler.measure(compiled, aggregate=False, iterations=args.iters)(x, copies)
    n = len(copies)
    per_iter = [sum(ms for _, ms in it) * 1e3 / n for it in tim]
    names = sorted({name for it in tim for name, _ in it})
    return statistics.median(per_iter), len(tim[0]) / n, names

  def row(name, fn, x, w, ref, wbytes):
    fn, options = fn if isinstance(fn, tuple) else (fn, None)  # (fn, XLA compiler options)
    n = int(min(16, max(1, np.ceil(2.5 * bench_util.L2_BYTES / wbytes))))
    copies = [jnp.copy(w) for _ in range(n)]
    got = np.asarray(jax.jit(fn, compiler_options=options)(x, w), np.float64)
    err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
    try:
      us, kernels, names = timed(fn, x, copies, options)
      r = dict(name=name, us=us, kernels_per_call=kernels, kernel_names=names[:6],
               GBps=wbytes / us / 1e3, relerr_max=err)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end
      r = dict(name=name, error=f"{type(e).__name__}: {e}"[:300], relerr_max=err)
    res["rows"].append(r)
    print(f"{name:24s} {r.get('us', float('nan')):8.2f} us  "
          f"{r.get('kernels_per_call', 0):4.1f} kernels  {r.get('GBps', 0):7.0f} GB/s  "
          f"relerr {err:.1e}", flush=True)
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1, default=str)

  rng = np.random.default_rng(0)
  hp = jax.lax.Precision.HIGHEST

  def bcast2(x):  # the row twice: a broadcast may fuse into the product's operand (no kernel)
    return jnp.broadcast_to(x, (2, x.shape[1])) if x.shape[0] == 1 else x

  products = args.products.split(",")
  for r in [int(v) for v in args.rows.split(",")]:
    # the router, float32 (x and w bf16 values, as the rollout's activations and weights)
    xr = np.asarray(jnp.asarray(rng.standard_normal((r, 2048)), jnp.bfloat16), np.float32)
    wr = np.asarray(jnp.asarray(rng.standard_normal((2048, 128)) * 0.02, jnp.bfloat16),
                    np.float32)
    ref = xr.astype(np.float64) @ wr.astype(np.float64)
    variants = {
        "dot": lambda x, w: jnp.dot(x, w, precision=hp),
        "pad2": dispatch.float32_dot,  # the library's rule (a zero second row at one row)
        "bcast2": lambda x, w: jnp.dot(bcast2(x), w, precision=hp)[:x.shape[0]],
        "mulsum": lambda x, w: jnp.sum(x[:, :, None] * w[None], axis=1),
        "x6": lambda x, w: jnp.dot(x, w, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6),
        "x3": lambda x, w: jnp.dot(x, w, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
    }
    for tag, fn in (variants.items() if "router" in products else ()):
      row(f"router_{tag}_r{r}", fn, jnp.asarray(xr), jnp.asarray(wr), ref, wr.nbytes)
    if "router" in products:
      parts, rest = [], jnp.asarray(wr)
      for _ in range(3):  # w = hi + mid + lo exactly (24 bits of mantissa in three of 8)
        parts.append(rest.astype(jnp.bfloat16))
        rest = rest - parts[-1].astype(jnp.float32)
      w3 = jnp.concatenate(parts, axis=1)

      def split3(x, w3):
        y = jnp.dot(x.astype(jnp.bfloat16), w3, preferred_element_type=jnp.float32)
        n = w3.shape[1] // 3
        return y[:, :n] + y[:, n:2 * n] + y[:, 2 * n:]

      row(f"router_split3_r{r}", split3, jnp.asarray(xr), w3, ref, w3.size * 2)
      # the operands as the rollout holds them (bf16), one bf16 product with float32
      # accumulation (`dispatch.bf16_operands_dot`, TRACE_JAX_ROUTER_DOT=bf16)
      row(f"router_bf16_r{r}", dispatch.bf16_operands_dot, jnp.asarray(xr, jnp.bfloat16),
          jnp.asarray(wr, jnp.bfloat16), ref, wr.size * 2)
    if "route_tail" in products:
      # the tail of routing
      logits = jnp.asarray(ref, jnp.float32)

      def tail(x, w):  # w (a zero) is read so that XLA does not merge the timed copies' calls
        p = jax.nn.softmax(x + w[0], axis=-1)
        v, i = jax.lax.top_k(p, 8)
        return (v / jnp.sum(v, axis=-1, keepdims=True)) + i.astype(jnp.float32) * 0

      pr = jax.nn.softmax(ref, axis=-1)
      top = np.sort(np.asarray(pr))[:, ::-1][:, :8]
      row(f"route_tail_r{r}", tail, logits, jnp.zeros((8,), jnp.float32),
          top / top.sum(-1, keepdims=True), 1024)
      for rows_a_program in (2, 4, 8, 16, 32):  # the same in one kernel (`router_topk.py`)
        def topk(x, w, rows_a_program=rows_a_program):
          v, i = router_topk.topk_gates(x + w[0], 8, normalize=True, rows=rows_a_program)
          return v + i.astype(jnp.float32) * 0

        row(f"route_topk{rows_a_program}_r{r}", topk, logits, jnp.zeros((8,), jnp.float32),
            top / top.sum(-1, keepdims=True), 1024)

    # dense bf16 projections
    for shape_tag, (k, n) in (("qkv", (2048, 5120)), ("o", (4096, 2048))):
      if shape_tag not in products:
        continue
      xb = jnp.asarray(rng.standard_normal((r, k)), jnp.bfloat16)
      wb = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.bfloat16)
      ref = np.asarray(xb, np.float64) @ np.asarray(wb, np.float64)
      dv = {
          "xla": lambda x, w: dispatch.xla_matmul(x, (w, None), jnp.bfloat16),
          "xla_nopad": lambda x, w: jnp.einsum("rk,kn->rn", x, w,
                                               preferred_element_type=jnp.float32
                                               ).astype(jnp.bfloat16),
          "xla_bcast2": lambda x, w: jnp.dot(bcast2(x), w, preferred_element_type=jnp.float32
                                             )[:x.shape[0]].astype(jnp.bfloat16),
          "mgpu": lambda x, w: bf16_mgpu.grouped_matmul(
              x, w[None], jnp.asarray([x.shape[0]], jnp.int32), out_dtype=jnp.bfloat16),
          # one column tile a CTA, K split the most ways that keep every chunk's CTAs in one
          # wave (the FP4 dense-as-a-group launch, `fp4_mgpu.dense_group_config`)
          "mgpu_dense": lambda x, w: bf16_mgpu.grouped_matmul(
              x, w[None], jnp.asarray([x.shape[0]], jnp.int32), out_dtype=jnp.bfloat16,
              config_override=_dense_launch(x.shape[0], w.shape[0], w.shape[1])),
      }
      # XLA's product with its Triton GEMM fusions off (cuBLAS / cuBLASLt picks the launch,
      # split-K included), as a program's `compiler_options` can set it
      xla = dv["xla"]
      dv["xla_cublas"] = (xla, {"xla_gpu_enable_triton_gemm": False})
      dv["xla_cublaslt"] = (xla, {"xla_gpu_enable_triton_gemm": False,
                                  "xla_gpu_enable_cublaslt": True})
      if r >= 128:  # the bf16 kernel with 128 / 256 rows a chunk (`bf16_mgpu.dense_matmul`)
        for bm, wgs, kb, sp in DENSE_LAUNCHES:
          dv[f"mgpu_bm{bm}_wg{wgs}_kb{kb}_s{sp}"] = functools.partial(
              bf16_mgpu.dense_matmul, bm=bm, wgs=wgs, kb=kb, splits=sp)
        for bm, sp, wgs, kb in CLUSTER_LAUNCHES:
          if n % (64 * wgs) == 0 and k % (64 * kb * sp) == 0:
            dv[f"mgpu_cluster_bm{bm}_s{sp}_wg{wgs}_kb{kb}"] = functools.partial(
                bf16_mgpu.cluster_matmul, splits=sp, wgs=wgs, kb=kb, bm=bm)
            if (bm, wgs, kb) == (256, 2, 1) and sp > 2:  # session 46's first GPU run: the
              # sends in one order ("_fixed"), and the partials in SMEM of their own too
              for tag, kw in (("fixed", {}), ("first", dict(alias=False))):
                dv[f"mgpu_cluster_bm{bm}_s{sp}_wg{wgs}_kb{kb}_{tag}"] = functools.partial(
                    bf16_mgpu.cluster_matmul, splits=sp, wgs=wgs, kb=kb, bm=bm, order="fixed",
                    **kw)
      dv.update(_hopper_variants(r) if args.hopper else {})
      for tag, fn in dv.items():
        if not args.only or re.search(args.only, tag):
          row(f"{shape_tag}_{tag}_r{r}", fn, xb, wb, ref, wb.size * 2)
  res["total_s"] = time.time() - t0
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1, default=str)
  try:
    print(plot(args.out))
  except ImportError:  # no matplotlib on the device image: draw it later with --plot
    pass


if __name__ == "__main__":
  main()
