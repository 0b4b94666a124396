"""The serving A/B's statistics, verdict and report on constructed results; the whole
tool end to end on the tiny model (slow)."""

import json
import math

import numpy as np
import pytest

from configs import serve_compare
from trace_jax.serving import compare

LIMITS = dict(max_pass_rate_drop=0.05, max_p95_latency_s=2.0, min_memory_saving=0.3)


def _summary(pass_rate, p95, memory):
  return {"pass_rate": pass_rate, "latency_s": {"p95": p95}, "memory_bytes": memory}


def test_verdict_keeps_fp4_only_if_every_limit_holds():
  base = _summary(0.80, 1.0, 1000)
  ok = compare.verdict(LIMITS, base, _summary(0.76, 1.9, 600))
  assert ok["keep"] == "candidate" and ok["reason"].startswith("keep FP4")
  assert all(c["holds"] for c in ok["checks"])
  # Exactly at a limit holds (limits are inclusive).
  edge = compare.verdict(dict(LIMITS, max_pass_rate_drop=0.25), _summary(0.75, 1, 1000),
                         _summary(0.5, 2.0, 700))
  assert edge["keep"] == "candidate"
  for cand, failing in ((_summary(0.70, 1.0, 600), "pass rate drop"),
                        (_summary(0.80, 2.5, 600), "p95 latency"),
                        (_summary(0.80, 1.0, 800), "memory saving")):
    v = compare.verdict(LIMITS, base, cand)
    assert v["keep"] == "baseline"
    assert [c["name"] for c in v["checks"] if not c["holds"]] == [failing]
    assert v["reason"].startswith("keep the baseline") and failing in v["reason"]
  failed = compare.verdict(LIMITS, base, _summary(0.8, None, 600))  # every request errored
  assert failed["keep"] == "baseline" and "no candidate request succeeded" in failed["reason"]
  both = compare.verdict(LIMITS, base, _summary(0.5, 9.0, 600))
  assert "pass rate drop" in both["reason"] and "p95 latency" in both["reason"]
  with pytest.raises(ValueError, match="max_p95_latency_s is not set"):
    compare.verdict(dict(LIMITS, max_p95_latency_s=None), base, base)


def test_wilson_interval_and_paired_difference():
  # Textbook 95% Wilson intervals (Newcombe 1998): 0/10 -> [0, 0.2775], 5/10 -> [.2366, .7634].
  np.testing.assert_allclose(compare.wilson_interval(0, 10), (0.0, 0.2775), atol=1e-4)
  np.testing.assert_allclose(compare.wilson_interval(5, 10), (0.2366, 0.7634), atol=1e-4)
  base = np.array([1, 1, 0, 1, 0.5])
  cand = np.array([1, 0, 0, 1, 1.0])
  d = compare.paired_difference(base, cand)
  diffs = cand - base
  se = math.sqrt(sum((x - diffs.mean()) ** 2 for x in diffs) / 4 / 5)
  assert d["mean"] == pytest.approx(-0.1)
  np.testing.assert_allclose(d["ci95"], [-0.1 - 1.96 * se, -0.1 + 1.96 * se], atol=1e-3)
  assert (d["tasks_better"], d["tasks_worse"]) == (1, 1)


def _arm(name, policy, passes, latency, memory, weights):
  tasks, runs = [], []
  for r in range(2):
    lat = [latency * (1 + 0.1 * i + 0.05 * r) for i in range(len(passes))]
    for i, (ok, l) in enumerate(zip(passes, lat)):
      tasks.append(dict(task=i, repeat=r, prompt=f"{i}+1=", answer=str(i + 1),
                        output=str(i + 1) if ok else "0", passed=bool(ok),
                        failure="" if ok else f"expected '{i + 1}', got '0'", ttft_s=l,
                        per_token_s=l / 2, latency_s=l, prompt_tokens=4, completion_tokens=2))
    runs.append(dict(repeat=r, wall_s=1.0 + r, completion_tokens=2 * len(passes),
                     throughput_tok_s=2 * len(passes) / (1.0 + r),
                     pass_rate=float(np.mean(passes)), latency_s=compare.percentiles(lat)))
  return dict(arm=name, policy=policy, precision="x", fp4_format="nvfp4", weights="random",
              setup_s=3.0, weight_bytes=weights, peak_memory_bytes=None,
              estimated_memory_bytes=memory, memory_measured=False, context_len=10, runs=runs,
              tasks=tasks)


