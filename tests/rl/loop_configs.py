"""Small RL-loop configs shared by the loop tests."""

from configs import tiny_arith
from trace_jax.rl import compare, loop


def _small_config(**over):
  c = tiny_arith.get_config()
  c.sft.max_steps = 0
  c.total_steps = 6
  c.rollout.prompts_per_step = 4
  c.rollout.samples_per_prompt = 4
  c.eval.every = 3
  c.eval.size = 16
  c.checkpoint.every = 2
  return compare.override(c, over)


def _comparable(rows):
  return [{k: v for k, v in r.items() if k not in loop.TIMING_KEYS} for r in rows]
