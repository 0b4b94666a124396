"""Does the rollout give the same numbers when asked again? One process builds the FP4 engine at
a profile_decode.py shape (random weights from a fixed key, fixed prompts), then generates with
one seed several times and hashes each call's tokens and logprobs. Equal hashes within a process
and unequal across processes point at what each process compiles (XLA's autotuned choices);
unequal within a process, at kernels whose sums depend on timing (atomics, arrival order).

  PYTHONPATH=. python benchmarks/rollout_repeats.py --layers 4 --batch 255 --calls 3 \
      --out $OUT/rollout_repeats.json

TRACE_JAX_COMPILATION_CACHE (a directory) makes a process load the programs an earlier process
stored there, as a resumed run launched with `--compilation_cache` does.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import bench_util  # (a sibling module: see its docstring)
from trace_jax import compilation_cache
from trace_jax import quant as tq
from trace_jax.provenance import run_info
from trace_jax.rollout import RolloutEngine, SamplingParams


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--policy", default="paper")
  ap.add_argument("--batch", type=int, default=255)
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--new_tokens", type=int, default=256)
  ap.add_argument("--cache_new_tokens", type=int, default=7680)
  ap.add_argument("--decode_chunk", type=int, default=128)
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--seed", type=int, default=7)
  ap.add_argument("--out", default="rollout_repeats.json")
  a = ap.parse_args()
  cache_dir = compilation_cache.enable()
  cfg, params, prompts = bench_util.random_rollout_model(
      a.preset, a.layers, a.prompt_len, a.cache_new_tokens, a.batch)
  eng = RolloutEngine(cfg, tq.make_policy(a.policy), max_new_tokens=a.cache_new_tokens,
                      prompt_bucket=a.prompt_len, decode_chunk=a.decode_chunk)
  eng.sync(params)
  del params
  out = {**run_info(), "benchmark": "rollout_repeats", **vars(a),
         "compilation_cache": cache_dir, "calls_sha256": []}
  first = None
  for i in range(a.calls):
    t = time.perf_counter()
    r = eng.generate(prompts, n=1, sampling=SamplingParams(temperature=1.0), seed=a.seed,
                     max_new_tokens=a.new_tokens)
    jax.block_until_ready(r.tokens)
    row = {"s": round(time.perf_counter() - t, 3), "tokens": bench_util.digest(r.tokens),
           "logprobs": bench_util.digest(r.logprobs)}
    lp = np.asarray(r.logprobs, np.float32)
    new = np.asarray(r.tokens)[:, -lp.shape[1]:]  # the completions (tokens: prompt + them)
    if first is None:
      first = (new, lp)
    else:  # how far this call is from the first: tokens that differ, logprobs where tokens agree
      same = new == first[0]
      row["tokens_differing"] = int((~same).sum())
      row["logprob_max_abs_diff_where_tokens_agree"] = float(
          np.abs(np.where(same, lp - first[1], 0)).max())
    out["calls_sha256"].append(row)
    print(f"call {i}", json.dumps(row), flush=True)
    del r
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
