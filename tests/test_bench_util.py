"""benchmarks/bench_util.py's reading of optimized HLO: which while body is the decode loop."""

import os
import sys

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
