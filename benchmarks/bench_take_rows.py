"""The backward of the trainer's two row gathers that repeat rows, three ways, side by side in one
process: XLA's scatter-add (`plain`: the gradient of `jnp.take`, atomics on the GPU, its order
not fixed), `kernels.take_rows`' sorted sum (`sorted`: stable sort by row, segmented scan, each
total written once) and `kernels.take_copies`' slot-order sum (`copies`: one gather of the
cotangents and a sum over each token's k slots; the MoE dispatch only).

Cases: the MoE dispatch (tokens x top-k rows of the hidden size, sorted by a random expert per
slot, as `kernels.route` sorts them; cotangents in --dtype, the compute dtype) and the token
embedding (token ids drawn Zipf-like, so frequent ids repeat as in text; float32, the parameters'
dtype, whose rows the model gathers before its cast). Each variant's backward alone is jitted
(the forward gather is dead code there), checked against a float64 enumeration on a sample of rows, run twice to see
whether it repeats bit for bit, and timed by CUPTI (`profiler.measure`, device time, median).

  PYTHONPATH=. python benchmarks/bench_take_rows.py --out $OUT/bench_take_rows.json
  python benchmarks/bench_take_rows.py --plot bench_take_rows.json   # the PNG of a saved run
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_util  # (a sibling module: see its docstring)
from trace_jax.kernels import repeatable_gather as rg

# name: (kind, x rows (tokens or vocabulary), cotangent rows per x row or tokens, width)
CASES = {
    "dispatch_a3b_32k": ("dispatch", 32768, 8, 2048),  # 16 x 2048 tokens, top-8, hidden 2048
    "dispatch_a3b_4k": ("dispatch", 4096, 8, 2048),
    "dispatch_mid": ("dispatch", 12288, 4, 512),  # bench_parallel's mid: 256 rows x 48 tokens
    "embed_a3b_32k": ("embed", 151936, 32768, 2048),  # vocabulary 151,936, 32,768 tokens
}


def backward(variant: str, n: int):
  """The gradient of the gather with respect to x, as a jitted fn(rows, inverse, g)."""
  def fn(rows, inverse, g):
    if variant == "plain":
      return jnp.zeros((n,) + g.shape[1:], g.dtype).at[rows].add(g)
    if variant == "sorted":
      return rg._take_rows_bwd(n, rows, g)[0]
    return rg._take_copies_bwd((inverse, n), g)[0]
  return jax.jit(fn)


def make_case(kind: str, n: int, per: int, d: int, dtype, seed: int = 0):
  """(rows, inverse or None, g) on the device and rows on the host."""
  rng = np.random.default_rng(seed)
  if kind == "dispatch":
    experts = rng.integers(0, 128, n * per)
    order = np.argsort(experts, kind="stable").astype(np.int32)
    rows, inverse = order // per, np.argsort(order).astype(np.int32)
    m = n * per
  else:
    rows = np.minimum(rng.zipf(1.1, per) - 1, n - 1).astype(np.int32)
    inverse, m = None, per
  g = jax.random.normal(jax.random.key(seed), (m, d), jnp.float32).astype(dtype)
  return rows, inverse, g


def sample_error(got, rows, g_host, sample) -> float:
  """Max |got - exact| / max|exact| over `sample` x rows, exact = float64 sum of their rows."""
  got = np.asarray(got[np.asarray(sample)], np.float64)
  want = np.stack([g_host[rows == r].astype(np.float64).sum(0) for r in sample])
  return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def plot(json_path: str) -> str:
  """Bars of us a call per variant, one panel per case (log scale); PNG beside the JSON."""
  with open(json_path) as f:  # each case's shape as it ran (a case's shape may change later)
    shapes = {r["case"]: r for r in json.load(f)["rows"]}

  def title(case):
    r = shapes[case]
    if r["kind"] == "dispatch":
      k = r["cotangent_rows"] // r["x_rows"]
      return f"{case}: {r['x_rows']} tokens x top-{k}, width {r['width']}"
    return f"{case}: {r['cotangent_rows']} tokens of {r['x_rows']}, width {r['width']}"
  return bench_util.site_bars(json_path, title, log=True, panel="case")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--cases", default=",".join(CASES))
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                  help="the dispatch cases' cotangents")
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--out", default="bench_take_rows.json")
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  a = ap.parse_args()
  if a.plot:
    print(plot(a.plot))
    return
  res = bench_util.result_header("bench_take_rows", **vars(a), rows=[],
                                 timing=bench_util.device_us_timing())
  t0 = time.time()
  for name in a.cases.split(","):
    kind, n, per, d = CASES[name]
    dtype = jnp.dtype(a.dtype if kind == "dispatch" else "float32")
    rows, inverse, g = make_case(kind, n, per, d, dtype)
    g_host = np.asarray(g.astype(jnp.float32))
    # the x rows checked: the most repeated ones and a spread of others
    counts = np.bincount(rows, minlength=n)
    sample = np.unique(np.concatenate([np.argsort(-counts)[:8], np.linspace(0, n - 1, 24,
                                                                            dtype=np.int64)]))
    args = (jnp.asarray(rows), None if inverse is None else jnp.asarray(inverse), g)
    m = g.shape[0]
    floor_bytes = (m + n) * d * dtype.itemsize + m * 4  # cotangents in, gradient out, rows
    for variant in ("plain", "sorted", "copies"):
      if variant == "copies" and inverse is None:
        continue
      row = dict(case=name, kind=kind, variant=variant, x_rows=n, cotangent_rows=m, width=d,
                 dtype=dtype.name, max_repeats=int(counts.max()), floor_bytes=floor_bytes)
      try:
        fn = backward(variant, n)
        first, second = fn(*args), fn(*args)
        row["repeats_bitwise"] = bool(jnp.array_equal(first, second))
        row["sample_relerr"] = sample_error(first, rows, g_host, sample)
        del first, second
        row.update(bench_util.device_us(fn, args, a.iters))
        row["floor_tbps_at_us"] = floor_bytes / row["us"] / 1e6
      except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end
        row["error"] = f"{type(e).__name__}: {e}"[:300]
      res["rows"].append(row)
      print(f"[{time.time() - t0:6.1f}s] {name} {variant:7s} {row.get('us', float('nan')):9.1f}"
            f" us  repeats {row.get('repeats_bitwise')}  relerr "
            f"{row.get('sample_relerr', float('nan')):.2e}  {row.get('error', '')[:80]}",
            flush=True)
      with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    by = {r["variant"]: r.get("us") for r in res["rows"] if r["case"] == name}
    if by.get("plain"):
      for v in ("sorted", "copies"):
        if by.get(v):
          print(f"  {name}: {v} / plain = {by[v] / by['plain']:.2f}", flush=True)
  print(plot(a.out))


if __name__ == "__main__":
  main()
