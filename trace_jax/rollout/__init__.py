"""Rollout generation: batched prefill + on-device decode with FP4 weights/activations/KV,
recording logprobs, expert routes and TRACE guidance; sampling; capacity planning."""

from trace_jax.rollout.engine import (CapacityError, Rollout, RolloutEngine, bytes_per_sequence,
                                      device_memory_bytes, generate_program, plan_capacity,
                                      tree_bytes)
from trace_jax.rollout.sampling import SamplingParams, filter_logits, sample

__all__ = [
    "CapacityError", "Rollout", "RolloutEngine", "SamplingParams", "bytes_per_sequence",
    "device_memory_bytes", "filter_logits", "generate_program", "plan_capacity", "sample",
    "tree_bytes",
]
