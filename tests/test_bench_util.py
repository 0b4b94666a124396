"""benchmarks/bench_util.py: its reading of optimized HLO (which while body is the decode loop)
the kernel error the benchmarks record, and the digest the repeat benchmarks compare."""

import hashlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_util  # noqa: E402

# Two loops, as at a large batch: the prefill in passes (the larger body, running the prefill
# attention) and the decode loop; plus a small third one.
_HLO = """
%prefill_body (p: (s32[])) -> (s32[]) {
  %a = f32[8]{0} fusion(%p), metadata={op_name="attn/prefill_attention_nvfp4"}
  %b = f32[8]{0} fusion(%a), metadata={op_name="moe/mul"}
  %c = f32[8]{0} fusion(%b), metadata={op_name="moe/add"}
  %d = f32[8]{0} fusion(%c), metadata={op_name="moe/sub"}
  ROOT %t = (s32[]) tuple(%d)
}

%decode_body (p: (s32[])) -> (s32[]) {
  %e = f32[8]{0} custom-call(%p), metadata={op_name="layers_0/attn/decode_attention_mosaic"}
  %f = f32[8]{0} fusion(%e), metadata={op_name="sample/argmax"}
  ROOT %t = (s32[]) tuple(%f)
}

%small_body (p: (s32[])) -> (s32[]) {
  ROOT %t = (s32[]) tuple(%p)
}

ENTRY %main () -> s32[] {
  %w0 = (s32[]) while(%x), condition=%c0, body=%prefill_body
  %w1 = (s32[]) while(%y), condition=%c1, body=%decode_body
  %w2 = (s32[]) while(%z), condition=%c2, body=%small_body
}
"""


def test_decode_loop_is_the_largest_loop_without_prefill_attention():
  listing = bench_util.decode_loop_listing(_HLO).split("\n")
  names = [ln.split()[0] for ln in listing if ln.strip()]
  assert names == ["e", "f"]
  assert "layers_#/attn/decode_attention_mosaic" in listing[0]
  # without a prefill loop, the largest loop is taken
  only_prefill = _HLO.replace("prefill_attention_nvfp4", "other")
  names = [ln.split()[0] for ln in bench_util.decode_loop_listing(only_prefill).split("\n")
           if ln.strip()]
  assert names == ["a", "b", "c", "d"]


def test_relerr_max():
  """The benchmarks' kernel error: max abs difference over max abs reference, from bf16 or
  float32 arrays; NaN when the kernel's output holds a non-finite value."""
  import jax.numpy as jnp
  rng = np.random.default_rng(0)
  ref = rng.standard_normal((5, 7)).astype(np.float32)
  got = ref + rng.standard_normal((5, 7)).astype(np.float32) * 1e-3
  want = max(abs(float(g) - float(r)) for g, r in zip(got.ravel(), ref.ravel())) / max(
      abs(float(r)) for r in ref.ravel())
  assert abs(bench_util.relerr_max(got, ref) - want) <= 1e-12 * want
  gb = jnp.asarray(got, jnp.bfloat16)  # a kernel's bf16 output, compared as float32 values
  want_b = np.max(np.abs(np.asarray(gb, np.float64) - ref)) / np.max(np.abs(ref))
  assert bench_util.relerr_max(gb, jnp.asarray(ref)) == float(want_b)
  got[2, 3] = np.inf
  assert np.isnan(bench_util.relerr_max(got, ref))


def test_keep_checked_row_appends_prints_and_saves(tmp_path, capsys):
  """A timed row and a failed one: both appended, each printed with its label, time, equality
  and error, and the file rewritten after each so that it holds every row kept so far."""
  import json
  import time
  path = str(tmp_path / "r.json")
  res = {"benchmark": "x", "rows": []}
  t0 = time.time()
  bench_util.keep_checked_row(res, {"variant": "a", "us": 4.25, "eq": True}, " 256 rows a",
                              "eq", t0, path)
  assert json.load(open(path))["rows"] == [{"variant": "a", "us": 4.25, "eq": True}]
  bench_util.keep_checked_row(res, {"variant": "b", "error": "ValueError: no"}, " 256 rows b",
                              "eq", t0, path)
  assert [r["variant"] for r in json.load(open(path))["rows"]] == ["a", "b"]
  a, b = capsys.readouterr().out.splitlines()
  assert a.endswith(" 256 rows a    4.25 us  equal True  ")
  assert b.endswith(" 256 rows b     nan us  equal None  ValueError: no")


def test_digest_hashes_every_leaf_in_order():
  a, b = np.arange(6, dtype=np.int32), np.ones((2, 2), np.float32)
  want = hashlib.sha256(a.tobytes() + b.tobytes()).hexdigest()[:16]
  assert bench_util.digest(a, b) == bench_util.digest({"a": a, "b": [b]}) == want
  flipped = b.copy()
  flipped[1, 1] = np.nextafter(np.float32(1), np.float32(2))  # one last bit
  assert bench_util.digest(a, flipped) != want and bench_util.digest(b, a) != want


def test_random_rollout_model_is_the_shape_and_draws_asked():
  import jax

  from trace_jax import models as M
  cfg, params, prompts = bench_util.random_rollout_model("tiny", 1, 5, 7, 3)
  assert (cfg.num_layers, cfg.max_seq_len) == (1, 12)
  assert M.preset("tiny").replace(num_layers=1, max_seq_len=12) == cfg
  # the draws every rollout benchmark shares: master from key 0, prompts from numpy seed 0
  rng = np.random.default_rng(0)
  assert prompts == [list(rng.integers(3, cfg.vocab_size, 5)) for _ in range(3)]
  want = M.random_params(cfg, jax.random.key(0), "bfloat16")
  assert bench_util.digest(params) == bench_util.digest(want)
  again = bench_util.random_rollout_model("tiny", 1, 5, 7, 3)
  assert again[2] == prompts and bench_util.digest(again[1]) == bench_util.digest(params)
