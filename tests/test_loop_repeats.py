"""benchmarks/loop_repeats.py and benchmarks/train_determinism.py on CPU: `compare_runs` names the
first event and metric where two runs part (a made-up difference), the whole loop script finds
none between a run and its killed-and-resumed twin (slow), and train_determinism's variants
repeat their hashes (slow); plot_train_determinism's table keeps timed variants only."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _run(events, rows):
  return {"events": dict(events), "order": [k for k, _ in events], "rows": rows}


def test_compare_runs_names_where_runs_part():
  import loop_repeats  # noqa: PLC0415
  base = _run([("rollout/1", "a"), ("train/1", "b"), ("rollout/2", "c"), ("train/2", "d")],
              [{"step": 1, "loss": 0.5, "time/train_s": 1.0}, {"step": 2, "loss": 0.25}])
  same = _run(list(base["events"].items()),
              [{"step": 1, "loss": 0.5, "time/train_s": 9.0}, {"step": 2, "loss": 0.25}])
  c = loop_repeats.compare_runs(base, same)
  assert c["events_differing"] == 0 and c["first_differing_step"] is None  # timings ignored
  other = _run([("rollout/1", "a"), ("train/1", "b"), ("rollout/2", "c"), ("train/2", "X")],
               [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.2500001}])
  c = loop_repeats.compare_runs(base, other)
  assert c["first_differing_event"] == "train/2" and c["events_differing"] == 1
  assert c["first_differing_step"] == 2
  assert c["metric_diffs"][0]["keys"] == {"loss": [0.25, 0.2500001]}
  short = _run([("rollout/1", "a"), ("train/1", "b")], base["rows"][:1])
  c = loop_repeats.compare_runs(base, short)
  assert c["events_differing"] == 0 and c["events_missing"] == ["rollout/2", "train/2"]


@pytest.mark.slow  # the RL loop three times (~20 s on 2 cores)
def test_run_and_resumed_run_agree(tmp_path, monkeypatch):
  import loop_repeats  # noqa: PLC0415
  out = tmp_path / "loop.json"
  monkeypatch.delenv("TRACE_JAX_COMPILATION_CACHE", raising=False)
  monkeypatch.setattr(sys, "argv", ["loop_repeats.py", "--runs", "1", "--steps", "4",
                                    "--kill_after", "3", "--workdir", str(tmp_path / "w"),
                                    "--out", str(out)])
  loop_repeats.main()
  runs = json.loads(out.read_text())["runs"]
  c = runs[1]["against_run0"]
  assert runs[1]["name"] == "killed_and_resumed"
  # 4 rollouts, 4 train steps and the evaluation after step 3 (eval.every 3) and the last
  assert c["events_compared"] == 10 and c["events_differing"] == 0
  assert c["first_differing_step"] is None


@pytest.mark.slow  # the RL loop in three processes (~50 s on 2 cores)
def test_resumed_in_a_new_process_agrees(tmp_path, monkeypatch):
  """--processes new: the killed run and its resumption each a process of its own, sharing the
  compilation cache, against an uninterrupted run in a third."""
  import jax  # noqa: PLC0415
  import loop_repeats  # noqa: PLC0415
  out = tmp_path / "loop.json"
  # the cache main would choose, set here so that monkeypatch takes it away after
  monkeypatch.setenv("TRACE_JAX_COMPILATION_CACHE", str(tmp_path / "w" / "xla_cache"))
  monkeypatch.setattr(sys, "argv", ["loop_repeats.py", "--runs", "1", "--steps", "4",
                                    "--kill_after", "3", "--processes", "new",
                                    "--workdir", str(tmp_path / "w"), "--out", str(out)])
  saved = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    loop_repeats.main()
  finally:  # (main turned this process's cache on)
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
  runs = json.loads(out.read_text())["runs"]
  c = runs[1]["against_run0"]
  assert c["events_compared"] == 10 and c["events_differing"] == 0
  assert c["first_differing_step"] is None
  # the resumption redid the steps after the last checkpoint (step 2): rollouts 3 and 4
  assert sum(k.startswith("rollout/") for k in runs[1]["resumed_events"]) == 2
  assert any((tmp_path / "w" / "xla_cache").iterdir())


@pytest.mark.slow  # two train-step compiles
def test_train_determinism_variants_repeat(tmp_path, monkeypatch):
  import train_determinism  # noqa: PLC0415
  out = tmp_path / "td.json"
  monkeypatch.setattr(sys, "argv", [
      "train_determinism.py", "--preset", "tiny", "--prompts", "4", "--samples", "2",
      "--max_new", "8", "--variants", "off,deterministic_ops", "--gathers", "repeatable,sorted",
      "--out", str(out)])
  train_determinism.main()
  variants = json.loads(out.read_text())["variants"]
  assert sorted(variants) == ["deterministic_ops/repeatable", "deterministic_ops/sorted",
                              "off/repeatable", "off/sorted"]
  assert all(v["repeatable"] for v in variants.values())
  # the compile option changes nothing on CPU: both variants end at the same parameters
  assert (variants["off/repeatable"]["hashes"][0]
          == variants["deterministic_ops/repeatable"]["hashes"][0])
  # the gathers' sums differ in order only: at tiny's top-2 a sum of two, the same bits
  assert variants["off/repeatable"]["hashes"][0] == variants["off/sorted"]["hashes"][0]
  assert variants["off/sorted"]["gather"] == "sorted"
  # each gather its own trace (jit's cache would give them the first one's: no more sorts)
  assert variants["off/sorted"]["sorts_in_program"] > variants["off/repeatable"][
      "sorts_in_program"]


def test_plot_train_determinism_table(tmp_path, capsys, monkeypatch):
  import plot_train_determinism  # noqa: PLC0415
  res = {"device": "cuda:0", "device_kind": "NVIDIA H100", "variants": {
      "off": {"step_s_median": 0.5, "repeatable": False},
      "deterministic_ops": {"step_s_median": 0.75, "repeatable": True},
      "reductions": {"error": "no such option"}}}
  path = tmp_path / "td.json"
  path.write_text(json.dumps(res))
  assert plot_train_determinism.rows([f"h100={path}"]) == [
      ("h100: off", 0.5, False, "NVIDIA H100"), ("h100: deterministic_ops", 0.75, True,
                                                 "NVIDIA H100")]
  png = tmp_path / "td.png"
  monkeypatch.setattr(sys, "argv", ["plot_train_determinism.py", "--out", str(png),
                                    f"h100={path}"])
  plot_train_determinism.main()
  assert png.stat().st_size > 1000 and "h100: off" in capsys.readouterr().out
