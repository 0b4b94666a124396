"""Decode and prefill attention over a bf16 / MXFP8 / NVFP4 / MXFP4 KV cache on the GPU: check,
time, one JSON file + a table.

  PYTHONPATH=. python benchmarks/bench_attention.py --out bench_attention.json [--quick] \
      [--what decode|prefill|both] [--batches 16,64 --contexts 8192,32768]
  python benchmarks/bench_attention.py --plot bench_attention.json   # the PNG of a saved run

The decode rows also go to a PNG beside the JSON (time per call by KV format, and % of the
read ceiling, per batch x context).

Shape: one Qwen3-30B-A3B attention layer (32 query heads, 4 KV heads, head_dim 128), one query
token per sequence, batch B in {1, 16, 64} x context S in {1k, 8k, 32k} (combos whose bf16 KV
would exceed --max_gb are skipped) x KV format. Every slot is valid except a left-padded first
row, so the kernel streams the whole cache.

Per variant: the Pallas kernel (`attention_pallas.decode_attention`; row `nvfp4_mosaic`: the
Mosaic kernel, which the dispatch `kernels.decode_attention` picks for NVFP4 on GPU) is
checked against the reference (`decode_attention_ref`, the definition) on fresh random data
(max |kernel - ref| / max |ref|), then both are timed. Timing: CUPTI device time from
`jax.experimental.mosaic.gpu.profiler.measure(f, aggregate=False, iterations=n)` (median over
iterations, all kernels of the call: q split, the attention kernel, the combine) when it is
available, else a wall-clock loop with `block_until_ready` (the JSON says which). The cache is
rotated over enough copies to exceed the 60 MB L2. GB/s are on the KV bytes the call must read
(codes + block scales + NVFP4 per-token scales, K and V); % is of the 4.27 TB/s read ceiling.
Speedups: vs the bf16-KV kernel at the same B and S, and vs XLA's attention on the reference
path (same format, and bf16).

Prefill rows (`prefill_attention`, the flash kernel, against `prefill_attention_ref`, which
materializes float32 scores): B prompts of T tokens in a cache of T + 256 slots, the first row
left-padded by T/10; TFLOP/s count 4 * H * hd flops per visible (query, slot) pair.

Row `nvfp4_mosaic`: the Mosaic GPU NVFP4 kernel (`attention_mgpu`) on the NVFP4 cache; row
`nvfp4_mosaic_kvwords`: the same on the cache's codes bit-placed ("kv_words", the GPU default
since session 27: the kernel's decode 13 instructions a word instead of 17).

--sweep: launch configurations (tile, splits, warps, stages) of the decode kernels (Pallas, and
Mosaic splits/stages) at B=16/S=8k and B=64/S=1k (the RL rollout's shape) and of the prefill
kernel at B=16/T=2048, NVFP4 and bf16 KV, each checked against the reference and timed the same
way (kernel rows only). Each variant runs in try/except (errors are recorded); a watchdog ends a
hung run; variants stop at --budget_s of total time.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback

import numpy as np

import bench_util

READ_CEILING_TBPS = bench_util.READ_CEILING_TBPS
L2_BYTES = bench_util.L2_BYTES
H, KVH, HD = 32, 4, 128
# nvfp4_mosaic: attention_mgpu on nibble-packed codes, nvfp4_mosaic_kvwords: on "kv_words"
FORMATS = ("bf16", "mxfp8", "nvfp4", "nvfp4_mosaic", "nvfp4_mosaic_kvwords", "mxfp4")
T0 = time.time()


def log(*a):
  print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def plot(res: dict, path: str) -> None:
  """Decode rows of a run as a PNG: per (batch, context), each KV format's time per call and
  its share of the 4.27 TB/s read ceiling (on the bytes of its own cache)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  plot_live(res, path.removesuffix(".png") + "_live.png")
  rows = [r for r in res["rows"] if r.get("kind", "decode") == "decode" and "us_call" in r]
  if not rows:
    return
  groups = sorted({(r["batch"], r["context"]) for r in rows})
  fmts = [f for f in FORMATS if any(r["kv"] == f for r in rows)]
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  width = 0.8 / len(fmts)
  for i, fmt in enumerate(fmts):
    by = {(r["batch"], r["context"]): r for r in rows if r["kv"] == fmt}
    xs = [j + i * width for j in range(len(groups))]
    for ax, key in zip(axes, ("us_call", "pct_of_ceiling")):
      ax.bar(xs, [by[g][key] if g in by else 0 for g in groups], width, label=fmt)
  for ax, title in zip(axes, ("time per call (us, lower is better)",
                              "% of the 4.27 TB/s read ceiling on its KV bytes")):
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"B{b}\nS{s // 1024}k" for b, s in groups])
    ax.set_title(title, fontsize=10)
  axes[0].legend(fontsize=8)
  _save(fig, "decode attention, 32 q / 4 KV heads x 128", res, path)


