"""The batch scheduler's bounds and batching rules (no engine call: the worker is held in its
batch-fill wait, so the queue's contents are deterministic)."""

import jax
import pytest

from trace_jax import models as M
from trace_jax.rollout import RolloutEngine, SamplingParams
from trace_jax.serving import (BatchScheduler, GenerationRequest, QueueFullError,
                               SchedulerClosedError, batch_buckets)

CFG = M.tiny(num_layers=1, max_seq_len=24)


def _scheduler(**kw):
  eng = RolloutEngine(CFG, max_new_tokens=8, prompt_bucket=8, record_guidance=False)
  eng.sync(M.init_params(CFG, jax.random.key(0)))
  # A long batch wait with a large max_batch keeps the worker waiting: nothing runs.
  return BatchScheduler(eng, **{"max_batch": 16, "batch_wait_s": 60.0, **kw})


def test_batch_buckets():
  assert batch_buckets(1) == [1]
  assert batch_buckets(8) == [1, 2, 4, 8]
  assert batch_buckets(12) == [1, 2, 4, 8, 12]
  assert batch_buckets(32, [32, 8]) == [8, 32]
  with pytest.raises(ValueError, match="max_batch"):
    batch_buckets(0)
  with pytest.raises(ValueError, match="end at max_batch"):
    batch_buckets(32, [8, 16])


def test_queue_and_token_bounds_and_close():
  sched = _scheduler(max_queue=2)
  ok = GenerationRequest((5, 6), 8)
  futs = [sched.submit(ok), sched.submit(GenerationRequest((5, 7), 1))]
  with pytest.raises(QueueFullError, match="queue is full"):
    sched.submit(ok)
  for bad, words in (((), "empty"), ((5,) * 9, "more than the limit of 8")):
    with pytest.raises(ValueError, match=words):
      sched.submit(GenerationRequest(bad, 1))
  for n in (0, 9):
    with pytest.raises(ValueError, match=r"max_tokens must be in \[1, 8\]"):
      sched.submit(GenerationRequest((5,), n))
  with pytest.raises(ValueError, match="outside the vocabulary"):
    sched.submit(GenerationRequest((5, CFG.vocab_size), 1))
  sched.close()
  for f in futs:
    with pytest.raises(SchedulerClosedError):
      f.result(timeout=5)
  with pytest.raises(SchedulerClosedError):
    sched.submit(ok)


def test_batches_keep_fifo_head_and_compatible_distinct_prompts():
  sched = _scheduler(max_batch=3, max_queue=16)
  greedy, hot = SamplingParams(0.0), SamplingParams(1.0)
  reqs = [GenerationRequest((5,), 2, greedy), GenerationRequest((6,), 2, hot),  # other sampling
          GenerationRequest((5,), 2, greedy),  # same prompt as the head: next batch
          GenerationRequest((7,), 2, greedy, seed=1),  # other seed
          GenerationRequest((8,), 2, greedy), GenerationRequest((9,), 2, greedy),
          GenerationRequest((10,), 2, greedy)]  # beyond max_batch
  with sched._cond:  # noqa: SLF001 - hold the worker off while the queue fills
    for r in reqs:
      sched._queue.append((r, None, 0.0))  # noqa: SLF001
    first = [item[0] for item in sched._take_batch()]  # noqa: SLF001
    second = [item[0] for item in sched._take_batch()]  # noqa: SLF001
    sched._queue.clear()  # noqa: SLF001
  assert first == [reqs[0], reqs[4], reqs[5]]
  assert second == [reqs[1]]  # the new head's group alone
  sched.close()
