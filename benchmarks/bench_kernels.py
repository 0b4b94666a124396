"""FP4 matmul kernels vs XLA bf16 on the GPU: build, check, time; one JSON file + a table.

  PYTHONPATH=. python benchmarks/bench_kernels.py [--quick] [--out DIR]

Variants, side by side in one run: XLA bf16 dot / `ragged_dot` (the baseline), tokamax's bf16
Mosaic `ragged_dot` (the BF16 engine's grouped matmul; where tokamax is installed), our bf16
Mosaic grouped kernel at decode sizes (`bf16_mgpu`, opt-in in the engine), and the
Mosaic GPU FP4 kernel (`trace_jax.kernels`) with NVFP4 and MXFP4 weights; grouped NVFP4 also
with n_inner column tiles per CTA (`_inD`) and K splits (`_sS`; `_auto`: the engine's choice,
`_auto_nosk`: its chunk schedule where the engine's is stream-K, `_auto_mk`: stream-K with the
cut tiles' parts added in the kernel);
dense bf16 at one row also as the engine calls it (`xla_bf16_engine`: a zero second row). Shapes:
8192x28672 (B 1, 16, 64), the Qwen3-30B-A3B attention q (2048x4096) and o (4096x2048)
projections, and the grouped expert matmuls (128 experts; gate+up K 2048 N 1536, down K 768 N
2048) at 8 and 64 rows (decode batches 1 and 8), 256, 512 and 32768 rows with top-8 routing of
random tokens.

Protocol (../shared/BENCHMARKS.md): CUPTI device times (`profiler.measure`, aggregate=False),
median over iterations; weights rotated over enough copies to exceed the 60 MB L2; each output
checked against the `jnp` reference (`trace_jax.kernels.reference`, float32 HIGHEST on the
dequantized QArray: the definition) on fresh random data in the same run, as float32 output
(accumulation-order noise only) and as the bf16 output the model uses. Figures: us per call
(all kernels of the call: K-permute gather, kernel, output transpose/gather), us of the main
kernel alone, TB/s on the bytes the kernel must stream (packed codes + scale bytes + factors of
the weights it touches, + activations), floor = bytes / 4.27 TB/s (the measured read ceiling).
A watchdog ends the run if one variant hangs (recorded in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback

import numpy as np

import bench_util

READ_CEILING_TBPS = bench_util.READ_CEILING_TBPS
L2_BYTES = bench_util.L2_BYTES
T0 = time.time()


def add_bandwidth(row, nbytes):
  """TB/s of the kernel and of the call, the bytes-moved floor and the kernel's ratio to it."""
  row["TBps_kernel"] = nbytes / (row["us_kernel"] * 1e-6) / 1e12
  row["TBps_call"] = nbytes / (row["us_call"] * 1e-6) / 1e12
  row["floor_us"] = nbytes / (READ_CEILING_TBPS * 1e12) * 1e6
  row["measured_over_floor_kernel"] = row["us_kernel"] / row["floor_us"]


