"""Request-level continuous batching over the RolloutEngine.

`BatchScheduler` owns one engine and one worker thread. Callers `submit` a `GenerationRequest`
from any thread and get a `concurrent.futures.Future`; the worker forms a batch from whatever is
waiting each time the engine is free, runs one `engine.generate` call for it, and resolves the
futures. Requests that arrive while a batch runs join the next batch: this is continuous
batching at request granularity, between engine calls. It is not step-level (slot) batching: the
engine runs a batch to completion in one jitted program, so a request cannot join a batch in
flight, and every token of a request becomes available when its batch ends (the time to first
token equals the request's latency).

What a batch holds and why:
- The head of the queue is always in the next batch (FIFO: nobody starves); later requests join
  it when they share its sampling settings, seed and stop tokens (one engine call takes one of
  each) and their prompt differs from every prompt already in it. The engine derives each
  sequence's PRNG key from (seed, prompt, occurrence of that prompt in the call), so keeping
  prompts distinct within a call makes a request's tokens independent of its batch-mates.
- Batches are padded to bucket sizes (default: powers of two up to `max_batch`) with copies of their first prompt
  limited to one new token, and prompts to the engine's prompt bucket, so the number of
  compiled programs stays small.
- The queue is bounded (`max_queue`, `QueueFullError` beyond it) and so is each request's
  `max_tokens` (the engine's `max_new_tokens`), so one client cannot starve the rest.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from trace_jax.rollout import RolloutEngine, SamplingParams


class QueueFullError(RuntimeError):
  """The scheduler's queue is at `max_queue`: the client should retry later."""