def test_report_renders_with_plots_and_verdict(tmp_path):
  config = serve_compare.get_config()
  config.limits.update(LIMITS)
  config.cost.gpu_hour_usd = 3.6
  arms = {"baseline": _arm("baseline", "bf16", [1, 1, 1, 0], 0.5, 2**20, 2**19),
          "candidate": _arm("candidate", "paper_nvfp4", [1, 0, 1, 0], 0.4, 2**19, 2**17)}
  limits = compare.write_limits(config, str(tmp_path))
  report = compare.build_report(config, arms, limits, 12.0, str(tmp_path))
  # The pass rate dropped by 0.25 > 0.05: keep the baseline, and say why.
  assert report["verdict"]["keep"] == "baseline"
  s = report["summary"]["candidate"]
  assert s["pass_rate"] == 0.5 and s["memory_kind"] == "estimate"
  # $3.6/h = $0.001/s over setup 3 s + runs 1 s + 2 s, for 16 generated tokens.
  assert s["usd_per_mtok"] == pytest.approx(0.001 * 6 / 16 * 1e6)
  md = (tmp_path / "report.md").read_text()
  assert "## Verdict: **keep the baseline**" in md and "pass rate drop fails" in md
  assert "| 1 | `1+1=` | `2` | pass | expected '2', got '0' |" in md
  for png in ("latency_cdf.png", "memory.png", "pass_rate.png"):
    data = (tmp_path / png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert f"({png})" in md
  saved = json.loads((tmp_path / "report.json").read_text())
  assert saved["verdict"] == report["verdict"]
  assert json.loads((tmp_path / "limits.json").read_text())["limits"]["max_p95_latency_s"] == 2.0


def test_limits_are_fixed_once_runs_begin(tmp_path):
  config = serve_compare.get_config()
  bad = serve_compare.get_config()
  bad.limits.min_memory_saving = 1.5
  with pytest.raises(ValueError, match="min_memory_saving"):
    compare.write_limits(bad, str(tmp_path))
  first = compare.write_limits(config, str(tmp_path))
  config.compare.only_arm = "candidate"  # another job of the same comparison
  assert compare.write_limits(config, str(tmp_path)) == first
  config.limits.max_pass_rate_drop = 0.5  # loosening a limit after seeing results: refused
  with pytest.raises(ValueError, match="limits cannot change"):
    compare.write_limits(config, str(tmp_path))
  other = serve_compare.get_config()
  other.load.concurrency = 1
  with pytest.raises(ValueError, match="another config"):
    compare.write_limits(other, str(tmp_path))


def _unfit(name, policy):
  return dict(arm=name, fits=False, policy=policy, precision="x", fp4_format="nvfp4",
              weights="random", error="CapacityError: serve.max_batch=8 sequences do not fit")


@pytest.mark.parametrize("unfit, p95, keep", [("baseline", 0.4, "candidate"),
                                              ("baseline", 3.0, "neither"),
                                              ("candidate", 0.4, "baseline")])
def test_report_when_one_arm_does_not_fit(tmp_path, unfit, p95, keep):
  """An arm that does not fit the device: the other is reported alone; FP4 alone is kept if its
  p95 holds (the pass rate drop and memory saving cannot be measured: they hold None), else
  neither; the baseline alone is kept. Both unfit: an error naming both."""
  config = serve_compare.get_config()
  config.limits.update(LIMITS)
  served = "candidate" if unfit == "baseline" else "baseline"
  arms = {unfit: _unfit(unfit, "bf16" if unfit == "baseline" else "paper_nvfp4"),
          served: _arm(served, "paper_nvfp4", [1, 0, 1, 0], p95 / 1.3, 2**19, 2**17)}
  limits = compare.write_limits(config, str(tmp_path))
  report = compare.build_report(config, arms, limits, 12.0, str(tmp_path))
  v = report["verdict"]
  assert v["keep"] == keep and report["unfit"] == [unfit]
  assert list(report["summary"]) == [served] and report["paired_difference"] is None
  assert f"the {unfit}" in v["reason"] and "does not fit" in v["reason"]
  if unfit == "baseline":
    assert [c["holds"] for c in v["checks"]] == [None, keep == "candidate", None]
  md = (tmp_path / "report.md").read_text()
  assert "not measurable" in md or unfit == "candidate"
  assert f"The {unfit} (" in md and "CapacityError" in md and f"| | {served} |" in md
  assert (tmp_path / "pass_rate.png").read_bytes()[:4] == b"\x89PNG"
  arms[served] = _unfit(served, "x")
  with pytest.raises(RuntimeError, match="neither arm fits"):
    compare.build_report(config, arms, limits, 12.0, str(tmp_path))


def test_does_not_fit_names_memory_errors_only():
  from trace_jax.rollout import CapacityError
  assert compare.does_not_fit(CapacityError("x")) and compare.does_not_fit(MemoryError())
  assert not compare.does_not_fit(ValueError("x"))


def test_an_arm_planned_for_too_small_a_device_is_reported_not_raised():
  """serve.device_gib below what max_batch needs: the arm is set up no further than its weight
  sync (nothing compiles) and comes back as `fits` False, the planner's figures in its error."""
  config = serve_compare.get_config()
  config.serve.device_gib = 2.0 ** -20  # 1 KiB
  got = compare.run_arm(config, "baseline", log=lambda *_: None)
  assert got["fits"] is False and got["policy"] == "bf16" and got["device_bytes"] == 1024
  assert got["error"].startswith("CapacityError: serve.max_batch=8 sequences")
  config.serve.device_gib = -1.0
  with pytest.raises(Exception, match="device_gib must be >= 0"):
    compare.run_arm(config, "baseline", log=lambda *_: None)


@pytest.mark.slow
def test_run_compare_end_to_end_on_the_tiny_model(tmp_path):
  config = serve_compare.get_config()
  config.compare.update(dict(num_prompts=8, repeats=2, isolate=False))
  config.serve.max_batch = 4
  config.load.rate = 50.0  # open-loop arrivals (the CPU report covers closed-loop clients)
  report = compare.run_compare(config, str(tmp_path), log=lambda *_: None)
  assert report["verdict"]["keep"] in ("baseline", "candidate")
  for arm in ("baseline", "candidate"):
    assert len(report["arms"][arm]["tasks"]) == 16
    assert report["summary"][arm]["completion_tokens"] > 0
    # The slot scheduler streams: TTFT is the first token's arrival, before the last one's.
    tasks = [t for t in report["arms"][arm]["tasks"] if t["latency_s"] is not None]
    assert all(t["ttft_s"] <= t["latency_s"] for t in tasks)
    summary = report["summary"][arm]
    assert summary["ttft_s"]["p50"] < summary["latency_s"]["p50"]
  assert (tmp_path / "report.md").exists()
  # A second call finds both arms' measurements and only rebuilds the report.
  again = compare.run_compare(config, str(tmp_path), log=lambda *_: None)
  assert again["summary"] == report["summary"]


def _least_device_bytes(config, arm) -> int:
  """The planner's smallest device (bytes) on which the arm serves max_batch sequences."""
  import jax  # noqa: PLC0415

  from trace_jax.rl import loop  # noqa: PLC0415
  from trace_jax.rollout import engine as E  # noqa: PLC0415
  from trace_jax.serving import backend  # noqa: PLC0415
  setup = loop.build(backend.arm_config(config, arm))
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
      E.rollout_weight_shapes(setup.rollout_config, setup.policy)))
  ctx = setup.prompt_len + setup.max_new_tokens
  lo, hi = 1, 1 << 40
  while lo < hi:
    mid = (lo + hi) // 2
    fits = E.capacity_limits(setup.rollout_config, setup.policy, ctx, weights, mid,
                             False)[0] >= int(config.serve.max_batch)
    lo, hi = (lo, mid) if fits else (mid + 1, hi)
  return lo


@pytest.mark.slow
def test_run_compare_when_only_fp4_fits(tmp_path):
  """A device between the two arms' needs (serve.device_gib): the BF16 baseline is reported as
  not fitting, FP4 is measured alone and the report says so."""
  config = serve_compare.get_config()
  config.compare.update(dict(num_prompts=4, repeats=1, isolate=False))
  need = {a: _least_device_bytes(config, a) for a in ("baseline", "candidate")}
  assert need["candidate"] < need["baseline"]
  config.serve.device_gib = (need["candidate"] + need["baseline"]) / 2 / 2**30
  report = compare.run_compare(config, str(tmp_path), log=lambda *_: None)
  assert report["unfit"] == ["baseline"] and report["arms"]["baseline"]["fits"] is False
  assert report["verdict"]["keep"] in ("candidate", "neither")
  assert len(report["arms"]["candidate"]["tasks"]) == 4
  md = (tmp_path / "report.md").read_text()
  assert "The baseline (bf16) does not fit: CapacityError" in md and "| | candidate |" in md
