"""The decode step's MoE combine + residual add + norm kernel (`kernels/moe_combine.py`) against
the XLA ops it replaces (`combine_add_rms_norm_ref`) at the 30B-A3B decode shapes: each
variant's sum and norm checked against a numpy computation of the model's rule (products
rounded to bf16, summed in float32 slot after slot, rounded, added; the norm in float64 to
its roundings), timed with CUPTI (`profiler.measure`, all kernels of a call, median); one JSON.

  PYTHONPATH=. python benchmarks/bench_moe_combine.py --out bench_moe_combine.json

Rows: `xla` (the reference's XLA ops) and the kernel at 4 / 8 / 16 warps, per batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import numpy as np

import bench_util

D, K, CHUNK_ROWS = 2048, 8, 220 * 32


def _case(seed: int, batch: int):
  import jax.numpy as jnp
  import ml_dtypes

  from trace_jax.kernels import layout as L
  from trace_jax.kernels import moe_combine as MC
  rng = np.random.default_rng(seed)
  m = batch * K
  rows = rng.standard_normal((CHUNK_ROWS, D)).astype(ml_dtypes.bfloat16)
  slot = rng.permutation(CHUNK_ROWS)[:m].astype(np.int32)
  inverse = rng.permutation(m).astype(np.int32)
  w = rng.uniform(0, 1, (batch, K)).astype(np.float32)
  w /= w.sum(-1, keepdims=True)
  x = (rng.standard_normal((batch, 1, D)) * 4).astype(ml_dtypes.bfloat16)
  scale = rng.uniform(0.5, 2, D).astype(ml_dtypes.bfloat16)
  args = (jnp.asarray(x), L.ChunkRows(jnp.asarray(rows), jnp.asarray(slot), D),
          jnp.asarray(inverse), jnp.asarray(w), jnp.asarray(scale))
  return args, MC.combine_add_numpy(*args[:4])[0]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batches", default="256,64")
  ap.add_argument("--iters", type=int, default=50)
  ap.add_argument("--out", default="bench_moe_combine.json")
  a = ap.parse_args()
  import statistics

  import jax
  from jax.experimental.mosaic.gpu import profiler

  from trace_jax.kernels import moe_combine as MC
  res = bench_util.result_header("bench_moe_combine", rows=[])
  t0 = time.time()
  for batch in [int(b) for b in a.batches.split(",")]:
    args, want_s = _case(batch, batch)
    variants = {"xla": jax.jit(functools.partial(MC.combine_add_rms_norm_ref, eps=1e-6))}
    for warps in (4, 8, 16):
      variants[f"kernel_w{warps}"] = jax.jit(functools.partial(
          MC.combine_add_rms_norm, eps=1e-6, num_warps=warps))
    outs = {}
    for name, fn in variants.items():
      row = dict(batch=batch, variant=name)
      try:
        s, y = fn(*args)
        s = np.asarray(s).reshape(batch, D)
        outs[name] = (s, np.asarray(y, np.float32).reshape(batch, D))
        row["sum_off_vs_numpy"] = float((s.view(np.uint16) != want_s.view(np.uint16)).mean())
        _, tim = profiler.measure(fn.lower(*args).compile(), aggregate=False,
                                  iterations=a.iters)(*args)
        row["us"] = statistics.median(sum(ms for _, ms in it) * 1e3 for it in tim)
        row["kernels_per_call"] = len(tim[0])
      except Exception as e:  # noqa: BLE001 - a variant that fails is a row
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      if "xla" in outs and name in outs and name != "xla":
        row["norm_off_vs_xla"] = float((outs[name][1] != outs["xla"][1]).mean())
        row["norm_max_rel_vs_xla"] = float(np.max(np.abs(outs[name][1] - outs["xla"][1]) / (
            np.abs(outs["xla"][1]).max(-1, keepdims=True))))
      res["rows"].append(row)
      print(f"[{time.time() - t0:6.1f}s] B {batch} {name:11s} {row.get('us', float('nan')):7.2f}"
            f" us  sum off vs numpy {row.get('sum_off_vs_numpy')}  norm off vs xla "
            f"{row.get('norm_off_vs_xla')} {row.get('error', '')[:80]}", flush=True)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
