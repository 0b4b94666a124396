"""Paired serving A/B: a baseline (BF16) and a candidate (FP4) on the same prompts, context
length and offered load, judged against acceptance limits fixed before the runs.

`run_compare(config, workdir)`:
1. writes `limits.json` (the limits, the config and the time) before anything is measured;
2. runs each arm (in its own process when `compare.isolate`, so peak memory and compile caches
   are the arm's own): load + quantize + warm-up (timed as setup), then `compare.repeats` runs
   of every prompt under the configured load through the arm's scheduler, repeat r
   sampling with seed r on both arms (paired);
3. records per task: output, pass/fail, failure text, TTFT, per-token latency, tokens; per run:
   peak device memory, throughput, p50/p95/p99 latency, cost per million tokens;
4. writes `report.json`, `report.md` and PNG plots (latency CDFs, memory bars, pass rate with
   95% confidence intervals) and the verdict: keep FP4 only if every limit holds.

Timing definitions. Latency: from the request's send time (open loop: its scheduled arrival)
to its last token. TTFT: from the send time to its first token on the host (the slot scheduler
streams tokens as they are generated; the request-level `BatchScheduler` delivers a batch's
tokens when the batch ends, so there TTFT equals the latency). Per-token latency: the mean time
between tokens after the first (batch delivery, or a single token: latency / generated tokens).
Memory: the device's `peak_bytes_in_use` while serving (sampled every 20 ms after
setup, when the backend reports memory stats, e.g. on GPU); otherwise (CPU) an estimate from
the capacity planner: serving weights + per-sequence KV/working bytes x max batch. Cost per
million generated tokens: `cost.gpu_hour_usd` x (setup + all runs' wall time) / tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import threading
import time

import jax
import ml_collections
import numpy as np

from trace_jax.provenance import run_info
from trace_jax.rl import loop
from trace_jax.rl.compare import override
from trace_jax.rollout import CapacityError, SamplingParams, bytes_per_sequence
from trace_jax.serving import backend
from trace_jax.serving.scheduler import GenerationRequest

Z95 = 1.959963984540054


# --------------------------------------------------------------------------- statistics

def wilson_interval(passed: float, n: int, z: float = Z95) -> tuple[float, float]:
  """95% Wilson score interval of a pass rate (well-behaved at 0 and 1, unlike the normal one)."""
  if n <= 0:
    return (0.0, 1.0)
  p = passed / n
  den = 1 + z * z / n
  centre = (p + z * z / (2 * n)) / den
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
  return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(base: np.ndarray, cand: np.ndarray, z: float = Z95) -> dict:
  """Mean and 95% normal CI of per-task (candidate - baseline) pass rates (tasks paired)."""
  d = np.asarray(cand, float) - np.asarray(base, float)
  n = d.size
  mean = float(d.mean()) if n else 0.0
  se = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0
  return {"mean": mean, "ci95": [mean - z * se, mean + z * se], "n_tasks": int(n),
          "tasks_better": int(np.sum(d > 0)), "tasks_worse": int(np.sum(d < 0))}


def percentiles(xs) -> dict:
  xs = np.asarray(xs, float)
  if xs.size == 0:
    return {"p50": None, "p95": None, "p99": None, "mean": None}
  return {"p50": float(np.percentile(xs, 50)), "p95": float(np.percentile(xs, 95)),
          "p99": float(np.percentile(xs, 99)), "mean": float(xs.mean())}


# --------------------------------------------------------------------------- the verdict

def _p95_check(limits, candidate: dict) -> dict:
  p95 = candidate["latency_s"]["p95"]
  return {"name": "p95 latency", "value": p95, "limit": limits["max_p95_latency_s"],
          "holds": p95 is not None and p95 <= limits["max_p95_latency_s"],
          "detail": (f"candidate p95 {p95:.3f} s" if p95 is not None else
                     "no candidate request succeeded")
                    + f" (limit <= {limits['max_p95_latency_s']:.3f} s)"}


def verdict(limits, baseline: dict, candidate: dict) -> dict:
  """Keep the candidate only if every limit holds; else keep the baseline, saying which failed.

  baseline/candidate: arm summaries with `pass_rate`, `latency_s["p95"]`, `memory_bytes`."""
  for k in ("max_pass_rate_drop", "max_p95_latency_s", "min_memory_saving"):
    if limits.get(k) is None:
      raise ValueError(f"limits.{k} is not set: every limit must be chosen before the runs")
  drop = baseline["pass_rate"] - candidate["pass_rate"]
  saving = 1.0 - candidate["memory_bytes"] / baseline["memory_bytes"]
  checks = [
      {"name": "pass rate drop", "value": drop, "limit": limits["max_pass_rate_drop"],
       "holds": drop <= limits["max_pass_rate_drop"],
       "detail": f"baseline {baseline['pass_rate']:.3f} - candidate "
                 f"{candidate['pass_rate']:.3f} = {drop:+.3f} (limit <= "
                 f"{limits['max_pass_rate_drop']:.3f})"},
      _p95_check(limits, candidate),
      {"name": "memory saving", "value": saving, "limit": limits["min_memory_saving"],
       "holds": saving >= limits["min_memory_saving"],
       "detail": f"1 - {candidate['memory_bytes'] / 2**20:.4g} MiB / "
                 f"{baseline['memory_bytes'] / 2**20:.4g} MiB = {saving:.1%} (limit >= "
                 f"{limits['min_memory_saving']:.1%})"},
  ]
  failed = [c for c in checks if not c["holds"]]
  if failed:
    reason = "keep the baseline: " + "; ".join(f"{c['name']} fails ({c['detail']})"
                                               for c in failed)
  else:
    reason = "keep FP4: every limit holds (" + "; ".join(c["detail"] for c in checks) + ")"
  return {"keep": "baseline" if failed else "candidate", "checks": checks, "reason": reason}


def verdict_one_fits(limits, arms: dict, summaries: dict) -> dict:
  """The verdict when one arm does not fit the device (`fits` False, its error kept). The
  candidate alone: keep FP4 if its p95 latency holds (the pass rate drop and the memory saving
  cannot be measured without a baseline: their checks hold None), else keep neither. The
  baseline alone: keep it."""
  unfit = [a for a in backend.ARMS if not arms[a].get("fits", True)]
  if len(unfit) != 1:
    raise ValueError(f"verdict_one_fits needs exactly one arm that does not fit, got {unfit}")
  why = f"the {unfit[0]} ({arms[unfit[0]]['policy']}) does not fit: {arms[unfit[0]]['error']}"
  if unfit[0] == "candidate":
    return {"keep": "baseline", "checks": [], "reason": f"keep the baseline: {why}"}
  c = summaries["candidate"]
  unmeasured = "not measurable: the baseline does not fit"
  p95 = _p95_check(limits, c)
  checks = [{"name": "pass rate drop", "value": None, "limit": limits["max_pass_rate_drop"],
             "holds": None, "detail": unmeasured},
            p95,
            {"name": "memory saving", "value": None, "limit": limits["min_memory_saving"],
             "holds": None, "detail": unmeasured}]
  rate = (f"its pass rate {c['pass_rate']:.3f} (95% CI {c['pass_rate_ci95'][0]:.3f}-"
          f"{c['pass_rate_ci95'][1]:.3f}) has no baseline to be compared with")
  if p95["holds"]:
    return {"keep": "candidate", "checks": checks,
            "reason": f"keep FP4, the only arm that serves here: {why}; {p95['detail']} "
                      f"holds; {rate}"}
  return {"keep": "neither", "checks": checks,
          "reason": f"neither arm serves within the limits: {why}; {p95['detail']} "
                    f"fails; {rate}"}


# --------------------------------------------------------------------------- one arm

def with_prompts(config):
  """`config` whose task is `compare.prompts_jsonl` when set (so prompt and answer lengths, and
  with them the context length, come from those prompts)."""
  cc = config.compare
  if not cc.prompts_jsonl:
    return config
  return override(config, {"task.name": "jsonl", "task.kwargs": ml_collections.ConfigDict(
      {"path": cc.prompts_jsonl, "reward": cc.reward, "eval_size": 0})})


def load_examples(config) -> tuple[object, list]:
  """(task, examples): the first `compare.num_prompts` records of `compare.prompts_jsonl` (file
  order), or the task's first eval examples."""
  cc = config.compare
  task = loop.build(config).task
  if cc.prompts_jsonl:
    examples = task.all_examples()
    return task, examples[:int(cc.num_prompts)] if cc.num_prompts else examples
  return task, task.examples("eval", int(cc.num_prompts))


