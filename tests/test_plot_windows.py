"""benchmarks/plot_windows.py: a rollout's pace from its windows' record arrivals, and the bytes
floor at each window's context from a bench_rollout row's figures."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _json(tmp_path, marks, extra=None):
  row = {"policy": "paper", "batch": 4, "generate_tokens": 40, "error": None,
         "kv_bytes": 4 * 100 * 1000, "floor_bytes_per_step": 5e6,
         "chunk_timelines": {"new_tokens_40": [{"marks": marks}]}, **(extra or {})}
  d = {"prompt_len": 20, "new_tokens": 80, "decode_chunk": 10, "bandwidth_bytes_per_s": 1e9,
       "results": [row]}
  path = tmp_path / "r.json"
  path.write_text(json.dumps(d))
  return d, str(path)


def test_window_pace_and_floor_from_marks(tmp_path):
  import plot_windows  # noqa: PLC0415
  marks = [["prompt records", 0.5], ["window 0 records", 1.0], ["window 0 flags", 1.01],
           ["window 1 records", 1.2], ["window 1 flags", 1.21], ["window 2 records", 1.5],
           ["window 3 records", 1.9], ["landed", 1.95]]
  d, _ = _json(tmp_path, marks)
  (name, ctx, steps, floors), = plot_windows.series(d)
  assert "timed" in name
  assert steps == pytest.approx([20.0, 30.0, 40.0])  # ms: 0.2, 0.3, 0.4 s over 10 steps each
  assert ctx == [35.0, 45.0, 55.0]  # prompt 20 + (i + 1.5) * 10
  # the floor at the mean context (20 + 40 / 2 = 40) is the row's; a token more of context adds
  # a token's cache (kv_bytes / batch / 100 tokens of capacity = 1,000 bytes) per sequence
  per_ms = 4 * 1000 / 1e9 * 1e3
  assert floors == pytest.approx([5.0 - 5 * per_ms, 5.0 + 5 * per_ms, 5.0 + 15 * per_ms])
  # a row with the bench's own figures draws those
  d, _ = _json(tmp_path, marks, {"window_step_ms": [1.0, 2.0], "window_floor_ms": [0.5, 0.6]})
  (_, ctx, steps, floors), = plot_windows.series(d)
  assert steps == [1.0, 2.0] and floors == [0.5, 0.6] and ctx == [35.0, 45.0]


def test_window_pace_by_the_timelines_pieces(tmp_path):
  """A timeline with `pieces` (a guided rollout's last window in shorter pieces): each window's
  pace over its own steps, at its own mean context; the engine's rule gives the same paces."""
  import plot_windows  # noqa: PLC0415
  from trace_jax.rollout.engine import window_step_ms
  marks = [["window 0 records", 1.0], ["window 1 records", 1.2], ["window 2 records", 1.5],
           ["window 3 records", 1.9], ["landed", 1.95]]
  d, _ = _json(tmp_path, marks)
  pieces = [[0, 10], [10, 10], [20, 5], [25, 5]]
  d["results"][0]["chunk_timelines"]["new_tokens_40"][0]["pieces"] = pieces
  (_, ctx, steps, _), = plot_windows.series(d)
  assert steps == pytest.approx([20.0, 60.0, 80.0])  # 0.2 s / 10 steps, 0.3 / 5, 0.4 / 5
  assert ctx == [35.0, 42.5, 47.5]  # prompt 20 + first step + steps / 2
  assert window_step_ms(marks, pieces) == pytest.approx(steps)
  assert window_step_ms(marks, [[i * 10, 10] for i in range(4)]) == pytest.approx(
      [20.0, 30.0, 40.0])


def test_window_arrivals_agree_with_the_engine():
  import plot_windows  # noqa: PLC0415
  from trace_jax.rollout.engine import window_arrivals
  marks = [["prompt records", 0.1], ["window 0 records", 0.3], ["window 0 flags", 0.31],
           ["window 10 records", 0.9], ["landed", 1.0]]
  assert plot_windows.window_arrivals(marks) == window_arrivals(marks) == [0.3, 0.9]