class SchedulerClosedError(RuntimeError):
  """The scheduler was closed; it accepts no more requests."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
  """One completion: prompt token ids, at most `max_tokens` new tokens."""

  prompt: tuple[int, ...]
  max_tokens: int
  sampling: SamplingParams = SamplingParams(temperature=0.0)
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()

  def group(self):
    """Requests with equal groups can share one engine call."""
    return (self.sampling, self.seed, self.stop_tokens)


@dataclasses.dataclass
class GenerationResult:
  """What a request produced, with its timeline (time.perf_counter seconds)."""

  tokens: list[int]  # generated ids, without the stop token
  logprobs: list[float]  # one per id in `tokens`
  finish_reason: str  # "stop" (a stop token) or "length" (max_tokens reached)
  submitted_at: float
  started_at: float  # its batch entered the engine
  finished_at: float  # its batch left the engine (all tokens available from here on)
  batch_size: int  # real requests in its batch
  padded_batch: int  # rows the engine ran

  @property
  def latency_s(self) -> float:
    return self.finished_at - self.submitted_at

  @property
  def queue_s(self) -> float:
    return self.started_at - self.submitted_at


def batch_buckets(max_batch: int, sizes: Sequence[int] = ()) -> list[int]:
  """Padded batch sizes: `sizes` (sorted; the largest must be `max_batch`), by default the
  powers of two below `max_batch`, then `max_batch`. Fewer sizes, fewer compiles (e.g. just
  `max_batch` on a GPU under steady load), at the price of padding small batches."""
  if max_batch < 1:
    raise ValueError(f"max_batch must be >= 1, got {max_batch}")
  if sizes:
    sizes = sorted({int(x) for x in sizes})
    if sizes[0] < 1 or sizes[-1] != max_batch:
      raise ValueError(f"batch bucket sizes {sizes} must be >= 1 and end at max_batch "
                       f"{max_batch}")
    return sizes
  sizes, b = [], 1
  while b < max_batch:
    sizes.append(b)
    b *= 2
  return sizes + [max_batch]


class BatchScheduler:
  """Forms batches from concurrent requests and runs them on `engine` (see module docstring).

    sched = BatchScheduler(engine, max_batch=8, max_queue=64)
    fut = sched.submit(GenerationRequest(tuple(ids), max_tokens=16))
    result = fut.result()
    sched.close()

  batch_wait_s: after the first request of an idle period arrives, wait this long for others to
  join its batch (0: run at once; under load batches fill from the queue anyway).
  """

  def __init__(self, engine: RolloutEngine, *, max_batch: int = 8, max_queue: int = 64,
               batch_wait_s: float = 0.0, prompt_len: int | None = None,
               buckets: Sequence[int] = ()):
    if engine.params is None:
      raise ValueError("BatchScheduler needs a synced engine (call engine.sync(params) first)")
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.engine = engine
    self.max_batch = int(max_batch)
    self.buckets = batch_buckets(self.max_batch, buckets)
    self.max_queue = int(max_queue)
    self.batch_wait_s = float(batch_wait_s)
    # Prompts pad to one length: one program per batch bucket (and sampling setting).
    self.prompt_len = int(prompt_len or engine.prompt_bucket)
    if self.prompt_len + engine.max_new_tokens > engine.config.max_seq_len:
      raise ValueError(f"prompt_len {self.prompt_len} + max_new_tokens {engine.max_new_tokens} "
                       f"exceeds the model's max_seq_len {engine.config.max_seq_len}")
    self._queue: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self.batches_run = 0
    self.shapes_run: set = set()
    self._worker = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
    self._worker.start()

  # -- limits a front end checks before submitting
  @property
  def max_prompt_tokens(self) -> int:
    return self.prompt_len

  @property
  def max_tokens(self) -> int:
    return self.engine.max_new_tokens

  def validate(self, request: GenerationRequest) -> None:
    """Raise ValueError naming what is wrong with `request` (nothing if it can run)."""
    n = len(request.prompt)
    if n == 0:
      raise ValueError("the prompt is empty")
    if n > self.prompt_len:
      raise ValueError(f"the prompt has {n} tokens, more than this server's limit of "
                       f"{self.prompt_len}")
    if not 1 <= request.max_tokens <= self.max_tokens:
      raise ValueError(f"max_tokens must be in [1, {self.max_tokens}], got {request.max_tokens}")
    vocab = self.engine.config.vocab_size
    bad = [t for t in request.prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

  def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
    """Queue `request`; raises ValueError (bad request), QueueFullError, SchedulerClosedError."""
    self.validate(request)
    fut: concurrent.futures.Future = concurrent.futures.Future()
    with self._cond:
      if self._closed:
        raise SchedulerClosedError("the scheduler is closed")
      if len(self._queue) >= self.max_queue:
        raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry "
                             "later")
      self._queue.append((request, fut, time.perf_counter()))
      self._cond.notify()
    return fut

  @property
  def queue_length(self) -> int:
    with self._cond:
      return len(self._queue)

  def close(self, timeout: float | None = 30.0) -> None:
    """Stop accepting requests, finish the batch in flight, fail the ones still queued."""
    with self._cond:
      self._closed = True
      pending = list(self._queue)
      self._queue.clear()
      self._cond.notify_all()
    for _, fut, _ in pending:
      fut.set_exception(SchedulerClosedError("the scheduler closed before this request ran"))
    self._worker.join(timeout)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- the worker
  def _take_batch(self) -> list:
    """Pop the head of the queue and the compatible requests behind it (caller holds _cond)."""
    head = self._queue[0]
    batch, seen, keep = [], set(), collections.deque()
    for item in self._queue:
      req = item[0]
      if (len(batch) < self.max_batch and req.group() == head[0].group()
          and req.prompt not in seen):
        batch.append(item)
        seen.add(req.prompt)
      else:
        keep.append(item)
    self._queue = keep
    return batch

  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._queue and not self._closed:
          self._cond.wait()
        if self._closed:
          return
        if self.batch_wait_s > 0 and len(self._queue) < self.max_batch:
          deadline = time.perf_counter() + self.batch_wait_s
          while len(self._queue) < self.max_batch and not self._closed:
            left = deadline - time.perf_counter()
            if left <= 0:
              break
            self._cond.wait(left)
          if self._closed:
            return
        batch = self._take_batch()
      batch = [item for item in batch if item[1].set_running_or_notify_cancel()]
      if batch:
        self._run(batch)

  def _run(self, batch: list) -> None:
    reqs = [item[0] for item in batch]
    size = next(b for b in self.buckets if b >= len(reqs))
    pad = size - len(reqs)
    prompts = [list(r.prompt) for r in reqs] + [list(reqs[0].prompt)] * pad
    max_new = [r.max_tokens for r in reqs] + [1] * pad
    head = reqs[0]
    started = time.perf_counter()
    try:
      ro = self.engine.generate(prompts, n=1, sampling=head.sampling, seed=head.seed,
                                stop_tokens=head.stop_tokens, max_new_tokens=max_new,
                                prompt_len=self.prompt_len)
      completion = np.asarray(ro.completion)
      mask = np.asarray(ro.completion_mask)
      logprobs = np.asarray(ro.logprobs)
    except Exception as e:  # noqa: BLE001 - the error belongs to these requests, not the server
      for _, fut, _ in batch:
        fut.set_exception(e)
      return
    finished = time.perf_counter()
    self.batches_run += 1
    self.shapes_run.add((size, self.prompt_len, head.sampling))
    stops = set(head.stop_tokens)
    for i, (req, fut, submitted) in enumerate(batch):
      toks = completion[i][mask[i]].tolist()
      lps = logprobs[i][mask[i]].tolist()
      reason = "length"
      if toks and toks[-1] in stops:
        toks, lps, reason = toks[:-1], lps[:-1], "stop"
      fut.set_result(GenerationResult(toks, lps, reason, submitted, started, finished,
                                      len(reqs), size))


def generate_direct(engine: RolloutEngine, requests: Sequence[GenerationRequest],
                    prompt_len: int) -> list[list[int]]:
  """Reference: each request alone through `engine.generate` (tokens without the stop token).
  What the scheduler must reproduce whatever it batches together."""
  out = []
  for r in requests:
    ro = engine.generate([list(r.prompt)], sampling=r.sampling, seed=r.seed,
                         stop_tokens=r.stop_tokens, max_new_tokens=r.max_tokens,
                         prompt_len=prompt_len)
    toks = np.asarray(ro.completion)[0][np.asarray(ro.completion_mask)[0]].tolist()
    if toks and toks[-1] in r.stop_tokens:
      toks = toks[:-1]
    out.append(toks)
  return out