class MemorySampler:
  """Max of the device's bytes in use, polled in a thread (None where the backend has no
  memory stats, e.g. CPU)."""

  def __init__(self, interval_s: float = 0.02):
    self.device = jax.devices()[0]
    self.interval_s = interval_s
    self.peak = self._read()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._poll, daemon=True)

  def _stats(self):
    try:
      return self.device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats
      return None

  def _read(self):
    stats = self._stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))

  def process_peak(self):
    """The allocator's peak since the process started (load and quantize included)."""
    stats = self._stats()
    return None if not stats or "peak_bytes_in_use" not in stats else int(
        stats["peak_bytes_in_use"])

  def _poll(self):
    while not self._stop.wait(self.interval_s):
      v = self._read()
      if v is not None:
        self.peak = max(self.peak or 0, v)

  def __enter__(self):
    if self.peak is not None:
      self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join()
    v = self._read()
    if v is not None:
      self.peak = max(self.peak or 0, v)


def offer_load(model: backend.ServingModel, requests: list[GenerationRequest], load) -> list:
  """Send `requests` under `load` (closed loop: `concurrency` clients each sending its next
  request when the last returns; open loop: Poisson arrivals at `rate`/s). Returns
  (result or exception, send time) per request, in order."""
  sched = model.scheduler
  out: list = [None] * len(requests)
  if load.rate and load.rate > 0:
    rng = np.random.default_rng(0)
    arrivals = np.cumsum(rng.exponential(1.0 / load.rate, len(requests)))
    t0 = time.perf_counter()
    futs = []
    for i, req in enumerate(requests):
      delay = t0 + arrivals[i] - time.perf_counter()
      if delay > 0:
        time.sleep(delay)
      sent = t0 + arrivals[i]
      try:
        futs.append((i, sched.submit(req), sent))
      except Exception as e:  # noqa: BLE001 - e.g. queue full: recorded as that request's failure
        out[i] = (e, sent)
    for i, fut, sent in futs:
      try:
        out[i] = (fut.result(), sent)
      except Exception as e:  # noqa: BLE001
        out[i] = (e, sent)
    return out
  nxt = iter(range(len(requests)))
  lock = threading.Lock()

  def client():
    while True:
      with lock:
        i = next(nxt, None)
      if i is None:
        return
      sent = time.perf_counter()
      try:
        out[i] = (sched.submit(requests[i]).result(), sent)
      except Exception as e:  # noqa: BLE001
        out[i] = (e, sent)

  threads = [threading.Thread(target=client) for _ in range(max(1, int(load.concurrency)))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return out


def _failure_text(example, output: str, reason: str, passed: bool) -> str:
  if passed:
    return ""
  text = f"expected {example.answer!r}, got {output!r}"
  if reason == "length":
    text += " (stopped at max_tokens)"
  return text


def does_not_fit(e: BaseException) -> bool:
  """Whether an error says the arm does not fit the device: the capacity planner's
  `CapacityError`, or the allocator's out-of-memory error."""
  return isinstance(e, (CapacityError, MemoryError)) or (
      isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e))


