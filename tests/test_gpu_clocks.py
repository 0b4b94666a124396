"""benchmarks/gpu_clocks.py's reading of `nvidia-smi` samples (synthetic lines in the layout
`--format=csv,noheader,nounits` writes, random values drawn here, figures recomputed by hand)."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import gpu_clocks  # noqa: E402


def _lines(rng, n):
  """n sample lines and their values: SM clock, power, utilization, reason mask."""
  sm = rng.choice([1980, 1785, 1620, 1410], size=n)
  power = np.round(rng.uniform(80, 700, size=n), 2)
  util = rng.choice([0, 30, 100], size=n)
  mask = rng.choice([0x0, 0x1, 0x4, 0x4 | 0x20, 0x400], size=n)
  lines = [f"2026/12/05 08:00:{i % 60:02d}.{i:03d}, {sm[i]}, 3201, {power[i]:.2f}, "
           f"{40 + i % 30}, {util[i]}, 0x{mask[i]:016x}" for i in range(n)]
  return lines, sm, power, util, mask


def test_summary_counts_busy_samples_only(tmp_path):
  rng = np.random.default_rng(7)
  lines, sm, power, util, mask = _lines(rng, 97)
  noise = ["timestamp, clocks.current.sm [MHz], ...", "Failed to query",
           "x, [N/A], 1, 2, 3, 4, 0x0"]
  path = tmp_path / "s.csv"
  path.write_text("\n".join(noise[:1] + lines[:50] + noise[1:] + lines[50:]) + "\n")
  out = tmp_path / "s.json"
  assert gpu_clocks.main([str(path), "--json", str(out)]) == 0
  got = json.loads(out.read_text())
  busy = util >= 50
  assert got["samples"] == 97 and got["busy_samples"] == int(busy.sum())
  assert got["sm_mhz"] == dict(min=float(sm[busy].min()), median=float(np.median(sm[busy])),
                               max=float(sm[busy].max()))
  assert abs(got["power_w"]["median"] - float(np.median(power[busy]))) < 1e-9
  # reasons: bit by bit over busy samples; 0x400 is no NVML name and shows as hex
  for bit, name in [(0x1, "gpu_idle"), (0x4, "sw_power_cap"), (0x20, "sw_thermal_slowdown")]:
    share = float(np.mean((mask[busy] & bit) != 0))
    assert got["reason_share"].get(name, 0.0) == round(share, 4), name
  assert got["reason_share"].get("0x400", 0.0) == round(float(np.mean(mask[busy] == 0x400)), 4)


def test_reason_names_and_no_busy_samples():
  assert gpu_clocks.reason_names(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
  assert gpu_clocks.reason_names(0) == []
  idle = gpu_clocks.parse(["t, 345, 3201, 75.5, 30, 0, 0x0000000000000001"])
  assert gpu_clocks.summarize(idle) == dict(samples=1, busy_samples=0)


def test_plot_draws_every_csv_and_names_an_empty_one(tmp_path):
  rng = np.random.default_rng(3)
  paths = []
  for name in ("a", "b"):
    lines, *_ = _lines(rng, 40)
    path = tmp_path / f"{name}.csv"
    path.write_text("\n".join(lines) + "\n")
    paths.append(str(path))
  png = tmp_path / "clocks.png"
  assert gpu_clocks.main(paths + ["--plot", str(png)]) == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert gpu_clocks.seconds(gpu_clocks.parse(lines))[1] == 1.001  # :00.000 -> :01.001
  empty = tmp_path / "empty.csv"
  empty.write_text("Failed to query\n")
  with pytest.raises(ValueError, match="empty.csv"):
    gpu_clocks.plot([paths[0], str(empty)], str(tmp_path / "x.png"))
