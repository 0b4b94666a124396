"""Serving: an OpenAI-compatible HTTP server over the rollout engine (step-level continuous
batching with token streaming, or request-level batching) and the paired BF16-vs-FP4 serving A/B
with acceptance limits and a verdict.

`scheduler` (SlotScheduler, BatchScheduler, GenerationRequest, TokenStream), `backend`
(build_serving: weights + policy + tokenizer + scheduler from a config), `server` (build_app: the
Starlette app), `compare` (run_compare, verdict, report). `server` needs starlette; import it
directly.
"""

from trace_jax.serving.backend import ARMS, ServingModel, arm_config, build_serving, render_chat
from trace_jax.serving.scheduler import (BatchScheduler, GenerationRequest, GenerationResult,
                                         QueueFullError, SchedulerClosedError, SlotScheduler,
                                         TokenStream, batch_buckets)

__all__ = [
    "ARMS", "BatchScheduler", "GenerationRequest", "GenerationResult", "QueueFullError",
    "SchedulerClosedError", "ServingModel", "SlotScheduler", "TokenStream", "arm_config",
    "batch_buckets", "build_serving", "render_chat",
]