def _arm_that_does_not_fit(config, arm: str, error: BaseException) -> dict:
  """An arm's result when it could not be set up for want of memory: what it is and why."""
  setup = loop.build(backend.arm_config(config, arm))
  return dict(arm=arm, fits=False, error=f"{type(error).__name__}: {error}",
              policy=setup.policy.name if setup.policy.quantizes_anything else "bf16",
              precision=config[arm].precision, fp4_format=config[arm].fp4_format,
              weights=backend.weights_source(config), max_batch=int(config.serve.max_batch),
              device_bytes=backend.device_bytes(config.serve), device=str(jax.devices()[0]))


def run_arm(config, arm: str, log=print) -> dict:
  """Serve one arm in this process and measure it on every prompt, `compare.repeats` times.
  An arm that does not fit the device (`does_not_fit`) is returned as `fits=False` with the
  error, so that the report can say so (FP4 is often the only way a model serves on a GPU)."""
  cc = config.compare
  sampling = SamplingParams(float(cc.temperature), 0, float(cc.top_p))
  try:
    model = backend.build_serving(config, arm, warm_sampling=sampling, log=log)
  except Exception as e:  # noqa: BLE001 - only memory errors are kept (re-raised otherwise)
    if not does_not_fit(e):
      raise
    log(f"{arm} does not fit: {type(e).__name__}: {e}")
    return _arm_that_does_not_fit(config, arm, e)
  try:
    task, examples = load_examples(backend.arm_config(config, arm))
    tok = model.tokenizer
    prompts = [tuple(tok.encode(e.prompt)) for e in examples]
    max_tokens = model.scheduler.max_tokens
    runs, tasks = [], []
    with MemorySampler() as mem:
      for r in range(int(cc.repeats)):
        reqs = [GenerationRequest(p, max_tokens, sampling, r, model.stop_tokens) for p in prompts]
        t0 = time.perf_counter()
        results = offer_load(model, reqs, config.load)
        wall = time.perf_counter() - t0
        outputs, lat, gen = [], [], 0
        for i, (res, sent) in enumerate(results):
          ex = examples[i]
          if isinstance(res, Exception):
            tasks.append(dict(task=i, repeat=r, prompt=ex.prompt, answer=ex.answer, output=None,
                              passed=False, failure=f"error: {type(res).__name__}: {res}",
                              ttft_s=None, per_token_s=None, latency_s=None,
                              prompt_tokens=len(prompts[i]), completion_tokens=0))
            outputs.append(None)
            continue
          text = tok.decode(res.tokens)
          outputs.append(text)
          latency = res.finished_at - sent
          lat.append(latency)
          gen += len(res.tokens)
          first = res.finished_at if res.first_token_at is None else res.first_token_at
          tasks.append(dict(task=i, repeat=r, prompt=ex.prompt, answer=ex.answer, output=text,
                            passed=None, failure=None, ttft_s=first - sent,
                            per_token_s=res.per_token_s, latency_s=latency,
                            queue_s=res.started_at - sent, prompt_tokens=len(prompts[i]),
                            completion_tokens=len(res.tokens), finish_reason=res.finish_reason,
                            batch_size=res.batch_size))
        rewards = task.reward([e.prompt for e in examples], outputs,
                              [e.answer for e in examples])
        for rec, rew in zip(tasks[-len(examples):], rewards):
          if rec["passed"] is None:
            rec["passed"] = bool(rew >= 1.0)
            rec["failure"] = _failure_text(examples[rec["task"]], rec["output"],
                                           rec["finish_reason"], rec["passed"])
        passed = sum(t["passed"] for t in tasks[-len(examples):])
        runs.append(dict(repeat=r, wall_s=wall, requests=len(reqs), completion_tokens=gen,
                         throughput_tok_s=gen / wall, requests_per_s=len(reqs) / wall,
                         pass_rate=passed / len(examples), latency_s=percentiles(lat)))
        log(f"{arm} repeat {r}: pass {passed}/{len(examples)}, {gen / wall:.1f} tok/s, "
            f"p95 {runs[-1]['latency_s']['p95']:.3f} s")
    engine = model.engine
    context = model.scheduler.max_prompt_tokens + engine.max_new_tokens
    estimate = engine.weight_bytes + model.scheduler.max_batch * bytes_per_sequence(
        engine.config, engine.policy, context, record_guidance=False)
    for run in runs:
      run["peak_memory_bytes"] = mem.peak
    return dict(arm=arm, policy=engine.policy.name if engine.policy.quantizes_anything else
                "bf16", precision=config[arm].precision, fp4_format=config[arm].fp4_format,
                weights=model.source, setup_s=model.setup_s, weight_bytes=engine.weight_bytes,
                peak_memory_bytes=mem.peak, process_peak_bytes=mem.process_peak(),
                estimated_memory_bytes=int(estimate),
                memory_measured=mem.peak is not None, context_len=context,
                batches_run=model.scheduler.batches_run, scheduler=config.serve.scheduler,
                fits=True,
                runs=runs, tasks=tasks,
                device=str(jax.devices()[0]))
  finally:
    model.close()


