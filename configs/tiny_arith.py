"""CPU default: a ~0.13M-parameter MoE learns 2-digit addition (SFT warm start, then GRPO with
FP4 TRACE rollouts). About 5 minutes on 2 CPU cores.

  python launch/train_rl.py --config configs/tiny_arith.py --workdir /tmp/run \\
      --config.rl.alignment=qat --config.rollout.fp4_format=mxfp4
"""

import ml_collections

# Mesh layouts the 8-device tests run (every one divides this config's model dimensions).
MESH_LAYOUTS = {
    "data8": dict(data=8),
    "fsdp8": dict(fsdp=8),
    "data2_expert4": dict(data=2, expert=4),
    "fsdp2_expert2_tensor2": dict(fsdp=2, expert=2, tensor=2),
}


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.total_steps = 200
  c.tokenizer = "char"
  c.init_checkpoint = ""  # an HF checkpoint directory to start from instead of random weights

  c.task = ml_collections.ConfigDict()
  c.task.name = "addition"
  c.task.kwargs = ml_collections.ConfigDict({"n_digits": 2})

  c.model = ml_collections.ConfigDict(dict(
      preset="tiny", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
      num_experts=4, num_experts_per_tok=2, moe_ffn_size=64, rope_theta=10000.0,
      dtype="float32"))

  c.sft = ml_collections.ConfigDict(dict(
      max_steps=800, batch_size=128, learning_rate=3e-3, warmup_steps=50, eval_every=25,
      eval_size=500, target_pass_rate=0.3))

  c.rollout = ml_collections.ConfigDict(dict(
      precision="fp4",  # or "bf16"
      policy="paper",  # routed experts W4A4 + KV4; see trace_jax.quant.make_policy
      fp4_format="nvfp4",  # or "mxfp4"
      guided_layers=0.5,  # deeper half records TRACE guidance
      guidance_compact=True,
      dtype="bfloat16",  # the rollout computes in bf16, the trainer in model.dtype
      temperature=1.0, top_k=0, top_p=1.0,
      prompts_per_step=32, samples_per_prompt=8,
      prompt_len=0, max_new_tokens=0,  # 0: from the task
      # > 0: decode in windows of this many steps and move each window's TRACE guidance to host
      # memory (long rollouts: on the 30B-A3B shape at 8k tokens guidance outweighs the FP4 KV
      # cache); 0: one program per rollout
      decode_chunk=0,
      # XLA command buffers (CUDA graphs over the whole decode window) where they were measured:
      # one GPU (RolloutEngine(command_buffers=)); False: XLA's default
      command_buffers=True))

  c.rl = ml_collections.ConfigDict(dict(
      alignment="trace",  # "none" | "qat" | "trace"
      routing_replay=True,
      learning_rate=3e-4, warmup_steps=5, weight_decay=0.01, grad_clip=1.0,
      clip_low=0.2, clip_high=0.2, is_mode="tis", is_clip=5.0,
      aggregation="token_mean", normalize_std=True, kl_coef=0.0,
      aux_loss_coef=0.01, z_loss_coef=0.0, micro_batches=1,
      code_agreement=True,  # record full codes at every site for mismatch/code_agreement
      # True: the train (and SFT) steps compiled with XLA's deterministic ops, every scatter
      # made deterministic (1.4x the train step on an H100 at the mid shape). Not needed for
      # this model: its gathers that repeat rows add their gradients in a fixed order
      # (`kernels.take_rows`, `kernels.take_copies`), so a GPU run repeats itself and resumes
      # with the same numbers
      deterministic=False))

  # Device mesh (trace_jax.parallel), rollout and trainer colocated: axis sizes, -1 = fill with
  # the remaining devices; all 1 runs on one device. With expert > 1 the MoE layer is expert
  # parallel: expert_parallel "auto" (ragged_all_to_all on GPU, fixed capacity elsewhere),
  # "fixed", "ragged" or "off" (GSPMD); expert_capacity_factor 0 = never drop.
  c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, expert=1, tensor=1,
                                          expert_parallel="auto", expert_capacity_factor=0.0))

  c.eval = ml_collections.ConfigDict(dict(every=25, size=500))
  c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep=3))
  return c
