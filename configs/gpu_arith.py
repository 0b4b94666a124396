"""One-GPU config: a ~107M-parameter MoE (8 layers, 32 experts, top-4) on 3-digit addition with
FP4 TRACE rollouts (bf16 rollout compute, float32 trainer). Sized to run in minutes on an H200.

  python launch/train_rl.py --config configs/gpu_arith.py --workdir /tmp/gpu_run
"""

from configs import tiny_arith


def get_config():
  c = tiny_arith.get_config()
  c.total_steps = 300
  c.task.kwargs = {"n_digits": 3}
  c.model.update(dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                      num_experts=32, num_experts_per_tok=4, moe_ffn_size=256,
                      dtype="float32"))
  c.sft.update(dict(max_steps=2000, batch_size=256, learning_rate=1e-3, eval_every=50,
                    eval_size=1000, target_pass_rate=0.3))
  c.rollout.update(dict(prompts_per_step=128, samples_per_prompt=8, dtype="bfloat16"))
  c.rl.update(dict(learning_rate=1e-4, micro_batches=2))
  c.eval.update(dict(every=50, size=1000))
  c.checkpoint.update(dict(every=50))
  return c
