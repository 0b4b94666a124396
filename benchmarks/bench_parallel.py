"""Expert parallel over N GPUs vs 1 GPU: rollout tokens/s, weight-sync time, guidance bytes and
RL train-step time for the tiny and a mid-size MoE (the `configs/tiny_arith.py` and
`configs/gpu_arith.py` model shapes) or the Qwen3-30B-A3B shape with fewer layers (`a3b_l4`:
4 layers, `a3b_l48`: all 48), per rollout policy (FP4 "paper" with TRACE guidance recorded, as in
the RL loop, and "bf16").

  PYTHONPATH=. python benchmarks/bench_parallel.py --out $OUT/bench_parallel.json
  # issue 11 on an 8-GPU host:
  PYTHONPATH=. python benchmarks/bench_parallel.py --presets a3b_l4 --policies bf16,paper \
      --settings 1dev,2dev_ep_ragged,8dev_ep_ragged,8dev_fsdp2_ep4 --out $OUT/scaleout.json

Settings (each timed after a warm-up call that compiles; an error is recorded, not fatal):
  1dev           one device, reference matmuls (what the mesh runs use: the comparison)
  1dev_kernels   one device, Mosaic FP4 kernels where shapes allow (GPU only)
  Ndev_ep_ragged mesh expert=N, expert parallel with ragged_all_to_all (GPU only)
  Ndev_ep_fixed  mesh expert=N, expert parallel with all_to_all, capacity for every pair
  Ndev_data      mesh data=N (GSPMD data parallel, weights replicated)
  Ndev_fsdpF_epE mesh fsdp=F, expert=E (F*E = N): the trainer's master weights and optimizer
                 state sharded over fsdp, experts over expert (ragged on GPU, fixed elsewhere)
The rollout and the trainer share the mesh (colocated). CPU check with fake devices:
  --cpu_devices 8 --presets tiny --settings 1dev,8dev_ep_fixed,8dev_fsdp2_ep4 --prompts 4
  --samples 2 --max_new 4
"""

import argparse
import json
import os
import re
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _args():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True)
  ap.add_argument("--presets", default="tiny,mid")
  ap.add_argument("--policies", default="paper", help="rollout policies (trace_jax.quant presets)")
  ap.add_argument("--settings", default="1dev,1dev_kernels,2dev_ep_ragged,2dev_ep_fixed,2dev_data",
                  help="comma-separated, see the module docstring")
  ap.add_argument("--prompts", type=int, default=64)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--prompt_len", type=int, default=16)
  ap.add_argument("--max_new", type=int, default=32)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--cpu_devices", type=int, default=0, help="fake CPU devices (testing)")
  ap.add_argument("--train_determinism", default="off", choices=("off", "on", "both"),
                  help="rl.deterministic: 'off' (the default train step), 'on' (compiled with "
                       "XLA's deterministic ops), or 'both': timed each way from the same state")
  return ap.parse_args()


A = _args()
if A.cpu_devices:
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={A.cpu_devices}")

import bench_util  # noqa: E402 - a sibling module (see its docstring)
import jax  # noqa: E402
import numpy as np  # noqa: E402

from trace_jax import models as M  # noqa: E402
from trace_jax import parallel as par  # noqa: E402
from trace_jax import provenance  # noqa: E402
from trace_jax import quant as tq  # noqa: E402
from trace_jax import rl  # noqa: E402
from trace_jax.rollout import RolloutEngine, SamplingParams  # noqa: E402

def model_config(preset: str):
  """The trainer's config (float32 masters; the rollout's bf16, as in the configs) for a preset
  name (see the module docstring)."""
  return bench_util.trainer_config(preset, max_seq_len=A.prompt_len + A.max_new, dtype="float32")


def parse_setting(name: str) -> dict:
  """'1dev', '1dev_kernels', 'Ndev_ep_ragged', 'Ndev_ep_fixed', 'Ndev_data', 'Ndev_fsdpF_epE'."""
  m = re.fullmatch(r"(\d+)dev(?:_(kernels|ep_ragged|ep_fixed|data|fsdp(\d+)_ep(\d+)))?", name)
  if not m:
    raise ValueError(f"unknown setting {name!r}")
  n, kind = int(m.group(1)), m.group(2)
  if n == 1:
    if kind not in (None, "kernels"):
      raise ValueError(f"setting {name!r}: one device takes no mesh")
    return dict(devices=1, mesh=None, kernels=kind == "kernels")
  if kind in ("ep_ragged", "ep_fixed"):
    return dict(devices=n, mesh=dict(expert=n), ep=kind[3:])
  if kind == "data":
    return dict(devices=n, mesh=dict(data=n))
  if kind and kind.startswith("fsdp"):
    f, e = int(m.group(3)), int(m.group(4))
    if f * e != n:
      raise ValueError(f"setting {name!r}: fsdp {f} x expert {e} != {n} devices")
    return dict(devices=n, mesh=dict(fsdp=f, expert=e), ep="auto")
  raise ValueError(f"setting {name!r}: {n} devices need a layout (ep_ragged, ep_fixed, data, "
                   "fsdpF_epE)")


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