def _save(fig, title: str, res: dict, path: str) -> None:
  """Title a figure with the run's device, jax version, date and commit; write it; close it."""
  import matplotlib.pyplot as plt
  fig.suptitle(f"{title}, {res.get('device_kind', '')} jax {res.get('jax_version', '')} "
               f"{res.get('date', '')} {res.get('git_commit', '')[:7]}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_live(res: dict, path: str) -> None:
  """The `--live` rows as a PNG: per (batch, cache slots, live slots), the Mosaic NVFP4 kernel's
  device time by split count and with the stream schedule, the bf16-KV kernel's as a line."""
  rows = [r for r in res["rows"] if r.get("kind") == "decode_live" and "us_kernel" in r]
  if not rows:
    return
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  groups = sorted({(r["batch"], r["context"], r["live"]) for r in rows}, key=lambda g: -g[0])
  fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.6), squeeze=False)
  for ax, (b, s, live) in zip(axes[0], groups):
    mine = [r for r in rows if (r["batch"], r["context"], r["live"]) == (b, s, live)]
    fp4 = [r for r in mine if r["kv"] == "nvfp4"]
    ax.bar([str(r["config"].get("splits", "stream")) for r in fp4], [r["us_kernel"] for r in fp4],
           color="tab:blue", label="NVFP4 KV (Mosaic)")
    for r in mine:
      if r["kv"] == "bf16":
        ax.axhline(r["us_kernel"], color="tab:red", ls="--", label="bf16 KV (Pallas)")
    ax.set_title(f"B{b}, cache {s}, {live} live", fontsize=10)
    ax.set_xlabel("splits (or the stream schedule)")
    ax.set_ylabel("kernel us (lower is better)")
  axes[0][0].legend(fontsize=8)
  _save(fig, "decode attention, cache sized past the live context", res, path)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default="bench_attention.json", help="result JSON path")
  ap.add_argument("--quick", action="store_true", help="B 16, S 8k only")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--max_gb", type=float, default=20.0, help="skip combos with more bf16 KV")
  ap.add_argument("--budget_s", type=float, default=200.0, help="start no variant after this")
  ap.add_argument("--hang_s", type=float, default=90.0)
  ap.add_argument("--batches", default="", help="decode batch sizes, e.g. 16,64 (else by --quick)")
  ap.add_argument("--formats", default=",".join(FORMATS), help="decode KV formats to run")
  ap.add_argument("--contexts", default="", help="decode cache lengths, e.g. 8192,32768")
  ap.add_argument("--what", default="both", choices=("decode", "prefill", "both"))
  ap.add_argument("--sweep", action="store_true",
                  help="after the rows: time launch configurations of both kernels (rows of "
                       "kind decode_sweep / prefill_sweep) to choose their defaults")
  ap.add_argument("--live", default="",
                  help="rollout-shaped decode rows BxSxL (cache S slots, L live), e.g. "
                       "276x8192x1536,64x8192x1536: Mosaic split counts and the bf16 kernel")
  ap.add_argument("--live_kernels", default="splits,stream,bf16",
                  help="which kernels the --live rows run: Mosaic split counts, its stream "
                       "schedule, the bf16-KV kernel")
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--dry", action="store_true",
                  help="CPU with jax-cuda13-plugin: only lower every kernel for cuda")
  args = ap.parse_args()
  if args.plot:
    with open(args.plot) as f:
      plot(json.load(f), args.plot.removesuffix(".json") + ".png")
    return

  import jax
  import jax.numpy as jnp

  from trace_jax import kernels
  from trace_jax import provenance
  from trace_jax import quant as tq
  from trace_jax.kernels import attention_mgpu, attention_pallas

  try:
    from jax.experimental.mosaic.gpu import profiler
    timing = "cupti_device_time(profiler.measure)"
  except Exception:  # noqa: BLE001 - no Mosaic GPU profiler in this jax
    profiler, timing = None, "wall_clock(block_until_ready)"

  res = dict(benchmark="decode_attention", **provenance.run_info(), timing=timing,
             shape=dict(num_heads=H, num_kv_heads=KVH, head_dim=HD),
             read_ceiling_TBps=READ_CEILING_TBPS,
             units=dict(us="microseconds per call (median)", GBps="1e9 KV bytes/s",
                        pct_of_ceiling="GBps / 4270", relerr_max="max|kernel-ref|/max|ref|"),
             rows=[])

  def save():
    with open(args.out, "w") as f:
      json.dump(res, f, indent=1, default=str)

  state = {}
  bench_util.start_watchdog(state, args.hang_s, res["rows"], save, log)

  def kernel_fn(q, k, v, valid):  # the Pallas kernel (the dispatch would pick Mosaic for NVFP4)
    return attention_pallas.decode_attention(q, k, v, valid)

  def mosaic_fn(q, k, v, valid):
    return attention_mgpu.decode_attention(q, k, v, valid)

  def ref_fn(q, k, v, valid):
    return kernels.decode_attention_ref(q, k, v, valid)

  def time_fn(fn, q, kvs, valid, kernel_name="decode_attention"):
    """Median us per call of fn over the copies `kvs` (one jit, all copies per iteration)."""
    one = jax.jit(fn)  # one callee: the kernel is lowered (and Triton-compiled) once
    multi = jax.jit(lambda q, kvs, valid: [one(q, k, v, valid) for k, v in kvs])
    if args.dry:
      with bench_util.abstract_h200():
        multi.trace(q, kvs, valid).lower(lowering_platforms=("cuda",))
      return float("nan"), float("nan")
    compiled = multi.lower(q, kvs, valid).compile()
    n = len(kvs)
    if profiler is not None:
      try:
        _, tim = profiler.measure(compiled, aggregate=False, iterations=args.iters)(q, kvs, valid)
        per_iter, per_kernel = [], []
        for it in tim:
          per_iter.append(sum(ms for _, ms in it) * 1e3)
          per_kernel.append(sum(ms for name, ms in it if kernel_name in name) * 1e3)
        us_kernel = statistics.median(per_kernel) / n
        return statistics.median(per_iter) / n, us_kernel if us_kernel > 0 else float("nan")
      except Exception:  # noqa: BLE001 - fall back to wall clock, say so in the row
        state["timing_fallback"] = traceback.format_exc()[-500:]
    jax.block_until_ready(compiled(q, kvs, valid))
    ts = []
    for _ in range(args.iters):
      t = time.perf_counter()
      jax.block_until_ready(compiled(q, kvs, valid))
      ts.append((time.perf_counter() - t) * 1e6 / n)
    return statistics.median(ts), float("nan")

  def make_kv(fmt, shape, key):
    def build(key):
      x = jax.random.normal(key, shape, jnp.bfloat16)
      return x if fmt == "bf16" else tq.quantize(x, fmt, second_level="row", validate=False)
    if args.dry:
      return jax.eval_shape(build, key)
    return jax.jit(build)(key)

  def nbytes(x):
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(x))

  relerr = bench_util.relerr_max

  def run_row(row, fill, describe):
    """Unless past the time budget: fill(row) (errors recorded in the row), then save and log
    the row (describe(row): its figures)."""
    if time.time() - T0 > args.budget_s:
      row["skipped"] = f"time budget {args.budget_s} s"
      res["rows"].append(row)
      return
    state.update(t=time.time(), name=row["name"])
    try:
      fill(row)
    except Exception:  # noqa: BLE001 - record and go on
      row["error"] = traceback.format_exc()[-3000:]
    state["t"] = None
    res["rows"].append(row)
    save()
    log(f"{row['name']:26s} {describe(row)} err={row.get('relerr_max')} "
        f"{row.get('error', '')[-300:]}")

  nan = float("nan")
  batches, contexts = ((16,), (8192,)) if args.quick else ((1, 16, 64), (1024, 8192, 32768))
  if args.batches:
    batches = tuple(int(x) for x in args.batches.split(","))
  if args.contexts:
    contexts = tuple(int(x) for x in args.contexts.split(","))
  if args.what == "prefill":
    batches = ()
  key = jax.random.key(int(time.time()) % 100000)  # fresh data every run
  base = {}  # (b, s) -> bf16 kernel / reference us

  def decode_row(b, s, fmt, row):
    nonlocal key
    key, kq, kk, kv = jax.random.split(key, 4)
    shape = (b, s, KVH, HD)
    data_fmt, _, variant = fmt.partition("_")
    kfn = mosaic_fn if variant.startswith("mosaic") else kernel_fn
    k, v = make_kv(data_fmt, shape, kk), make_kv(data_fmt, shape, kv)
    if variant.endswith("kvwords"):
      pack = functools.partial(tq.with_packing, packing="kv_words")
      k, v = (jax.eval_shape(pack, x) if args.dry else jax.jit(pack)(x) for x in (k, v))
    q = (jax.ShapeDtypeStruct((b, H, HD), jnp.bfloat16) if args.dry
         else jax.random.normal(kq, (b, H, HD), jnp.bfloat16))
    valid = np.ones((b, s), bool)
    valid[0, : s // 10] = False  # a left-padded row
    valid = jnp.asarray(valid)
    if not args.dry:
      why = (attention_mgpu if variant else attention_pallas).kernel_supported(
          q, k, v)
      if why:
        raise ValueError(why)
    m = attention_mgpu  # the Mosaic kernel runs its defaults (settings: TRACE_JAX_ATTN_*)
    halves = m.default_v_halves(False, m.MERGE_IN_KERNEL)
    fit = m.max_stages(m.query_lanes(H // KVH), m.MERGE_IN_KERNEL, halves)
    cfg = (dict(schedule=m.SCHEDULE, stages=min(m.STAGES, fit), auto_barriers=m.AUTO_BARRIERS,
                v_halves=halves,
                splits=m.default_splits(b, s) if m.SCHEDULE == "splits" else None) if variant
           else attention_pallas.default_config(b, KVH, s, data_fmt.endswith("fp4")))
    kv_bytes = nbytes(k) + nbytes(v)
    row.update(kv_bytes=kv_bytes, config=cfg)
    if not args.dry:
      got = jax.jit(kfn)(q, k, v, valid)
      want = jax.jit(ref_fn)(q, k, v, valid)
      row["relerr_max"] = relerr(got, want)
      del got, want
    n = int(min(16, max(1, np.ceil(2.5 * L2_BYTES / kv_bytes))))
    kvs = [(k, v)] + [jax.tree.map(jnp.copy, (k, v)) for _ in range(n - 1)] if (
        not args.dry) else [(k, v)] * n
    row["n_copies"] = n
    us, us_kernel = time_fn(kfn, q, kvs, valid)
    us_ref, _ = time_fn(ref_fn, q, kvs, valid)
    del kvs
    row.update(us_call=us, us_kernel=us_kernel, us_xla_ref=us_ref,
               GBps=kv_bytes / us / 1e3, GBps_kernel_only=kv_bytes / us_kernel / 1e3,
               pct_of_ceiling=100 * kv_bytes / us / 1e3 / (READ_CEILING_TBPS * 1e3),
               speedup_vs_xla_ref=us_ref / us)
    if state.pop("timing_fallback", None):
      row["timing"] = "wall_clock(block_until_ready) after profiler error"
    if fmt == "bf16":
      base[(b, s)] = (us, us_ref)
    if (b, s) in base:
      row["speedup_vs_bf16_kernel"] = base[(b, s)][0] / us
      row["speedup_vs_xla_ref_bf16"] = base[(b, s)][1] / us

  for b in batches:
    for s in contexts:
      if b * s * KVH * HD * 2 * 2 > args.max_gb * 1e9:
        res["rows"].append(dict(name=f"B{b}_S{s}", skipped=f"bf16 KV over {args.max_gb} GB"))
        continue
      for fmt in args.formats.split(","):
        run_row(dict(name=f"B{b}_S{s}_{fmt}", batch=b, context=s, kv=fmt, timing=timing),
                functools.partial(decode_row, b, s, fmt),
                lambda r: f"us={r.get('us_call', nan):9.1f} GB/s={r.get('GBps', nan):7.0f}")

  def prefill_kernel_fn(q, k, v, key_mask):
    return kernels.prefill_attention(q, k, v, key_mask, 0, use_kernel=True)

  def prefill_ref_fn(q, k, v, key_mask):
    return kernels.prefill_attention_ref(q, k, v, key_mask, 0)

  def prefill_row(b, t, s, fmt, row):
    nonlocal key
    key, kq, kk, kv = jax.random.split(key, 4)
    k, v = make_kv(fmt, (b, s, KVH, HD), kk), make_kv(fmt, (b, s, KVH, HD), kv)
    q = (jax.ShapeDtypeStruct((b, t, H, HD), jnp.bfloat16) if args.dry
         else jax.random.normal(kq, (b, t, H, HD), jnp.bfloat16))
    mask = np.zeros((b, s), bool)
    mask[:, :t] = True
    mask[0, : t // 10] = False
    visible = int(np.cumsum(mask[:, :t], axis=1).sum())  # query i sees slots <= i
    flops = 4 * H * HD * visible
    row.update(config=attention_pallas.default_prefill_config(t * H // KVH, fmt.endswith("fp4")),
               flops=flops)
    mask = jnp.asarray(mask)
    if not args.dry:
      got = jax.jit(prefill_kernel_fn)(q, k, v, mask)
      want = jax.jit(prefill_ref_fn)(q, k, v, mask)
      # queries before t/10 see no slot in row 0 (kernel 0, reference mean of V): skipped
      row["relerr_max"] = relerr(got[:, t // 10:], want[:, t // 10:])
      del got, want
    us, us_kernel = time_fn(prefill_kernel_fn, q, [(k, v)], mask, "prefill_attention")
    row.update(us_call=us, us_kernel=us_kernel, TFLOPs=flops / us / 1e6)
    try:
      us_ref, _ = time_fn(prefill_ref_fn, q, [(k, v)], mask)
      row.update(us_xla_ref=us_ref, speedup_vs_xla_ref=us_ref / us)
    except Exception:  # noqa: BLE001 - the reference can run out of memory at long prompts
      row["xla_ref_error"] = traceback.format_exc()[-1000:]

  shapes = () if args.what == "decode" else (((16, 2048),) if args.quick else
                                              ((16, 2048), (64, 2048), (4, 8192)))
  for b, t in shapes:
    s = t + 256
    for fmt in ("bf16", "nvfp4"):
      run_row(dict(name=f"prefill_B{b}_T{t}_{fmt}", kind="prefill", batch=b, prompt=t,
                   cache_slots=s, kv=fmt, timing=timing),
              functools.partial(prefill_row, b, t, s, fmt),
              lambda r: (f"us={r.get('us_call', nan):10.1f} TFLOP/s={r.get('TFLOPs', nan):6.1f} "
                         f"x_xla={r.get('speedup_vs_xla_ref', nan):5.2f}"))

  def sweep_row(kind, name, fn, cfg, q, kvs, mask, want, kernel_name):
    def fill(row):
      f = functools.partial(fn, config=cfg)
      if not args.dry:
        row["relerr_max"] = relerr(jax.jit(f)(q, *kvs[0], mask), want)
      row["us_call"], row["us_kernel"] = time_fn(f, q, kvs, mask, kernel_name)
    run_row(dict(name=name, kind=kind, config=cfg, timing=timing), fill,
            lambda r: f"us={r.get('us_call', nan):9.1f}")

  def variants(base, changes):
    out = []
    for ch in [{}] + changes:
      c = dict(base, **ch)
      if c not in out:
        out.append(c)
    return out

  for b, s in ((16, 8192), (64, 1024)) if args.sweep else ():
    for fmt in ("nvfp4", "bf16"):
      d = attention_pallas.default_config(b, KVH, s, fmt == "nvfp4")
      key, kq, kk, kv = jax.random.split(key, 4)
      k, v = make_kv(fmt, (b, s, KVH, HD), kk), make_kv(fmt, (b, s, KVH, HD), kv)
      q = (jax.ShapeDtypeStruct((b, H, HD), jnp.bfloat16) if args.dry
           else jax.random.normal(kq, (b, H, HD), jnp.bfloat16))
      valid = jnp.ones((b, s), bool)
      want = None if args.dry else jax.jit(ref_fn)(q, k, v, valid)
      n = int(min(16, max(1, np.ceil(2.5 * L2_BYTES / (nbytes(k) + nbytes(v))))))
      kvs = [(k, v)] + [jax.tree.map(jnp.copy, (k, v)) for _ in range(n - 1)] if (
          not args.dry) else [(k, v)] * n
      changes = [dict(num_warps=8), dict(splits=2 * d["splits"]), dict(splits=4 * d["splits"]),
                 dict(block_k=64), dict(block_k=64, splits=2 * d["splits"]), dict(num_stages=3),
                 dict(num_warps=8, splits=2 * d["splits"]), dict(block_k=32, num_warps=2)]
      if fmt == "bf16":
        changes = changes[:2]
      for cfg in variants(d, changes):
        tag = "_".join(f"{a}{cfg[a]}" for a in ("block_k", "splits", "num_warps", "num_stages"))
        sweep_row("decode_sweep", f"sweep_B{b}_S{s}_{fmt}_{tag}",
                  attention_pallas.decode_attention, cfg, q, kvs,
                  valid, want, "decode_attention")
      if fmt == "nvfp4":  # the Mosaic kernel: splits and pipeline stages
        dm = attention_mgpu.default_splits(b, s)
        for cfg in variants(dict(splits=dm, stages=2, overlap=False), [
            dict(splits=2 * dm), dict(splits=max(1, dm // 2)), dict(stages=1),
            dict(overlap=True), dict(overlap=True, splits=2 * dm)]):
          sweep_row("decode_sweep", f"sweep_B{b}_S{s}_nvfp4_mosaic_splits{cfg['splits']}"
                    f"_stages{cfg['stages']}" + ("_overlap" if cfg["overlap"] else ""),
                    functools.partial(kernels.decode_attention, use_kernel="mosaic"), cfg, q,
                    kvs, valid, want, "decode_attention")
      del kvs

  # rollout-shaped decode: a cache sized for the longest context, L slots live (prompts
  # left-padded, every row at the same slot as in the engine): the Mosaic kernel's split counts
  # (splits past the live tiles exit at once) and its stream schedule beside the bf16-KV kernel
  # on the same rows
  for spec in filter(None, args.live.split(",")):
    b, s, live = (int(x) for x in spec.lower().split("x"))
    mask = np.arange(s)[None].repeat(b, 0) < live
    mask[0, : live // 10] = False
    mask = jnp.asarray(mask)
    tiles = -(-s // attention_mgpu.TILE)
    dm = attention_mgpu.default_splits(b, s)
    live_kernels = set(args.live_kernels.split(","))
    for fmt in ("nvfp4", "bf16") if "bf16" in live_kernels else ("nvfp4",):
      key, kq, kk, kv = jax.random.split(key, 4)
      k, v = make_kv(fmt, (b, s, KVH, HD), kk), make_kv(fmt, (b, s, KVH, HD), kv)
      q = (jax.ShapeDtypeStruct((b, H, HD), jnp.bfloat16) if args.dry
           else jax.random.normal(kq, (b, H, HD), jnp.bfloat16))
      want = None if args.dry else jax.jit(ref_fn)(q, k, v, mask)
      live_bytes = (nbytes(k) + nbytes(v)) * live / s
      n = int(min(4, max(1, np.ceil(2.5 * L2_BYTES / live_bytes))))  # live bytes past L2
      kvs = [(k, v)] + [jax.tree.map(jnp.copy, (k, v)) for _ in range(n - 1)] if (
          not args.dry) else [(k, v)] * n
      if fmt == "bf16":
        cfgs = [("pallas", attention_pallas.decode_attention,
                 attention_pallas.default_config(b, KVH, s, False))]
      else:
        mosaic = functools.partial(kernels.decode_attention, use_kernel="mosaic")
        cfgs = [(f"mosaic_splits{n}", mosaic, dict(splits=n))
                for n in sorted({dm, *(tiles // t for t in (32, 16, 8, 4, 2) if tiles >= t)})
                if "splits" in live_kernels]
        if "stream" in live_kernels:
          cfgs.append(("mosaic_stream", mosaic, dict(schedule="stream")))
      for tag, fn, cfg in cfgs:
        name = f"live_B{b}_S{s}_L{live}_{fmt}_{tag}"
        sweep_row("decode_live", name, fn, cfg, q, kvs, mask, want, "decode_attention")
        r = res["rows"][-1]
        if "us_call" in r:
          r.update(batch=b, context=s, live=live, kv=fmt, live_kv_bytes=live_bytes,
                   pct_of_ceiling_live=100 * live_bytes / r["us_call"] / 1e3
                   / (READ_CEILING_TBPS * 1e3))
      del k, v, kvs

  for b, t in ((16, 2048),) if args.sweep else ():
    s = t + 256
    for fmt in ("nvfp4", "bf16"):
      d = attention_pallas.default_prefill_config(t * H // KVH, fmt == "nvfp4")
      key, kq, kk, kv = jax.random.split(key, 4)
      k, v = make_kv(fmt, (b, s, KVH, HD), kk), make_kv(fmt, (b, s, KVH, HD), kv)
      q = (jax.ShapeDtypeStruct((b, t, H, HD), jnp.bfloat16) if args.dry
           else jax.random.normal(kq, (b, t, H, HD), jnp.bfloat16))
      mask = jnp.asarray(np.arange(s)[None].repeat(b, 0) < t)
      want = None if args.dry else jax.jit(prefill_ref_fn)(q, k, v, mask)
      changes = [dict(block_k=32), dict(block_k=64), dict(block_k=128), dict(block_q=64),
                 dict(num_warps=4), dict(num_warps=8), dict(num_stages=3),
                 dict(block_k=128, num_stages=3)]
      if fmt == "bf16":
        changes = changes[:6]
      for cfg in variants(d, changes):
        tag = "_".join(f"{a}{cfg[a]}" for a in ("block_q", "block_k", "num_warps", "num_stages"))
        sweep_row("prefill_sweep", f"sweep_prefill_B{b}_T{t}_{fmt}_{tag}",
                  lambda q, k, v, m, config: kernels.prefill_attention(
                      q, k, v, m, 0, use_kernel=True, config=config),
                  cfg, q, [(k, v)], mask, want, "prefill_attention")

  res["total_s"] = round(time.time() - T0, 1)
  save()
  if not args.dry:
    plot(res, args.out.removesuffix(".json") + ".png")
  log("DONE ->", args.out)
  print(f"\ntiming: {timing}\n{'name':22s} {'us':>8s} {'us_kern':>8s} {'GB/s':>7s} {'%4.27':>6s} "
        f"{'x_bf16':>6s} {'x_xla':>6s} {'x_xlabf':>7s} {'relerr':>8s}")
  f = lambda r, k, fmt: format(r[k], fmt) if isinstance(r.get(k), float) else "-"  # noqa: E731
  for r in res["rows"]:
    if "error" in r or "skipped" in r:
      msg = r.get("skipped") or r["error"].strip().splitlines()[-1][:100]
      print(f"{r['name']:22s} {'SKIP' if 'skipped' in r else 'ERROR'} {msg}")
      continue
    if r.get("kind") in ("decode_sweep", "prefill_sweep", "decode_live"):
      print(f"{r['name']:22s} {f(r, 'us_call', '8.1f'):>8s} {f(r, 'us_kernel', '8.1f'):>8s} "
            f"relerr {f(r, 'relerr_max', '8.1e')}"
            + (f" {f(r, 'pct_of_ceiling_live', '5.1f')}% of 4.27 TB/s on live KV bytes"
               if r.get("kind") == "decode_live" else ""))
      continue
    if r.get("kind") == "prefill":
      print(f"{r['name']:22s} {f(r, 'us_call', '8.1f'):>8s} {f(r, 'us_kernel', '8.1f'):>8s} "
            f"TFLOP/s {f(r, 'TFLOPs', '6.1f')} x_xla {f(r, 'speedup_vs_xla_ref', '6.2f')} "
            f"relerr {f(r, 'relerr_max', '8.1e')}")
      continue
    print(f"{r['name']:22s} {f(r, 'us_call', '8.1f'):>8s} {f(r, 'us_kernel', '8.1f'):>8s} "
          f"{f(r, 'GBps', '7.0f'):>7s} {f(r, 'pct_of_ceiling', '6.1f'):>6s} "
          f"{f(r, 'speedup_vs_bf16_kernel', '6.2f'):>6s} {f(r, 'speedup_vs_xla_ref', '6.2f'):>6s} "
          f"{f(r, 'speedup_vs_xla_ref_bf16', '7.2f'):>7s} {f(r, 'relerr_max', '8.1e'):>8s}")


if __name__ == "__main__":
  main()
