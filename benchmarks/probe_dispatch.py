"""What the chunked engine's host spends launching its programs, and a check of two of its
settings on the device, in one process:

1. `prefill_command_buffers`: the prefill program compiled with XLA command buffers (the
   default, as the decode windows) or without. On the H200 the 48-layer 8k-capacity rollout's
   prefill launch held the calling thread 0.46 s each call, with nothing else queued on the
   device (session 36). Sides in turn: on, off, on again (A/B/A), `--repeats` rollouts each
   after a warm-up; the host seconds of each part (`ChunkTimeline`) and the call's wall time.
   At 12 layers, B 128, prompt 512 (session 36): ~0.01 s either way, calls 1.30-1.56 s either
   way; so the 48-layer launch's 0.46 s is not its command buffer.
2. `guidance_copy` "pinned" against the default: the same rollout bit for bit.

Tokens, logprobs and guidance of every side are compared with the first side's (same seed):
`same_as_first` in each side's record.

  python benchmarks/probe_dispatch.py --layers 12 --batch 64 --out probe_dispatch.json
  # the 8k-capacity shape's launches (cache for 7,680 new tokens, 64 generated)
  python benchmarks/probe_dispatch.py --layers 48 --batch 255 --new_tokens 7680 \
      --generate_tokens 64 --decode_chunk 256 --out probe_dispatch_cap8k.json
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

import bench_util
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams


def _same(a, b) -> bool:
  leaves = [(np.asarray(x), np.asarray(y)) for x, y in zip(
      jax.tree_util.tree_leaves((a.tokens, a.logprobs, a.guidance)),
      jax.tree_util.tree_leaves((b.tokens, b.logprobs, b.guidance)), strict=True)]
  return all(x.shape == y.shape and np.array_equal(x.view(np.uint8), y.view(np.uint8))
             for x, y in leaves)


def run(preset: str, layers: int, batch: int, prompt_len: int, new_tokens: int, chunk: int,
        repeats: int, generate_tokens: int = 0) -> dict:
  cfg, params, prompts = bench_util.random_rollout_model(preset, layers, prompt_len, new_tokens,
                                                         batch)
  engine = RolloutEngine(cfg, tq.make_policy("paper"), max_new_tokens=new_tokens,
                         prompt_bucket=prompt_len, decode_chunk=chunk)
  engine.sync(params)
  del params
  sampling = SamplingParams(temperature=1.0)

  def generate():
    t = time.perf_counter()
    out = engine.generate(prompts, sampling=sampling, seed=7,
                          max_new_tokens=generate_tokens or new_tokens)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t, out

  sides, first = [], None
  for name, prefill_cb, copy in (("prefill_cb_on", True, "async"),
                                 ("prefill_cb_off", False, "async"),
                                 ("prefill_cb_on_again", True, "async"),
                                 ("pinned_copy", True, "pinned")):
    engine.prefill_command_buffers = prefill_cb and engine.command_buffers
    engine.guidance_copy = copy
    t0 = time.perf_counter()
    warm, out = generate()  # (compiles this side's programs where new)
    side = dict(name=name, prefill_command_buffers=engine.prefill_command_buffers, copy=copy,
                warmup_s=warm, wall_s=[], timelines=[])
    del out
    for _ in range(repeats):
      t, out = generate()
      side["wall_s"].append(t)
      side["timelines"].append(engine.last_timeline.as_dict())
    if first is None:
      first = jax.tree_util.tree_map(np.asarray, out)
    side["same_as_first"] = _same(first, out)
    del out
    tl = side["timelines"]
    side["prefill_launch_s"] = [t["seconds"]["prefill_launch"] for t in tl]
    side["window_dispatch_s"] = [t["seconds"]["window_dispatch"] for t in tl]
    sides.append(side)
    print(f"{name:22s} wall {' '.join(f'{t:.3f}' for t in side['wall_s'])} s, prefill launch "
          f"{' '.join(f'{t:.4f}' for t in side['prefill_launch_s'])} s, window dispatch "
          f"{' '.join(f'{t:.4f}' for t in side['window_dispatch_s'])} s, same as first: "
          f"{side['same_as_first']} ({time.perf_counter() - t0:.1f} s)", flush=True)
  return dict(command_buffers=engine.command_buffers, sides=sides)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--new_tokens", type=int, default=256)
  ap.add_argument("--generate_tokens", type=int, default=0,
                  help="tokens a rollout generates (0: new_tokens; the cache is sized for those)")
  ap.add_argument("--decode_chunk", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default="probe_dispatch.json")
  a = ap.parse_args(argv)
  res = run(a.preset, a.layers, a.batch, a.prompt_len, a.new_tokens, a.decode_chunk,
            a.repeats, a.generate_tokens)
  return bench_util.write_result(a.out, "probe_dispatch", **vars(a), **res)


if __name__ == "__main__":
  main()