def run_setting(preset: str, name: str, policy_name: str) -> dict:
  s = parse_setting(name)
  if s.get("kernels") and jax.default_backend() != "gpu":
    return {"skipped": "Mosaic kernels need a GPU"}
  if jax.device_count() < s["devices"]:
    return {"skipped": f"needs {s['devices']} devices, have {jax.device_count()}"}
  train_cfg = model_config(preset)
  if s.get("ep"):
    train_cfg = train_cfg.replace(expert_parallel=s["ep"])
  roll_cfg = train_cfg.replace(dtype="bfloat16")
  policy = tq.make_policy(policy_name, "nvfp4").replace(guided_layers=0.5)
  mesh = par.make_mesh(s["mesh"], jax.devices()[:s["devices"]]) if s["mesh"] else None
  params = M.init_params(train_cfg, jax.random.key(0))
  if mesh is not None:
    params = par.shard_params(params, mesh)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, train_cfg.vocab_size, A.prompt_len)) for _ in range(A.prompts)]
  eng = RolloutEngine(roll_cfg, policy, max_new_tokens=A.max_new, prompt_bucket=A.prompt_len,
                      mesh=mesh, use_kernels=bool(s.get("kernels")) if mesh is None else False)
  eng.sync(params)  # first sync compiles the quantizer
  jax.block_until_ready(eng.params)
  t = time.perf_counter()
  eng.sync(params)
  jax.block_until_ready(eng.params)
  sync_s = time.perf_counter() - t
  sampling = SamplingParams(temperature=1.0)
  ro, roll_first, roll_times = _timed(
      lambda: eng.generate(prompts, n=A.samples, sampling=sampling, seed=0), A.reps)
  gen = int(np.sum(par.to_host(ro.completion_mask)))
  rewards = (np.arange(ro.num_rows) % 3 == 0).astype(np.float32)
  sides = {"on": [True], "off": [False], "both": [False, True]}[A.train_determinism]
  train = {}
  for deterministic in sides:
    cfg = rl.RLConfig(alignment="trace", deterministic=deterministic)
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

    m, first, times = _timed(one_step, A.reps)
    train[deterministic] = (m, first, float(np.median(times)))
    state[0] = None  # the next side's state is built with this one freed
  m, train_first, train_s = train[sides[0]]
  extra = {}
  if len(train) == 2:
    extra = {"train_step_s_deterministic_ops": train[True][2],
             "train_first_call_s_deterministic_ops": train[True][1],
             "train_deterministic_ops_over_default": train[True][2] / train_s}
  roll_s = float(np.median(roll_times))
  return {
      "devices": s["devices"], "mesh": s["mesh"], "policy": policy.name,
      "rows": ro.num_rows, "generated_tokens": gen, "weight_sync_s": sync_s,
      "guidance_bytes_per_token": ro.guidance_bytes_per_token(),
      "guidance_bytes_per_rollout": ro.guidance_bytes_per_token() * gen,
      "rollout_first_call_s": roll_first, "rollout_s": roll_s,
      "rollout_tokens_per_s": gen / roll_s,
      "train_deterministic": sides[0], **extra,
      "train_first_call_s": train_first, "train_step_s": train_s,
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
    for policy in A.policies.split(","):
      res = out["results"].setdefault(preset if policy == "paper" else f"{preset}_{policy}", {})
      for name in A.settings.split(","):
        try:
          res[name] = run_setting(preset, name, policy)
        except Exception as e:  # noqa: BLE001 - record and go on with the other settings
          res[name] = {"error": f"{type(e).__name__}: {e}"[:2000],
                       "traceback": traceback.format_exc()[-4000:]}
        print(preset, policy, name,
              json.dumps({k: v for k, v in res[name].items() if k != "traceback"}), flush=True)
        save()
  print(f"wrote {A.out}")


if __name__ == "__main__":
  main()
