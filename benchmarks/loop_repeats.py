"""Does the RL loop give the same numbers when run again, and when killed and resumed? This runs
the small RL loop (tiny_arith with the loop tests' settings: no SFT, 6 steps of 4 prompts x
4 samples, eval every 3, a checkpoint every 2) RUNS times uninterrupted, each in its own
workdir, then once killed after KILL_AFTER steps and resumed. Each rollout call's tokens and
logprobs and each train step's new parameters are hashed as they happen, keyed by the step, so
the first difference between two runs says where it began: in a rollout (given equal
parameters) or in a train step (given equal rollouts).

  PYTHONPATH=. python benchmarks/loop_repeats.py --runs 2 --out $OUT/loop_repeats.json

Runs in one process share their compiled programs (jit's cache), so a difference between them
points at kernels whose results depend on timing (atomics, arrival order), not at what XLA
compiled. --processes new runs each run, the killed one and its resumption each in a process of
its own (this script as a child), as launches are: the processes share one compilation cache
that stores every program (ROOT/xla_cache, or TRACE_JAX_COMPILATION_CACHE), as a GPU launch's
WORKDIR/xla_cache does, so the resumed process runs the programs the killed one compiled.
--train_determinism on compiles the train step with XLA's deterministic ops (rl.deterministic;
off is the default). TRACE_JAX_COMPILATION_CACHE (a directory) makes the
process load programs an earlier process stored, as a resumed launch does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

import bench_util  # (a sibling module: see its docstring)
from configs import tiny_arith
from trace_jax import compilation_cache
from trace_jax.metrics import read_metrics
from trace_jax.provenance import run_info
from trace_jax.rl import compare, loop
from trace_jax.rl import train_step as ts


def small_config(steps: int, deterministic: bool = False):
  c = tiny_arith.get_config()
  return compare.override(c, {
      "sft.max_steps": 0, "total_steps": steps, "rollout.prompts_per_step": 4,
      "rollout.samples_per_prompt": 4, "eval.every": 3, "eval.size": 16,
      "checkpoint.every": 2, "rl.deterministic": deterministic})


class Recorder:
  """Hashes of what the loop computes, keyed by when: ("rollout", seed) for a step's rollout
  (its seed names the step), ("train", seed) for the train step after it, ("eval", seed, n) for
  the n-th other generate call after it (evaluation)."""

  def __init__(self):
    self.events: dict[str, str] = {}
    self.order: list[str] = []
    self._seed = None
    self._other = 0

  def add(self, key: str, value: str) -> None:
    self.events[key] = value
    self.order.append(key)

  def rollout(self, seed: int, r) -> None:
    self.add(f"rollout/{seed}", bench_util.digest(r.tokens, r.logprobs))
    self._seed, self._other = seed, 0

  def other(self, r) -> None:
    self._other += 1
    self.add(f"eval/{self._seed}/{self._other}", bench_util.digest(r.tokens))

  def train(self, params) -> None:
    self.add(f"train/{self._seed}", bench_util.digest(params))


def instrument(current: list, rollout_seeds: set):
  """Wrap the loop's engine and learner so that `current[0]` (a Recorder) hears of each call
  (a generate call with stop tokens and one of `rollout_seeds` is a step's rollout). Returns a
  function that puts the originals back."""
  make_engine, learner = loop.make_engine, ts.learner

  def make_engine_recorded(*args, **kwargs):
    engine = make_engine(*args, **kwargs)
    generate = engine.generate

    def generate_recorded(prompts, **kw):
      r = generate(prompts, **kw)
      if kw.get("stop_tokens") and kw.get("seed", 0) in rollout_seeds:
        current[0].rollout(kw["seed"], r)
      else:
        current[0].other(r)
      return r

    engine.generate = generate_recorded
    return engine

  def learner_recorded(*args, **kwargs):
    optimizer, step_fn = learner(*args, **kwargs)

    def step_recorded(state, batch):
      state, m = step_fn(state, batch)
      current[0].train(state.params)
      return state, m

    return optimizer, step_recorded

  loop.make_engine, ts.learner = make_engine_recorded, learner_recorded

  def restore():
    loop.make_engine, ts.learner = make_engine, learner

  return restore


def compare_runs(base: dict, other: dict) -> dict:
  """Where run `other` first parts from run `base` (each with events, their order and metric
  rows): events (in `other`'s order) and metric rows."""
  events = [k for k in dict.fromkeys(other["order"]) if k in base["events"]]
  differing = [k for k in events if other["events"][k] != base["events"][k]]
  missing = [k for k in base["order"] if k not in other["events"]]
  rows = {r["step"]: r for r in base["rows"]}
  metric_diffs = []
  for r in other["rows"]:
    b = rows.get(r["step"])
    if b is None:
      continue
    keys = sorted(k for k in set(r) | set(b) if k not in loop.TIMING_KEYS and r.get(k) != b.get(k))
    if keys:
      metric_diffs.append({"step": r["step"], "keys": {
          k: [b.get(k), r.get(k)] for k in keys}})
  return {"events_compared": len(events), "events_differing": len(differing),
          "events_missing": missing[:12],
          "first_differing_event": differing[0] if differing else None,
          "differing_events": differing[:12],
          "first_differing_step": metric_diffs[0]["step"] if metric_diffs else None,
          "metric_diffs": metric_diffs[:3]}


def _child_run(a, name: str, workdir: str, stop_after: int | None = None) -> dict:
  """One run in a process of its own (this script with --child_events): its events and order."""
  events = os.path.join(os.path.dirname(workdir), f"{name}_events.json")
  cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(a.steps),
         "--train_determinism", a.train_determinism, "--workdir", workdir,
         "--child_events", events, "--child_stop_after", str(stop_after or 0)]
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (configs/ is there)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      p for p in (root, os.environ.get("PYTHONPATH")) if p)}
  try:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.child_timeout,
                       check=False, env=env)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"loop_repeats child {name} failed: no end in {a.child_timeout} s") from e
  if r.returncode:
    raise RuntimeError(f"loop_repeats child {name} failed (rc {r.returncode}): "
                       f"{r.stderr[-2000:]}")
  with open(events) as f:
    return json.load(f)


