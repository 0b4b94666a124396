"""Continuous batching over the rollout engine: step-level (`SlotScheduler`, streaming) and
request-level (`BatchScheduler`).

`SlotScheduler` (what the server runs) owns a `rollout.slots.SlotDecoder` (S slots over one
persistent KV cache) and one worker thread that loops: admit waiting requests into free slots
(FIFO; requests of one prompt bucket prefill together, and each one's first token is sampled by
the prefill), decode a chunk of C steps for all live slots, push every new token to its request's
`TokenStream`, free the slots that finished. A request joins the running batch at the next chunk
boundary, so its time to first token (TTFT) is its queue wait plus one prefill, not its whole
latency, and clients can stream tokens as they are generated. A request's tokens equal
`engine.generate`'s for the same prompt, seed and sampling (see `rollout.slots`), whatever else
is in the slots. Bounds: the queue (`max_queue`, `QueueFullError` beyond it) and each request's
`max_tokens` (the engine's `max_new_tokens`), so one client cannot starve the rest.
`TokenStream.cancel()` (the server calls it when a streaming client disconnects or a stop string
ends the text) frees the request's slot at the next chunk boundary.

`BatchScheduler` batches at request granularity: the worker forms a batch from whatever is
waiting each time the engine is free and runs one `engine.generate` call for it (one jitted
program to completion), so a request cannot join a batch in flight and all its tokens become
available when its batch ends (TTFT equals latency). What its batch holds and why:
- The head of the queue is always in the next batch (FIFO: nobody starves); later requests join
  it when they share its sampling settings, seed and stop tokens (one engine call takes one of
  each) and their prompt differs from every prompt already in it. The engine derives each
  sequence's PRNG key from (seed, prompt, occurrence of that prompt in the call), so keeping
  prompts distinct within a call makes a request's tokens independent of its batch-mates.
- Batches are padded to bucket sizes (default: powers of two up to `max_batch`) with copies of
  their first prompt limited to one new token, and prompts to the engine's prompt bucket, so the
  number of compiled programs stays small.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from trace_jax.rollout import RolloutEngine
from trace_jax.rollout.slots import SlotDecoder, SlotRequest, batch_buckets, validate_request


class QueueFullError(RuntimeError):
  """The scheduler's queue is at `max_queue`: the client should retry later."""