def run_arm_isolated(config, arm: str, workdir: str, log=print) -> dict:
  """`run_arm` in a fresh Python process (its own device memory and peak statistics)."""
  cfg_path = os.path.join(workdir, f"{arm}_config.json")
  out_path = os.path.join(workdir, f"{arm}_raw.json")
  with open(cfg_path, "w") as f:
    f.write(config.to_json())
  cmd = [sys.executable, "-m", "trace_jax.serving.compare", "--arm", arm, "--config_json",
         cfg_path, "--out", out_path]
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  for line in proc.stdout.splitlines():
    log(line)
  if proc.returncode != 0:
    raise RuntimeError(f"the {arm} arm failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  with open(out_path) as f:
    return json.load(f)


# --------------------------------------------------------------------------- summary + report

def summarize(arm: dict, gpu_hour_usd: float) -> dict:
  tasks = arm["tasks"]
  n = len(tasks)
  passed = sum(t["passed"] for t in tasks)
  lat = [t["latency_s"] for t in tasks if t["latency_s"] is not None]
  ttft = [t["ttft_s"] for t in tasks if t["ttft_s"] is not None]
  tpot = [t["per_token_s"] for t in tasks if t["per_token_s"] is not None]
  gen = sum(r["completion_tokens"] for r in arm["runs"])
  wall = sum(r["wall_s"] for r in arm["runs"])
  memory = arm["peak_memory_bytes"] if arm["memory_measured"] else arm["estimated_memory_bytes"]
  usd_per_s = gpu_hour_usd / 3600.0
  rates = [r["pass_rate"] for r in arm["runs"]]
  return dict(
      pass_rate=passed / max(n, 1), pass_rate_ci95=list(wilson_interval(passed, n)),
      pass_rate_by_repeat=rates, samples=n, errors=sum(t["output"] is None for t in tasks),
      latency_s=percentiles(lat), ttft_s=percentiles(ttft), per_token_s=percentiles(tpot),
      p95_by_repeat=[r["latency_s"]["p95"] for r in arm["runs"]],
      throughput_tok_s=gen / max(wall, 1e-9),
      throughput_by_repeat=[r["throughput_tok_s"] for r in arm["runs"]],
      completion_tokens=gen, wall_s=wall, setup_s=arm["setup_s"],
      memory_bytes=memory, memory_kind="measured peak" if arm["memory_measured"] else "estimate",
      weight_bytes=arm["weight_bytes"],
      usd_per_mtok=usd_per_s * (arm["setup_s"] + wall) / max(gen, 1) * 1e6,
      usd_per_mtok_steady=usd_per_s * wall / max(gen, 1) * 1e6)


def _per_task(arm: dict) -> np.ndarray:
  n = 1 + max(t["task"] for t in arm["tasks"])
  tot, cnt = np.zeros(n), np.zeros(n)
  for t in arm["tasks"]:
    tot[t["task"]] += t["passed"]
    cnt[t["task"]] += 1
  return tot / np.maximum(cnt, 1)


def make_plots(arms: dict, summaries: dict, out_dir: str) -> dict:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  plots = {}
  colors = {"baseline": "tab:blue", "candidate": "tab:orange"}
  label = {a: f"{a} ({arms[a]['policy']})" for a in arms}

  def save(fig, key):
    fig.tight_layout()
    plots[key] = f"{key}.png"
    fig.savefig(os.path.join(out_dir, plots[key]))
    plt.close(fig)

  fig, ax = plt.subplots(figsize=(5, 3.2), dpi=90)
  for a, arm in arms.items():
    xs = np.sort([t["latency_s"] for t in arm["tasks"] if t["latency_s"] is not None])
    ax.step(xs, np.arange(1, xs.size + 1) / max(xs.size, 1), where="post", color=colors[a],
            label=label[a])
  ax.set_xlabel("request latency (s), send to last token")
  ax.set_ylabel("fraction of requests")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  save(fig, "latency_cdf")

  fig, ax = plt.subplots(figsize=(4, 3.2), dpi=90)
  names = list(arms)
  mem = [summaries[a]["memory_bytes"] / 2**20 for a in names]
  wts = [summaries[a]["weight_bytes"] / 2**20 for a in names]
  x = np.arange(len(names))
  ax.bar(x - 0.2, mem, 0.4, label="serving memory (" + summaries[names[0]]["memory_kind"] + ")",
         color=[colors[a] for a in names])
  ax.bar(x + 0.2, wts, 0.4, label="weights", color="gray")
  ax.set_xticks(x, [label[a] for a in names], fontsize=8)
  ax.set_ylabel("MiB")
  ax.legend(fontsize=7)
  save(fig, "memory")

  fig, ax = plt.subplots(figsize=(4, 3.2), dpi=90)
  for j, a in enumerate(names):
    s = summaries[a]
    lo, hi = s["pass_rate_ci95"]
    ax.errorbar([j], [s["pass_rate"]], yerr=[[s["pass_rate"] - lo], [hi - s["pass_rate"]]],
                fmt="o", capsize=6, color=colors[a])
    ax.scatter([j + 0.12] * len(s["pass_rate_by_repeat"]), s["pass_rate_by_repeat"], s=10,
               color=colors[a], alpha=0.6)
  ax.set_xticks(range(len(names)), [label[a] for a in names], fontsize=8)
  ax.set_ylabel("pass rate (95% Wilson CI; dots: repeats)")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3, axis="y")
  save(fig, "pass_rate")
  return plots


