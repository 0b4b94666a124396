"""The paper's comparison at small scale: BF16 rollout, naive FP4, independent QAT and TRACE on
the same seeds, task and SFT warm start; a Markdown report with PNG plots."""

from __future__ import annotations

import copy
import json
import os
import time

import jax
import numpy as np

from trace_jax.metrics import plot_metrics, read_metrics
from trace_jax.provenance import run_info
from trace_jax.rl import loop

VARIANTS = {
    "bf16_rollout": {"rollout.precision": "bf16", "rl.alignment": "none"},
    "fp4_naive": {"rollout.precision": "fp4", "rl.alignment": "none"},
    "fp4_qat": {"rollout.precision": "fp4", "rl.alignment": "qat"},
    "fp4_trace": {"rollout.precision": "fp4", "rl.alignment": "trace"},
}
TABLE_KEYS = ("reward/mean", "eval/pass_rate", "mismatch/k3_kl", "mismatch/abs_logp_diff",
              "mismatch/max_abs_logp_diff", "mismatch/code_agreement_guided",
              "mismatch/code_agreement_unguided")


def override(config, changes: dict):
  """A copy of `config` with dotted keys set, e.g. {"rl.alignment": "qat"}."""
  c = copy.deepcopy(config)
  for key, value in changes.items():
    node = c
    *path, last = key.split(".")
    for p in path:
      node = node[p]
    node[last] = value
  return c


def _summary(rows: list[dict]) -> dict:
  """Means over the last 20% of steps (eval: the last evaluation), as in the paper's table."""
  steps = [r for r in rows if r.get("step", 0) > 0]
  tail = steps[-max(1, len(steps) // 5):]
  out = {}
  for k in TABLE_KEYS:
    if k == "eval/pass_rate":
      evals = [r[k] for r in steps if r.get(k) is not None]
      out[k] = evals[-1] if evals else None
      out["eval/pass_rate_first"] = evals[0] if evals else None
      continue
    vals = [r[k] for r in tail if r.get(k) is not None]
    out[k] = float(np.mean(vals)) if vals else None
  first = [r["reward/mean"] for r in steps[:max(1, len(steps) // 5)]]
  out["reward/first_20pct"] = float(np.mean(first)) if first else None
  out["time/step_s"] = float(np.mean([r["time/rollout_s"] + r["time/train_s"] for r in steps]))
  return out


def compare_alignment(config, workdir: str, variants=None, log=print) -> dict:
  """Run every variant from one shared SFT warm start; write report.md/json and plots."""
  workdir = loop.resolve_workdir(workdir)
  variants = variants or list(VARIANTS)
  setup = loop.build(config)
  t0 = time.time()
  params = None
  if config.sft.max_steps:
    from trace_jax import models as M
    params, info = loop.warm_start(M.init_params(setup.model_config, jax.random.key(config.seed)),
                                   setup, config, loop.make_engine(setup), log)
    log(f"shared SFT warm start: {info}")
  results, runs = {}, {}
  for name in variants:
    log(f"=== {name} ===")
    cfg = override(config, VARIANTS[name])
    if params is not None:
      cfg.sft.max_steps = 0
    run_dir = os.path.join(workdir, name)
    loop.run(cfg, run_dir, log=log, init_params=params)
    rows = read_metrics(run_dir)
    results[name] = _summary(rows)
    runs[name] = run_dir
  plots = {}
  plots = make_plots(runs, workdir)
  report = dict(
      benchmark="compare_alignment", **run_info(), config=config.to_dict(), wall_s=time.time() - t0, results=results, plots=plots,
      units={"time/step_s": "s", "mismatch/k3_kl": "nats/token",
             "mismatch/abs_logp_diff": "nats/token"})
  with open(os.path.join(workdir, "report.json"), "w") as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(markdown_report(report))
  return report


def make_plots(runs: dict, out_dir: str) -> dict:
  """Reward, eval pass rate, k3 KL (log scale) and code agreement over steps, one PNG each."""
  plots = {}
  for key, fname, smooth, logy in (("reward/mean", "reward.png", 10, False),
                                   ("eval/pass_rate", "eval_pass_rate.png", 1, False),
                                   ("mismatch/k3_kl", "k3_kl.png", 10, True),
                                   ("mismatch/code_agreement", "code_agreement.png", 10, False)):
    plots[key] = os.path.basename(plot_metrics(runs, [key], os.path.join(out_dir, fname),
                                               smooth=smooth, title=key, logy=logy))
  return plots


def _fmt(v, k):
  if v is None:
    return "–"
  if "k3" in k:
    return f"{v:.2e}"
  return f"{v:.4f}"


def markdown_report(report: dict) -> str:
  res = report["results"]
  cols = ["reward/first_20pct"] + list(TABLE_KEYS[:1]) + ["eval/pass_rate_first"] + \
      list(TABLE_KEYS[1:]) + ["time/step_s"]
  heads = {"reward/first_20pct": "reward (first 20%)", "reward/mean": "reward (last 20%)",
           "eval/pass_rate_first": "eval pass (first eval)", "eval/pass_rate": "eval pass (end)",
           "mismatch/k3_kl": "k3 KL", "mismatch/abs_logp_diff": "mean abs dlogp",
           "mismatch/max_abs_logp_diff": "max abs dlogp",
           "mismatch/code_agreement_guided": "code agr. guided",
           "mismatch/code_agreement_unguided": "code agr. unguided",
           "time/step_s": "s/step"}
  lines = [f"# Alignment comparison ({report['date']}, {report['device']}, jax "
           f"{report['jax_version']}, commit {report['git_commit'][:10]})", "",
           f"Task `{report['config']['task']['name']}`, {report['config']['total_steps']} RL "
           f"steps, {report['config']['rollout']['prompts_per_step']} prompts x "
           f"{report['config']['rollout']['samples_per_prompt']} samples, FP4 policy "
           f"`{report['config']['rollout']['policy']}` ({report['config']['rollout']['fp4_format']}"
           f"), rollout computes in {report['config']['rollout']['dtype']}, trainer in "
           f"{report['config']['model']['dtype']}. Mismatch metrics are means over the last 20% "
           "of steps.", "",
           "| variant | " + " | ".join(heads[c] for c in cols) + " |",
           "|---|" + "---|" * len(cols)]
  for name, r in res.items():
    lines.append(f"| {name} | " + " | ".join(_fmt(r.get(c), c) for c in cols) + " |")
  lines += ["", "Plots: " + ", ".join(f"![{k}]({v})" for k, v in report["plots"].items()), "",
            f"Command: `{report['command']}`; wall time {report['wall_s']:.0f} s.", ""]
  return "\n".join(lines)
