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