def _mib(b):
  return "–" if b is None else f"{b / 2**20:.4g}"


def _results_table(names: list, summaries: dict, arms: dict) -> list:
  """The results table's lines, a column per arm served."""
  cols = [summaries[a] for a in names]

  def row(label, cell):
    return f"| {label} | " + " | ".join(cell(s, arms[a]) for s, a in zip(cols, names)) + " |"

  def joined(key, fmt):
    return lambda s, _: ", ".join(fmt.format(x) for x in s[key])

  lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
           row("pass rate (95% CI)", lambda s, _: f"{s['pass_rate']:.3f} "
               f"[{s['pass_rate_ci95'][0]:.3f}, {s['pass_rate_ci95'][1]:.3f}]"),
           row("pass rate per repeat", joined("pass_rate_by_repeat", "{:.3f}"))]
  for key, name in (("latency_s", "latency"), ("ttft_s", "TTFT"),
                    ("per_token_s", "per-token latency")):
    for q in ("p50", "p95", "p99"):
      lines.append(row(f"{name} {q} (s)", lambda s, _, k=key, q=q: f"{s[k][q]:.4f}"))
  lines += [
      row("p95 latency per repeat (s)", joined("p95_by_repeat", "{:.3f}")),
      row("throughput (generated tok/s)", lambda s, _: f"{s['throughput_tok_s']:.1f}"),
      row("throughput per repeat", joined("throughput_by_repeat", "{:.1f}")),
      row(f"serving memory, MiB ({cols[0]['memory_kind']})",
          lambda s, _: _mib(s["memory_bytes"])),
      row("weights, MiB", lambda s, _: _mib(s["weight_bytes"])),
      row("process peak incl. load + quantize, MiB",
          lambda _, arm: _mib(arm.get("process_peak_bytes"))),
      row("setup s (load + quantize + compile)", lambda s, _: f"{s['setup_s']:.1f}"),
      row("$ / M generated tokens (setup counted)", lambda s, _: f"{s['usd_per_mtok']:.3f}"),
      row("$ / M generated tokens (steady)", lambda s, _: f"{s['usd_per_mtok_steady']:.3f}"),
      row("generated tokens / errors",
          lambda s, _: f"{s['completion_tokens']} / {s['errors']}")]
  return lines