def log(*a):
  print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out", default=os.environ.get("OUT", "."))
  ap.add_argument("--quick", action="store_true", help="one shape of each kind")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--hang_s", type=float, default=90)
  ap.add_argument("--only", default="", help="comma list of row-name substrings to run (a "
                  "trailing $: that exact name)")
  ap.add_argument("--grouped_rows", default="",
                  help="comma list of more row counts for both expert shapes (e.g. 3072,4096)")
  ap.add_argument("--dry", action="store_true",
                  help="CPU with jax-cuda13-plugin: only lower every variant for cuda")
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler

  from trace_jax import kernels
  from trace_jax.kernels import bf16_mgpu, dispatch, fp4_mgpu, reference
  from trace_jax.quant import quantize

  from trace_jax import provenance

  res = dict(
      benchmark="fp4_matmul_kernels", date=datetime.datetime.utcnow().isoformat() + "Z",
      device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
      # provenance: TRACE_JAX_COMMIT on the device copy, whose own .git (if any) is stale
      git_commit=provenance.git_commit(),
      source_tree=provenance.source_tree(),  # the tree that ran (an A/B side's own)
      command=" ".join([os.path.basename(sys.executable)] + sys.argv),
      units=dict(us="microseconds of CUPTI device time, median over iterations",
                 TBps="1e12 bytes/s on the bytes named in bytes_*",
                 relerr="||out - ref|| / ||ref|| (float64 norms)"),
      read_ceiling_TBps=READ_CEILING_TBPS,
      peers_not_measured_here={  # ../shared/BENCHMARKS.md, same H200 model, host WALL times
          "tokamax_ragged_dot_mosaic_bf16_gateup_256rows_us_wall": 415,
          "tokamax_ragged_dot_mosaic_bf16_gateup_32768rows_us_wall": 917,
          "xla_ragged_dot_bf16_gateup_32768rows_us_wall": 35500},
      rows=[])
  out_path = os.path.join(args.out, "bench_kernels.json")

  def save():
    with open(out_path, "w") as f:
      json.dump(res, f, indent=1, default=str)

  state = {}
  bench_util.start_watchdog(state, args.hang_s, res["rows"], save, log)

  def relerr(got, ref):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.all(np.isfinite(got)):
      return float("nan")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))

  def time_fn(fn, x_args, copies):
    """fn(*x_args, w) for each w in copies inside one jit; per-call = iteration total / copies."""
    multi = jax.jit(lambda xa, ws: [fn(*xa, w) for w in ws])
    t0 = time.time()
    if args.dry:
      multi.trace(x_args, copies).lower(lowering_platforms=("cuda",))
      return dict(us_call=float("nan"), us_kernel=float("nan"), n_copies=len(copies),
                  compile_s=round(time.time() - t0, 1))
    compiled = multi.lower(x_args, copies).compile()
    compile_s = time.time() - t0
    _, tim = profiler.measure(compiled, aggregate=False, iterations=args.iters)(x_args, copies)
    per_iter, per_name = [], {}
    for it in tim:
      per_iter.append(sum(ms for _, ms in it) * 1e3)
      agg = {}
      for name, ms in it:
        agg[name] = agg.get(name, 0.0) + ms * 1e3
      for name, us in agg.items():
        per_name.setdefault(name, []).append(us)
    n = len(copies)
    med = {k: statistics.median(v) / n for k, v in per_name.items()}
    # the main kernel: the Mosaic GPU kernel where there is one, else XLA's largest
    mosaic = [k for k in med if "mosaic" in k]
    main = mosaic or [max(med, key=med.get)]
    return dict(us_call=statistics.median(per_iter) / n, us_kernel=sum(med[k] for k in main),
                main_kernel=",".join(main)[:80],
                kernels_us={k[:60]: round(v, 2) for k, v in med.items()},
                n_copies=n, compile_s=round(compile_s, 1), iterations=args.iters)

  def n_copies(nbytes):
    return int(min(16, max(1, np.ceil(2.5 * L2_BYTES / nbytes))))

  def copies_of(tree, n):
    return [jax.tree.map(lambda a: jnp.copy(a), tree) for _ in range(n)]

  def record(row):
    res["rows"].append(row)
    save()
    log(f"{row['name']:40s} us_call={row.get('us_call', float('nan')):9.1f} "
        f"us_kernel={row.get('us_kernel', float('nan')):9.1f} "
        f"TBps={row.get('TBps_kernel', float('nan')):5.2f} err={row.get('relerr_f32')} "
        f"{row.get('error', '')[-300:]}")

  def want(name):
    return not args.only or any(name == s[:-1] if s.endswith("$") else s in name
                                for s in args.only.split(","))

  force = True if args.dry else None  # dry: lower the kernel path off-GPU
  tokamax_ok = not args.dry and dispatch.grouped_backend().endswith("tokamax")
  key = [jax.random.key(int(time.time()) % 100000)]  # fresh data every run

  def nk():
    key[0], k = jax.random.split(key[0])
    return k

  # ------------------------------------------------------------------ dense shapes
  # Dense rows past the GEMV kernel's 64: the grouped kernel with the rows as one group
  # (`fp4_mgpu.matmul_as_group`), config per variant: its default launch, n_inner 1 with S K
  # splits (_sS), `grouped_matmul`'s own rule (_rule)
  GROUP_VARIANTS = {"nvfp4_g": None, **{f"nvfp4_g_s{s}": dict(n_inner=1, splits=s)
                                        for s in (1, 2, 4)}, "nvfp4_g_rule": {}}
  # 256 rows: the 8k-capacity rollout's decode batch through the fused q/k/v (2048 x 5120) and
  # o projections, past the GEMV kernel's 64 rows
  dense = [("ffn_8192x28672", 8192, 28672, (1, 16, 32, 64)),
           ("attn_q_2048x4096", 2048, 4096, (1, 16, 64)),
           ("attn_o_4096x2048", 4096, 2048, (1, 16, 64, 256)),
           ("attn_qkv_2048x5120", 2048, 5120, (256,))]
  if args.quick:
    dense = [("ffn_8192x28672", 8192, 28672, (16,)), ("attn_q_2048x4096", 2048, 4096, (1,))]
  def dense_variants(k, n, b):
    """The rows of one dense shape and batch."""
    # the big FFN shape: also kb=8 steps (2 stages) and kb=2 (a stream-K run's units half as
    # long: its longest run 27.5 steps of 256 K at 8192 x 28672 against 28 at kb=4)
    big = k * n >= 2**27 and not args.quick
    # "_nosk": the schedule before stream-K (equal K splits), where `stream_k_plan` takes it
    sk = fp4_mgpu.dense_stream_k(-(-n // 256), -(-k // 256), fp4_mgpu.pick_bm(b)) > 0
    if b > fp4_mgpu.MAX_DECODE_ROWS:  # "nvfp4": the engine's path; "_dot": the bf16 decode +
      # XLA dot (the engine's path past DENSE_GROUP_ROWS); GROUP_VARIANTS: the grouped kernel
      return ["xla_bf16", "nvfp4", "nvfp4_dot", *GROUP_VARIANTS]
    return (["xla_bf16"]
            + (["xla_bf16_engine"] if b == 1 else [])  # the engine's bf16 product differs
            + ["nvfp4", "mxfp4"]                      # from `x @ w` at one row only
            + (["nvfp4_nosk"] if sk else [])
            + (["nvfp4_kb8"] + (["nvfp4_kb8_nosk"] if sk else [])
               if big and b != 64 else [])  # kb=8, 64-row chunks: over SMEM
            + (["nvfp4_kb2"] if big else []))

  for sname, k, n, bs in dense:
    if not any(want(f"{sname}_B{b}_{v}") for b in bs for v in dense_variants(k, n, b)):
      continue  # no row of this shape asked for: skip its weights (seconds of setup each)
    w = jax.random.normal(nk(), (k, n), jnp.float32) * 0.02
    wb = w.astype(jnp.bfloat16)
    qs = {fmt: quantize(w, fmt, axis=0, validate=False) for fmt in ("nvfp4", "mxfp4")}
    pws = {fmt: kernels.prepare_weight(q) for fmt, q in qs.items()}
    for kb in (8, 2):
      if any(f"nvfp4_kb{kb}" in dense_variants(k, n, b) for b in bs):
        pws[f"nvfp4_kb{kb}"] = kernels.prepare_weight(qs["nvfp4"], kb=kb)
        qs[f"nvfp4_kb{kb}"] = qs["nvfp4"]
    for var in ("nvfp4", "nvfp4_kb8"):
      if var in pws:
        pws[var + "_nosk"], qs[var + "_nosk"] = pws[var], qs[var]
    for var in ("nvfp4_dot", *GROUP_VARIANTS):
      pws[var], qs[var] = pws["nvfp4"], qs["nvfp4"]
    for b in bs:
      x = jax.random.normal(nk(), (b, k), jnp.float32).astype(jnp.bfloat16)
      base = None
      for var in dense_variants(k, n, b):
        name = f"{sname}_B{b}_{var}"
        if not want(name):
          continue
        row = dict(name=name, kind="dense", K=k, N=n, B=b, variant=var)
        state.update(t=time.time(), name=name)
        try:
          if var in ("xla_bf16", "xla_bf16_engine"):
            wbytes = k * n * 2
            # the engine's path (dispatch.xla_matmul: one row gets a zero second row)
            fn = ((lambda x, w: x @ w) if var == "xla_bf16" else
                  (lambda x, w: dispatch.matmul(x, w, jnp.bfloat16, use_kernel=False)))
            wt = wb
            if not args.dry:
              ref = reference.matmul_ref(x.astype(jnp.float32), wb.astype(jnp.float32))
              row["relerr_bf16"] = relerr(jax.jit(fn)(x, wb), ref)
          else:
            pw, q = pws[var], qs[var]
            wbytes = pw.nbytes
            row["bytes_qarray"] = q.nbytes
            if var in GROUP_VARIANTS:
              fn = lambda x, w, cfg=GROUP_VARIANTS[var], dt=jnp.bfloat16: (
                  fp4_mgpu.matmul_as_group(x, w, out_dtype=dt, config=cfg))
            elif var == "nvfp4_dot":
              def fn(x, w, dt=jnp.bfloat16):
                a, factor = dispatch.decode_parts(w)
                return dispatch.xla_matmul(x, (a[0], factor[0]), dt)
            else:
              cfg = dict(stream_k=0) if var.endswith("_nosk") else None
              fn = lambda x, w, cfg=cfg, dt=jnp.bfloat16: kernels.matmul(
                  x, w, dt, use_kernel=force, config=cfg)
            wt = pw
            if not args.dry:
              ref = reference.matmul_ref(x, q, jnp.float32)
              got32 = jax.jit(lambda x, w: fn(x, w, dt=jnp.float32))(x, pw)
              row["relerr_f32"] = relerr(got32, ref)
              row["relerr_bf16"] = relerr(jax.jit(fn)(x, pw), ref)
          row["bytes_weights"] = wbytes
          nbytes = wbytes + b * k * 2 + b * n * 2
          row["bytes_total"] = nbytes
          row.update(time_fn(fn, (x,), copies_of(wt, n_copies(wbytes))))
          add_bandwidth(row, nbytes)
          if var == "xla_bf16":
            base = row
          elif base is not None:
            row["speedup_vs_bf16_kernel"] = base["us_call"] / row["us_kernel"]
            row["speedup_vs_bf16_call"] = base["us_call"] / row["us_call"]
        except Exception:  # noqa: BLE001 - record and go on
          row["error"] = traceback.format_exc()[-3000:]
        state["t"] = None
        record(row)

  # ------------------------------------------------------------------ grouped (experts)
  # 2,208 rows: the 8k-capacity rollout's decode batch (276 sequences x top-8)
  grouped = [("moe_gateup_E128_K2048_N1536", 128, 2048, 1536, (8, 64, 256, 512, 2208, 32768)),
             ("moe_down_E128_K768_N2048", 128, 768, 2048, (8, 64, 256, 512, 2208))]
  if args.quick:
    grouped = [("moe_gateup_E128_K2048_N1536", 128, 2048, 1536, (256,))]
  more = tuple(int(m) for m in args.grouped_rows.split(",") if m)
  grouped = [(sname, e, k, n, ms + tuple(m for m in more if m not in ms))
             for sname, e, k, n, ms in grouped]
  def grouped_variants(e, n, m):
    """The rows of one expert shape and row count. nvfp4_auto: the engine's choice
    (fp4_mgpu.grouped_parallelism); nvfp4[_inD][_sS]: D column tiles per CTA (default 1), S K
    splits (default: the rule's for that D); nvfp4_auto_bmR: R rows per chunk."""
    n_tiles = -(-n // 256)
    bm_of = lambda m: fp4_mgpu.grouped_bm(m, e)  # noqa: E731
    inner = sorted({d for d in (2, 4, n_tiles) if n_tiles % d == 0 and d > 1})
    return (["xla_bf16"] + (["tokamax_bf16"] if tokamax_ok else [])
            + (["bf16_mgpu"] if m <= bf16_mgpu.MAX_ROWS else [])
            + ["nvfp4_auto", "nvfp4", "nvfp4_s1"] + (["nvfp4_s2"] if m <= 64 else [])
            + (["nvfp4_auto_nosk", "nvfp4_auto_mk"]
               if fp4_mgpu.grouped_stream_k(m, bm_of(m), False, {}) else [])
            + [f"nvfp4_in{d}" for d in inner] + ["mxfp4"]
            + ([f"nvfp4_auto_bm{b}" for b in fp4_mgpu.BM_CHOICES
                if b != fp4_mgpu.grouped_bm(m, e)] if 1024 <= m <= 4096 else []))

  for sname, e, k, n, ms in grouped:
    # sizes none of whose rows is asked for are skipped before their setup
    ms = [m for m in ms if any(want(f"{sname}_M{m}_{v}") for v in grouped_variants(e, n, m))]
    if not ms:
      continue
    w = jax.random.normal(nk(), (e, k, n), jnp.float32) * 0.02
    wb = w.astype(jnp.bfloat16)
    qs = {fmt: quantize(w, fmt, axis=1, second_level=(0,), validate=False)
          for fmt in ("nvfp4", "mxfp4")}
    pws = {fmt: kernels.prepare_weight(q) for fmt, q in qs.items()}
    del w
    for m in ms:
      tokens = m // 8
      # top-8 routing of random tokens: distinct experts per token, rows sorted by expert
      logits = jax.random.normal(nk(), (tokens, e))
      top = jax.lax.top_k(logits, 8)[1].reshape(-1)
      gs = jnp.bincount(top, length=e).astype(jnp.int32)
      nonempty = int(jnp.sum(gs > 0))
      x = jax.random.normal(nk(), (m, k), jnp.float32).astype(jnp.bfloat16)
      base = tok = None
      for var in grouped_variants(e, n, m):
        name = f"{sname}_M{m}_{var}"
        if not want(name):
          continue
        row = dict(name=name, kind="grouped", E=e, K=k, N=n, M=m, variant=var,
                   experts_with_rows=nonempty, max_group=int(jnp.max(gs)))
        state.update(t=time.time(), name=name)
        try:
          if var in ("xla_bf16", "tokamax_bf16", "bf16_mgpu"):
            wbytes = e * k * n * 2
            if var == "xla_bf16":
              fn = lambda x, g, w: jax.lax.ragged_dot(x, w, g, preferred_element_type=jnp.float32
                                                      ).astype(jnp.bfloat16)
            elif var == "tokamax_bf16":  # the BF16 engine's default on the GPU
              fn = lambda x, g, w: dispatch._ragged_bf16(x, w, g).astype(jnp.bfloat16)
            else:  # our Mosaic kernel for bf16 experts (opt-in: TRACE_JAX_BF16_GROUPED=kernel)
              fn = lambda x, g, w: bf16_mgpu.grouped_matmul(x, w, g)
              row["n_inner_splits"] = bf16_mgpu.parallelism(m, e, k, n)
            wt = wb
            if not args.dry:
              ref = reference.grouped_matmul_ref(x.astype(jnp.float32),
                                                 wb.astype(jnp.float32), gs)
              row["relerr_bf16"] = relerr(jax.jit(fn)(x, gs, wb), ref)
              if var == "bf16_mgpu":
                row["relerr_f32"] = relerr(jax.jit(lambda x, g, w: bf16_mgpu.grouped_matmul(
                    x, w, g, out_dtype=jnp.float32))(x, gs, wb), ref)
          else:
            fmt, *opts = var.split("_")
            cfg = {} if "auto" in opts else dict(n_inner=1)
            for o in opts:
              if o.startswith("bm"):  # rows per chunk (default: fp4_mgpu.grouped_bm)
                cfg["bm"] = int(o[2:])
              elif o == "nosk":  # the chunk schedule where the default is stream-K
                cfg["stream_k"] = False
              elif o == "mk":  # stream-K, the cut tiles' parts added in the kernel
                cfg["merge"] = "kernel"
              elif o.startswith("in"):
                cfg["n_inner"] = int(o[2:])
              elif o.startswith("s"):
                cfg["splits"] = int(o[1:])
            k_steps = pws[fmt].k_pad // (64 * pws[fmt].kb)
            row["config"] = cfg
            row["bm"] = cfg.get("bm") or fp4_mgpu.grouped_bm(m, e)  # rows per chunk it ran
            row["n_inner_splits"] = fp4_mgpu.grouped_parallelism(
                min(m, e), pws[fmt].n_pad // 256, k_steps, cfg.get("n_inner"), cfg.get("splits"))
            row["stream_k"] = cfg.get("stream_k", fp4_mgpu.grouped_stream_k(
                m, row["bm"], False, cfg))
            pw, q = pws[fmt], qs[fmt]
            wbytes = pw.nbytes
            row["bytes_qarray"] = q.nbytes
            fn = lambda x, g, w, cfg=cfg: kernels.grouped_matmul(x, w, g, use_kernel=force,
                                                                 config=cfg)
            wt = pw
            if not args.dry:
              ref = reference.grouped_matmul_ref(x, q, gs, jnp.float32)
              got32 = jax.jit(lambda x, g, w: kernels.grouped_matmul(
                  x, w, g, jnp.float32, config=cfg))(x, gs, pw)
              row["relerr_f32"] = relerr(got32, ref)
              row["relerr_bf16"] = relerr(jax.jit(fn)(x, gs, pw), ref)
          touched = wbytes * nonempty / e
          nbytes = touched + m * k * 2 + m * n * 2
          row.update(bytes_weights=wbytes, bytes_weights_touched=touched, bytes_total=nbytes)
          row["flops"] = 2 * m * k * n
          row.update(time_fn(fn, (x, gs), copies_of(wt, n_copies(wbytes))))
          add_bandwidth(row, nbytes)
          row["TFLOPs_call"] = row["flops"] / (row["us_call"] * 1e-6) / 1e12
          if var == "xla_bf16":
            base = row
          elif var == "tokamax_bf16":
            tok = row
          if var != "xla_bf16" and base is not None:
            row["speedup_vs_bf16_call"] = base["us_call"] / row["us_call"]
          if var not in ("xla_bf16", "tokamax_bf16") and tok is not None:
            row["speedup_vs_tokamax_call"] = tok["us_call"] / row["us_call"]
        except Exception:  # noqa: BLE001
          row["error"] = traceback.format_exc()[-3000:]
        state["t"] = None
        record(row)

  log("DONE")
  print("\nname                                       us_call  us_kern  TB/s(k)  x_bf16  "
        "meas/floor  relerr_f32  relerr_bf16")
  for r in res["rows"]:
    if "error" in r:
      print(f"{r['name']:42s} ERROR {r['error'].strip().splitlines()[-1][:100]}")
      continue
    sp = r.get("speedup_vs_bf16_call")
    if args.dry:
      print(f"{r['name']:42s} lowered ({r.get('compile_s')} s)")
      continue
    print(f"{r['name']:42s} {r['us_call']:8.1f} {r['us_kernel']:8.1f} {r['TBps_kernel']:7.2f} "
          f"{(f'{sp:6.2f}' if sp else '     -')} {r['measured_over_floor_kernel']:10.2f} "
          f"{r.get('relerr_f32', float('nan')):11.2e} {r.get('relerr_bf16', float('nan')):11.2e}")


if __name__ == "__main__":
  main()
