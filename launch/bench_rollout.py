"""Rollout throughput: BF16 vs FP4 policies side by side on a random-weight model, RL-shaped and
serving-shaped loads, with HF transformers `generate` as peer columns when torch is present.

  python launch/bench_rollout.py --preset=tiny --out=/tmp/bench_rollout.json          # CPU
  python launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=1,32,64 \\
      --prompt_len=256 --new_tokens=256 --hf_peer=false --out=$OUT/bench_rollout.json   # H200
"""

import json
import os
import tempfile
import time

from absl import app
from absl import flags

flags.DEFINE_string("preset", "tiny", "Model preset (trace_jax.models.config.PRESETS).")
flags.DEFINE_list("policies", ["bf16", "paper", "w4a16", "kv4"], "Policy presets to compare.")
flags.DEFINE_string("fp4_format", "nvfp4", "FP4 format of the policies.")
flags.DEFINE_list("batches", ["1", "8", "32"], "Sequences per batch.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.")
flags.DEFINE_integer("new_tokens", 32, "Generated tokens per sequence.")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).")
flags.DEFINE_float("bandwidth", 4.27e12, "Device read bandwidth for the floor, bytes/s (H200).")
flags.DEFINE_boolean("hf_peer", True, "Also time HF transformers generate (eager, static cache).")
flags.DEFINE_boolean("record_guidance", True, "Record TRACE guidance as RL rollouts do.")
flags.DEFINE_string("out", "bench_rollout.json", "Output JSON path.")
FLAGS = flags.FLAGS


def _median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2]


def _bytes_floor(config, policy, weight_bytes_by_kind, batch, context):
  """Bytes a decode step must read: attention/dense weights, the experts the batch touches,
  lm_head/embedding row reads, and the live KV cache."""
  from trace_jax import models as M
  e, k = config.num_experts, config.num_experts_per_tok
  hit = e * (1 - (1 - k / e) ** batch)  # expected distinct experts per layer
  expert = weight_bytes_by_kind["experts"] * hit / e
  kv = M.cache_bytes_per_token(config, policy.kv_format, config.compute_dtype) * context * batch
  return weight_bytes_by_kind["other"] + expert + kv


def bench_engine(config, policy_name, batch):
  import jax
  import numpy as np

  from trace_jax import models as M
  from trace_jax import quant as tq
  from trace_jax.rollout import RolloutEngine, SamplingParams, tree_bytes

  policy = tq.make_policy(policy_name, FLAGS.fp4_format)
  params = M.init_params(config, jax.random.key(0))
  engine = RolloutEngine(config, policy, max_new_tokens=FLAGS.new_tokens,
                         prompt_bucket=FLAGS.prompt_len,
                         record_guidance=FLAGS.record_guidance)
  engine.sync(params)
  del params
  weights = engine.params
  experts = sum(tree_bytes(weights[f"layers_{i}"]["moe"]["experts"])
                for i in range(config.num_layers) if config.is_moe_layer(i))
  by_kind = {"experts": experts, "other": tree_bytes(weights) - experts
             - tree_bytes(weights["embed"])}  # embedding: only B rows are read
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, config.vocab_size, FLAGS.prompt_len)) for _ in range(batch)]
  s = SamplingParams(temperature=1.0)

  def timed(max_new):
    out = engine.generate(prompts, n=1, sampling=s, seed=1, max_new_tokens=max_new)
    jax.block_until_ready(out.tokens)  # compile + warm up
    ts = []
    for r in range(FLAGS.repeats):
      t = time.perf_counter()
      out = engine.generate(prompts, n=1, sampling=s, seed=2 + r, max_new_tokens=max_new)
      jax.block_until_ready(out.tokens)
      ts.append(time.perf_counter() - t)
    return _median(ts), out

  t_full, out = timed(FLAGS.new_tokens)
  t_one, _ = timed(1)  # prefill + one step (same compiled program, early exit)
  gen = int(np.sum(np.asarray(out.completion_mask)))
  step_s = (t_full - t_one) / max(FLAGS.new_tokens - 1, 1)
  ctx = FLAGS.prompt_len + FLAGS.new_tokens // 2
  floor_b = _bytes_floor(config, policy, by_kind, batch, ctx)
  peak = None
  try:
    peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
  except Exception:  # noqa: BLE001 - no stats on this backend
    pass
  return {
      "policy": policy.name, "batch": batch, "tokens_per_s": gen / t_full,
      "decode_step_ms": 1e3 * step_s, "prefill_plus_first_step_ms": 1e3 * t_one,
      "total_s": t_full, "generated_tokens": gen,
      "weight_bytes": tree_bytes(weights), "expert_weight_bytes": experts,
      "kv_bytes": int(M.cache_bytes_per_token(config, policy.kv_format, config.compute_dtype)
                      * (FLAGS.prompt_len + FLAGS.new_tokens) * batch),
      "guidance_bytes_per_token": out.guidance_bytes_per_token(),
      "floor_bytes_per_step": floor_b, "floor_step_ms": 1e3 * floor_b / FLAGS.bandwidth,
      "measured_over_floor": step_s / (floor_b / FLAGS.bandwidth),
      "peak_device_bytes": peak,
  }


