"""How long the rollout's generate program takes to lower and compile, by layer count, from
shapes alone (no weights are made: the rollout weights are `jax.eval_shape` of the engine's
weight sync). Session 9 found the 48-layer BF16 program still compiling after ~370 s on the
H200 (XLA printed "Very slow compile?") where the 48-layer FP4 one took 152 s; this measures the
growth so the cause can be bisected with XLA_FLAGS.

  python benchmarks/compile_time.py --policy bf16 --layers 12,24 --out compile_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trace_jax import models as M  # noqa: E402
from trace_jax import quant as tq  # noqa: E402
from trace_jax.provenance import run_info  # noqa: E402
from trace_jax.rollout import RolloutEngine, SamplingParams  # noqa: E402
from trace_jax.rollout import engine as E  # noqa: E402


def generate_program(config, policy, batch: int, prompt_len: int, new_tokens: int,
                     use_kernels: bool, prefill_tokens: int = 65536,
                     record_guidance: bool = True):
  """(the engine's jitted generate program, arguments to lower it with: the rollout weights as
  shapes, a batch of prompts) for one sampled rollout of `new_tokens` tokens."""
  engine = RolloutEngine(config, policy, max_new_tokens=new_tokens, prompt_bucket=prompt_len,
                         record_guidance=record_guidance, use_kernels=use_kernels,
                         prefill_tokens=prefill_tokens)
  weights = E.rollout_weight_shapes(config, policy, use_kernels)
  sampling = SamplingParams(temperature=1.0)
  key = (prompt_len, batch, 1, new_tokens, sampling, 1, engine._pass_rows(prompt_len))
  args = (weights, jnp.zeros((batch, prompt_len), jnp.int32), jnp.ones((batch, prompt_len), bool),
          E.sequence_keys(0, [[3]] * batch), jnp.full((batch,), new_tokens, jnp.int32),
          jnp.asarray([-1], jnp.int32))
  return engine._program(key), args


def compile_seconds(config, policy, batch: int, prompt_len: int, new_tokens: int,
                    use_kernels: bool, prefill_tokens: int = 65536) -> dict:
  program, args = generate_program(config, policy, batch, prompt_len, new_tokens, use_kernels,
                                   prefill_tokens)
  t = time.perf_counter()
  lowered = program.lower(*args)
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  lowered.compile()
  return {"lower_s": lower_s, "compile_s": time.perf_counter() - t}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--policy", default="bf16")
  ap.add_argument("--layers", default="12,24")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--new_tokens", type=int, default=256)
  ap.add_argument("--kernels", type=int, default=1, help="FP4 weights on the Mosaic kernels")
  ap.add_argument("--prefill_tokens", type=int, default=65536,
                  help="prompt tokens per prefill pass (RolloutEngine(prefill_tokens=))")
  ap.add_argument("--out", default="compile_time.json")
  a = ap.parse_args()
  policy = tq.make_policy(a.policy)
  rows = []
  out = dict(benchmark="compile_time", **run_info(), preset=a.preset, policy=a.policy,
             batch=a.batch, prompt_len=a.prompt_len, new_tokens=a.new_tokens,
             prefill_tokens=a.prefill_tokens,
             xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows)
  for layers in [int(x) for x in a.layers.split(",")]:
    config = M.preset(a.preset).replace(num_layers=layers,
                                        max_seq_len=a.prompt_len + a.new_tokens)
    row = {"layers": layers, **compile_seconds(config, policy, a.batch, a.prompt_len,
                                               a.new_tokens, bool(a.kernels),
                                               a.prefill_tokens),
           "prefill_passes": -(-a.batch // E.prefill_pass(a.prefill_tokens, a.prompt_len)[0])}
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
      json.dump(out, f, indent=2)


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
