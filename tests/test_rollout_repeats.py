"""benchmarks/rollout_repeats.py on the tiny model (CPU): one process generating with one seed
again repeats its tokens and logprobs bit for bit, and the JSON says so."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_one_seed_twice_in_one_process(tmp_path, monkeypatch):
  import rollout_repeats  # noqa: PLC0415
  out = tmp_path / "repeats.json"
  monkeypatch.delenv("TRACE_JAX_COMPILATION_CACHE", raising=False)
  monkeypatch.setattr(sys, "argv", [
      "rollout_repeats.py", "--preset", "tiny", "--layers", "2", "--batch", "3",
      "--prompt_len", "8", "--new_tokens", "12", "--cache_new_tokens", "16",
      "--decode_chunk", "4", "--calls", "2", "--out", str(out)])
  rollout_repeats.main()
  rows = json.loads(out.read_text())["calls_sha256"]
  assert len(rows) == 2 and rows[0]["tokens"] == rows[1]["tokens"]
  assert rows[0]["logprobs"] == rows[1]["logprobs"]
  assert rows[1]["tokens_differing"] == 0
  assert rows[1]["logprob_max_abs_diff_where_tokens_agree"] == 0.0
