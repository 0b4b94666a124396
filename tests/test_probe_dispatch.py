"""benchmarks/probe_dispatch.py on CPU with the tiny preset: every side's rollout equals the
first side's bit for bit (prefill programs with and without command buffers, guidance copied
async and pinned), and each side records its host seconds by part."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_probe_dispatch_sides_agree(tmp_path):
  import probe_dispatch  # noqa: PLC0415
  out = probe_dispatch.main(["--preset", "tiny", "--layers", "2", "--batch", "3",
                             "--prompt_len", "8", "--new_tokens", "6", "--decode_chunk", "4",
                             "--repeats", "1", "--generate_tokens", "5",
                             "--out", str(tmp_path / "p.json")])
  sides = {s["name"]: s for s in out["sides"]}
  assert list(sides) == ["prefill_cb_on", "prefill_cb_off", "prefill_cb_on_again",
                         "pinned_copy"]
  assert all(s["same_as_first"] for s in sides.values())
  assert sides["pinned_copy"]["copy"] == "pinned"
  # (no command buffers on CPU: the setting follows the engine's)
  assert not any(s["prefill_command_buffers"] for s in sides.values())
  for s in sides.values():
    assert len(s["prefill_launch_s"]) == 1 and s["timelines"][0]["windows"] == 2


def test_same_sees_one_bit():
  import types

  import numpy as np

  import probe_dispatch  # noqa: PLC0415
  def ro(g):
    return types.SimpleNamespace(tokens=np.arange(4), logprobs=np.full(4, -0.5, np.float32),
                                 guidance={"l0": {"s": g}})
  g = np.arange(8, dtype=np.uint8)
  g2 = g.copy()
  g2[3] ^= 1
  assert probe_dispatch._same(ro(g), ro(g.copy())) and not probe_dispatch._same(ro(g), ro(g2))
  # -0.0 and 0.0 compare equal as floats but are different bits
  a, b = ro(g), ro(g)
  b.logprobs = a.logprobs.copy()
  a.logprobs[0], b.logprobs[0] = 0.0, -0.0
  assert not probe_dispatch._same(a, b)
