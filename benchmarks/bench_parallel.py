"""Expert parallel over 2 GPUs vs 1 GPU: rollout tokens/s and RL train-step time for the tiny
and a mid-size MoE (the `configs/tiny_arith.py` and `configs/gpu_arith.py` model shapes), FP4
"paper" policy with TRACE guidance recorded, as in the RL loop.

  PYTHONPATH=. python benchmarks/bench_parallel.py --out $OUT/bench_parallel.json

Settings (each timed after a warm-up call that compiles; an error is recorded, not fatal):
  1dev           one device, reference matmuls (what the mesh runs use: the comparison)
  1dev_kernels   one device, Mosaic FP4 kernels where shapes allow (GPU only)
  2dev_ep_ragged mesh expert=2, expert parallel with ragged_all_to_all (GPU only)
  2dev_ep_fixed  mesh expert=2, expert parallel with all_to_all, capacity for every pair
  2dev_data      mesh data=2 (GSPMD data parallel, weights replicated)
CPU check with fake devices: --cpu_devices 2 --presets tiny --prompts 4 --samples 2 --max_new 4
"""

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _args():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--presets", default="tiny,mid")
  ap.add_argument("--settings", default="1dev,1dev_kernels,2dev_ep_ragged,2dev_ep_fixed,2dev_data")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--max_new", type=int, default=32)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--cpu_devices", type=int, default=0, help="fake CPU devices (testing)")
  return ap.parse_args()


A = _args()
if A.cpu_devices:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={A.cpu_devices}")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax import models as M  # noqa: E402
from trace_jax import parallel as par  # noqa: E402
from trace_jax import provenance  # noqa: E402
from trace_jax import quant as tq  # noqa: E402
from trace_jax import rl  # noqa: E402
from trace_jax.rollout import RolloutEngine, SamplingParams  # noqa: E402

VOCAB = 128
PRESETS = {  # trainer float32, rollout bf16 (as in the configs)
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, moe_ffn_size=64),
    "mid": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                num_experts=32, num_experts_per_tok=4, moe_ffn_size=256),
}
SETTINGS = {
    "1dev": dict(mesh=None, kernels=False),
    "1dev_kernels": dict(mesh=None, kernels=True),
    "2dev_ep_ragged": dict(mesh=dict(expert=2), ep="ragged"),
    "2dev_ep_fixed": dict(mesh=dict(expert=2), ep="fixed"),
    "2dev_data": dict(mesh=dict(data=2)),
}


def _timed(fn, reps):
  t = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  first = time.perf_counter() - t
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t)
  return out, first, times


def run_setting(preset: str, name: str) -> dict:
  s = SETTINGS[name]
  if s.get("kernels") and jax.default_backend() != "gpu":
    return {"skipped": "Mosaic kernels need a GPU"}
  if s["mesh"] and jax.device_count() < 2:
    return {"skipped": f"needs 2 devices, have {jax.device_count()}"}
  train_cfg = M.tiny(vocab_size=VOCAB, max_seq_len=A.prompt_len + A.max_new, dtype="float32",
                     rope_theta=10000.0, **PRESETS[preset])
  if s.get("ep"):
    train_cfg = train_cfg.replace(expert_parallel=s["ep"])
  roll_cfg = train_cfg.replace(dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4").replace(guided_layers=0.5)
  mesh = par.make_mesh(s["mesh"], jax.devices()[:2]) if s["mesh"] else None
  params = M.init_params(train_cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, VOCAB, A.prompt_len)) for _ in range(A.prompts)]
  eng = RolloutEngine(roll_cfg, policy, max_new_tokens=A.max_new, prompt_bucket=A.prompt_len,
                      mesh=mesh, use_kernels=bool(s.get("kernels")) if mesh is None else False)
  eng.sync(params)
  sampling = SamplingParams(temperature=1.0)
  ro, roll_first, roll_times = _timed(
      lambda: eng.generate(prompts, n=A.samples, sampling=sampling, seed=0), A.reps)
  gen = int(np.sum(par.to_host(ro.completion_mask)))
  rewards = (np.arange(ro.num_rows) % 3 == 0).astype(np.float32)
  cfg = rl.RLConfig(alignment="trace")
  batch = rl.batch_from_rollout(ro, rewards, A.samples, cfg)
  if mesh is None:
    opt, step = rl.learner(train_cfg, policy, cfg, False)
    place = lambda x: x  # noqa: E731
  else:
    opt, step, place = par.sharded_learner(train_cfg, policy, cfg, mesh, False)
  state = [place(rl.init_state(params, opt))]

  def one_step():
    state[0], m = step(state[0], batch)
    return m

  m, train_first, train_times = _timed(one_step, A.reps)
  roll_s = float(np.median(roll_times))
  return {
      "rows": ro.num_rows, "generated_tokens": gen,
      "rollout_first_call_s": roll_first, "rollout_s": roll_s,
      "rollout_tokens_per_s": gen / roll_s,
      "train_first_call_s": train_first, "train_step_s": float(np.median(train_times)),
      "loss": float(jax.device_get(m["loss/total"])),
      "params": train_cfg.num_params(),
  }


def main():
  out = {"run_info": provenance.run_info(), "devices": [str(d) for d in jax.devices()],
         "args": vars(A), "results": {}}

  def save():  # after every setting: a run cut short by a timeout keeps what it measured
    for res in out["results"].values():
      base = res.get("1dev", {})
      for r in res.values():
        if "rollout_s" in r and "rollout_s" in base:
          r["rollout_speedup_vs_1dev"] = base["rollout_s"] / r["rollout_s"]
          r["train_speedup_vs_1dev"] = base["train_step_s"] / r["train_step_s"]
    with open(A.out, "w") as f:
      json.dump(out, f, indent=2)

  for preset in A.presets.split(","):
    res = out["results"].setdefault(preset, {})
    for name in A.settings.split(","):
      try:
        res[name] = run_setting(preset, name)
      except Exception as e:  # noqa: BLE001 - record and go on with the other settings
        res[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                     "traceback": traceback.format_exc()[-4000:]}
      print(preset, name, json.dumps({k: v for k, v in res[name].items() if k != "traceback"}),
            flush=True)
      save()
  print(f"wrote {A.out}")


if __name__ == "__main__":
  main()
