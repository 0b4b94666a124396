"""benchmarks/profile_decode.py's reading of a JAX profiler trace (a synthetic Perfetto JSON in
the layout jax 0.11 writes: process and thread names as metadata events, device kernels as
complete events on stream threads naming their HLO module and op)."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


@pytest.fixture
def profile_decode(monkeypatch):
  # the module turns on XLA's HLO dumps unless XLA_FLAGS names a dump already: keep them off
  # for the processes the rest of the suite starts (monkeypatch restores the variable)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=" + os.devnull)
  import profile_decode as mod  # noqa: PLC0415
  return mod


def _trace(path, kernels):
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7"}}]
  events = meta + [{"ph": "X", "pid": 1, "tid": 7, "name": name, "dur": dur, "ts": i,
                    "args": {"hlo_module": module, "hlo_op": op}}
                   for i, (name, dur, module, op) in enumerate(kernels)]
  os.makedirs(path, exist_ok=True)
  with gzip.open(os.path.join(path, "x.perfetto_trace.json.gz"), "wt") as f:
    json.dump({"traceEvents": events}, f)


def test_prefill_and_decode_loop_kernels_apart(tmp_path, profile_decode):
  """Kernels of one name in both programs (every Mosaic kernel is `kernel_mosaic_gpu_kernel`)
  are counted to the program their event names: the decode loop per step, the prefill program
  in ms of the call, each by the source its HLO op maps to."""
  steps = 4
  moe = "jit(f)/Transformer/layers_3/moe/kernel"
  attn = "jit(f)/Transformer/layers_3/attn/prefill"
  sources = {"fusion_1": moe, "custom_call_2": attn, "custom_call_3": moe}
  kernels = ([("kernel_mosaic_gpu_kernel", 1000.0, "jit_prefill_program", "custom_call_3"),
              ("prefill_attention", 500.0, "jit_prefill_program", "custom_call_2")]
             + [("kernel_mosaic_gpu_kernel", 30.0, "jit__decode", "custom_call_3")] * steps
             + [("loop_fusion", 5.0, "jit__decode", "fusion_1")] * steps)
  _trace(str(tmp_path), kernels)
  out = profile_decode.summarize_trace(str(tmp_path), steps, sources=sources)
  loop = {r["source"]: r for r in out["decode_loop"]["sources"]}
  assert loop["Transformer/layers_#/moe/kernel"]["ms_per_step"] == pytest.approx(0.035)
  assert out["decode_loop"]["kernel_ms_per_step"] == pytest.approx(0.035)
  pre = out["prefill"]
  assert pre["kernel_ms"] == pytest.approx(1.5) and pre["kernels"] == 2
  assert {r["source"]: r["ms"] for r in pre["sources"]} == {
      "Transformer/layers_#/moe/kernel": pytest.approx(1.0),
      "Transformer/layers_#/attn/prefill": pytest.approx(0.5)}
  # all programs together, spread over the steps
  assert out["device_kernel_ms_per_step"] == pytest.approx((1500 + 4 * 35) / steps / 1e3)


def test_window_paces_of_the_timed_calls(profile_decode):
  """`_timed`'s window paces: for each call after the first, ms a step between consecutive
  windows' records reaching the host (other marks ignored) over the later window's steps, from
  the engine's timeline (its `pieces`: the last window in two pieces of 50 here)."""
  import types

  class Engine:
    calls = 0

    def generate(self, prompts, **kw):
      Engine.calls += 1
      t0 = 0.1 * Engine.calls  # each call's marks its own
      self.last_timeline = types.SimpleNamespace(marks=[
          ("prefill launched", 0.0), ("window 0 records", t0), ("window 1 records", t0 + 0.2),
          ("window 1 launched", t0 + 0.25), ("window 2 records", t0 + 0.5),
          ("window 3 records", t0 + 0.65)], pieces=[[0, 100], [100, 100], [200, 50], [250, 50]])
      return types.SimpleNamespace(tokens=[0], guidance_bytes_per_token=lambda: 8.0)

  first, med, per_token, paces = profile_decode._timed(Engine(), [[1]], 300, 2, chunk=100)
  assert Engine.calls == 3 and per_token == 8.0 and first >= 0 and med >= 0
  assert paces == [[2.0, 6.0, 3.0], [2.0, 6.0, 3.0]]  # the first call's left out
  assert profile_decode._timed(Engine(), [[1]], 1, 1)[3] == []  # no chunk: no paces