def _run_here(config, current: list, workdir: str, stop_after: int | None = None) -> dict:
  """One run of the loop in this process (stopped after `stop_after` steps if given): its events
  and their order."""
  current[0] = Recorder()
  loop.run(config, workdir, log=lambda *_: None, stop_after=stop_after)
  return {"events": current[0].events, "order": current[0].order}


def _runs(a, root: str, one_run) -> list[dict]:
  """The uninterrupted runs, then the killed and resumed one, each with its events and rows;
  `one_run(name, workdir, stop_after=None)` runs one (here or in a child process)."""
  runs = []
  for i in range(a.runs):
    d = os.path.join(root, f"run{i}")
    runs.append({"name": f"run{i}", **one_run(f"run{i}", d), "rows": read_metrics(d)})
  if a.kill_after:
    d = os.path.join(root, "resumed")
    killed = one_run("killed", d, a.kill_after)
    resumed = one_run("resumed", d)
    # the resumed run redoes the steps after the last checkpoint: its events replace the
    # killed run's for them
    runs.append({"name": "killed_and_resumed",
                 "events": {**killed["events"], **resumed["events"]},
                 "order": killed["order"] + resumed["order"],
                 "resumed_events": resumed["events"], "rows": read_metrics(d)})
  return runs


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--runs", type=int, default=2, help="uninterrupted runs")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--kill_after", type=int, default=3,
                  help="steps of the killed run (0: no killed run)")
  ap.add_argument("--train_determinism", default="off", choices=("on", "off"),
                  help="rl.deterministic: the train step compiled with XLA's deterministic ops "
                       "(off: the default)")
  ap.add_argument("--processes", default="one", choices=("one", "new"),
                  help="one: every run in this process; new: each run, the killed run and its "
                       "resumption in a process of its own, sharing one compilation cache")
  ap.add_argument("--child_timeout", type=float, default=600, help="seconds, --processes new")
  ap.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
  ap.add_argument("--out", default="loop_repeats.json")
  ap.add_argument("--child_events", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--child_stop_after", type=int, default=0, help=argparse.SUPPRESS)
  a = ap.parse_args()
  root = a.workdir or tempfile.mkdtemp(prefix="loop_repeats_")
  if a.processes == "new" and not a.child_events:
    os.environ.setdefault(compilation_cache.ENV, os.path.join(root, "xla_cache"))
  # a new process's programs come from the cache only if each was stored, however fast it
  # compiled (the launcher's WORKDIR/xla_cache stores every one)
  cache_dir = compilation_cache.enable(
      min_compile_secs=0.0 if (a.processes == "new" or a.child_events) else 1.0)
  config = small_config(a.steps, a.train_determinism == "on")
  current = [None]
  restore = instrument(current, {loop.step_seed(int(config.seed), s, "rollout")
                                 for s in range(a.steps)})
  try:
    if a.child_events:  # (a child of --processes new: one run, its events to the file)
      with open(a.child_events, "w") as f:
        json.dump(_run_here(config, current, a.workdir, a.child_stop_after or None), f)
      return
    if a.processes == "new":
      runs = _runs(a, root, functools.partial(_child_run, a))
    else:
      runs = _runs(a, root, lambda name, d, stop_after=None: _run_here(config, current, d,
                                                                       stop_after))
  finally:
    restore()  # the loop's own engine and (cached) learner again, for whatever runs next
  out = {**run_info(), "benchmark": "loop_repeats", **vars(a), "compilation_cache": cache_dir,
         "runs": []}
  base = runs[0]
  for r in runs:
    row = {"name": r["name"], "events": r["events"]}
    if "resumed_events" in r:  # what the resumption ran (the steps after the last checkpoint)
      row["resumed_events"] = r["resumed_events"]
    if r is not base:
      row["against_run0"] = compare_runs(base, r)
      c = row["against_run0"]
      print(f"{r['name']} vs run0: {c['events_differing']} of {c['events_compared']} events "
            f"differ, first {c['first_differing_event']}; metrics first differ at step "
            f"{c['first_differing_step']}", flush=True)
      if c["metric_diffs"]:
        print("  " + json.dumps(c["metric_diffs"][0])[:600], flush=True)
    out["runs"].append(row)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
