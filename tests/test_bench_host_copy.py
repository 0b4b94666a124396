"""benchmarks/bench_host_copy.py on CPU at a small size: every row's arrays arrive with the
values they were made with, and the rows report what the GPU run is for (start and wait times,
the calling thread's loop rate beside the copies)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_bench_host_copy_rows_arrive_with_their_values(tmp_path):
  import bench_host_copy  # noqa: PLC0415
  out = bench_host_copy.main(["--total_gb", "0.004", "--arrays", "6", "--busy_s", "0.05",
                              "--out", str(tmp_path / "hc.json")])
  rows = {r["name"]: r for r in out["rows"]}
  assert {"host_touch", "asarray", "asarray_again", "one_array", "async_then_asarray",
          "pending_async", "thread_gil"} <= set(rows)
  assert all(r["values_ok"] and r["gb"] > 0 and r["seconds"] > 0 for r in rows.values())
  # (main_rate is timing: at this size the copies can end before the loop runs once)
  assert rows["pending_async"]["busy_s"] == 0.05 and rows["thread_gil"]["main_rate"] >= 0
  with open(tmp_path / "hc.json") as f:
    assert json.load(f)["rows"] == json.loads(json.dumps(out["rows"]))
