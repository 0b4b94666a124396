"""Step-level (slot) decoding: a fixed set of sequence slots sharing one persistent KV cache, so
requests join and leave a running batch between short decode chunks.

`SlotDecoder` holds `S` slots (a batch bucket) and one KV cache `[S, max_len]` (bf16 or FP4/FP8
per the engine's policy), plus per-slot state: the last sampled token and where it goes (cache
write position, position id, decode step), done flag, token budget, PRNG key, sampling settings
(`RowSampling`) and stop tokens. Two jitted programs, both donating the state:

- `prefill(requests, slots)`: prefill k requests of one prompt bucket (left-padded as the
  engine pads them; k padded to one of `prefill_sizes`), sample each one's first token, and
  write their cache rows and state into free slots. The first tokens come back at once.
- `decode()`: up to `chunk` decode steps for every live slot (a `lax.while_loop` that stops
  early when all slots are done); returns the new tokens, logprobs and which were emitted.

A request decoded in a slot produces the tokens of `RolloutEngine.generate` for the same prompt,
seed and sampling, whatever else is in the slots: the same weights (`engine.params`) and
quantization context, the same prompt padding (its own prompt bucket at cache slots `0 .. p-1`),
the same per-sequence key (`engine.sequence_keys`, step keys `fold_in(key, step)`), the same
sampling rule (`sampling.sample`, settings per row) and the same stop rule. Rows only differ in
their cache write position, which `models.apply` takes per row (`cache_index` `[S]`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import models as M
from trace_jax.models import kv_cache as kvc
from trace_jax.rollout.engine import RolloutEngine, sequence_keys, step_keys
from trace_jax.rollout.sampling import RowSampling, SamplingParams, sample


@dataclasses.dataclass(frozen=True)
class SlotState:
  """Everything the device keeps per slot (leaves `[S, ...]`)."""

  cache: kvc.KVCache  # [S, max_len]
  token: jax.Array  # int32: the last sampled token, fed at the next decode step
  write: jax.Array  # int32: the cache slot `token` is written to
  position: jax.Array  # int32: its position id
  step: jax.Array  # int32: index of the next token to sample (tokens generated so far)
  keys: jax.Array  # PRNG keys, one per sequence
  max_new: jax.Array  # int32: token budget
  done: jax.Array  # bool: finished or free
  sampling: RowSampling
  stop: jax.Array  # int32 [S, max_stops], -1 pads


jax.tree_util.register_dataclass(
    SlotState, data_fields=["cache", "token", "write", "position", "step", "keys", "max_new",
                            "done", "sampling", "stop"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class SlotRequest:
  """One sequence to decode: prompt ids, token budget, sampling, seed, stop tokens."""

  prompt: tuple[int, ...]
  max_tokens: int
  sampling: SamplingParams = SamplingParams(temperature=0.0)
  seed: int = 0
  stop_tokens: tuple[int, ...] = ()


def validate_request(request: SlotRequest, vocab_size: int, max_prompt_tokens: int,
                     max_new_tokens: int) -> None:
  """Raise ValueError naming what is wrong with `request` under these limits."""
  n = len(request.prompt)
  if n == 0:
    raise ValueError("the prompt is empty")
  if n > max_prompt_tokens:
    raise ValueError(f"the prompt has {n} tokens, more than the limit of {max_prompt_tokens}")
  if not 1 <= request.max_tokens <= max_new_tokens:
    raise ValueError(f"max_tokens must be in [1, {max_new_tokens}], got {request.max_tokens}")
  bad = [t for t in request.prompt if not 0 <= t < vocab_size]
  if bad:
    raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")


def _is_stop(tok, stop):
  return jnp.any(tok[:, None] == stop, axis=1)


def empty_state(config: M.ModelConfig, slots: int, max_len: int, kv_format,
                max_stops: int) -> SlotState:
  """All slots free (done)."""
  zeros = jnp.zeros((slots,), jnp.int32)
  keys = jax.random.split(jax.random.key(0), slots)
  return SlotState(M.init_cache(config, slots, kvc.padded_length(max_len), kv_format), zeros,
                   zeros, zeros, zeros, keys, zeros, jnp.ones((slots,), bool),
                   RowSampling(jnp.zeros((slots,), jnp.float32), zeros,
                               jnp.ones((slots,), jnp.float32)),
                   jnp.full((slots, max_stops), -1, jnp.int32))


def prefill_program(params, state: SlotState, tokens, mask, slots, keys, max_new,
                    sampling: RowSampling, stop, *, config, ctx, kv_format):
  """Prefill k left-padded prompts `[k, p]`, sample their first tokens and put them in `slots`
  (`[k]`; an index >= S drops a padding row). Returns (state, tokens, logprobs, done) `[k]`."""
  k, p = tokens.shape
  cache = M.init_cache(config, k, state.cache.max_len, kv_format)
  pre = M.apply(params, tokens, config, ctx, positions=M.default_positions(tokens, mask),
                token_mask=mask, cache=cache, cache_index=0, last_logits_only=True)
  tok, lp = sample(pre.logits[:, -1], step_keys(keys, 0), sampling)
  done = _is_stop(tok, stop) | (max_new <= 1)
  rows = SlotState(pre.cache, tok, jnp.full((k,), p, jnp.int32),
                   jnp.sum(mask, axis=1).astype(jnp.int32), jnp.ones((k,), jnp.int32), keys,
                   max_new, done, sampling, stop)
  return kvc.put_rows(state, rows, slots), tok, lp, done


def decode_program(params, state: SlotState, *, config, ctx, chunk: int):
  """Up to `chunk` decode steps of every live slot. Returns (state, tokens, logprobs, emitted)
  with `[S, chunk]` arrays (`emitted`: the slot was live and sampled that token)."""
  s = state.token.shape[0]

  def cond(carry):
    i, st = carry[0], carry[1]
    return (i < chunk) & ~jnp.all(st.done)

  def body(carry):
    i, st, toks, lps, emitted = carry
    live = ~st.done
    out = M.apply(params, st.token[:, None], config, ctx, positions=st.position[:, None],
                  token_mask=live[:, None], cache=st.cache, cache_index=st.write)
    tok, lp = sample(out.logits[:, -1], step_keys(st.keys, st.step), st.sampling)
    done = st.done | (live & (_is_stop(tok, st.stop) | (st.step + 1 >= st.max_new)))
    adv = live.astype(jnp.int32)
    st = dataclasses.replace(st, cache=out.cache, token=jnp.where(live, tok, st.token),
                             write=st.write + adv, position=st.position + adv,
                             step=st.step + adv, done=done)
    toks = toks.at[:, i].set(jnp.where(live, tok, 0))
    lps = lps.at[:, i].set(jnp.where(live, lp, 0.0))
    return i + 1, st, toks, lps, emitted.at[:, i].set(live)

  carry = (jnp.int32(0), state, jnp.zeros((s, chunk), jnp.int32),
           jnp.zeros((s, chunk), jnp.float32), jnp.zeros((s, chunk), bool))
  _, state, toks, lps, emitted = jax.lax.while_loop(cond, body, carry)
  return state, toks, lps, emitted


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


_PROGRAMS: dict = {}


class SlotDecoder:
  """`slots` sequences decoding together over `engine`'s synced weights (see module docstring).

    dec = SlotDecoder(engine, slots=8, chunk=8)
    firsts = dec.prefill([SlotRequest(prompt, 16)], [0])   # (token, logprob, done) per request
    toks, lps, emitted, done = dec.decode()                # [S, chunk], ..., done [S]

  max_prompt_tokens: the longest prompt accepted (default: the engine's prompt bucket); the cache
  holds its bucket plus the engine's `max_new_tokens`. The host keeps the slots' occupancy: a
  slot is free again once `done` says so.
  """

  def __init__(self, engine: RolloutEngine, *, slots: int = 8, chunk: int = 8,
               max_prompt_tokens: int | None = None, max_stops: int = 4,
               prefill_sizes: Sequence[int] = ()):
    if engine.params is None:
      raise ValueError("SlotDecoder needs a synced engine (call engine.sync(params) first)")
    if engine.mesh is not None:
      raise ValueError("SlotDecoder runs on one device; this engine has a mesh")
    if slots < 1 or chunk < 1 or max_stops < 1:
      raise ValueError(f"slots, chunk and max_stops must be >= 1, got {slots}, {chunk}, "
                       f"{max_stops}")
    self.engine = engine
    self.config = engine.config
    self.slots = int(slots)
    self.chunk = int(chunk)
    self.max_stops = int(max_stops)
    self.max_prompt_tokens = int(max_prompt_tokens or engine.prompt_bucket)
    self.max_new_tokens = engine.max_new_tokens
    self.max_len = engine.bucket_length(self.max_prompt_tokens) + self.max_new_tokens
    if self.max_len > self.config.max_seq_len:
      raise ValueError(f"prompt bucket {self.max_len - self.max_new_tokens} + max_new_tokens "
                       f"{self.max_new_tokens} exceeds the model's max_seq_len "
                       f"{self.config.max_seq_len}")
    # The engine's weights and quantization; guidance/codes/routes are RL records, not served.
    self.ctx = dataclasses.replace(engine.ctx, record_guidance=False, record_codes=False)
    # Padded prefill batch sizes (fewer sizes, fewer compiles); the largest takes all slots.
    self.prefill_sizes = batch_buckets(self.slots, prefill_sizes)
    self.shapes_run: set = set()
    self.reset()

  def reset(self) -> None:
    """All slots free, the cache empty (also after a failed program left the donated state
    unusable)."""
    # Built by one program: every leaf its own buffer (the state is donated as a whole).
    self.state = jax.jit(empty_state, static_argnums=(0, 1, 2, 3, 4))(
        self.config, self.slots, self.max_len, self.engine.policy.kv_format, self.max_stops)

  def _program(self, kind: str, *key):
    full = (kind, self.config, self.ctx, self.engine.policy.kv_format) + key
    if full not in _PROGRAMS:
      if kind == "prefill":
        fn = functools.partial(prefill_program, config=self.config, ctx=self.ctx,
                               kv_format=self.engine.policy.kv_format)
      else:
        fn = functools.partial(decode_program, config=self.config, ctx=self.ctx, chunk=key[0])
      _PROGRAMS[full] = jax.jit(fn, donate_argnums=(1,))
    return _PROGRAMS[full]

  def validate(self, request: SlotRequest) -> None:
    """Raise ValueError naming what is wrong with `request` (nothing if it can run)."""
    validate_request(request, self.config.vocab_size, self.max_prompt_tokens,
                     self.max_new_tokens)
    if len(request.stop_tokens) > self.max_stops:
      raise ValueError(f"at most {self.max_stops} stop tokens, got {len(request.stop_tokens)}")

  def bucket(self, request: SlotRequest) -> int:
    """The prompt bucket `request` is prefilled at (requests prefill together only within one)."""
    return self.engine.bucket_length(len(request.prompt))

  def prefill(self, requests: Sequence[SlotRequest], slots: Sequence[int]):
    """Start `requests` (one prompt bucket) in the free `slots`. Returns numpy (tokens,
    logprobs, done) `[k]`: each request's first token, and whether it already finished."""
    if not requests or len(requests) != len(slots):
      raise ValueError(f"prefill needs one slot per request, got {len(requests)} requests and "
                       f"{len(slots)} slots")
    for r in requests:
      self.validate(r)
    buckets = {self.bucket(r) for r in requests}
    if len(buckets) != 1:
      raise ValueError(f"requests of one prefill must share a prompt bucket, got {buckets}")
    if any(not 0 <= s < self.slots for s in slots) or len(set(slots)) != len(slots):
      raise ValueError(f"slots {list(slots)} must be distinct and in [0, {self.slots})")
    p = buckets.pop()
    k = len(requests)
    kb = next(b for b in self.prefill_sizes if b >= k)
    tokens = np.zeros((kb, p), np.int32)
    mask = np.zeros((kb, p), bool)
    mask[k:, -1] = True  # padding rows: one token, dropped at the insert
    stop = np.full((kb, self.max_stops), -1, np.int32)
    max_new = np.ones((kb,), np.int32)
    for i, r in enumerate(requests):
      tokens[i, p - len(r.prompt):] = r.prompt
      mask[i, p - len(r.prompt):] = True
      stop[i, :len(r.stop_tokens)] = r.stop_tokens
      max_new[i] = r.max_tokens
    samp = RowSampling.of([r.sampling for r in requests]
                          + [SamplingParams(temperature=0.0)] * (kb - k))
    keys = jnp.concatenate([sequence_keys(r.seed, [r.prompt]) for r in requests]
                           + [sequence_keys(0, [[0]])] * (kb - k))
    index = np.asarray(list(slots) + [self.slots] * (kb - k), np.int32)
    self.shapes_run.add(("prefill", kb, p))
    self.state, tok, lp, done = self._program("prefill")(
        self.engine.params, self.state, tokens, mask, index, keys, max_new, samp, stop)
    tok, lp, done = jax.device_get((tok, lp, done))
    return tok[:k], lp[:k], done[:k]

  def release(self, slot: int) -> None:
    """Stop decoding `slot` (its request was cancelled): it is free from the next chunk on."""
    self.state = dataclasses.replace(self.state, done=self.state.done.at[slot].set(True))

  def decode(self):
    """One chunk of decode steps. Returns numpy (tokens, logprobs, emitted) `[S, chunk]` and
    done `[S]`."""
    self.shapes_run.add(("decode", self.slots, self.chunk))
    self.state, tok, lp, emitted = self._program("decode", self.chunk)(
        self.engine.params, self.state)
    return jax.device_get((tok, lp, emitted, self.state.done))