def _notes(report: dict, memory_kind: str) -> str:
  """How the report's figures were taken (cost, latency, memory, CPU caveat)."""
  cfg = report["config"]
  return (
      f"Cost at ${cfg['cost']['gpu_hour_usd']}/GPU-hour. Latency is from send to the last "
      "token, TTFT from send to the first token on the host. "
      + ("The slot scheduler streams tokens per decode chunk; per-token latency is the mean "
         "time between tokens after the first. " if cfg["serve"].get("scheduler") == "slots"
         else "The batch scheduler returns a batch's tokens when the batch ends, so TTFT equals "
         "latency and per-token latency is latency / generated tokens. ")
      + "Memory: "
      + ("the device's peak bytes in use while serving (sampled)." if memory_kind ==
         "measured peak" else "the backend reports no memory statistics, so this is the "
         "capacity planner's estimate: serving weights + KV/working bytes per sequence x max "
         "batch.")
      + (" On CPU, FP4 matmuls are emulated (dequantize, then compute in the rollout dtype), so "
         "CPU speed says nothing about FP4 speed on a GPU; the pass rates and memory do carry "
         "over." if report["device"].lower().startswith("cpu") or report["device"].startswith(
             "TFRT_CPU") else ""))


_KEEP = {"candidate": "keep FP4", "baseline": "keep the baseline",
         "neither": "neither arm serves within the limits"}