def bench_hf(config, batch):
  """HF transformers generate on the same shape (random weights): eager and static cache."""
  import jax
  import torch
  import transformers

  from trace_jax import models as M
  with tempfile.TemporaryDirectory() as d:
    M.save_hf_checkpoint(d, M.init_params(config, jax.random.key(0)), config)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev).eval()
  ids = torch.randint(3, config.vocab_size, (batch, FLAGS.prompt_len), device=dev)
  rows = []
  for impl in ("eager", "static"):
    kw = dict(max_new_tokens=FLAGS.new_tokens, min_new_tokens=FLAGS.new_tokens, do_sample=True)
    if impl == "static":
      kw["cache_implementation"] = "static"
    try:
      with torch.no_grad():
        model.generate(ids, **kw)
        ts = []
        for _ in range(FLAGS.repeats):
          t = time.perf_counter()
          model.generate(ids, **kw)
          if dev == "cuda":
            torch.cuda.synchronize()
          ts.append(time.perf_counter() - t)
      rows.append({"policy": f"hf_{impl}", "batch": batch,
                   "tokens_per_s": batch * FLAGS.new_tokens / _median(ts),
                   "total_s": _median(ts)})
    except Exception as e:  # noqa: BLE001 - record why the peer could not run
      rows.append({"policy": f"hf_{impl}", "batch": batch, "error": str(e)[:300]})
  return rows


def main(argv):
  del argv
  from trace_jax import models as M
  from trace_jax.provenance import run_info
  config = M.preset(FLAGS.preset).replace(max_seq_len=FLAGS.prompt_len + FLAGS.new_tokens)
  rows = []
  for b in [int(x) for x in FLAGS.batches]:
    for p in FLAGS.policies:
      rows.append(bench_engine(config, p, b))
      print(json.dumps({k: rows[-1][k] for k in ("policy", "batch", "tokens_per_s",
                                                  "decode_step_ms", "measured_over_floor")}))
    if FLAGS.hf_peer:
      try:
        import torch  # noqa: F401
        rows += bench_hf(config, b)
      except ImportError:
        pass
  out = dict(benchmark="bench_rollout", **run_info(), preset=FLAGS.preset,
             prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens,
             bandwidth_bytes_per_s=FLAGS.bandwidth,
             note="reference (jnp) path: FP4 weights are dequantized by XLA; the fused kernels "
                  "replace it on GPU",
             units=dict(tokens_per_s="generated tokens/s (wall)", decode_step_ms="ms (wall)",
                        weight_bytes="bytes", kv_bytes="bytes at full context",
                        floor_step_ms="ms at the given bandwidth"),
             results=rows)
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  with open(FLAGS.out, "w") as f:
    json.dump(out, f, indent=2)
  print(f"{'policy':14s} {'B':>4s} {'tok/s':>10s} {'step ms':>9s} {'floor ms':>9s} {'x floor':>8s}")
  for r in rows:
    if "error" in r:
      print(f"{r['policy']:14s} {r['batch']:4d} error: {r['error'][:60]}")
      continue
    print(f"{r['policy']:14s} {r['batch']:4d} {r['tokens_per_s']:10.1f} "
          f"{r.get('decode_step_ms', float('nan')):9.2f} {r.get('floor_step_ms', float('nan')):9.4f} "
          f"{r.get('measured_over_floor', float('nan')):8.1f}")


if __name__ == "__main__":
  app.run(main)
