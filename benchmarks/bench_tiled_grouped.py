"""The trainer's float32 grouped matmul, forward and backward, two ways side by side in one
process: `jax.lax.ragged_dot` (`reference.grouped_matmul_ref`'s definition,
TRACE_JAX_GROUPED_REF=ragged_dot; XLA expands it into a dense product E times as large) and
`kernels.tiled_grouped` (a loop over row tiles of one group each, the default since session 51)
at several tile sizes. Each variant: the jitted value
and gradient of sum(y * g) (forward + dx + dw), checked against the ragged_dot variant (max
relative difference) and timed (CUPTI device time on the GPU, wall time elsewhere; median).

  PYTHONPATH=. python benchmarks/bench_tiled_grouped.py --out $OUT/bench_tiled_grouped.json
  python benchmarks/bench_tiled_grouped.py --plot bench_tiled_grouped.json   # the PNG only
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_util  # (a sibling module: see its docstring)
from trace_jax.kernels import tiled_grouped

# name: (rows M = tokens x top-k, experts, K, N): one expert product of the train step
CASES = {
    "mid_gate_up": (12288 * 4, 32, 512, 512),  # bench_parallel's mid: 256 rows x 48 tokens, top-4
    "mid_down": (12288 * 4, 32, 256, 512),
    "a3b_gate_up_2k": (2048 * 8, 128, 2048, 1536),  # 30B-A3B layer, 2,048 tokens, top-8
    "a3b_down_2k": (2048 * 8, 128, 768, 2048),
    "tiny_cpu": (512, 8, 64, 128),  # a CPU-sized check
}


def variant_fn(name: str, sizes):
  """jitted (x, w, g) -> (sum(y g), dx, dw) for "ragged_dot" or "tiles<T>[x<per step>]"."""
  if name == "ragged_dot":
    def f(x, w):
      return jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
  else:
    tile, _, per_step = name[len("tiles"):].partition("x")

    def f(x, w):
      return tiled_grouped.grouped_matmul(x, w, sizes, tile=int(tile),
                                          per_step=int(per_step or 1))

  def value_and_grads(x, w, g):
    loss, (dx, dw) = jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * g), argnums=(0, 1))(x, w)
    return loss, dx, dw
  return jax.jit(value_and_grads)


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one panel per case (log scale); PNG beside the JSON."""
  with open(json_path) as f:
    shapes = {r["case"]: r for r in json.load(f)["rows"]}

  def title(case):
    r = shapes[case]
    return f"{case}: M {r['m']}, E {r['experts']}, K {r['k']}, N {r['n']}"
  return bench_util.site_bars(json_path, title, log=True, panel="case")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default="mid_gate_up,mid_down,a3b_gate_up_2k,a3b_down_2k")
  ap.add_argument("--variants", default="ragged_dot,tiles128,tiles256,tiles512,tiles128x4,"
                  "tiles128x16,tiles64x8")
  ap.add_argument("--iters", type=int, default=10)
  ap.add_argument("--out", default="bench_tiled_grouped.json")
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  a = ap.parse_args()
  if a.plot:
    print(plot(a.plot))
    return
  res = bench_util.result_header("bench_tiled_grouped", **vars(a), rows=[],
                                 timing=bench_util.device_us_timing())
  t0 = time.time()
  for case in a.cases.split(","):
    m, e, k, n = CASES[case]
    rng = np.random.default_rng(0)
    sizes = np.bincount(rng.integers(0, e, m), minlength=e)  # routed rows per expert
    sizes_j = jnp.asarray(sizes, jnp.int32)
    key = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(key[0], (m, k), jnp.float32)
    w = jax.random.normal(key[1], (e, k, n), jnp.float32) * k ** -0.5
    g = jax.random.normal(key[2], (m, n), jnp.float32)
    want = None
    for variant in a.variants.split(","):
      row = dict(case=case, variant=variant, m=m, experts=e, k=k, n=n,
                 useful_gflop=6 * m * k * n / 1e9)  # forward, dx, dw
      try:
        fn = variant_fn(variant, sizes_j)
        out = jax.block_until_ready(fn(x, w, g))
        if want is None:
          want = out
        row["max_rel_diff_vs_first"] = max(
            bench_util.relerr_max(o, r) for o, r in zip(out[1:], want[1:], strict=True))
        del out
        row.update(bench_util.device_us(fn, (x, w, g), a.iters))
        row["useful_tflops"] = row["useful_gflop"] / row["us"] * 1e3  # GFLOP / us = PFLOP/s
      except Exception as e_:  # noqa: BLE001 - a variant that fails is a row, not the end
        row["error"] = f"{type(e_).__name__}: {e_}"[:300]
      res["rows"].append(row)
      print(f"[{time.time() - t0:6.1f}s] {case} {variant:10s} {row.get('us', float('nan')):10.1f}"
            f" us  rel diff {row.get('max_rel_diff_vs_first', float('nan')):.1e}  "
            f"{row.get('error', '')[:100]}", flush=True)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    by = {r["variant"]: r.get("us") for r in res["rows"] if r["case"] == case}
    for v, us in by.items():
      if us and by.get("ragged_dot") and v != "ragged_dot":
        print(f"  {case}: {v} / ragged_dot = {us / by['ragged_dot']:.3f}", flush=True)
  print(plot(a.out))


if __name__ == "__main__":
  main()