class SchedulerClosedError(RuntimeError):
  """The scheduler was closed; it accepts no more requests."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest(SlotRequest):
  """One completion: prompt token ids, at most `max_tokens` new tokens, sampling, seed, stop
  tokens (the fields of `rollout.slots.SlotRequest`)."""

  def group(self):
    """Requests with equal groups can share one engine call."""
    return (self.sampling, self.seed, self.stop_tokens)


@dataclasses.dataclass
class GenerationResult:
  """What a request produced, with its timeline (time.perf_counter seconds)."""

  tokens: list[int]  # generated ids, without the stop token
  logprobs: list[float]  # one per id in `tokens`
  finish_reason: str  # "stop" (a stop token), "length" (max_tokens reached) or "cancelled"
  submitted_at: float
  started_at: float  # it entered the engine (its prefill or its batch started)
  finished_at: float  # its last token was available on the host
  batch_size: int  # real requests in its batch (slots: live slots when it was admitted)
  padded_batch: int  # rows the engine ran (slots: the slot count)
  first_token_at: float | None = None  # its first token was available on the host
  token_times: list[float] = dataclasses.field(default_factory=list)  # when each token arrived

  @property
  def latency_s(self) -> float:
    return self.finished_at - self.submitted_at

  @property
  def queue_s(self) -> float:
    return self.started_at - self.submitted_at

  @property
  def ttft_s(self) -> float:
    return (self.finished_at if self.first_token_at is None
            else self.first_token_at) - self.submitted_at

  @property
  def per_token_s(self) -> float:
    """Mean time between tokens after the first; latency / tokens when they came all at once
    (batch delivery) or there is one."""
    if len(self.tokens) < 2 or self.first_token_at is None:
      return self.latency_s / max(len(self.tokens), 1)
    return (self.finished_at - self.first_token_at) / (len(self.tokens) - 1)


class TokenStream:
  """The tokens of one request as they are generated, for any number of readers.

  `for token, logprob in stream` (blocking) or `async for token, logprob in stream`; after the
  last token the iteration ends, or raises the request's error. `future` resolves to the
  `GenerationResult` (stop tokens are neither streamed nor in the result).
  """

  def __init__(self, request: GenerationRequest, submitted_at: float):
    self.request = request
    self.submitted_at = submitted_at
    self.future: concurrent.futures.Future = concurrent.futures.Future()
    self._cond = threading.Condition()
    self._tokens: list[tuple[int, float]] = []
    self._times: list[float] = []
    self._error: BaseException | None = None
    self._ended = False
    self._wakeups: list = []  # (event loop, asyncio.Event) of async readers
    self.cancelled = False  # read by the slot scheduler's worker at each chunk boundary

  def _notify(self) -> None:  # caller holds _cond
    self._cond.notify_all()
    for loop, event in self._wakeups:
      try:
        loop.call_soon_threadsafe(event.set)
      except RuntimeError:  # that reader's loop is closed
        pass

  def push(self, tokens: Sequence[tuple[int, float]], at: float) -> None:
    with self._cond:
      self._tokens.extend(tokens)
      self._times.extend([at] * len(tokens))
      self._notify()

  def end(self, result: GenerationResult | None = None,
          error: BaseException | None = None) -> None:
    with self._cond:
      self._ended, self._error = True, error
      self._notify()
    if error is not None:
      self.future.set_exception(error)
    else:
      self.future.set_result(result)

  def cancel(self) -> None:
    """The client no longer wants more tokens (it disconnected, or a stop string ended the
    text). Queued: the request never runs. In a slot (slot scheduler): the slot is freed at the
    next chunk boundary and the result ends with finish reason "cancelled". A finished request
    is unaffected; a request-level batch runs to its end."""
    with self._cond:
      if self._ended:
        return
      self.cancelled = True
    if self.future.cancel():  # still queued
      with self._cond:
        self._ended, self._error = True, concurrent.futures.CancelledError()
        self._notify()
    # In a slot: the worker never waits while a slot is live, so it sees the flag at the next
    # chunk boundary without being woken.

  def _read(self, start: int):
    with self._cond:
      return self._tokens[start:], self._ended, self._error

  def __iter__(self):
    n = 0
    while True:
      with self._cond:
        self._cond.wait_for(lambda: len(self._tokens) > n or self._ended)
      new, ended, error = self._read(n)
      yield from new
      n += len(new)
      if ended and not new:
        if error is not None:
          raise error
        return

  async def __aiter__(self):
    loop, event = asyncio.get_running_loop(), asyncio.Event()
    with self._cond:
      self._wakeups.append((loop, event))
    try:
      n = 0
      while True:
        event.clear()  # before reading: a push after the read sets it again
        new, ended, error = self._read(n)
        for item in new:
          yield item
        n += len(new)
        if ended and not new:
          if error is not None:
            raise error
          return
        if not new:
          await event.wait()
    finally:
      with self._cond:
        self._wakeups.remove((loop, event))

  def result(self, timeout: float | None = None) -> GenerationResult:
    return self.future.result(timeout)

  def token_times(self) -> list[float]:
    """When each streamed token reached the host (time.perf_counter seconds)."""
    with self._cond:
      return list(self._times)


class _QueueFront:
  """What both schedulers share: a bounded FIFO queue of (request, stream, submit time) that a
  worker thread drains, `submit` / `submit_stream`, `close`."""

  def _start(self, max_queue: int, name: str) -> None:
    if max_queue < 1:
      raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    self.max_queue = int(max_queue)
    self._queue: collections.deque = collections.deque()
    self._cond = threading.Condition()
    self._closed = False
    self._worker = threading.Thread(target=self._loop, name=name, daemon=True)
    self._worker.start()

  def validate(self, request: GenerationRequest) -> None:
    raise NotImplementedError

  def _loop(self) -> None:
    raise NotImplementedError

  def _enqueue(self, request: GenerationRequest) -> TokenStream:
    self.validate(request)
    stream = TokenStream(request, time.perf_counter())
    with self._cond:
      if self._closed:
        raise SchedulerClosedError("the scheduler is closed")
      if len(self._queue) >= self.max_queue:
        raise QueueFullError(f"the queue is full ({self.max_queue} requests waiting); retry "
                             "later")
      self._queue.append((request, stream, stream.submitted_at))
      self._cond.notify()
    return stream

  def submit(self, request: GenerationRequest) -> concurrent.futures.Future:
    """Queue `request`; the future resolves to its `GenerationResult`. Raises ValueError (bad
    request), QueueFullError, SchedulerClosedError."""
    return self.submit_stream(request).future

  def submit_stream(self, request: GenerationRequest) -> TokenStream:
    raise NotImplementedError

  @property
  def queue_length(self) -> int:
    with self._cond:
      return len(self._queue)

  def close(self, timeout: float | None = 30.0) -> None:
    """Stop accepting requests, finish the work in flight, fail the requests still queued."""
    with self._cond:
      self._closed = True
      pending = list(self._queue)
      self._queue.clear()
      self._cond.notify_all()
    for _, stream, _ in pending:
      stream.end(error=SchedulerClosedError("the scheduler closed before this request ran"))
    self._worker.join(timeout)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class BatchScheduler(_QueueFront):
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
    self.engine = engine
    self.max_batch = int(max_batch)
    self.buckets = batch_buckets(self.max_batch, buckets)
    self.batch_wait_s = float(batch_wait_s)
    # Prompts pad to one length: one program per batch bucket (and sampling setting).
    self.prompt_len = int(prompt_len or engine.prompt_bucket)
    if self.prompt_len + engine.max_new_tokens > engine.config.max_seq_len:
      raise ValueError(f"prompt_len {self.prompt_len} + max_new_tokens {engine.max_new_tokens} "
                       f"exceeds the model's max_seq_len {engine.config.max_seq_len}")
    self.batches_run = 0
    self.shapes_run: set = set()
    self._start(max_queue, "batch-scheduler")

  # -- limits a front end checks before submitting
  @property
  def max_prompt_tokens(self) -> int:
    return self.prompt_len

  @property
  def max_tokens(self) -> int:
    return self.engine.max_new_tokens

  def validate(self, request: GenerationRequest) -> None:
    """Raise ValueError naming what is wrong with `request` (nothing if it can run)."""
    validate_request(request, self.engine.config.vocab_size, self.prompt_len, self.max_tokens)

  def submit_stream(self, request: GenerationRequest) -> TokenStream:
    """Queue `request`; its stream gets every token at once when its batch ends."""
    return self._enqueue(request)

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
      batch = [item for item in batch if item[1].future.set_running_or_notify_cancel()]
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
      for _, stream, _ in batch:
        stream.end(error=e)
      return
    finished = time.perf_counter()
    self.batches_run += 1
    self.shapes_run.add((size, self.prompt_len, head.sampling))
    stops = set(head.stop_tokens)
    for i, (req, stream, submitted) in enumerate(batch):
      toks = completion[i][mask[i]].tolist()
      lps = logprobs[i][mask[i]].tolist()
      reason = "length"
      if toks and toks[-1] in stops:
        toks, lps, reason = toks[:-1], lps[:-1], "stop"
      stream.push(list(zip(toks, lps)), finished)
      stream.end(GenerationResult(toks, lps, reason, submitted, started, finished, len(reqs),
                                  size))


@dataclasses.dataclass
class _Live:
  """A request in a slot."""

  stream: TokenStream
  started_at: float
  batch_size: int
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  first_token_at: float | None = None


class SlotScheduler(_QueueFront):
  """Step-level continuous batching with token streaming (see module docstring).

    sched = SlotScheduler(engine, slots=8, chunk=8, max_queue=64)
    stream = sched.submit_stream(GenerationRequest(tuple(ids), max_tokens=16))
    for token, logprob in stream: ...
    result = stream.result()          # or: sched.submit(request).result()
    sched.close()

  slots: sequences decoding together (one compiled decode program); chunk: decode steps per
  program call (tokens reach the host, and waiting requests join, between chunks);
  prompt_len: the longest prompt (default: the engine's prompt bucket); prefill_sizes: padded
  prefill batch sizes (default: powers of two up to `slots`).
  """

  def __init__(self, engine: RolloutEngine, *, slots: int = 8, chunk: int = 8,
               max_queue: int = 64, prompt_len: int | None = None,
               prefill_sizes: Sequence[int] = ()):
    self.decoder = SlotDecoder(engine, slots=slots, chunk=chunk, max_prompt_tokens=prompt_len,
                               prefill_sizes=prefill_sizes)
    self.engine = engine
    self._live: dict[int, _Live] = {}
    self.chunks_run = 0
    self.prefills_run = 0
    self._start(max_queue, "slot-scheduler")

  # -- what the server, backend and A/B tool read
  @property
  def max_batch(self) -> int:
    return self.decoder.slots

  @property
  def buckets(self) -> list[int]:
    return self.decoder.prefill_sizes

  @property
  def max_prompt_tokens(self) -> int:
    return self.decoder.max_prompt_tokens

  @property
  def max_tokens(self) -> int:
    return self.decoder.max_new_tokens

  @property
  def batches_run(self) -> int:
    """Engine program calls (prefills and decode chunks)."""
    return self.chunks_run + self.prefills_run

  @property
  def shapes_run(self) -> set:
    return self.decoder.shapes_run

  def validate(self, request: GenerationRequest) -> None:
    """Raise ValueError naming what is wrong with `request` (nothing if it can run)."""
    self.decoder.validate(request)

  def submit_stream(self, request: GenerationRequest) -> TokenStream:
    """Queue `request` and return its token stream; raises ValueError (bad request),
    QueueFullError, SchedulerClosedError."""
    return self._enqueue(request)

  def hold(self):
    """A context in which the worker pauses at its next chunk boundary (admits and decodes
    nothing); requests submitted inside it are admitted together when it ends (warm-up compiles
    each prefill size this way)."""
    return self._cond

  # -- the worker
  def _loop(self) -> None:
    while True:
      with self._cond:
        while not self._queue and not self._live and not self._closed:
          self._cond.wait()
        if self._closed and not self._live:
          return
      self._release_cancelled()
      with self._cond:
        free = [s for s in range(self.decoder.slots) if s not in self._live]
        admit = []
        while self._queue and len(admit) < len(free):
          stream = self._queue.popleft()[1]
          if stream.future.set_running_or_notify_cancel():
            admit.append(stream)
      if admit:
        self._admit(admit, free)
      if self._live:
        self._decode()

  def _release_cancelled(self) -> None:
    """Free the slots of cancelled requests; their results end with what they produced."""
    now = time.perf_counter()
    for slot, live in list(self._live.items()):
      if live.stream.cancelled:
        self.decoder.release(slot)
        del self._live[slot]
        self._finish(live, "cancelled", now)

  def _finish(self, live: "_Live", reason: str, now: float) -> None:
    stream = live.stream
    stream.end(GenerationResult(live.tokens, live.logprobs, reason, stream.submitted_at,
                                live.started_at, now, live.batch_size, self.decoder.slots,
                                live.first_token_at, stream.token_times()))

  def _fail_all(self, error: BaseException) -> None:
    """An engine failure: the requests in slots get it, the decoder starts empty."""
    for live in self._live.values():
      live.stream.end(error=error)
    self._live.clear()
    self.decoder.reset()

  def _admit(self, streams: list, free: list) -> None:
    groups: dict = {}  # prompt bucket -> streams, in arrival order
    for stream in streams:
      groups.setdefault(self.decoder.bucket(stream.request), []).append(stream)
    for group in groups.values():
      slots, free = free[:len(group)], free[len(group):]
      started = time.perf_counter()
      try:
        toks, lps, done = self.decoder.prefill([s.request for s in group], slots)
      except Exception as e:  # noqa: BLE001 - the error belongs to these requests
        for s in group:
          s.end(error=e)
        self._fail_all(e)
        return
      now = time.perf_counter()
      self.prefills_run += 1
      busy = len(self._live) + len(group)
      for stream, slot, tok, lp, d in zip(group, slots, toks, lps, done):
        live = _Live(stream, started, busy)
        self._live[slot] = live
        self._emit(slot, [(int(tok), float(lp))], bool(d), now)

  def _decode(self) -> None:
    try:
      toks, lps, emitted, done = self.decoder.decode()
    except Exception as e:  # noqa: BLE001
      self._fail_all(e)
      return
    now = time.perf_counter()
    self.chunks_run += 1
    for slot in list(self._live):
      new = [(int(t), float(l)) for t, l, e in zip(toks[slot], lps[slot], emitted[slot]) if e]
      self._emit(slot, new, bool(done[slot]), now)

  def _emit(self, slot: int, new: list, done: bool, now: float) -> None:
    """Stream `new` tokens of the request in `slot` (not a final stop token) and finish it when
    `done`."""
    live = self._live[slot]
    req = live.stream.request
    reason = "length"
    if done and new and new[-1][0] in req.stop_tokens:
      new, reason = new[:-1], "stop"
    if new:
      if live.first_token_at is None:
        live.first_token_at = now
      live.tokens += [t for t, _ in new]
      live.logprobs += [l for _, l in new]
      live.stream.push(new, now)
    if not done:
      return
    del self._live[slot]
    self._finish(live, reason, now)


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
