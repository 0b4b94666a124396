"""The RL loop: kill/resume equality, reward rises on the tiny task, launcher errors."""

import json
import os
import subprocess
import sys

import pytest

from configs import tiny_arith
from trace_jax.metrics import read_metrics
from trace_jax.rl import compare, loop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _small_config(**over):
  c = tiny_arith.get_config()
  c.sft.max_steps = 0
  c.total_steps = 6
  c.rollout.prompts_per_step = 4
  c.rollout.samples_per_prompt = 4
  c.eval.every = 3
  c.eval.size = 16
  c.checkpoint.every = 2
  return compare.override(c, over)


def _comparable(rows):
  return [{k: v for k, v in r.items() if k not in loop.TIMING_KEYS} for r in rows]


def test_killed_run_resumes_with_identical_metrics(tmp_path):
  cfg = _small_config()
  loop.run(cfg, str(tmp_path / "a"), log=lambda *_: None)
  # Killed after 3 steps: the last checkpoint is step 2, so step 3 is redone on restart.
  loop.run(cfg, str(tmp_path / "b"), log=lambda *_: None, stop_after=3)
  assert len(read_metrics(str(tmp_path / "b"))) == 4  # steps 0..3 written before the "kill"
  loop.run(cfg, str(tmp_path / "b"), log=lambda *_: None)
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in b] == list(range(7))
  assert _comparable(a) == _comparable(b)
  assert "eval/pass_rate" in a[3] and "mismatch/k3_kl" in a[1]


def test_checkpoint_of_another_model_shape_is_refused(tmp_path):
  loop.run(_small_config(total_steps=2), str(tmp_path), log=lambda *_: None)
  with pytest.raises(loop.ConfigError, match="different model.*fresh --workdir"):
    loop.run(_small_config(**{"total_steps": 4, "model.hidden_size": 32}), str(tmp_path),
             log=lambda *_: None)


def test_missing_workdir_and_bad_precision():
  with pytest.raises(loop.ConfigError, match="--workdir is required"):
    loop.run(_small_config(), "")
  with pytest.raises(loop.ConfigError, match="rollout.precision must be"):
    loop.build(_small_config(**{"rollout.precision": "fp3"}))


def test_launcher_one_line_errors(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  cmd = [sys.executable, os.path.join(ROOT, "launch", "train_rl.py")]
  r = subprocess.run(cmd + ["--config.no_such_key=1", f"--workdir={tmp_path}"], env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "no_such_key" in r.stderr
  r = subprocess.run(cmd + ["--config.rollout.precision=fp3", f"--workdir={tmp_path}"], env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1].startswith("error: rollout.precision must be")


def test_rl_raises_reward_on_tiny_addition(tmp_path):
  """SFT warm start to ~30%, then 60 GRPO steps with FP4 TRACE rollouts."""
  cfg = _small_config(**{"sft.max_steps": 600, "total_steps": 60, "rollout.prompts_per_step": 32,
                         "rollout.samples_per_prompt": 8, "eval.every": 60, "eval.size": 200,
                         "checkpoint.every": 60})
  rows = loop.run(cfg, str(tmp_path), log=lambda *_: None)
  rewards = [r["reward/mean"] for r in rows]
  first, last = sum(rewards[:15]) / 15, sum(rewards[-15:]) / 15
  print(f"reward first 15 steps {first:.3f} -> last 15 {last:.3f}")
  assert last >= first + 0.05
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    assert json.loads(f.readline())["sft/pass_rate"] >= 0.3
