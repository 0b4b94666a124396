"""metrics.jsonl writer (JSON conversion, per-step merge, resume truncation), progress, plots."""

import importlib.util
import io
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from trace_jax.metrics import (MetricWriter, Progress, format_metrics, plot_metrics,
                               read_metrics, to_json_value)


def lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(l) for l in f]


def test_to_json_value_numpy_and_jax_scalars():
  cases = [
      (np.float32(0.5), 0.5, float), (np.float64(1.25), 1.25, float),
      (np.int32(7), 7, int), (np.uint8(3), 3, int), (np.bool_(True), True, bool),
      (jnp.float32(2.5), 2.5, float), (jnp.array(4, jnp.int32), 4, int),
      (jnp.array(1.5, jnp.bfloat16), 1.5, float), (ml_dtypes.bfloat16(0.75), 0.75, float),
      (jnp.array(True), True, bool), (3, 3, int), ("fp4", "fp4", str),
  ]
  for value, want, typ in cases:
    got = to_json_value(value)
    assert got == want and type(got) is typ, (value, got)
  assert to_json_value(float("nan")) is None and to_json_value(np.float32(np.inf)) is None
  assert to_json_value(jnp.arange(4).reshape(2, 2)) == [[0, 1], [2, 3]]
  with pytest.raises(TypeError):
    to_json_value(object())


def test_writer_lines_types_and_merge(tmp_path):
  w = MetricWriter(tmp_path / "run")
  w.write(1, {"reward/mean": jnp.float32(0.25), "time/train_s": 1.5})
  w.write(1, {"eval": {"pass_rate": np.float64(0.5)}})  # same step: merged into one line
  w.write(2, {"reward/mean": np.float32(0.5), "mismatch/k3_kl": float("nan")})
  w.close()
  recs = lines(tmp_path / "run")
  assert recs == [
      {"step": 1, "reward/mean": 0.25, "time/train_s": 1.5, "eval/pass_rate": 0.5},
      {"step": 2, "reward/mean": 0.5, "mismatch/k3_kl": None},
  ]
  assert list(recs[0])[0] == "step"
  assert read_metrics(tmp_path / "run") == recs  # a workdir or the file itself
  if importlib.util.find_spec("tensorboardX") is not None:
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tmp_path / "run"))


def _run(workdir, steps, resume_step=None):
  w = MetricWriter(workdir, resume_step=resume_step, tensorboard=False)
  for s in steps:
    w.write(s, {"reward/mean": s / 10, "x": s})
    if s % 3 == 0:
      w.write(s, {"eval/pass_rate": s / 100})
  w.close()


def test_resume_truncates_to_uninterrupted_run(tmp_path):
  _run(tmp_path / "full", range(1, 11))
  # Killed after step 7 (checkpoint at 5), with a torn half line at the end.
  _run(tmp_path / "kill", range(1, 8))
  with open(tmp_path / "kill" / "metrics.jsonl", "a") as f:
    f.write('{"step": 8, "rew')
  _run(tmp_path / "kill", range(6, 11), resume_step=5)
  with open(tmp_path / "full" / "metrics.jsonl") as a, \
       open(tmp_path / "kill" / "metrics.jsonl") as b:
    assert a.read() == b.read()
  # Resuming at a step that has a line, then writing that step again, still merges.
  w = MetricWriter(tmp_path / "kill", resume_step=10, tensorboard=False)
  w.write(10, {"extra": 1})
  w.close()
  recs = lines(tmp_path / "kill")
  assert [r["step"] for r in recs] == list(range(1, 11))
  assert recs[-1]["extra"] == 1 and recs[-1]["reward/mean"] == 1.0


def test_fresh_start_keeps_old_log_aside(tmp_path):
  _run(tmp_path, range(1, 4))
  _run(tmp_path, range(1, 3))
  assert [r["step"] for r in lines(tmp_path)] == [1, 2]
  assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl.prev")] == [1, 2, 3]


def test_relative_workdir_and_disabled_writer(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  w = MetricWriter("rel/run", tensorboard=False)
  assert w.path == str(tmp_path / "rel" / "run" / "metrics.jsonl")
  w.close()
  off = MetricWriter(tmp_path / "off", enabled=False)
  assert off.write(3, {"a": np.int64(2)}) == {"step": 3, "a": 2}
  off.close()
  assert not (tmp_path / "off").exists()


def test_progress_lines_and_log():
  buf = io.StringIO()
  with Progress(10, start=4, desc="rl", bar=False, file=buf) as p:
    p.update(5, {"reward/mean": np.float32(0.123456)})
    line = p.log(5, {"reward/mean": 0.5, "eval": {"pass_rate": 1}})
  out = buf.getvalue().splitlines()
  assert out[0].startswith("rl step 5/10 (50%)") and "ETA" in out[0] and "step/s" in out[0]
  assert "reward/mean=0.1235" in out[0]
  assert out[1] == line == "rl step 5/10 | reward/mean=0.5 eval/pass_rate=1"
  assert format_metrics({"a": 1, "b": 2.0}, keys=["b"]) == "b=2"


def test_progress_bar_mode():
  buf = io.StringIO()
  p = Progress(3, desc="bar", bar=True, file=buf)
  for s in (1, 2, 3):
    p.update(s, {"loss": 0.1})
  p.log(3, {"loss": 0.1})
  p.close()
  text = buf.getvalue()
  assert "3/3" in text and "bar step 3/3 | loss=0.1" in text


def test_plot_writes_png(tmp_path):
  _run(tmp_path / "a", range(1, 21))
  _run(tmp_path / "b", range(1, 11))
  out = plot_metrics(tmp_path / "a", ["reward/mean", "eval/pass_rate"], tmp_path / "p1.png",
                     smooth=3)
  out2 = plot_metrics({"trace": tmp_path / "a", "qat": tmp_path / "b"},
                      ["reward/mean", "missing/key"], tmp_path / "sub" / "p2.png")
  for p in (out, out2):
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(p) > 1000
