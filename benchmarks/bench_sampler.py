"""The rollout's token draw on the GPU, each way `TRACE_JAX_SAMPLER` can make it: time, check,
one JSON file + a PNG.

  PYTHONPATH=. python benchmarks/bench_sampler.py --out bench_sampler.json [--batches 1,64,256]
  python benchmarks/bench_sampler.py --plot bench_sampler.json   # the PNG of a saved run

Why: the 4-layer FP4 decode step at B 256 (H200, session 28's profile) spent 259 us a step in
one reduction, the Gumbel draw of `jax.random.categorical` (threefry bits for 256 x 151,936
entries), as long as the lm_head product. Rows: `sampling.sample` at temperature 1 over
float32 logits [B, V] (V = 151,936, Qwen3's vocabulary) with one key per row, for each draw
("gumbel", "hashed_gumbel", "inverse_cdf"), CUPTI device time of all its kernels (median over
iterations) and their count; beside each, ratio to "gumbel" in the same run. Check: over 64
rows of the same logits, the sampled tokens' mean log-probability against the distribution's
negative entropy (a draw that ignored the logits would sit near log(1/V)).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import bench_util

SAMPLERS = ("gumbel", "hashed_gumbel", "inverse_cdf")


def plot(json_path: str) -> str:
  """Bars of us a call per draw, one group per batch; PNG beside the JSON."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(json_path) as f:
    res = json.load(f)
  batches = sorted({r["batch"] for r in res["rows"] if "us" in r})
  fig, ax = plt.subplots(figsize=(7, 4))
  width = 0.8 / len(SAMPLERS)
  for j, s in enumerate(SAMPLERS):
    us = [next((r["us"] for r in res["rows"] if r["batch"] == b and r["sampler"] == s
                and "us" in r), 0) for b in batches]
    ax.bar(np.arange(len(batches)) + j * width, us, width, label=s)
  ax.set_xticks(np.arange(len(batches)) + width, [f"B {b}" for b in batches])
  ax.set_ylabel("us a draw (CUPTI, all kernels)")
  ax.legend()
  out = json_path.replace(".json", ".png")
  bench_util.save_figure(fig, f"token draw over {res['vocab']} entries, {res['device']}", out)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--plot", default="", help="only draw the PNG of this saved JSON and exit")
  ap.add_argument("--out", default="bench_sampler.json")
  ap.add_argument("--batches", default="1,64,256")
  ap.add_argument("--vocab", type=int, default=151936)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  if args.plot:
    print(plot(args.plot))
    return

  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler

  from trace_jax.rollout import SamplingParams, sampling

  t0 = time.time()
  res = bench_util.result_header(
      "bench_sampler", vocab=args.vocab,
      units=dict(us="microseconds of CUPTI device time a draw (all its kernels), median",
                 x_gumbel="this draw's us over gumbel's at the same batch, same run"),
      rows=[])
  params = SamplingParams(1.0)
  for b in (int(s) for s in args.batches.split(",")):
    logits = jax.random.normal(jax.random.key(b), (b, args.vocab), jnp.float32) * 3.0
    keys = jax.random.split(jax.random.key(7), b)
    check_logits = jnp.broadcast_to(logits[:1], (64, args.vocab))
    logp = jax.nn.log_softmax(logits[0])
    neg_entropy = float(jnp.sum(jnp.exp(logp) * logp))
    base = None
    for s in SAMPLERS:
      sampling.SAMPLER = s  # read when `sample` is traced
      fn = jax.jit(lambda lg, k: sampling.sample(lg, k, params))
      row = dict(batch=b, sampler=s, name=f"{s}_b{b}")
      try:
        tok, lp = fn(check_logits, jax.random.split(jax.random.key(11), 64))
        row["mean_logprob_64"] = float(jnp.mean(lp))
        row["neg_entropy"] = neg_entropy
        compiled = fn.lower(logits, keys).compile()
        _, tim = profiler.measure(compiled, aggregate=False, iterations=args.iters)(logits, keys)
        row["us"] = statistics.median(sum(ms for _, ms in it) * 1e3 for it in tim)
        row["kernels"] = len(tim[0])
        base = row["us"] if s == "gumbel" else base
        row["x_gumbel"] = row["us"] / base if base else None
      except Exception as e:  # noqa: BLE001 - a failed row stays a row
        row["error"] = f"{type(e).__name__}: {e}"[:400]
      res["rows"].append(row)
      print(f"{row['name']:24s} " + (f"{row['us']:9.1f} us {row['kernels']:3d} kernels "
                                     f"x_gumbel {row['x_gumbel']:.2f}  mean logprob "
                                     f"{row['mean_logprob_64']:.2f} (neg entropy "
                                     f"{neg_entropy:.2f})" if "us" in row else row["error"]),
            flush=True)
  res["total_s"] = time.time() - t0
  with open(args.out, "w") as f:
    json.dump(res, f, indent=1, default=str)
  try:
    print(plot(args.out))
  except ImportError:  # no matplotlib on the device image: draw it later with --plot
    pass


if __name__ == "__main__":
  main()
