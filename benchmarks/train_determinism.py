"""Which XLA option makes the RL train step repeat itself on a GPU, and what each costs. One
process builds a TRACE batch (FP4 rollout with guidance) at bench_parallel's "mid" shape, then for
each variant compiles the train step with those XLA compile options (`jax.jit(...,
compiler_options=...)`), runs CHAIN steps from the same state REPEATS times (params hashed at the
end of each chain: equal hashes = repeatable) and times single steps. (One step from a fresh
optimizer state is a weak check: Adam's first update is nearly the gradient's sign, which hides
last-bit differences in the gradient; benchmarks/loop_repeats.py is the sensitive one.)

  PYTHONPATH=. python benchmarks/train_determinism.py --out $OUT/train_determinism.json

--gathers repeatable,sorted,plain times the step with each of the gathers' gradients
(`kernels.take_rows` / `take_copies`' settings, as TRACE_JAX_TAKE_ROWS names them) in this
process, each variant with each gather (rows "VARIANT/GATHER"); --preset a3b_l4 is the
Qwen3-30B-A3B shape with 4 layers.

Variants (--variants, in order): off (no option), deterministic_ops (xla_gpu_deterministic_ops:
what rl.deterministic sets), scatter (xla_gpu_enable_scatter_determinism_expander), reductions
(xla_gpu_deterministic_reductions), scatter_reductions (both), exclude
(xla_gpu_exclude_nondeterministic_ops).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import bench_util  # (a sibling module: see its docstring)
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import repeatable_gather
from trace_jax.provenance import run_info
from trace_jax.rl import train_step as ts
from trace_jax.rollout import RolloutEngine, SamplingParams

VARIANTS = {
    "off": {},
    "deterministic_ops": dict(ts.DETERMINISTIC_COMPILE),
    "scatter": {"xla_gpu_enable_scatter_determinism_expander": True},
    "reductions": {"xla_gpu_deterministic_reductions": True},
    "scatter_reductions": {"xla_gpu_enable_scatter_determinism_expander": True,
                           "xla_gpu_deterministic_reductions": True},
    "exclude": {"xla_gpu_exclude_nondeterministic_ops": True},
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default="off,scatter_reductions,scatter,deterministic_ops,"
                  "reductions")
  ap.add_argument("--preset", default="mid", help="tiny, mid or a3b_l<layers>")
  ap.add_argument("--gathers", default="", help="TRACE_JAX_TAKE_ROWS values to run in turn "
                  "(default: the setting's own)")
  ap.add_argument("--prompts", type=int, default=32)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--max_new", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--chain", type=int, default=3, help="steps in a row before each hash")
  ap.add_argument("--reps", type=int, default=2, help="timed steps after the repeats")
  ap.add_argument("--out", default="train_determinism.json")
  a = ap.parse_args()
  config = bench_util.trainer_config(a.preset, max_seq_len=a.prompt_len + a.max_new,
                                     dtype="float32")
  policy = tq.make_policy("paper", "nvfp4").replace(guided_layers=0.5)
  params = M.init_params(config, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, config.vocab_size, a.prompt_len)) for _ in range(a.prompts)]
  eng = RolloutEngine(config.replace(dtype="bfloat16"), policy, max_new_tokens=a.max_new,
                      prompt_bucket=a.prompt_len)
  eng.sync(params)
  ro = eng.generate(prompts, n=a.samples, sampling=SamplingParams(temperature=1.0), seed=0)
  rewards = (np.arange(ro.num_rows) % 3 == 0).astype(np.float32)
  cfg = ts.RLConfig(alignment="trace")
  batch = ts.batch_from_rollout(ro, rewards, a.samples, cfg)
  optimizer = ts.make_optimizer(cfg)
  host_state = jax.device_get(ts.init_state(params, optimizer))
  del eng, ro, params
  ctx = ts.trainer_context(policy, cfg, False)
  fn = lambda s, b: ts.train_step(s, b, config=config, ctx=ctx, cfg=cfg,  # noqa: E731
                                  optimizer=optimizer)
  out = {**run_info(), "benchmark": "train_determinism", **vars(a), "rows": len(rewards),
         "variants": {}}
  gathers = a.gathers.split(",") if a.gathers else [None]
  choices = ("repeatable", "sorted", "plain")
  if any(g not in choices for g in gathers if g is not None):
    raise SystemExit(f"--gathers: each of {', '.join(choices)}, got {a.gathers!r}")
  setting = repeatable_gather._TAKE_ROWS
  try:
    for variant, gather in [(v, g) for v in a.variants.split(",") for g in gathers]:
      name = variant if gather is None else f"{variant}/{gather}"
      if gather is not None:  # read when the step is traced (below, at its first call)
        repeatable_gather._TAKE_ROWS = gather
      # a new function each time: jit's trace cache is keyed by the function, so `fn` itself
      # would give every gather the first gather's trace
      step = jax.jit(lambda s, b: fn(s, b), donate_argnums=(0,),
                     compiler_options=VARIANTS[variant])
      row = {"compiler_options": VARIANTS[variant], "hashes": [],
             "gather": gather or repeatable_gather._TAKE_ROWS}
      try:
        # sorts in the traced step: tells the gathers' programs apart (the sorted one has more)
        row["sorts_in_program"] = step.lower(host_state, batch).as_text().count(
            "stablehlo.sort")
        for i in range(a.repeats):
          state = jax.device_put(host_state)
          t = time.perf_counter()
          for _ in range(a.chain):
            state, m = step(state, batch)
          jax.block_until_ready(state)
          if i == 0:
            row["first_chain_s"] = time.perf_counter() - t  # the compile included
          row["hashes"].append(bench_util.digest(state.params))
          del state, m
        for _ in range(a.reps):
          state = jax.block_until_ready(jax.device_put(host_state))  # the upload not timed
          t = time.perf_counter()
          new, m = step(state, batch)
          jax.block_until_ready(new)
          row.setdefault("step_s", []).append(time.perf_counter() - t)
          del new, m
        row["repeatable"] = len(set(row["hashes"])) == 1
        row["step_s_median"] = float(np.median(row["step_s"]))
      except Exception as e:  # noqa: BLE001 - record it and go on with the other variants
        row["error"] = f"{type(e).__name__}: {e}"[:1500]
      out["variants"][name] = row
      # over the same gather's "off" row, and over the first gather's row of this variant
      for key, base_name in (("step_over_off", "off" if gather is None else f"off/{gather}"),
                             ("step_over_first_gather",
                              None if gather is None else f"{variant}/{gathers[0]}")):
        base = out["variants"].get(base_name, {}).get("step_s_median")
        if base and "step_s_median" in row:
          row[key] = row["step_s_median"] / base
      print(name, json.dumps({k: v for k, v in row.items() if k != "compiler_options"}),
            flush=True)
      with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
  finally:
    repeatable_gather._TAKE_ROWS = setting  # (this process's setting again)


if __name__ == "__main__":
  main()
