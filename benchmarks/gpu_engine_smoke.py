"""GPU smoke test of the rollout engine on the Mosaic FP4 kernels vs the jnp reference path:
30B-A3B layer shapes (1-2 layers, small vocab), paper policy (`--policy`), greedy; same tokens
expected.

  PYTHONPATH=. python benchmarks/gpu_engine_smoke.py --out $OUT/gpu_engine_smoke.json
"""

import argparse
import json
import time

import jax
import numpy as np

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=1)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--policy", default="paper", help="a tq.make_policy name")
  ap.add_argument("--out", default="gpu_engine_smoke.json")
  a = ap.parse_args()
  cfg = M.qwen3_30b_a3b(num_layers=a.layers, vocab_size=4096, max_seq_len=128)
  params = M.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 4096, 32)) for _ in range(a.batch)]
  from trace_jax.provenance import run_info
  out = {**run_info(), "layers": a.layers, "policy": a.policy,
         "batch": a.batch, "runs": {}}
  toks = {}
  for use in (False, True):
    eng = RolloutEngine(cfg, tq.make_policy(a.policy), max_new_tokens=16, prompt_bucket=32,
                        use_kernels=use, record_guidance=False)
    eng.sync(params)
    s = SamplingParams(temperature=0.0)
    t = time.perf_counter()
    ro = eng.generate(prompts, sampling=s)
    jax.block_until_ready(ro.tokens)
    first = time.perf_counter() - t
    t = time.perf_counter()
    ro = eng.generate(prompts, sampling=s)
    jax.block_until_ready(ro.tokens)
    toks[use] = (np.asarray(ro.completion), np.asarray(ro.logprobs))
    out["runs"]["kernels" if use else "reference"] = {"first_call_s": first,
                                                      "steady_call_s": time.perf_counter() - t}
    print(use, out["runs"], flush=True)
  same = toks[True][0] == toks[False][0]  # [rows, new tokens]
  out["same_tokens_frac"] = float(np.mean(same))
  out["max_abs_logprob_diff"] = float(np.max(np.abs(toks[True][1] - toks[False][1])))
  # where a row's tokens first differ: before it both paths saw the same inputs, so the
  # logprob differences there are the paths' rounding; a flip at a near-tie shows as a first
  # divergence whose two chosen tokens have about equal logprobs (each path's argmax)
  first = np.where(same.all(1), same.shape[1], np.argmin(same, axis=1))
  before = np.arange(same.shape[1])[None] < first[:, None]
  diff = np.abs(toks[True][1] - toks[False][1])
  rows = np.flatnonzero(first < same.shape[1])
  out["diverging_rows"] = int(rows.size)
  out["first_divergence"] = first[rows].tolist()
  out["max_abs_logprob_diff_before_divergence"] = float(diff[before].max(initial=0.0))
  out["chosen_logprob_gap_at_divergence"] = [float(diff[r, first[r]]) for r in rows]
  print(json.dumps(out, indent=1))
  with open(a.out, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
