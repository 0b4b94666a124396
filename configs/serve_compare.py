"""Serving A/B: a BF16 baseline vs an FP4 candidate on the same prompts, load and GPU, judged
against acceptance limits written here before anything runs.

  python launch/compare.py --workdir /tmp/ab                       # CPU: tiny model, addition
  python launch/compare.py --workdir /tmp/ab --config.init_checkpoint=/tmp/sft/hf \\
      --config.limits.max_pass_rate_drop=0.05 --config.cost.gpu_hour_usd=3.5
  python launch/compare.py --config=configs/serve_compare.py:gpu --workdir $OUT/ab   # H200
  python launch/serve.py --arm=candidate --port=8000 --api_key=$KEY   # serve the same setup

Extends the RL config (`configs/tiny_arith.py`): `task`, `tokenizer`, `model`,
`init_checkpoint` and `rollout` (prompt_len, max_new_tokens, compute dtype, FP4 guidance
settings) mean the same there. `get_config("gpu")`: Qwen3-30B-A3B layer shapes (12 of its 48
layers, random weights unless `init_checkpoint` is set) in bf16, 256-token prompts.
"""

import ml_collections

from configs import tiny_arith


def get_config(variant: str = "cpu"):
  c = tiny_arith.get_config()
  c.sft.max_steps = 0  # serving never trains

  # What is compared: each arm sets the rollout precision/policy of the served model.
  c.baseline = ml_collections.ConfigDict(dict(precision="bf16", policy="bf16",
                                              fp4_format="nvfp4"))
  c.candidate = ml_collections.ConfigDict(dict(precision="fp4", policy="paper",
                                               fp4_format="nvfp4"))

  c.serve = ml_collections.ConfigDict(dict(
      model_name="",  # the name clients send as "model" (default: trace-<arm>)
      trainer_checkpoint="",  # a launch/train_rl.py workdir to serve (else init_checkpoint)
      load_dtype="bfloat16",  # master weights as loaded, before the serving copy is made
      # "slots": step-level continuous batching, tokens streamed as generated (TTFT = queue
      # wait + one prefill); "batch": request-level, one engine.generate call per batch.
      scheduler="slots",
      max_batch=8,  # slots: sequences decoding together; batch: requests per engine call
      # padded batch sizes (slots: prefill sizes), e.g. "8,32" (default: powers of two to
      # max_batch)
      batch_buckets="",
      decode_chunk=8,  # slots: decode steps per program call (tokens reach clients per chunk)
      max_queue=256,  # waiting requests beyond this get 429
      # plan serving as if the device had this many GiB (0: the device's own), e.g. 24 to ask
      # whether an arm serves max_batch sequences on a 24 GB GPU; an arm that does not fit is
      # reported as such, not as a crash
      device_gib=0.0,
      batch_wait_s=0.0,  # batch: how long an idle scheduler waits to fill a batch
      max_body_bytes=1 << 20))
  c.rollout.temperature = 0.0  # serving default; the A/B sampling is `compare.*`

  c.compare = ml_collections.ConfigDict(dict(
      prompts_jsonl="",  # your prompts: {"prompt", "answer"} lines (else the task's eval split)
      reward="exact",  # for prompts_jsonl: exact | numeric | contains
      num_prompts=64,
      repeats=3,  # paired runs (repeat r: the same prompts and seed r on both arms)
      temperature=0.7, top_p=1.0,
      only_arm="",  # "baseline" / "candidate": measure just that arm (then rerun for the report)
      notes="",  # free text for the report (e.g. how the checkpoint was made)
      isolate=True,  # each arm in its own process (clean peak memory; no shared compile cache)
      report_failures=10))

  # Offered load, the same for both arms: `concurrency` closed-loop clients, or an open-loop
  # Poisson arrival `rate` (requests/s) when rate > 0.
  c.load = ml_collections.ConfigDict(dict(concurrency=8, rate=0.0))

  # Acceptance limits, fixed before running: keep FP4 only if all hold.
  c.limits = ml_collections.ConfigDict(dict(
      max_pass_rate_drop=0.05,  # baseline pass rate - candidate pass rate (absolute)
      max_p95_latency_s=5.0,  # candidate's p95 end-to-end request latency
      min_memory_saving=0.3))  # 1 - candidate serving memory / baseline serving memory

  c.cost = ml_collections.ConfigDict(dict(gpu_hour_usd=3.0))

  if variant == "gpu":
    c.model = ml_collections.ConfigDict(dict(preset="qwen3_30b_a3b_12l", dtype="bfloat16",
                                             vocab_size=151936, max_seq_len=1024))
    c.rollout.update(dict(prompt_len=256, max_new_tokens=128))
    # One padded batch size: few compiles per arm (minutes at this shape; slots: one prefill of
    # 32 rows and one decode chunk program), full batches under load.
    c.serve.update(dict(max_batch=32, batch_buckets="32", max_queue=1024))
    c.compare.update(dict(num_prompts=128, repeats=3))
    c.load.concurrency = 32
    c.limits.max_p95_latency_s = 30.0
  elif variant != "cpu":
    raise ValueError(f"unknown variant {variant!r}: 'cpu' or 'gpu'")
  return c
