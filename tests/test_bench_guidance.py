"""benchmarks/bench_guidance.py: its shares from made-up calls, and a whole run on the tiny model
(CPU): every side draws the same numbers, the guided sides hold guidance and the unguided none,
each chunked call lands its windows."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_summarize_shares_against_each_engines_unguided_side():
  import bench_guidance  # noqa: PLC0415
  def rows(*s):
    return [{"s": x, "guidance_bytes": 0} for x in s]
  calls = {"one_program off": rows(9.0, 1.0, 1.2, 0.8),
           "one_program on": rows(9.0, 1.1, 1.05, 1.3),
           "chunked off": rows(9.0, 2.0, 2.0, 2.0),
           "chunked on pinned thread": rows(9.0, 2.5, 2.4, 2.6)}
  out = bench_guidance.summarize(calls)
  assert out["one_program off"]["median_s"] == 1.0  # the first call left out
  assert out["one_program on"]["share"] == pytest.approx((1.1 - 1.0) / 1.1, abs=1e-4)
  assert out["chunked on pinned thread"]["share"] == pytest.approx(0.5 / 2.5, abs=1e-4)
  assert out["one_program on"]["share_range"] == pytest.approx(
      [(1.05 - 1.2) / 1.05, (1.3 - 0.8) / 1.3], abs=1e-4)
  assert not out["chunked on pinned thread"]["meets_bar"]
  assert "share" not in out["chunked off"]
  assert bench_guidance.baseline("chunked on async inline") == "chunked off"


def test_chosen_sides():
  import bench_guidance  # noqa: PLC0415
  assert bench_guidance.chosen_sides("") == bench_guidance.side_names()
  assert bench_guidance.chosen_sides("chunked on pinned thread, one_program off") == [
      "one_program off", "chunked off", "chunked on pinned thread"]
  with pytest.raises(ValueError, match="unknown sides.*chunked on pinned"):
    bench_guidance.chosen_sides("chunked on pinned")
  # a guided chunked side with its last window in pieces (`GUIDANCE_TAIL`), after its way
  assert bench_guidance.chosen_sides(
      "chunked on async thread, chunked on async inline tail32, chunked on async inline tail0"
  ) == ["chunked off", "chunked on async inline tail32", "chunked on async inline tail0",
        "chunked on async thread"]
  assert bench_guidance.split_tail("chunked on async inline tail8") == (
      "chunked on async inline", 8)
  assert bench_guidance.split_tail("chunked on async inline") == ("chunked on async inline", None)
  for bad in ("chunked off tail8", "one_program on tail8", "chunked on async inline tailx"):
    with pytest.raises(ValueError, match="unknown sides"):
      bench_guidance.chosen_sides(bad)
  from trace_jax.rollout import engine  # noqa: PLC0415
  assert bench_guidance.DEFAULT_WAY == (  # (the plot marks the way a rollout takes unset)
      f"chunked on {engine.GUIDANCE_COPY} {engine.GUIDANCE_LANDING}")


def test_tiny_run(tmp_path, monkeypatch):
  import bench_guidance  # noqa: PLC0415
  out = tmp_path / "guidance.json"
  monkeypatch.delenv("TRACE_JAX_COMPILATION_CACHE", raising=False)
  monkeypatch.setattr(sys, "argv", [
      "bench_guidance.py", "--preset", "tiny", "--layers", "2", "--batch", "3",
      "--prompt_len", "8", "--new_tokens", "5,12", "--decode_chunk", "4", "--rounds", "1",
      "--sides", ",".join(bench_guidance.side_names() + ["chunked on async inline tail1"]),
      "--out", str(out)])
  bench_guidance.main()
  res = json.loads(out.read_text())
  names = bench_guidance.side_names()
  assert len(names) == 7 and res["sides"] == names[:4] + ["chunked on async inline tail1"] + (
      names[4:])
  assert res["args"]["cache_new_tokens"] == 12
  # windows of 4; with tail1 the last window in halves: 12 steps as 4 + 4 + 2 + 1 + 1
  for n, windows, pieces in (("5", 2, 2), ("12", 3, 5)):
    got = res["lengths"][n]
    assert got["same_numbers_every_round"] == [True, True]  # (round 0 and 1)
    for side, row in got["sides"].items():
      assert (row["guidance_bytes"] > 0) == (" on" in side), side
      assert len(row["timed_s"]) == 1 and row["median_s"] == row["timed_s"][0]
      if " on" in side:
        off = got["sides"][bench_guidance.baseline(side)]["median_s"]
        assert row["share"] == pytest.approx((row["median_s"] - off) / row["median_s"],
                                             abs=1e-3)
      if side.startswith("chunked"):
        assert row["median_call_timeline"]["windows"] == (
            pieces if side.endswith("tail1") else windows), side
  assert res["pinned_peak_bytes"] > 0  # (the CPU backend has pinned host memory)
  assert (tmp_path / "guidance.png").stat().st_size > 0
