"""Rollout generation: batched prefill + on-device decode with FP4 weights/activations/KV,
recording logprobs, expert routes and TRACE guidance; sampling; capacity planning (device and
host memory); step-level slot decoding for serving (`slots`)."""

from trace_jax.rollout.engine import (CapacityError, Rollout, RolloutEngine, bytes_per_sequence,
                                      capacity_limits, device_bytes_in_use,
                                      device_memory_bytes, generate_program,
                                      guidance_bytes_per_token, host_bytes_per_sequence,
                                      host_memory_bytes, host_tokens_held, plan_capacity, planning,
                                      sequence_keys, tree_bytes)
from trace_jax.rollout.sampling import RowSampling, SamplingParams, filter_logits, sample
from trace_jax.rollout.slots import SlotDecoder, SlotRequest

__all__ = [
    "CapacityError", "Rollout", "RolloutEngine", "RowSampling", "SamplingParams", "SlotDecoder",
    "SlotRequest", "bytes_per_sequence", "capacity_limits", "device_bytes_in_use",
    "device_memory_bytes",
    "filter_logits", "generate_program", "guidance_bytes_per_token", "host_bytes_per_sequence",
    "host_memory_bytes", "host_tokens_held", "plan_capacity", "planning", "sample", "sequence_keys",
    "tree_bytes",
]