def markdown_report(report: dict) -> str:
  s, v, cfg = report["summary"], report["verdict"], report["config"]
  arms = report["arms"]
  served = [a for a in backend.ARMS if a not in report.get("unfit", [])]
  load = cfg["load"]
  offered = (f"open-loop Poisson arrivals at {load['rate']} req/s" if load["rate"]
             else f"{load['concurrency']} concurrent closed-loop clients")
  lim = report["limits"]
  planned = cfg["serve"].get("device_gib") or 0
  lines = [
      f"# Serving A/B: {arms['baseline']['policy']} vs FP4 `{arms['candidate']['policy']}` "
      f"({arms['candidate']['fp4_format']})", "",
      f"{report['date']}, {report['device']}, jax {report['jax_version']}, commit "
      f"{report['git_commit'][:10]}. Weights: {arms['baseline']['weights']}. Task: "
      f"{report['prompts']} ({report['num_prompts']} prompts) x {cfg['compare']['repeats']} "
      f"paired repeats, sampling temperature {cfg['compare']['temperature']} (repeat r: seed r "
      f"on both arms). Same context length ({arms[served[0]]['context_len']} tokens: prompt "
      f"bucket + max_tokens), same offered load ({offered}), max batch "
      f"{cfg['serve']['max_batch']}."
      + (f" Serving planned for a device of {planned:.4g} GiB." if planned else "")
      + (f" {cfg['compare']['notes']}" if cfg['compare'].get('notes') else ""), "",
      f"## Verdict: **{_KEEP[v['keep']]}**", "",
      v["reason"] + ".", "",
      f"Limits written before the runs ({lim['written_at']}):", "",
      "| limit | value | measured | holds |", "|---|---|---|---|"]
  for ch in v["checks"]:
    measured = "–" if ch["value"] is None else f"{ch['value']:.4g}"
    holds = ("not measurable" if ch["holds"] is None else "yes" if ch["holds"] else "**no**")
    lines.append(f"| {ch['name']} | {ch['limit']} | {measured} | {holds} |")
  lines += ["", "## Results", ""]
  for a in report.get("unfit", []):
    lines += [f"The {a} ({arms[a]['policy']}) does not fit: {arms[a]['error']}", ""]
  lines += _results_table(served, s, arms) + [""]
  d = report["paired_difference"]
  if d is not None:
    lines += [
        f"Paired per-task difference (candidate - baseline, mean over repeats): "
        f"{d['mean']:+.3f}, 95% CI [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]; "
        f"{d['tasks_better']} tasks better, {d['tasks_worse']} worse of {d['n_tasks']}.", ""]
  lines += [_notes(report, s[served[0]]["memory_kind"]), "",
            "![latency CDF](latency_cdf.png) ![memory](memory.png) ![pass rate](pass_rate.png)",
            ""]
  if report["failures"]:
    lines += ["## Tasks where the arms differ (repeat 0)", "",
              "| task | prompt | answer | baseline | candidate |", "|---|---|---|---|---|"]
    for f in report["failures"]:
      lines.append(f"| {f['task']} | `{f['prompt']}` | `{f['answer']}` | "
                   f"{f['baseline'] or 'pass'} | {f['candidate'] or 'pass'} |")
    lines.append("")
  lines += [f"Command: `{report['command']}`; wall time {report['wall_s']:.0f} s. Per-task "
            "records (output, pass/fail, failure text, TTFT, per-token latency, tokens) are in "
            "report.json.", ""]
  return "\n".join(lines)


