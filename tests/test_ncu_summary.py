"""benchmarks/ncu_summary.py's reading of Nsight Compute's CSV exports (synthetic files in the
layout ncu 2025.3 writes: raw page with a units row, source page with a kernel-name line)."""

import csv
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import ncu_summary  # noqa: E402


def _write(path, rows):
  with open(path, "w", newline="") as f:
    csv.writer(f, quoting=csv.QUOTE_ALL).writerows(rows)


def test_raw_summary_units_pipes_and_stalls(tmp_path):
  head = ["ID", "Kernel Name", "gpu__time_duration.sum",
          "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
          "smsp__issue_active.avg.pct_of_peak_sustained_active",
          "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active",
          "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
          "sm__inst_executed_pipe_alu.max.pct_of_peak_sustained_active",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio"]
  units = ["", "", "nsecond", "%", "%", "%", "%", "%", "inst", "inst", "inst"]
  vals = ["0", "k_mosaic_gpu_kernel", "41,020", "68.9", "64.1", "49.5", "12.0", "70.0", "0.7",
          "1.9", "0"]
  _write(tmp_path / "r.csv", [head, units, vals])
  s = ncu_summary.raw_summary(str(tmp_path / "r.csv"))
  assert s["kernel"] == "k_mosaic_gpu_kernel"
  assert s["duration_us"] == pytest.approx(41.02)  # thousands separator, ns -> us
  assert s["dram_pct"] == 68.9 and s["issue_active_pct"] == 64.1
  assert s["pipes_pct"] == {"alu": 49.5, "fma": 12.0}  # the .max variant is not a pipe's avg
  assert list(s["stalls_per_issue"]) == ["long_scoreboard", "wait"]  # sorted, zeros dropped
  _write(tmp_path / "empty.csv", [head, units])
  with pytest.raises(ValueError, match="no kernel row"):
    ncu_summary.raw_summary(str(tmp_path / "empty.csv"))


def test_sass_hotspots_rank_instructions_by_samples(tmp_path):
  head = ["Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed", "stall_long_sb",
          "stall_math", "stall_long_sb (Not Issued)"]
  rows = [["Kernel Name", "k"], head,
          ["0x10", "  LOP3.LUT R1, R2, 0x81c081c0, RZ, 0xc0, !PT", "30", "20", "512", "2", "25",
           "99"],
          ["0x20", "@!P1 BRA 0x40", "60", "60", "128", "58", "0", "0"],
          ["0x30", "EXIT", "10", "0", "16", "0", "0", "0"]]
  _write(tmp_path / "s.csv", rows)
  h = ncu_summary.sass_hotspots(str(tmp_path / "s.csv"), top=2)
  assert h["total_samples"] == 100
  assert [r["address"] for r in h["hotspots"]] == ["0x20", "0x10"]
  # the main reason counts all samples, not the not-issued column
  assert [r["main_reason"] for r in h["hotspots"]] == ["long_sb", "math"]
  assert h["hotspots"][1]["source"].startswith("LOP3.LUT") and h["hotspots"][0]["executed"] == 128
