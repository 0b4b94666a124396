"""Qwen3-30B-A3B imported from a Hugging Face checkpoint directory, RL on a JSONL task with
NVFP4 TRACE rollouts (the paper's policy: routed experts W4A4 + KV4, deeper half guided).

  python launch/train_rl.py --config configs/qwen3_30b_a3b.py --workdir /tmp/q3 \\
      --config.init_checkpoint=/path/to/Qwen3-30B-A3B --config.tokenizer=/path/to/Qwen3-30B-A3B \\
      --config.task.kwargs.path=/path/to/problems.jsonl

The model shape comes from the checkpoint's config.json; `model` here only sets the compute
dtype. The float32 masters and AdamW moments of 30B parameters (~360 GB) do not fit one GPU: run
on a mesh (`c.mesh`, see configs/tiny_arith.py), e.g. on one 8-GPU host
  --config.mesh.fsdp=2 --config.mesh.expert=4
and --coordinator_address/--num_processes/--process_id per host for several hosts. Not yet run
at this size (no 8-GPU machine so far); benchmarks/bench_parallel.py has the 8-GPU settings.
"""

import ml_collections

from configs import tiny_arith


def get_config():
  c = tiny_arith.get_config()
  c.total_steps = 400
  c.init_checkpoint = ""  # required: HF checkpoint directory
  c.tokenizer = ""  # required: the checkpoint's tokenizer directory
  c.task.name = "jsonl"
  c.task.kwargs = ml_collections.ConfigDict({"path": "", "reward": "numeric"})
  c.model = ml_collections.ConfigDict(dict(preset="qwen3_30b_a3b", dtype="bfloat16"))
  c.sft.max_steps = 0
  c.rollout.update(dict(prompts_per_step=64, samples_per_prompt=16, dtype="bfloat16",
                        prompt_len=512, max_new_tokens=2048, temperature=1.0,
                        decode_chunk=256))
  c.rl.update(dict(learning_rate=1e-6, warmup_steps=0, micro_batches=16, is_clip=5.0,
                   aux_loss_coef=0.0, code_agreement=False))
  c.eval.update(dict(every=25, size=256))
  c.checkpoint.update(dict(every=10, keep=2))
  return c