def build_report(config, arms: dict, limits: dict, wall_s: float, out_dir: str) -> dict:
  """Summaries, verdict, paired difference, plots, report.json and report.md in `out_dir`."""
  usd = float(config.cost.gpu_hour_usd)
  unfit = [a for a in backend.ARMS if not arms[a].get("fits", True)]
  if len(unfit) == len(backend.ARMS):
    raise RuntimeError("neither arm fits the device: " + "; ".join(
        f"{a}: {arms[a]['error']}" for a in unfit))
  served = {a: arms[a] for a in backend.ARMS if a not in unfit}
  summaries = {a: summarize(arms[a], usd) for a in served}
  diff, differ = None, []
  if unfit:
    v = verdict_one_fits(limits, arms, summaries)
  else:
    v = verdict(limits, summaries["baseline"], summaries["candidate"])
    diff = paired_difference(_per_task(arms["baseline"]), _per_task(arms["candidate"]))
    base0 = {t["task"]: t for t in arms["baseline"]["tasks"] if t["repeat"] == 0}
    for t in arms["candidate"]["tasks"]:
      if t["repeat"] == 0 and t["passed"] != base0[t["task"]]["passed"]:
        differ.append(dict(task=t["task"], prompt=t["prompt"], answer=t["answer"],
                           baseline=base0[t["task"]]["failure"], candidate=t["failure"]))
  cc = config.compare
  report = dict(benchmark="serve_compare", **run_info(), config=config.to_dict(), limits=limits,
                prompts=cc.prompts_jsonl or f"task {config.task.name} eval split",
                num_prompts=1 + max(t["task"] for t in next(iter(served.values()))["tasks"]),
                wall_s=wall_s, verdict=v, summary=summaries, paired_difference=diff,
                failures=differ[:int(cc.report_failures)], unfit=unfit, arms=arms)
  report["plots"] = make_plots(served, summaries, out_dir)
  with open(os.path.join(out_dir, "report.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown_report(report))
  return report


def _fingerprint(config) -> str:
  """What a measurement depends on: the config without `compare.only_arm`/`notes`."""
  d = config.to_dict()
  d["compare"] = {k: v for k, v in d["compare"].items() if k not in ("only_arm", "notes")}
  return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_limits(config, workdir: str) -> dict:
  """Fix the acceptance limits on disk before any measurement. Refuses unset limits; in a
  workdir that already has limits.json (an arm ran there), refuses changed limits or config."""
  limits = dict(config.limits.to_dict())
  for k, val in limits.items():
    if val is None:
      raise loop.ConfigError(f"limits.{k} is not set: choose every limit before the runs")
  if not 0 <= limits["min_memory_saving"] < 1:
    raise loop.ConfigError("limits.min_memory_saving is a fraction in [0, 1)")
  path = os.path.join(workdir, "limits.json")
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    written = {k: v for k, v in old["limits"].items() if k != "written_at"}
    if written != limits or old.get("fingerprint") != _fingerprint(config):
      raise loop.ConfigError(f"{path} holds limits {written} for another config or other "
                             "limits: limits cannot change once runs began; use a fresh workdir")
    return old["limits"]
  limits["written_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
  with open(path, "w") as f:
    json.dump(dict(limits=limits, fingerprint=_fingerprint(config), config=config.to_dict()), f,
              indent=1)
  return limits


def run_compare(config, workdir: str, log=print) -> dict | None:
  """The paired A/B end to end (see the module docstring); returns the report dict.

  `compare.only_arm`: measure just that arm into `<arm>_raw.json` and return None (e.g. one
  device job per arm); a later call without it reuses the raw results found in the workdir
  (same config and limits only) and writes the report."""
  workdir = loop.resolve_workdir(workdir)
  t0 = time.perf_counter()
  config = with_prompts(config)
  only = config.compare.get("only_arm", "")
  if only and only not in backend.ARMS:
    raise loop.ConfigError(f"compare.only_arm must be '' or one of {backend.ARMS}, got {only!r}")
  limits = write_limits(config, workdir)
  arms = {}
  for arm in backend.ARMS:
    if only and arm != only:
      continue
    raw = os.path.join(workdir, f"{arm}_raw.json")
    if not only and os.path.exists(raw):
      log(f"=== {arm}: reusing {raw} ===")
      with open(raw) as f:
        arms[arm] = json.load(f)
      continue
    log(f"=== {arm}: {config[arm].precision} {config[arm].policy} ===")
    if config.compare.isolate:
      arms[arm] = run_arm_isolated(config, arm, workdir, log)
    else:
      arms[arm] = run_arm(config, arm, log)
      with open(raw, "w") as f:
        json.dump(arms[arm], f)
  if only:
    log(f"{only} measured into {workdir}; run again without compare.only_arm for the report")
    return None
  return build_report(config, arms, limits, time.perf_counter() - t0, workdir)


def _arm_main(argv=None) -> None:
  import argparse
  ap = argparse.ArgumentParser(description="One arm of launch/compare.py (internal).")
  ap.add_argument("--arm", required=True, choices=backend.ARMS)
  ap.add_argument("--config_json", required=True)
  ap.add_argument("--out", required=True)
  a = ap.parse_args(argv)
  with open(a.config_json) as f:
    config = ml_collections.ConfigDict(json.load(f))
  result = run_arm(config, a.arm, log=lambda m: print(m, flush=True))
  with open(a.out, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  _arm_main()
