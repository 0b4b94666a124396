"""The rollout engine: batched prefill + on-device decode loop that records what RL needs.

One jitted program per (prompt bucket, batch, samples per prompt, max new tokens, sampling)
(or, with `decode_chunk`, a prefill program and a decode-window program that the host calls until
every row is done, moving each window's guidance to host memory):
the prompt batch is prefilled once into a KV cache (bf16 or FP4/FP8 per the policy), the cache
is repeated for the `n` samples of each prompt (GRPO groups share the prefill), and a
`lax.while_loop` decodes until every sequence has stopped or reached its own limit. Per
generated token it records the logprob under the temperature-scaled full softmax, and over the
whole sequence the experts chosen in every MoE layer (for routing replay) and, at the policy's
guided layers, the TRACE guidance of every quantized activation site and of K/V.

Prompts are left-padded to a bucket length, so all sequences write the same cache slot each
step; `token_mask` keeps padding out of attention. Each sequence samples with its own key,
derived from the prompt's content, so a sequence's tokens do not depend on its batch-mates.

It also owns memory planning, the rule `generate` enforces (`CapacityError`): how many sequences
fit in device memory next to the weights and, for the chunked engine, whose guidance goes to host
memory, in host memory too (`capacity_limits`, `plan_capacity`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import mmap
import os
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import parallel
from trace_jax import quant as tq
from trace_jax.kernels import dispatch as kernel_dispatch
from trace_jax.settings import choice_setting, int_setting
from trace_jax.models import kv_cache as kvc
from trace_jax.rollout.sampling import SamplingParams, sample


@dataclasses.dataclass(frozen=True)
class Rollout:
  """A batch of generated sequences (rows `i * n + j`: sample j of prompt i)."""

  tokens: jax.Array  # [R, P + N] left-padded prompt then completion (pad 0 after stopping)
  token_mask: jax.Array  # [R, P + N] real tokens
  positions: jax.Array  # [R, P + N]
  completion_mask: jax.Array  # [R, N] generated tokens up to and including the stop token
  logprobs: jax.Array  # [R, N] under the temperature-scaled full softmax (0 where masked)
  routes: jax.Array | None  # [L_moe, R, P + N, k]
  guidance: dict  # {layer: {site: Guidance [R, P + N, ...]}}
  prompt_len: int = dataclasses.field(metadata=dict(static=True))

  @property
  def num_rows(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def completion(self) -> jax.Array:
    return self.tokens[:, self.prompt_len:]

  def guidance_bytes(self) -> int:
    return tree_bytes(self.guidance)

  def guidance_bytes_per_token(self) -> float:
    return self.guidance_bytes() / max(int(np.prod(self.tokens.shape)), 1)


jax.tree_util.register_dataclass(
    Rollout, data_fields=["tokens", "token_mask", "positions", "completion_mask", "logprobs",
                          "routes", "guidance"], meta_fields=["prompt_len"])


class CapacityError(ValueError):
  """A batch that would not fit in device memory, or whose guidance would not fit in host
  memory (the chunked engine)."""


# --------------------------------------------------------------------------- the program

def _repeat_rows(tree, n: int):
  """Repeat every batch-first leaf n times along the batch (QArray/Guidance shapes follow)."""
  if n == 1:
    return tree

  def rep(x):
    if isinstance(x, (tq.QArray, tq.Guidance)):
      return tq.map_blocked(x, lambda a: jnp.repeat(a, n, axis=0),
                            (x.shape[0] * n,) + tuple(x.shape[1:]))
    return jnp.repeat(x, n, axis=0)

  return jax.tree_util.tree_map(rep, tree,
                                is_leaf=lambda x: isinstance(x, (tq.QArray, tq.Guidance)))


def _zeros_resized(tree, axis, size, zeros=jnp.zeros):
  """Zeros shaped like `tree` (arrays, QArrays, Guidance: values or abstract shapes; None stays
  None) with `size` along `axis` (or sizes along axes: tuples): decode-step buffers (time, axis
  1), a whole batch's prefill buffers (rows), the chunked engine's host arrays
  (`zeros=host_zeros`)."""
  sizes = dict(zip(axis, size)) if isinstance(axis, tuple) else {axis: size}

  def resized(shape):
    return tuple(sizes.get(i, d) for i, d in enumerate(shape))

  def grow(x):
    if isinstance(x, (tq.QArray, tq.Guidance)):
      return tq.map_blocked(x, lambda a: zeros(resized(a.shape), a.dtype), resized(x.shape))
    return zeros(resized(x.shape), x.dtype)

  return jax.tree_util.tree_map(grow, tree,
                                is_leaf=lambda x: isinstance(x, (tq.QArray, tq.Guidance)))


def _to_bytes(x: jax.Array) -> jax.Array:
  """`[R, ...]` of any dtype -> its bytes `[R, n]` uint8 (bool as 0/1)."""
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  elif x.dtype != jnp.uint8:  # wider dtypes gain a trailing axis of their bytes
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(x.shape[0], -1)


def _from_bytes(b: jax.Array, shape, dtype) -> jax.Array:
  """Inverse of `_to_bytes` on a time window: b `[R, L, n]` uint8 -> `[R, L, *shape]` dtype."""
  dtype = jnp.dtype(dtype)
  lead = b.shape[:2]
  if dtype == jnp.bool_:
    return b.reshape(*lead, *shape) != 0
  if dtype.itemsize == 1:
    b = b.reshape(*lead, *shape)
    return b if dtype == jnp.uint8 else jax.lax.bitcast_convert_type(b, dtype)
  return jax.lax.bitcast_convert_type(b.reshape(*lead, *shape, dtype.itemsize), dtype)


# A decode step writes its window buffers as one byte row per sequence: every leaf (tokens,
# logprobs, validity, routes, each guidance and code array of every guided layer) goes into a
# single `[R, L, bytes]` buffer with one dynamic-update-slice per step, unpacked to `[R, L, ...]`
# leaves after the loop. One write instead of one per leaf: at 4 layers of the 30B-A3B shape
# the per-leaf writes were 28 small kernels per step, and the 4-layer decode step took
# 1.27-1.29 ms with them against 1.24 ms packed (H200, B=64, 2026-11-30).

def _leaf_bytes(leaf) -> int:
  """Bytes per row and step of a window leaf `[R, L, ...]`."""
  return int(np.prod(leaf.shape[2:], dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize


def _pack_step(step_tree) -> jax.Array:
  """One step's tree (leaves `[R, 1, ...]`, in the window's leaf order) -> `[R, 1, bytes]`."""
  rows = [_to_bytes(x) for x in jax.tree_util.tree_leaves(step_tree)]
  return jnp.concatenate(rows, axis=1)[:, None, :]


def _unpack_window(buf: jax.Array, window):
  """`buf [R, L, bytes]` -> a tree shaped like `window` (its leaves `[R, L, ...]`)."""
  leaves, treedef = jax.tree_util.tree_flatten(window)
  out, off = [], 0
  for leaf in leaves:
    size = _leaf_bytes(leaf)
    out.append(_from_bytes(buf[:, :, off:off + size], leaf.shape[2:], leaf.dtype))
    off += size
  return jax.tree_util.tree_unflatten(treedef, out)


def _prefill(params, prompt_tokens, prompt_mask, *, config: M.ModelConfig, ctx: M.QuantContext,
             n: int, steps: int, kv_format: str | None, pass_rows: int | None = None):
  """Prefill the prompt batch into a cache with room for `steps` more tokens. Returns the
  prefill's output (records and routes of the b prompts), the prompt positions, each of the b * n
  rows' prompt length, and their decode carry (GRPO groups share the prefill: cache and
  next-token logits repeated n times).

  pass_rows < b: the prompts go through the model `pass_rows` rows at a time (`_prefill_passes`),
  so the forward's transients (activations, expert intermediates) scale with a pass, not with
  the batch: what lets a batch planned for the decode's memory be prefilled at all."""
  b, p = prompt_tokens.shape
  cache = M.init_cache(config, b, kvc.padded_length(p + steps), kv_format)
  positions = M.default_positions(prompt_tokens, prompt_mask)
  forward = functools.partial(M.apply, config=config, ctx=ctx, cache_index=0,
                              last_logits_only=True)
  if pass_rows is None or pass_rows >= b:
    pre = forward(params, prompt_tokens, positions=positions, token_mask=prompt_mask,
                  cache=cache)
  else:
    # a pass's cache holds its prompts only, written into the first slots of the whole cache
    pass_cache = M.init_cache(config, pass_rows, kvc.padded_length(p), kv_format)
    pre = _prefill_passes(forward, params, prompt_tokens, prompt_mask, positions, cache,
                          pass_cache)
  carry = dict(s=jnp.int32(0), done=jnp.zeros((b * n,), bool), cache=_repeat_rows(pre.cache, n),
               logits=jnp.repeat(pre.logits[:, -1], n, axis=0))
  prompt_len = jnp.repeat(jnp.sum(prompt_mask, axis=1).astype(jnp.int32), n)
  return pre, positions, prompt_len, carry


def _prefill_passes(forward, params, tokens, mask, positions, cache, pass_cache):
  """The prefill of b prompts in ceil(b / rows) passes of `rows` prompts (`pass_cache`: rows x
  the prompt's slots), each written into the whole batch's cache (its first slots), records,
  routes and logits in place (a loop carry). The last pass starts
  at b - rows, so it may redo rows of the one before: every row's results depend on that row
  alone (causal attention within a row, per-token routing), so a redone row is rewritten with
  its own cache, records and routes together, never mixed."""
  b, rows = tokens.shape[0], pass_cache.valid.shape[0]
  rows_of = lambda a, start: jax.lax.dynamic_slice_in_dim(a, start, rows, 0)  # noqa: E731
  put = functools.partial(kvc.update_slice, axis=0)  # rows of a pass into the whole batch's

  def one_pass(start):
    return forward(params, rows_of(tokens, start), positions=rows_of(positions, start),
                   token_mask=rows_of(mask, start), cache=pass_cache)

  # the whole batch's buffers, shaped from a pass traced abstractly (one traced forward: the
  # loop body's, so the program compiles the model once)
  shape = jax.eval_shape(one_pass, 0)
  state = (cache, _zeros_resized(shape.records, 0, b),
           _zeros_resized(shape.routes, 1, b),  # [L_moe, B, T, k]: batch second (or None)
           _zeros_resized(shape.logits, 0, b))

  def body(i, state):
    start = jnp.minimum(i * rows, b - rows)
    out = one_pass(start)
    c, rec, routes, logits = state
    return (put(c, out.cache, start), put(rec, out.records, start),
            kvc.update_slice(routes, out.routes, start, axis=1), put(logits, out.logits, start))

  c, rec, routes, logits = jax.lax.fori_loop(0, -(-b // rows), body, state)
  rest = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                (shape.aux_loss, shape.z_loss, shape.dropped_pairs))
  return M.ModelOutput(logits, c, routes, rec, *rest)


def _decode(params, carry, prompt_len, seq_keys, max_new, stop_ids, limit=None, *,
            config: M.ModelConfig, ctx: M.QuantContext, p: int, steps: int, length: int,
            sampling: SamplingParams, record_routes: bool):
  """Decode steps `carry["s"]` .. `carry["s"] + limit - 1` (limit: a traced step count, at most
  `length`, default `length`; never past `steps`), stopping early once every row is done.
  Returns the new carry and that window's buffers (`[R, length]` per step: tokens, logprobs,
  valid, routes, records; zeros past the last step run)."""
  r = prompt_len.shape[0]
  start = carry["s"]

  def feed(cache, token, s):
    return M.apply(params, token[:, None], config, ctx, positions=(prompt_len + s)[:, None],
                   token_mask=jnp.ones((r, 1), bool), cache=cache, cache_index=p + s)

  # Buffers shaped like one decode step's outputs. eval_shape, not a real first step before the
  # loop: that would put a second copy of the whole decode step in the program and make it
  # compile about a third longer.
  step0 = jax.eval_shape(feed, carry["cache"], jnp.zeros((r,), jnp.int32), 0)
  with_routes = record_routes and step0.routes is not None

  def step_tree(tok, lp, live, out):  # every leaf [R, 1, ...]; routes batch-first here
    return dict(tokens=tok[:, None], logp=lp[:, None], valid=live[:, None], records=out.records,
                routes=jnp.transpose(out.routes, (1, 2, 0, 3)) if with_routes else None)

  window = jax.eval_shape(lambda: dict(  # the unpacked buffers' tree (static shapes)
      tokens=jnp.zeros((r, length), jnp.int32), logp=jnp.zeros((r, length), jnp.float32),
      valid=jnp.zeros((r, length), bool), records=_zeros_resized(step0.records, 1, length),
      routes=(jnp.zeros((r, length) + step0.routes.shape[:1] + step0.routes.shape[3:],
                        jnp.int32) if with_routes else None)))
  packed = jnp.zeros((r, length, sum(map(_leaf_bytes, jax.tree_util.tree_leaves(window)))),
                     jnp.uint8)
  run = length if limit is None else jnp.minimum(limit, length)
  stop_at = jnp.minimum(start + run, steps)

  def cond(state):
    carry, _ = state
    return (carry["s"] < stop_at) & ~jnp.all(carry["done"])

  def body(state):
    carry, packed = state
    s, done = carry["s"], carry["done"]
    tok, lp = sample(carry["logits"], step_keys(seq_keys, s), sampling)
    tok = jnp.where(done, 0, tok)
    out = feed(carry["cache"], tok, s)
    live = ~done
    row = _pack_step(step_tree(tok, jnp.where(live, lp, 0.0), live, out))
    packed = jax.lax.dynamic_update_slice_in_dim(packed, row, s - start, axis=1)
    done = done | jnp.isin(tok, stop_ids) | (s + 1 >= max_new)
    return dict(s=s + 1, done=done, cache=out.cache, logits=out.logits[:, -1]), packed

  carry, packed = jax.lax.while_loop(cond, body, (carry, packed))
  bufs = _unpack_window(packed, window)
  if with_routes:  # [R, L, L_moe, k] -> [L_moe, R, L, k]
    bufs["routes"] = jnp.transpose(bufs["routes"], (2, 0, 1, 3))
  return carry, bufs


def _assemble(prompt_tokens, prompt_mask, positions, prompt_len, pre_routes, pre_records, bufs,
              n: int, steps: int, guidance=None) -> Rollout:
  """The Rollout of prompt + generated steps. guidance: the whole rollout's records when the
  caller built them (the chunked engine, in host memory), else joined here from the prompt's
  (`pre_records`) and the decode steps' (`bufs["records"]`)."""
  valid = bufs["valid"]
  tokens = jnp.concatenate([jnp.repeat(prompt_tokens, n, axis=0),
                            jnp.where(valid, bufs["tokens"], 0)], axis=1)
  token_mask = jnp.concatenate([jnp.repeat(prompt_mask, n, axis=0), valid], axis=1)
  gen_pos = prompt_len[:, None] + jnp.arange(steps)[None]
  positions = jnp.concatenate([jnp.repeat(positions, n, axis=0), gen_pos], axis=1)
  routes = None
  if bufs["routes"] is not None:
    routes = jnp.concatenate([jnp.repeat(pre_routes, n, axis=1), bufs["routes"]], axis=2)
  if guidance is None:
    pre_rec = _repeat_rows(pre_records, n)
    guidance = {layer: {site: tq.concatenate([pre_rec[layer][site], g], axis=1)
                        for site, g in sites.items()}
                for layer, sites in bufs["records"].items()}
  return Rollout(tokens, token_mask, positions, valid, bufs["logp"], routes, guidance,
                 int(prompt_tokens.shape[1]))


def generate_program(params, prompt_tokens, prompt_mask, seq_keys, max_new, stop_ids, *,
                     config: M.ModelConfig, ctx: M.QuantContext, n: int, steps: int,
                     sampling: SamplingParams, kv_format: str | None, record_routes: bool,
                     pass_rows: int | None = None):
  """The whole rollout as one pure function (jitted by the engine)."""
  pre, positions, prompt_len, carry = _prefill(params, prompt_tokens, prompt_mask, config=config,
                                               ctx=ctx, n=n, steps=steps, kv_format=kv_format,
                                               pass_rows=pass_rows)
  _, bufs = _decode(params, carry, prompt_len, seq_keys, max_new, stop_ids, config=config,
                    ctx=ctx, p=prompt_tokens.shape[1], steps=steps, length=steps,
                    sampling=sampling, record_routes=record_routes)
  return _assemble(prompt_tokens, prompt_mask, positions, prompt_len, pre.routes, pre.records,
                   bufs, n, steps)


def prefill_program(params, prompt_tokens, prompt_mask, *, config, ctx, n, steps, kv_format,
                    pass_rows=None):
  """The chunked engine's first program: the prefill and the decode carry."""
  pre, positions, prompt_len, carry = _prefill(params, prompt_tokens, prompt_mask, config=config,
                                               ctx=ctx, n=n, steps=steps, kv_format=kv_format,
                                               pass_rows=pass_rows)
  return pre.records, pre.routes, positions, prompt_len, carry


# --------------------------------------------------------------------------- memory planning

def _memory_stat(device, key: str) -> int | None:
  """One figure of `device`'s allocator statistics (None where the backend keeps none)."""
  try:
    stats = (device or jax.devices()[0]).memory_stats()
  except Exception:  # noqa: BLE001 - backends without memory stats
    return None
  return int(stats[key]) if stats and key in stats else None


def device_memory_bytes(device=None) -> int:
  """Usable memory of `device` (GPU: the allocator's limit; CPU: physical RAM)."""
  limit = _memory_stat(device, "bytes_limit")
  return limit if limit is not None else int(os.sysconf("SC_PHYS_PAGES")
                                             * os.sysconf("SC_PAGE_SIZE"))


def device_bytes_in_use(device=None) -> int | None:
  """Bytes the allocator holds on `device` now (None where the backend keeps no such count,
  as on CPU)."""
  return _memory_stat(device, "bytes_in_use")


def _read_ints(path: str) -> dict[str, int]:
  """`key value` lines (memory.stat) as ints; {} where the file cannot be read."""
  try:
    with open(path) as f:
      return {k: int(v) for k, v, *_ in (line.split() for line in f) if v.isdigit()}
  except (OSError, ValueError):
    return {}


def _read_int(path: str) -> int | None:
  try:
    with open(path) as f:
      text = f.read().strip()
    return None if text == "max" else int(text)
  except (OSError, ValueError):
    return None


def host_memory_bytes(proc: str = "/proc", cgroup: str = "/sys/fs/cgroup") -> int:
  """Host memory a rollout may still take: MemAvailable from /proc/meminfo, capped by the
  container's cgroup limit less what the cgroup holds that the kernel would not reclaim
  (its usage less inactive file pages: reading a 60 GB checkpoint leaves that much page cache
  charged to the cgroup, which the kernel drops before it kills anything); physical RAM where
  none of these can be read. Available rather than physical memory because the per-sequence
  figure counts only the rollout's guidance: what the process already holds (the runtime,
  compiled programs, a previous rollout the caller still keeps) and what other processes hold
  is not free for it. cgroup v2 (`memory.max`, `memory.current`, `memory.stat` inactive_file)
  or v1 (`memory/memory.limit_in_bytes`, `memory.usage_in_bytes`, total_inactive_file)."""
  avail = _read_ints(os.path.join(proc, "meminfo")).get("MemAvailable:")
  avail = None if avail is None else avail * 1024  # kB
  for limit_f, usage_f, stat_f, inactive in (
      ("memory.max", "memory.current", "memory.stat", "inactive_file"),
      ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
       "total_inactive_file")):
    limit, usage = (_read_int(os.path.join(cgroup, f)) for f in (limit_f, usage_f))
    if limit is None or usage is None or limit >= 2**60:  # no limit (v1 writes a huge number)
      continue
    held = usage - _read_ints(os.path.join(cgroup, stat_f)).get(inactive, 0)
    left = max(limit - held, 0)
    avail = left if avail is None else min(avail, left)
    break
  if avail is None:
    avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  return int(avail)


def _guidance_rows(config: M.ModelConfig, layer: int):
  """(site, rows per token, row length) of every site of `layer` that can record guidance, as
  the forward quantizes it (blocks along the row; one second-level scale per row)."""
  c = config
  rows = [("attn/in", 1, c.hidden_size), ("attn/o_in", 1, c.num_heads * c.head_dim),
          ("kv/k", c.num_kv_heads, c.head_dim), ("kv/v", c.num_kv_heads, c.head_dim)]
  if c.is_moe_layer(layer):
    rows += [("experts/in", 1, c.hidden_size),  # once per token, before dispatch
             ("experts/down_in", c.num_experts_per_tok, c.moe_ffn_size)]
    if c.shared_ffn_size:
      rows += [("shared/in", 1, c.hidden_size), ("shared/down_in", 1, c.shared_ffn_size)]
  else:
    rows += [("mlp/in", 1, c.hidden_size), ("mlp/down_in", 1, c.dense_ffn_size)]
  return rows


def guidance_bytes_per_token(config: M.ModelConfig, policy: tq.QuantPolicy,
                             record_guidance: bool = True) -> float:
  """Bytes of TRACE guidance the rollout records per token (one sequence, all guided layers),
  as it stores it: per quantized row the payload and block scales of its whole blocks
  (`tq.guidance_bits_per_element`) and, for two-level formats (NVFP4), the row's float32
  second-level scale. Only FP4 sites record guidance (an MXFP8 KV cache records none). The one
  rule both device and host planning use."""
  if not (record_guidance and policy.quantizes_anything):
    return 0.0
  total = 0.0
  for layer in range(config.num_layers):
    if not policy.is_guided_layer(layer, config.num_layers):
      continue
    for site, rows, length in _guidance_rows(config, layer):
      fmt = policy.kv if site.startswith("kv/") else policy.activation_format(site)
      if fmt is None or not fmt.is_fp4:
        continue
      padded = -(-length // fmt.block) * fmt.block  # a row shorter than a block fills one
      row = padded * tq.guidance_bits_per_element(fmt, policy.guidance_compact) / 8
      total += rows * (row + (4 if fmt.two_level else 0))
  return total


def bytes_per_sequence(config: M.ModelConfig, policy: tq.QuantPolicy, context_len: int,
                       record_guidance: bool = True, guidance_tokens: int | None = None) -> float:
  """Device bytes one sequence needs at `context_len`: KV cache, guidance, routes, logits.
  guidance_tokens: how many tokens' guidance is on the device at once (default: all of them;
  the chunked engine holds the prompt's and two windows')."""
  kv = M.cache_bytes_per_token(config, policy.kv_format, config.compute_dtype)
  per_token = kv + 4 * config.num_layers * config.num_experts_per_tok  # routes (int32)
  guidance = guidance_bytes_per_token(config, policy, record_guidance)
  # Transient per sequence in a decode step: float32 logits (a few copies), attention scores and
  # probabilities over the context, a few hidden-size buffers.
  transient = (3 * 4 * config.vocab_size + 2 * 4 * config.num_heads * context_len
               + 8 * 4 * config.hidden_size)
  on_device = context_len if guidance_tokens is None else min(guidance_tokens, context_len)
  return per_token * context_len + guidance * on_device + transient


def guidance_tokens_held(prompt_len: int, decode_chunk: int) -> int | None:
  """Tokens whose guidance the engine holds on the device at once: all of them (None) in one
  program; with decode windows, the prompt's and two windows' (one decoding, one being copied
  to host memory)."""
  return max(prompt_len, 0) + 2 * decode_chunk if decode_chunk > 0 else None


def prefill_pass(prefill_tokens: int, prompt_len: int) -> tuple[int, int]:
  """(prompts per prefill pass, cache slots of a pass) for passes of at most `prefill_tokens`
  prompt tokens at prompt bucket `prompt_len` (`_prefill_passes`; at least one prompt)."""
  return max(1, prefill_tokens // max(prompt_len, 1)), kvc.padded_length(prompt_len)


def host_tokens_held(prompt_len: int, max_new: int, decode_chunk: int) -> float:
  """Tokens' guidance the chunked engine holds in host memory per sequence at its peak:
  prompt + max_new + 2 windows.

  Why: the final arrays (`_host_guidance`, prompt + max_new tokens) are allocated once and each
  window's records are copied in as they arrive (`_place_window`), then dropped; beside them at
  most two windows are in host memory (the one being placed, and the next one's asynchronous
  copy). The prompt's records (one row per prompt) are dropped at the first window, when host
  memory holds little else."""
  return prompt_len + max_new + 2 * decode_chunk


def host_bytes_per_sequence(config: M.ModelConfig, policy: tq.QuantPolicy, context_len: int,
                            record_guidance: bool = True,
                            host_tokens: float | None = None) -> float:
  """Host bytes one sequence of the chunked engine needs at `context_len`: its guidance, which
  the engine moves to host memory window by window. host_tokens: tokens' guidance held at the
  peak (`host_tokens_held`; default context_len)."""
  tokens = context_len if host_tokens is None else host_tokens
  return guidance_bytes_per_token(config, policy, record_guidance) * tokens


def planning(prompt_len: int, context_len: int, decode_chunk: int,
             prefill_pass: tuple[int, int] | None = None, host_bytes: int | None = None,
             host_is_device: bool = False) -> dict:
  """`capacity_limits`' keyword arguments for an engine at prompt bucket `prompt_len`: with
  decode windows (decode_chunk > 0), the guidance of the prompt and two windows on the device
  and a whole context's in host memory (`host_bytes`, or the device's own with
  host_is_device); prefill_pass: `prefill_pass`'s figures when a batch may take several. The
  engine and `benchmarks/capacity.py` plan with it."""
  plan = dict(prefill_pass=prefill_pass)
  if decode_chunk <= 0:
    return plan
  return dict(plan, guidance_tokens=guidance_tokens_held(prompt_len, decode_chunk),
              host_tokens=host_tokens_held(prompt_len, context_len - prompt_len, decode_chunk),
              host_bytes=host_bytes, host_is_device=host_is_device)


def capacity_limits(config: M.ModelConfig, policy: tq.QuantPolicy, context_len: int,
                    weight_bytes: int, device_bytes: int | None = None,
                    record_guidance: bool = True, headroom: float = 0.9,
                    guidance_tokens: int | None = None, host_bytes: int | None = None,
                    host_tokens: float | None = None, host_is_device: bool = False,
                    prefill_pass: tuple[int, int] | None = None) -> tuple[int, int | None]:
  """(device-limited, host-limited) counts of sequences of `context_len` tokens, each with
  `headroom` of its memory. The host figure is None unless the engine keeps guidance in host
  memory (the chunked engine: `host_bytes`, or `host_is_device`). host_is_device: the device's
  memory is host RAM (the CPU backend), so the host figure charges device and host bytes per
  sequence to one budget, `device_bytes` less the weights. It counts a sequence's windows twice
  (device buffers that its host copies alias there, at most prompt + two windows of guidance
  against a context's of host arrays): it errs toward fewer sequences.

  prefill_pass: (prompts per prefill pass, prompt slots): a batch larger than one pass is
  prefilled in passes (`_prefill_passes`) whose own cache is held beside the weights."""
  device_bytes = device_memory_bytes() if device_bytes is None else device_bytes
  per = bytes_per_sequence(config, policy, context_len, record_guidance, guidance_tokens)
  per_host = host_bytes_per_sequence(config, policy, context_len, record_guidance, host_tokens)

  def limits(fixed):
    free = headroom * device_bytes - fixed
    on_device = max(int(free // per), 0)
    if host_bytes is None and not host_is_device:
      return on_device, None
    if host_is_device:
      return on_device, max(int(free // (per + per_host)), 0)
    if per_host == 0:  # nothing goes to host memory
      return on_device, None
    return on_device, max(int(headroom * host_bytes // per_host), 0)

  base = limits(weight_bytes)
  if prefill_pass is None or min(n for n in base if n is not None) <= prefill_pass[0]:
    return base  # one prefill pass: it writes the whole batch's cache
  rows, slots = prefill_pass
  reserve = rows * slots * M.cache_bytes_per_token(config, policy.kv_format,
                                                   config.compute_dtype)
  # with the pass's cache held, but never fewer than one pass (which holds none)
  return tuple(None if w is None else max(w, min(rows, b))
               for w, b in zip(limits(weight_bytes + reserve), base))


def plan_capacity(config: M.ModelConfig, policy: tq.QuantPolicy, context_len: int,
                  weight_bytes: int, device_bytes: int | None = None,
                  record_guidance: bool = True, headroom: float = 0.9,
                  guidance_tokens: int | None = None, host_bytes: int | None = None,
                  host_tokens: float | None = None, host_is_device: bool = False,
                  prefill_pass: tuple[int, int] | None = None) -> int:
  """How many sequences of `context_len` tokens fit next to the weights, and with host_bytes
  (or host_is_device) in host memory too: the smaller of `capacity_limits`."""
  limits = capacity_limits(config, policy, context_len, weight_bytes, device_bytes,
                           record_guidance, headroom, guidance_tokens, host_bytes, host_tokens,
                           host_is_device, prefill_pass)
  return min(n for n in limits if n is not None)


def tree_bytes(tree) -> int:
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree))


# --------------------------------------------------------------------------- the engine

def _rollout_weight(w, fmt, dtype):
  """One master leaf's rollout weight: `quantize_weight` to `fmt` (the policy's format for its
  name), anything that is not then a QArray cast to the rollout's compute dtype."""
  q = M.quantize_weight(w, fmt)
  return q if isinstance(q, tq.QArray) else q.astype(dtype)


def _rollout_weights(master, policy, dtype):
  """`_rollout_weight` of every leaf: policy-named weights become QArrays, the rest is cast."""
  return jax.tree_util.tree_map_with_path(
      lambda path, w: _rollout_weight(w, policy.weight_format(M.param_name(path)), dtype),
      master, is_leaf=lambda a: isinstance(a, tq.QArray))


@functools.lru_cache(maxsize=None)
def _rollout_leaf(fmt, dtype):
  """`_rollout_weight` jitted per format (a 48-layer model's leaves take a few distinct shapes,
  so a few compiles)."""
  return jax.jit(functools.partial(_rollout_weight, fmt=fmt, dtype=dtype))


def _on_host(master) -> bool:
  """Whether a master is held in host memory: a dict whose leaves are all numpy arrays (a
  `QArray` among them, already quantized, takes the device path, which keeps it as it is)."""
  leaves = jax.tree_util.tree_leaves(master, is_leaf=lambda a: isinstance(a, tq.QArray))
  return isinstance(master, dict) and bool(leaves) and all(
      isinstance(x, np.ndarray) for x in leaves)


def _sync_from_host(master, policy, dtype, kernel_layout: bool):
  """Rollout weights from a master held in host memory (numpy leaves, as `load_hf_checkpoint(...,
  on_host=True)` gives), made part by part (the embedding, each layer, ...): each part's leaves
  go to the device, become rollout weights (and the kernel layout), and their device copies are
  dropped before the next part's arrive. The device then holds the rollout weights and one
  layer's master at most, where a device master holds all of it: the 30B-A3B shape's bf16
  master is 61 GB, beyond what an 80 GB GPU gives a process beside the 17 GB of FP4 weights.
  The numbers equal `_sync_weights`' (each leaf's quantization is the same function of it)."""
  out = {}
  for key, part in master.items():
    flat, treedef = jax.tree_util.tree_flatten_with_path({key: part})
    made = [_rollout_leaf(policy.weight_format(M.param_name(path)), dtype)(jnp.asarray(w))
            for path, w in flat]
    tree = treedef.unflatten(made)
    out[key] = (_kernel_layout(tree) if kernel_layout else tree)[key]
  return out


# What a sync makes of each master leaf (`_leaf_kinds`): the master's array itself (SHARED: not
# quantized, already in the compute dtype, and not fused with others in the kernel layout), a
# rollout weight computed from it (COMPUTED: the engine's own, donated at the next sync), or
# nothing (ABSENT: a part that the kernel layout fused into another leaf's weight, e.g. k and v
# beside q).
SHARED, COMPUTED, ABSENT = "shared", "computed", "absent"


def _leaf_kinds(master, policy, dtype, kernel_layout) -> tuple[str, ...]:
  """`SHARED` / `COMPUTED` / `ABSENT` per leaf of `master` (flattened). Shared leaves are the
  master's arrays, not copies: a BF16 rollout of bf16 master weights held both, 122 GB for the
  48-layer 30B-A3B shape on the H200, where 61 GB do."""
  leaves, treedef = jax.tree_util.tree_flatten(master)
  sig = tuple((tuple(m.shape), jnp.dtype(m.dtype).name, isinstance(m, jax.Array))
              for m in leaves)
  return _kinds(policy, jnp.dtype(dtype).name, treedef, sig, kernel_layout)


@functools.lru_cache(maxsize=64)
def _kinds(policy, dtype, treedef, sig, kernel_layout):
  # cached: an abstract quantization of a 48-layer model at every sync would cost seconds
  master = treedef.unflatten([jax.ShapeDtypeStruct(shape, dt) for shape, dt, _ in sig])
  out = jax.eval_shape(functools.partial(_synced_weights, policy=policy, dtype=dtype,
                                         kernel_layout=kernel_layout), master)
  def kind(s, r):
    shape, dt, is_array = s
    if r is None:
      return ABSENT
    plain = isinstance(r, jax.ShapeDtypeStruct)  # not a QArray, nor a kernel-layout weight
    return SHARED if is_array and plain and r.dtype == dt and r.shape == shape else COMPUTED
  return tuple(kind(s, r) for s, r in zip(sig, treedef.flatten_up_to(out)))


def _layout_key(use: bool):
  """The kernel layout a sync makes (`_kernel_layout`, unsharded): None without it, else the
  settings it reads as it is traced (the cached sync programs are keyed by them)."""
  return (FUSE_PROJECTIONS, kernel_dispatch.BF16_DENSE) if use else None


def _synced_weights(master, policy, dtype, kernel_layout):
  """The rollout weights of a master: `_rollout_weights`, in the kernels' layout with
  kernel_layout (a `_layout_key`; unsharded: q/k/v fused)."""
  out = _rollout_weights(master, policy, dtype)
  return _kernel_layout(out) if kernel_layout else out


def _own(parts, kinds):
  """Per master leaf: the part where `COMPUTED` (the engine's own array), None elsewhere."""
  return [p if k == COMPUTED else None for p, k in zip(parts, kinds, strict=True)]


def _with_master(master, parts, kinds):
  """The rollout weights: the master's leaf where `SHARED`, the part elsewhere (None where
  `ABSENT`)."""
  leaves, treedef = jax.tree_util.tree_flatten(master)
  return treedef.unflatten([m if k == SHARED else p for m, p, k in zip(leaves, parts, kinds)])


def _changed_weights(master, policy, dtype, kinds):
  """The quantized rollout weights (`_rollout_weights`) per master leaf where `COMPUTED`, None
  elsewhere (the caller puts the master leaf where `SHARED`): a jitted program returns only what
  it computes, so nothing is copied."""
  treedef = jax.tree_util.tree_structure(master)
  return _own(treedef.flatten_up_to(_rollout_weights(master, policy, dtype)), kinds)


def _laid_out(weights, treedef, kinds):
  """The kernel layout (`_kernel_layout`) of the rollout weights per master leaf (treedef: the
  master's) where `COMPUTED` (kinds of the laid-out weights), None elsewhere."""
  return _own(treedef.flatten_up_to(_kernel_layout(weights)), kinds)


def _donating(fn):
  """fn(x, old) jitted with `old` donated: XLA writes the outputs into its buffers where shapes
  agree. keep_unused: jit drops an argument the program does not read, and the donation with it
  (until session 57 no re-sync donated: the old weights stayed alive beside the new ones)."""
  def run(x, old):
    del old
    return fn(x)
  return jax.jit(run, donate_argnums=(1,), keep_unused=True)


@functools.lru_cache(maxsize=None)
def _first_sync(policy, dtype, kinds):
  return jax.jit(functools.partial(_changed_weights, policy=policy, dtype=dtype, kinds=kinds))


@functools.lru_cache(maxsize=None)
def _resync(policy, dtype, kinds):
  return _donating(functools.partial(_changed_weights, policy=policy, dtype=dtype, kinds=kinds))


@functools.lru_cache(maxsize=None)
def _layout_sync(treedef, kinds, layout):
  del layout  # (the settings the layout reads as it is traced: a key of this cache)
  return _donating(functools.partial(_laid_out, treedef=treedef, kinds=kinds))


def _sync_weights(master, old_parts, policy, dtype, kernel_layout=None):
  """(rollout weights, kinds): the master's leaves where they serve unchanged (`SHARED`), the
  policy's weights elsewhere; kinds per master leaf (`_leaf_kinds`). old_parts (the previous
  rollout weights per master leaf, or None) are donated where `COMPUTED`: XLA writes the new
  weights into their buffers. With kernel_layout (a `_layout_key`) the quantized weights are
  laid out by a second program, to which the old laid-out weights are donated: quantization and
  layout in one program gave other bits on the H100 (XLA fused them; session 57), the layout
  alone is data movement. A re-sync then holds the old weights and the new quantized ones (two
  copies; three before session 57), without the layout one."""
  qkinds = _leaf_kinds(master, policy, dtype, None)
  if old_parts is not None and kernel_layout is None:
    parts = _resync(policy, dtype, qkinds)(master, _own(old_parts, qkinds))
  else:
    parts = _first_sync(policy, dtype, qkinds)(master)
  weights = _with_master(master, parts, qkinds)
  if kernel_layout is None:
    return weights, qkinds
  kinds = _leaf_kinds(master, policy, dtype, kernel_layout)
  old = [None] * len(kinds) if old_parts is None else _own(old_parts, kinds)
  parts = _layout_sync(jax.tree_util.tree_structure(master), kinds, kernel_layout)(weights, old)
  return _with_master(master, parts, kinds), kinds


# `kernels.fuse_projections` on unsharded kernel-layout weights ("off": q, k and v as three
# calls). H200, 12 layers, w4a16 at HF's B 1 load: 862.7 -> 964.4 tok/s (BF16 900.7), session 18.
FUSE_PROJECTIONS = choice_setting(
    "TRACE_JAX_FUSE_PROJECTIONS", "on", ("on", "off"),
    doc="q, k and v side by side in one FP4 weight at the rollout's weight sync")


def _kernel_layout(params, fuse: bool = True):
  """FP4 weights whose K and N are multiples of 256 (the shapes the Mosaic kernels were validated
  at on the H200: 30B-A3B attention and expert matrices) move to the kernel layout; smaller ones
  stay QArrays and take the reference path. fuse: the attention's q, k and v weights side by
  side in one (`kernels.fuse_projections`; not for weights sharded over a mesh, whose column
  shards would not line up with the parts')."""
  def conv(a):
    if (isinstance(a, tq.QArray) and a.fmt.is_fp4 and a.ndim in (2, 3) and a.axis == a.ndim - 2
        and a.shape[-2] % 256 == 0 and a.shape[-1] % 256 == 0):
      return kernels.prepare_weight(a)
    return a
  out = jax.tree_util.tree_map(conv, params, is_leaf=lambda a: isinstance(a, tq.QArray))
  if not (fuse and FUSE_PROJECTIONS == "on"):
    return out
  return kernels.fuse_projections(out, bf16=kernel_dispatch.BF16_DENSE == "kernel")


def rollout_weight_shapes(config: M.ModelConfig, policy: tq.QuantPolicy,
                          use_kernels: bool = False):
  """The shapes and dtypes of the rollout weights `RolloutEngine.sync` makes (in the kernel
  layout with use_kernels), from shapes alone: nothing is allocated (capacity planning and
  compile measurements of a 30B model on any machine)."""
  tree = jax.eval_shape(lambda: _rollout_weights(
      M.init_params(config, jax.random.key(0), "bfloat16"), policy, config.compute_dtype))
  return jax.eval_shape(_kernel_layout, tree) if use_kernels else tree


def _prompt_key(seed: int, prompt: Sequence[int], occurrence: int) -> int:
  h = hashlib.blake2b(np.asarray(prompt, np.int64).tobytes(), digest_size=4,
                      key=seed.to_bytes(8, "little", signed=True)).digest()
  return (int.from_bytes(h, "little") + 7919 * occurrence) % (2**31 - 1)


def _join_windows(windows, steps: int) -> dict:
  """Decode windows' tokens, logprobs, validity and routes joined along time into buffers of
  `steps`: steps past the windows run (every row had stopped) are zeros, as in the one-program
  engine's buffers. (Their guidance goes straight into the final arrays: `_host_guidance`.)"""
  def join(xs, axis):
    x = jnp.concatenate(xs, axis=axis)
    if x.shape[axis] >= steps:
      return jax.lax.slice_in_dim(x, 0, steps, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, steps - x.shape[axis])
    return jnp.pad(x, pad)

  out = {k: join([w[k] for w in windows], 1) for k in ("tokens", "logp", "valid")}
  out["routes"] = None if windows[0]["routes"] is None else join(
      [w["routes"] for w in windows], 2)
  return out


def window_pieces(total: int, chunk: int, tail: int = 0) -> list[tuple[int, int]]:
  """The chunked engine's decode windows, (first step, steps) each, for a rollout of `total`
  steps: windows of `chunk`, and the last one (the rest) split in halves while longer than
  `tail` steps (0: not split), so that the records landing after the device has finished, those
  of the last piece, are a small part of a window's: the earlier pieces' copies overlap the
  pieces after them (`GUIDANCE_TAIL`)."""
  if total < 1 or chunk < 1:
    raise ValueError(f"window_pieces needs total >= 1 and chunk >= 1, got {total}, {chunk}")
  last = (total - 1) // chunk * chunk
  out = [(s, chunk) for s in range(0, last, chunk)]
  rest = total - last
  while tail and rest > tail:
    half = -(-rest // 2)
    out.append((last, half))
    last, rest = last + half, rest - half
  return out + [(last, rest)]


@functools.partial(jax.jit, static_argnums=1)
def _cut_window(bufs, steps: int):
  """A window's buffers cut to their first `steps` steps (a piece of the last window: the
  program's buffers are a whole window long; only the steps it ran go to host memory). Time is
  axis 1, the routes' axis 2."""
  def cut(axis):
    return lambda x: jax.lax.slice_in_dim(x, 0, steps, axis=axis)
  return {k: None if v is None else jax.tree_util.tree_map(cut(2 if k == "routes" else 1), v)
          for k, v in bufs.items()}


def host_zeros(shape, dtype) -> np.ndarray:
  """A zero array in host memory whose pages are committed as they are written, 4 KiB at a
  time. numpy advises transparent huge pages for large arrays, which commit 2 MiB at the first
  write: a `[rows, time, ...]` guidance array whose rows are written at their prompt only was
  committed whole (1.97 of 1.97 GiB, against 0.02 GiB here; filling it window by window was no
  slower, 1.1 s vs 2.0 s for 2 GiB on this CPU)."""
  dtype = np.dtype(dtype)
  size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if size == 0:
    return np.zeros(shape, dtype)
  buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled, lazy
  if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (THP "always" would use huge pages unasked)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
  return np.frombuffer(buf, dtype).reshape(shape)


# Host threads for guidance copies into the final arrays: numpy copies release the GIL, and a
# copy into fresh `host_zeros` pages is bound by the page commits (~1-2 GB/s a thread: the
# prompt's 5.8 GB of guidance at the 8k-capacity shape, 48 layers, is seconds on one thread).
_COPY_BLOCK_BYTES = 64 * 2**20
_copy_pool = None


def _pool():
  global _copy_pool
  if _copy_pool is None:
    _copy_pool = concurrent.futures.ThreadPoolExecutor(min(16, os.cpu_count() or 1),
                                                       thread_name_prefix="guidance_copy")
  return _copy_pool


def _copy_blocks(copies, wait: bool = True) -> list:
  """Run `dst[index] = src` for each (dst, index, src) in `copies` (src None: zeros, which
  commits the pages of a `host_zeros` region), cut into row blocks of about
  `_COPY_BLOCK_BYTES`, on a pool of host threads (one per CPU, at most 16). wait=False: return
  the blocks' futures at once (`_wait_blocks`) instead of running them to the end."""
  def run(block):
    dst, index, src, lo, hi = block
    view = dst[index]  # a view: the copy lands in dst
    view[lo:hi] = 0 if src is None else src[lo:hi]

  blocks = []
  for dst, index, src in copies:
    region = dst[index]
    rows = region.shape[0]
    step = max(1, _COPY_BLOCK_BYTES * rows // max(region.nbytes, 1))
    for r in range(0, rows, step):
      blocks.append((dst, index, src, r, min(r + step, rows)))
  if wait and len(blocks) <= 1:
    for block in blocks:
      run(block)
    return []
  futures = [_pool().submit(run, block) for block in blocks]
  if wait:
    _wait_blocks(futures)
    return []
  return futures


def _wait_blocks(futures) -> None:
  for f in futures:
    f.result()  # (re-raises a block's error)


@dataclasses.dataclass
class ChunkTimeline:
  """Host seconds of the chunked engine's parts in its last `generate`. seconds: the calling
  thread's (`lap` adds the time since its previous lap to a part; they sum to the call's time):
  launches, waits on the device (window_wait), landing (records into the final arrays: inline,
  or waits on the landing thread, `GUIDANCE_LANDING`). landing_seconds: within the landing, on
  whichever thread lands (`timed`): waits for records to reach host memory
  (prompt_records_wait, window_records_wait) and host copies (page_commit_wait, prompt_copy,
  window_place)."""
  seconds: dict = dataclasses.field(default_factory=dict)
  landing_seconds: dict = dataclasses.field(default_factory=dict)
  windows: int = 0
  # [first step, steps] of each window launched, in order (`window_pieces`: the last window of
  # a guided rollout in pieces; one more than landed where every row stopped early): what its
  # records' arrivals are paced by (`window_step_ms`)
  pieces: list = dataclasses.field(default_factory=list)
  # [what, seconds since the call began] as records and end flags reach host memory: their
  # spacing is the device's pace once it, not the host, is the bound
  marks: list = dataclasses.field(default_factory=list)
  _last: float = dataclasses.field(default_factory=time.perf_counter, repr=False)
  _start: float = dataclasses.field(default_factory=time.perf_counter, repr=False)
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  @property
  def launches(self) -> int:
    """Windows launched."""
    return len(self.pieces)

  def mark(self, what: str) -> None:
    with self._lock:  # (landing thread and caller: appended in time order)
      self.marks.append([what, round(time.perf_counter() - self._start, 4)])

  def lap(self, part: str) -> None:
    now = time.perf_counter()
    self.seconds[part] = self.seconds.get(part, 0.0) + now - self._last
    self._last = now

  @contextlib.contextmanager
  def timed(self, part: str):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.landing_seconds[part] = (self.landing_seconds.get(part, 0.0)
                                    + time.perf_counter() - t)

  def as_dict(self) -> dict:
    return {"seconds": {k: round(v, 4) for k, v in self.seconds.items()},
            "landing_seconds": {k: round(v, 4) for k, v in self.landing_seconds.items()},
            "total_s": round(sum(self.seconds.values()), 4), "windows": self.windows,
            "launches": self.launches, "pieces": [list(x) for x in self.pieces],
            "marks": list(self.marks)}


def window_arrivals(marks: list) -> list:
  """Seconds (since the call began) at which each window's records reached host memory, from
  a `ChunkTimeline`'s marks."""
  return [t for what, t in marks if what.startswith("window ") and what.endswith(" records")]


def window_step_ms(marks: list, pieces: list) -> list:
  """The chunked engine's pace, ms a decode step, of each window after the first: the time
  between its records and the previous window's reaching host memory (`window_arrivals`) over
  its steps (`pieces`: [first step, steps] of each window, a `ChunkTimeline`'s)."""
  arrived = window_arrivals(marks)
  return [1e3 * (b - a) / n for a, b, (_, n) in zip(arrived, arrived[1:], pieces[1:])]


def _host_guidance_arrays(pre_records, n: int, steps: int) -> tuple[dict, list]:
  """The chunked rollout's final guidance in host memory, `[rows, prompt + steps, ...]` per
  site, shaped from the prefill's records (`n` samples a prompt: rows `i * n + j`), and the
  futures of the host threads committing the prompt's pages (zeros written). Called as soon as
  the prefill is launched, so the page commits run while the device prefills; the prompt's
  records are copied in when they land (`_host_guidance`). Allocated once and filled window by
  window, so host memory holds the guidance about once, not a joined copy beside the windows,
  and only as far as windows ran (`host_zeros`: pages are committed as they are written; a
  rollout whose rows all stop early commits less than the planner's prompt + max_new tokens;
  windows never run stay zero, as in the one-program engine)."""
  out, fills = {}, []
  for layer, sites in pre_records.items():
    out[layer] = {}
    for site, pre in sites.items():
      rows, p = pre.shape[0], pre.shape[1]
      full = _zeros_resized(pre, (0, 1), (rows * n, p + steps), host_zeros)
      fills += [(dst, (slice(None), slice(0, p)), None)
                for dst in jax.tree_util.tree_leaves(full)]
      out[layer][site] = full
  return out, _copy_blocks(fills, wait=False)


def _host_guidance(guidance, pre_records, n: int) -> None:
  """Copy the prompt's host records into the final arrays (`_host_guidance_arrays`): sample j
  of prompt i is row i * n + j (no repeated copy)."""
  copies = []
  for layer, sites in guidance.items():
    for site, full in sites.items():
      for dst, src in zip(jax.tree_util.tree_leaves(full),
                          jax.tree_util.tree_leaves(pre_records[layer][site]), strict=True):
        for j in range(n):
          copies.append((dst, (slice(j, None, n), slice(0, src.shape[1])), src))
  _copy_blocks(copies)


# Where the chunked engine lands guidance (host copies into the final arrays): "inline", on the
# calling thread (each window's copies started at its launch), or "thread", on a landing thread
# of its own (copies started there; the window dropped after the last one is never copied).
# On the H200, 48 layers at 8k capacity, thread 35.95 s against inline 36.21, within the
# spread (session 36); on the H100, 4 layers, guidance's share 5.2% / 2.4% against inline's
# 4.1% / 2.8% at 256 / 1,024 new tokens (session 54); 48 layers, B 128, 7.2% / 2.8% against
# 8.7% / 3.0% (session 55: thread ahead at both lengths there, behind at 4 layers' 256, so
# inline stays the default). With several processes the landing is inline whatever this says.
GUIDANCE_LANDING = choice_setting(
    "TRACE_JAX_GUIDANCE_LANDING", "inline", ("inline", "thread"),
    doc="guidance windows landed in host arrays inline, or on a thread of their own")


def _run_now(fn, *args) -> concurrent.futures.Future:
  """fn(*args) on the calling thread, as a finished future (inline landing)."""
  f = concurrent.futures.Future()
  try:
    f.set_result(fn(*args))
  except BaseException as e:  # noqa: BLE001 - raised again at .result(), as a thread's would be
    f.set_exception(e)
  return f


# The last decode window of a guided chunked rollout runs as pieces, halves while longer than
# this many steps (`window_pieces`; 0: one window). Its records land after the device has
# finished: whole, on the H100 at 48 layers (B 128, windows of 256), their copy and placing
# were ~0.4-0.55 s a rollout whatever its length. In pieces (128 + 64 + 32 + 32) only the last
# piece's land then: guidance's share of a 256-token rollout 2.31% against 10.71% whole, the
# rollout landing 0.11 s after the unguided one against 0.55 s (session 56). A piece's records
# are cut to the steps it ran before they are copied (`_cut_window`); every piece runs the one
# window program.
GUIDANCE_TAIL = int_setting(
    "TRACE_JAX_GUIDANCE_TAIL", 32, 0,
    doc="the last guided decode window split in halves down to this many steps (0: not split)")


@jax.jit
def _window_flags(done, s):
  """Whether every row is done, and the step count: new arrays (a decode window's carry is
  donated to the next window before the host reads these)."""
  return jnp.all(done), s + 0


def _to_host(tree):
  """Numpy copies of a tree's arrays in host memory. An array spread over several processes'
  devices (a multi-host mesh) is gathered, so every process holds the whole batch's values,
  as one process would (its rollout's guidance then enters the train step as on one host;
  `jax.device_get` refuses such arrays)."""
  return jax.tree_util.tree_map(parallel.to_host, tree)


# How guidance records reach host memory: "async", each array's `copy_to_host_async`, then
# `np.asarray` (into new host memory, whose pages are committed as the copy lands: on the H200
# 1.2-1.6 GB/s, session 36), or "pinned", a `device_put` to the device's pinned host memory,
# read there in place (`np.asarray` of such an array is a view), then placed in the final
# arrays by host threads. Where a device has no pinned host memory, "async". On the H200 (48
# layers, 8k capacity, 255 x 2,048 tokens, one process, async / pinned / async): whole
# rollouts 35.41 / 35.51 / 35.43 s, the device the bound; prefill plus one step 5.8 -> 5.0 s.
# On the H100 (4 layers, B 256, prompt 512, rounds in rotated order, bench_guidance.py) pinned
# made whole rollouts slower: guidance's share 5.2% against async's 4.1% at 256 new tokens,
# 5.2% against 2.8% at 1,024 (the prompt's 471 MB reached host memory in 0.41 s against 0.20;
# session 54). Pinned stays opt-in; the runtime also keeps its pinned memory for the process's
# life (~8 GB on the H200).
GUIDANCE_COPY = choice_setting(
    "TRACE_JAX_GUIDANCE_COPY", "async", ("async", "pinned"),
    doc="guidance windows copied to the host asynchronously, or through pinned memory")


def _start_host_copies(tree, mode: str = "async"):
  """Start the device-to-host copies of a tree's arrays (those this process holds whole; arrays
  spread over processes are gathered when they land, `_to_host`), the `GUIDANCE_COPY` way.
  Returns the tree to land: the same arrays, or with "pinned" their pinned host copies."""
  def start(x):
    if not (isinstance(x, jax.Array) and x.is_fully_addressable):
      return x
    if mode == "pinned" and _has_pinned_host(x.sharding):
      return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    x.copy_to_host_async()
    return x
  return jax.tree_util.tree_map(start, tree)


def _has_pinned_host(sharding) -> bool:
  return all("pinned_host" in {m.kind for m in d.addressable_memories()}
             for d in sharding.device_set)


def _pinned_bytes(tree) -> int:
  """Bytes of a tree's arrays held in pinned host memory."""
  return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(tree)
             if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host")


class _PinnedPool:
  """Guidance bytes a process holds in pinned host memory (`GUIDANCE_COPY` "pinned"), now and
  at most. The runtime keeps pinned memory it has handed out for later copies (on the H200 a
  first 5.6 GB of copies into it ran at ~1 GB/s, pinning pages, a second at ~47 GB/s; session
  36): capacity planning counts the peak as host memory the next rollout's copies can use."""

  def __init__(self):
    self.held = self.peak = 0
    self._lock = threading.Lock()  # (the landing thread releases)

  def add(self, n: int) -> None:
    with self._lock:
      self.held += n
      self.peak = max(self.peak, self.held)


_PINNED = _PinnedPool()


def _place_window(guidance, window_records, start: int, ran: int) -> None:
  """Copy the `ran` steps one window ran of its host records into the final arrays from time
  index `start` (the window's first decode step after the prompt), cut at their end. (The
  steps after those hold zeros, as the final arrays do: their pages stay uncommitted.)"""
  copies = []
  for layer, sites in window_records.items():
    for site, g in sites.items():
      for dst, src in zip(jax.tree_util.tree_leaves(guidance[layer][site]),
                          jax.tree_util.tree_leaves(g), strict=True):
        length = min(src.shape[1], dst.shape[1] - start, ran)
        copies.append((dst, (slice(None), slice(start, start + length)), src[:, :length]))
  _copy_blocks(copies)


def sequence_keys(seed: int, prompts: Sequence[Sequence[int]], n: int = 1) -> jax.Array:
  """The PRNG key of each of the `n` samples of each prompt (rows `i * n + j`): from the seed,
  the prompt's content and its occurrence among equal prompts, never its row, so a sequence's
  tokens do not depend on its batch-mates. Decode step s samples with `fold_in(key, s)`."""
  seen: dict = {}
  ids = []
  for pr in prompts:
    t = tuple(int(x) for x in pr)
    occ = seen.get(t, 0)
    seen[t] = occ + 1
    for j in range(n):
      ids.append(_prompt_key(seed, t, occ * n + j))
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(ids, jnp.uint32))


def step_keys(seq_keys: jax.Array, step) -> jax.Array:
  """The keys of decode step `step` (a scalar or one per row)."""
  return jax.vmap(jax.random.fold_in)(seq_keys, jnp.broadcast_to(step, seq_keys.shape))


_PROGRAMS: dict = {}

# XLA command buffers (CUDA graphs) over the whole decode program, its while loops (the
# condition evaluated on the device, no host round trip per step), conditionals and custom
# calls (the Mosaic kernels) included, from graphs of one kernel up. H200, the 8k-capacity FP4
# decode step (12 layers, B 276, ~43 kernels a layer): 7.20 -> 5.06 ms (session 15); XLA's
# default captures fusions and library calls only, in graphs of 5 or more.
GPU_COMMAND_BUFFERS = {
    "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL",
    "xla_gpu_graph_min_graph_size": 1,
}


class RolloutEngine:
  """Generates rollouts from FP4 (or BF16) rollout weights synced from master weights.

    engine = RolloutEngine(config, make_policy("paper"), max_new_tokens=64)
    engine.sync(master_params)            # quantize once, on device
    ro = engine.generate(prompts, n=8, sampling=SamplingParams(temperature=1.0), seed=step)
  """

  def __init__(self, config: M.ModelConfig, policy: tq.QuantPolicy | None = None, *,
               max_new_tokens: int = 64, prompt_bucket: int = 16,
               record_guidance: bool = True, record_routes: bool = True,
               record_codes: bool = False, device_bytes: int | None = None,
               host_bytes: int | None = None, use_kernels: bool | None = None,
               mesh: jax.sharding.Mesh | None = None, decode_chunk: int = 0,
               prefill_tokens: int = 65536, command_buffers: bool | None = None):
    kernels.import_gpu_libraries()  # before any program compiles (its docstring says why)
    self.config = config
    self.policy = policy or tq.make_policy("bf16")
    self.max_new_tokens = int(max_new_tokens)
    self.prompt_bucket = int(prompt_bucket)
    self.record_routes = record_routes
    quantized = self.policy.quantizes_anything
    # record_codes keeps every quantized site's full codes too (diagnostics: code agreement).
    self.ctx = M.QuantContext(self.policy, "rollout" if quantized else "bf16",
                              record_guidance=record_guidance and quantized,
                              record_codes=record_codes and quantized)
    self.device_bytes = device_bytes
    # host_bytes: host memory the chunked engine's guidance may take (default: what is available
    # at each generate call, `host_memory_bytes`; on the CPU backend one budget with the device's).
    self.host_bytes = host_bytes
    # decode_chunk > 0: decode in windows of that many steps, one program call each, and move
    # each window's TRACE guidance to host memory as it completes, so device memory holds the
    # guidance of the prompt and two windows instead of the whole sequence (at 8k tokens on the
    # 30B-A3B shape it is larger than the FP4 KV cache). Same tokens, logprobs and guidance.
    if decode_chunk < 0:
      raise ValueError(f"decode_chunk must be >= 0 (0: one program), got {decode_chunk}")
    self.decode_chunk = int(decode_chunk)
    self.last_timeline: ChunkTimeline | None = None  # the chunked engine's last generate
    self.guidance_copy = GUIDANCE_COPY  # how its records reach host memory (`GUIDANCE_COPY`)
    self.guidance_landing = GUIDANCE_LANDING  # which thread lands them (`GUIDANCE_LANDING`)
    self.guidance_tail = GUIDANCE_TAIL  # the last window's pieces (`GUIDANCE_TAIL`)
    # prefill_tokens: prompt tokens per prefill pass; a larger batch is prefilled in passes of
    # that many tokens' prompts (`_prefill_passes`), which bounds the forward's transients where
    # the capacity planner counts the decode's memory. 64k prompt tokens: the prompt-2048 B=64
    # rows (131k tokens in one pass) peaked at 32 GB of 141 on the H200 with 12 layers, weights
    # and cache included, so half of that is within the planner's 10% headroom. With a mesh the
    # batch is sharded over devices: one pass.
    if prefill_tokens < 1:
      raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
    self.prefill_tokens = int(prefill_tokens)
    # mesh: weights sharded per `parallel.param_shardings` (sync reshards the master weights
    # onto it, e.g. from a disjoint train submesh), prompts over its batch axes.
    self.mesh = mesh
    # FP4 weights in the Mosaic GPU kernels' layout (made once per sync): default on a Hopper GPU
    # device (the kernel-layout weights have no sharding rules).
    if use_kernels is None:
      use_kernels = kernels.kernels_on() and mesh is None
    self.use_kernels = use_kernels
    # command_buffers: compile the rollout programs with `GPU_COMMAND_BUFFERS` (default: on one
    # GPU, where it was measured; a mesh's programs, with their collectives, keep XLA's
    # default). Other XLA flags come from XLA_FLAGS as usual.
    if command_buffers is None:
      command_buffers = self._platform() == "gpu" and mesh is None
    self.command_buffers = bool(command_buffers)
    # The chunked engine's prefill program with them too. Without, on the H200 (12 layers, B
    # 128, prompt 512): the same rollout bit for bit, its launch as short (~0.01 s) and the call
    # no faster (benchmarks/probe_dispatch.py, session 36)
    self.prefill_command_buffers = self.command_buffers
    self.params = None
    self._computed = None  # per master leaf: the rollout weight made from it, None if shared

  # -- weights
  def sync(self, master_params) -> None:
    """Requantize the rollout weights from `master_params` on device, replacing the old copy
    (whose buffers are donated to the new one). Master arrays the rollout uses unchanged (not
    quantized, already in the compute dtype) are shared, not copied: a step that donates the
    master (the trainer's) leaves them deleted until the next sync. A master in host memory
    (numpy leaves; without a mesh) is made part by part, the old copy dropped first: the device
    holds the rollout weights and one layer's master (`_sync_from_host`)."""
    dtype = self.config.compute_dtype
    if self.mesh is None and _on_host(master_params):
      # part by part (`_sync_from_host`); the old copy goes first, so the device never holds two
      self.params = self._computed = None
      self.params = _sync_from_host(master_params, self.policy, dtype, self.use_kernels)
      # all of it is the engine's own (nothing is shared with a host master): a later device
      # sync donates it, as after a device sync
      self._computed = jax.tree_util.tree_structure(master_params).flatten_up_to(self.params)
      return
    if self.mesh is not None:
      master_params = parallel.shard_params(master_params, self.mesh)
    # unsharded: the kernel layout made by the sync's second program (a re-sync donates the old
    # one to it); on a mesh after resharding, unfused
    layout = _layout_key(self.use_kernels and self.mesh is None)
    params, kinds = _sync_weights(master_params, self._computed, self.policy, dtype, layout)
    if self.mesh is not None:  # whole quantization blocks per shard
      params = parallel.shard_params(params, self.mesh)
      if self.use_kernels:
        params = _kernel_layout(params, False)
    self.params = params
    # what the next sync donates: the arrays this engine made (never the shared master's); none
    # where the layout is made after the program (its shapes are not the program's outputs')
    parts = jax.tree_util.tree_structure(master_params).flatten_up_to(params)
    self._computed = (None if self.mesh is not None and self.use_kernels else
                      _own(parts, kinds))

  @property
  def weight_bytes(self) -> int:
    return 0 if self.params is None else tree_bytes(self.params)

  @property
  def planned_device_bytes(self) -> int:
    """The device memory capacity planning uses: `device_bytes` if given, else the device's."""
    return self.device_bytes or device_memory_bytes()

  # -- capacity
  def _chunked(self) -> bool:
    return 0 < self.decode_chunk < self.max_new_tokens

  def capacity(self, context_len: int, prompt_len: int | None = None,
               host_reserve: int = 0) -> int:
    """Sequences of `context_len` tokens that fit (prompt_len: the prompt bucket, which sets
    how much guidance the chunked engine holds at once; default context_len - max_new;
    host_reserve: `capacity_limits`)."""
    return min(n for n in self.capacity_limits(context_len, prompt_len, host_reserve)
               if n is not None)

  def capacity_limits(self, context_len: int, prompt_len: int | None = None,
                      host_reserve: int = 0) -> tuple[int, int | None]:
    """(device-limited, host-limited) sequence counts (`capacity_limits`); the host figure is
    None for the one-program engine, whose guidance stays on the device. host_reserve: bytes of
    the host memory available now that the process will take before the rollout (planning
    before the first call: compiling the 48-layer FP4 program and its first call took 5.1 GiB
    of host memory on the H200 machine, session 12, which turned a batch planned on 115.3 GiB
    into a `CapacityError` on 110.2)."""
    return capacity_limits(self.config, self.policy, context_len, self._resident_bytes(),
                           self.device_bytes, self.ctx.record_guidance,
                           **self._planning(context_len, prompt_len, host_reserve))

  def _resident_bytes(self) -> int:
    """What the device holds beside the rollout's sequences: the engine's weights, or, on a
    device whose memory the engine measures (no `device_bytes` given), everything the
    allocator holds now if that is more: a trainer's master weights, optimizer state and
    gradients beside a colocated rollout, arrays the caller still keeps. Counting only the
    rollout weights let a colocated trainer's state turn a planned batch into an out-of-memory
    error instead of a `CapacityError`. (On a mesh the weights alone, as before.)"""
    if self.device_bytes is not None or self.mesh is not None:  # (a mesh: planned as before)
      return self.weight_bytes
    in_use = device_bytes_in_use(jax.devices()[0])
    return self.weight_bytes if in_use is None else max(self.weight_bytes, in_use)

  def _platform(self) -> str:
    device = self.mesh.devices.flat[0] if self.mesh is not None else jax.devices()[0]
    return device.platform

  def _on_cpu(self) -> bool:
    return self._platform() == "cpu"

  def _planning(self, context_len: int, prompt_len: int | None, host_reserve: int = 0) -> dict:
    """`capacity_limits`' arguments for what the engine holds where: with decode windows, the
    guidance of the prompt and two windows on the device and the whole context in host memory
    (on the CPU backend, unless host_bytes is given, the device's memory is host RAM: one
    budget); and the cache of a prefill pass when the batch takes more than one."""
    p = context_len - self.max_new_tokens if prompt_len is None else prompt_len
    if not self._chunked():
      return planning(p, context_len, 0, self._prefill_pass(p))
    shared = self.host_bytes is None and self._on_cpu()
    host = None
    if not shared:
      # (pinned memory the runtime keeps from earlier copies is free for this call's)
      host = (self.host_bytes if self.host_bytes is not None
              else host_memory_bytes() + _PINNED.peak)
      host = max(host - host_reserve, 0)
    return planning(p, context_len, self.decode_chunk, self._prefill_pass(p), host_bytes=host,
                    host_is_device=shared)

  # -- generation
  def _prefill_pass(self, p: int) -> tuple[int, int] | None:
    """`prefill_pass` at prompt bucket p (None: one pass; with a mesh the batch is sharded)."""
    return None if self.mesh is not None else prefill_pass(self.prefill_tokens, p)

  def _pass_rows(self, p: int) -> int | None:
    """Prompts per prefill pass at prompt bucket p (None: one pass)."""
    pass_ = self._prefill_pass(p)
    return None if pass_ is None else pass_[0]

  def bucket_length(self, prompt_tokens: int) -> int:
    """The padded prompt length of a batch whose longest prompt has `prompt_tokens` tokens."""
    return -(-prompt_tokens // self.prompt_bucket) * self.prompt_bucket

  def _jit(self, fn, command_buffers: bool | None = None, **kw):
    on = self.command_buffers if command_buffers is None else command_buffers
    return jax.jit(fn, compiler_options=GPU_COMMAND_BUFFERS if on else None, **kw)

  def _program(self, key):
    # Shared across engines: a new engine with the same config reuses compiled programs.
    full = (self.config, self.ctx, self.record_routes, self.mesh, self.command_buffers) + key
    if full not in _PROGRAMS:
      n, steps, sampling, pass_rows = key[2], key[3], key[4], key[6]
      fn = functools.partial(generate_program, config=self.config, ctx=self.ctx, n=n,
                             steps=steps, sampling=sampling, kv_format=self.policy.kv_format,
                             record_routes=self.record_routes, pass_rows=pass_rows)
      _PROGRAMS[full] = self._jit(fn)
    return _PROGRAMS[full]

  def _chunk_programs(self, key):
    base = ("chunked", self.decode_chunk, self.config, self.ctx, self.record_routes,
            self.mesh) + key
    pre_key = base + ("prefill", self.prefill_command_buffers)
    dec_key = base + ("decode", self.command_buffers)
    p, n, steps, sampling, pass_rows = key[0], key[2], key[3], key[4], key[6]
    if pre_key not in _PROGRAMS:
      pre = functools.partial(prefill_program, config=self.config, ctx=self.ctx, n=n,
                              steps=steps, kv_format=self.policy.kv_format, pass_rows=pass_rows)
      _PROGRAMS[pre_key] = self._jit(pre, command_buffers=self.prefill_command_buffers)
    if dec_key not in _PROGRAMS:
      dec = functools.partial(_decode, config=self.config, ctx=self.ctx, p=p, steps=steps,
                              length=self.decode_chunk, sampling=sampling,
                              record_routes=self.record_routes)
      _PROGRAMS[dec_key] = self._jit(dec, donate_argnums=(1,))
    return _PROGRAMS[pre_key], _PROGRAMS[dec_key]

  def _generate_chunked(self, key, tokens, mask, seq_keys, max_new, stop,
                        most: int | None = None) -> Rollout:
    """Prefill, then windows of `decode_chunk` steps until every row is done; each window's
    records are copied to host memory while the next window decodes. most: the largest of the
    rows' token limits (the engine's `max_new_tokens` if None): no window past it is launched.
    Host seconds of each part: `last_timeline` (`ChunkTimeline`)."""
    n, steps, chunk = key[2], key[3], self.decode_chunk
    pre_fn, window_fn = self._chunk_programs(key)
    clock = ChunkTimeline()
    pre_records, pre_routes, positions, prompt_len, carry = pre_fn(self.params, tokens, mask)
    clock.lap("prefill_launch")
    # The final host arrays now, their prompt pages committed by host threads while the device
    # prefills (at 8k capacity on the H200, 48 layers, 255 prompts of 512: 5.6 GB of prompt
    # guidance; prefill plus one step took 5.5 s, the prefill's kernels ~2.3 s; session 35)
    guidance, commits = _host_guidance_arrays(pre_records, n, steps)
    clock.lap("host_arrays")
    # The prompt's records come to host memory while the first window decodes, not before it
    # is launched (session 13: prefill plus one step 16 s of wall time, kernels ~1.5 s).
    p = int(tokens.shape[1])
    windows = []
    # Windows past the rows' largest limit would run no step: none is launched, nor its records
    # copied (a window's, 2.8 GB at the 8k-capacity shape, 48 layers, for a caller who asked
    # 2,048 of 7,680 tokens). Rows that stop earlier still cost the window after the last. A
    # guided rollout's last window runs in pieces (`GUIDANCE_TAIL`).
    tail = self.guidance_tail if self.ctx.record_guidance else 0
    pieces = window_pieces(min(steps, most or steps), chunk, tail)
    to_run = len(pieces)
    # (several processes land inline: a landing thread's gathers of records spread over
    # processes are collectives, which must keep their order against the windows' launches)
    thread = self.guidance_landing == "thread" and jax.process_count() == 1

    copy = self.guidance_copy

    def started(records):  # copies started, their pinned bytes counted until placed
      records = _start_host_copies(records, copy)
      _PINNED.add(_pinned_bytes(records))
      return records

    def launch(i, carry):  # window i, and its end flags read before the next launch donates carry
      run = pieces[i][1]
      carry, bufs = window_fn(self.params, carry, prompt_len, seq_keys, max_new, stop,
                              np.int32(run))
      if run < chunk:  # a piece: only the steps it ran go to host memory
        bufs = _cut_window(bufs, run)
      clock.pieces.append(list(pieces[i]))
      # (the flags' copy first: it then need not wait behind the records')
      flags = _start_host_copies(_window_flags(carry["done"], carry["s"]))
      if not thread:
        bufs = dict(bufs, records=started(bufs["records"]))
      clock.lap("window_dispatch")
      return carry, bufs, flags

    def land_prompt(pre_records):
      with clock.timed("prompt_records_wait"):
        pre_records = started(pre_records)
        pinned = _pinned_bytes(pre_records)
        pre_records = _to_host(pre_records)
      clock.mark("prompt records")
      with clock.timed("page_commit_wait"):
        _wait_blocks(commits)
      with clock.timed("prompt_copy"):
        _host_guidance(guidance, pre_records, n)
      _PINNED.add(-pinned)

    def land(i, bufs, flags):  # window i's records into the final arrays, then dropped
      with clock.timed("window_records_wait"):
        records = started(bufs["records"]) if thread else bufs["records"]
        pinned = _pinned_bytes(records)
        records = _to_host(records)
        start = pieces[i][0]
        ran = int(_to_host(flags[1])) - start  # the steps it ran (it stops when all are done)
      clock.mark(f"window {i} records")
      with clock.timed("window_place"):
        _place_window(guidance, records, p + start, ran)
      _PINNED.add(-pinned)
      windows.append({k: v for k, v in bufs.items() if k != "records"})

    # Window i + 1 is launched before the host learns whether window i finished every row, so the
    # device does not wait on the host between windows (where every row stopped before its limit,
    # the window launched after the last one runs no step and is dropped). The device holds two
    # windows' records at once: the next one's launch comes after the previous one has landed. On
    # the H200 (48 layers, 8k capacity, 255 x 2,048 tokens) the rollout took 35.5 s, 39.3 s
    # launching each window after the host had read that the last one had not ended (session 35).
    # Starting a copy to host memory there blocked the caller for about as long as the copy (5.6 GB
    # of prompt records: 2.9-5.5 s), so each window's copies start right after its launch: started
    # before the next window's launch instead, the rollout took 36.4 s (the copies of the dropped
    # window after the last one, 2.8 GB of zeros, are the price). With GUIDANCE_LANDING "thread" the
    # landing (copies started and awaited, records placed) runs on a thread of its own, in order,
    # and the dropped window is never copied.
    lander = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="guidance_landing")
    submit = lander.submit if thread else _run_now
    try:
      carry, bufs, flags = launch(0, carry)
      landed = [submit(land_prompt, pre_records)]
      del pre_records
      clock.lap("landing")
      for i in range(to_run):
        if i:
          landed[-1].result()  # window i - 1 has landed (one landing thread: in order)
          clock.lap("landing")
        nxt = launch(i + 1, carry) if i + 1 < to_run else None
        landed.append(submit(land, i, bufs, flags))
        clock.lap("landing")
        done = bool(_to_host(flags[0]))
        clock.mark(f"window {i} flags")
        clock.lap("window_wait")
        if done or nxt is None:
          break
        carry, bufs, flags = nxt
      if nxt is not None and not thread:  # launched after the last window: never landed
        _PINNED.add(-_pinned_bytes(nxt[1]["records"]))
      del bufs, nxt, carry
      for f in landed:
        f.result()
      clock.lap("landing")
      clock.mark("landed")
    finally:
      lander.shutdown(wait=True)
    out = _assemble(tokens, mask, positions, prompt_len, pre_routes, None,
                    _join_windows(windows, steps), n, steps, guidance=guidance)
    clock.lap("assemble")
    clock.windows = len(windows)
    self.last_timeline = clock
    return out

  def _check_capacity(self, rows: int, p: int) -> None:
    """CapacityError if `rows` sequences of prompt bucket `p` do not fit, naming the memory
    (device, or host for the chunked engine's guidance) whose limit is exceeded."""
    ctx_len = p + self.max_new_tokens
    plan = self._planning(ctx_len, p)
    resident = self._resident_bytes()
    on_device, on_host = capacity_limits(self.config, self.policy, ctx_len, resident,
                                         self.device_bytes, self.ctx.record_guidance, **plan)
    if rows <= min(n for n in (on_device, on_host) if n is not None):
      return
    device = self.planned_device_bytes
    per = bytes_per_sequence(self.config, self.policy, ctx_len, self.ctx.record_guidance,
                             plan.get("guidance_tokens"))
    held = (f"{resident / 2**30:.2f} GiB of weights" if resident == self.weight_bytes else
            f"{resident / 2**30:.2f} GiB already held on the device (rollout weights "
            f"{self.weight_bytes / 2**30:.2f} GiB)")
    if on_host is None or on_device <= on_host:
      raise CapacityError(
          f"{rows} sequences of {ctx_len} tokens do not fit: at most {on_device} fit "
          f"next to {held} ({per / 2**20:.1f} MiB per sequence, device "
          f"{device / 2**30:.1f} GiB)")
    per_host = host_bytes_per_sequence(self.config, self.policy, ctx_len,
                                       self.ctx.record_guidance, plan["host_tokens"])
    budget = (f"host memory = the device's {device / 2**30:.1f} GiB, next to "
              f"{held} and {per / 2**20:.1f} MiB per "
              f"sequence on the device" if plan["host_is_device"]
              else f"host memory {plan['host_bytes'] / 2**30:.1f} GiB")
    raise CapacityError(
        f"{rows} sequences of {ctx_len} tokens do not fit in host memory: at most {on_host} "
        f"fit ({per_host / 2**20:.1f} MiB of guidance per sequence in host memory at its peak, "
        f"decode windows of {self.decode_chunk}; {budget})")

  def generate(self, prompts: Sequence[Sequence[int]], *, n: int = 1,
               sampling: SamplingParams = SamplingParams(), seed: int = 0,
               stop_tokens: Sequence[int] = (), max_new_tokens: int | Sequence[int] | None = None,
               prompt_len: int | None = None) -> Rollout:
    """Generate `n` samples for each prompt (lists of token ids; rows `i * n + j`).

    max_new_tokens: per prompt (int or one per prompt), at most the engine's `max_new_tokens`.
    prompt_len: pad prompts to this length (default: the longest, rounded up to the bucket).
    """
    if self.params is None:
      raise RuntimeError("RolloutEngine.generate called before sync(master_params)")
    if any(a.is_deleted() for a in jax.tree_util.tree_leaves(self.params)):
      raise RuntimeError("the rollout weights share master arrays that have been deleted since "
                         "the last sync (a train step donated them): call sync with the new "
                         "master params before generate")
    if not prompts:
      raise ValueError("generate needs at least one prompt")
    if n < 1:
      raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
      raise ValueError(f"prompt {lens.index(0)} is empty")
    longest = max(lens)
    p = prompt_len or self.bucket_length(longest)
    if longest > p:
      raise ValueError(f"a prompt has {longest} tokens, more than prompt_len={p}")
    if p + self.max_new_tokens > self.config.max_seq_len:
      raise ValueError(f"prompt bucket {p} + max_new_tokens {self.max_new_tokens} exceeds the "
                       f"model's max_seq_len {self.config.max_seq_len}")
    vocab = self.config.vocab_size
    for i, pr in enumerate(prompts):
      bad = [t for t in pr if not 0 <= int(t) < vocab]
      if bad:
        raise ValueError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")
    rows = len(prompts) * n
    self._check_capacity(rows, p)

    tokens = np.zeros((len(prompts), p), np.int32)
    mask = np.zeros((len(prompts), p), bool)
    for i, pr in enumerate(prompts):
      tokens[i, p - len(pr):] = pr
      mask[i, p - len(pr):] = True
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
      per_prompt = np.asarray(max_new_tokens, np.int32)
      if per_prompt.shape != (len(prompts),):
        raise ValueError("max_new_tokens needs one value per prompt")
    else:
      per_prompt = np.full((len(prompts),), max_new_tokens or self.max_new_tokens, np.int32)
    if per_prompt.max() > self.max_new_tokens or per_prompt.min() < 1:
      raise ValueError(f"max_new_tokens must be in [1, {self.max_new_tokens}]")
    seq_keys = sequence_keys(seed, prompts, n)
    stop = np.asarray(list(stop_tokens) or [-1], np.int32)
    key = (p, len(prompts), n, self.max_new_tokens, sampling, len(stop), self._pass_rows(p))
    args = (jnp.asarray(tokens), jnp.asarray(mask), seq_keys,
            jnp.asarray(np.repeat(per_prompt, n)))
    def run(*args):
      if self._chunked():
        return self._generate_chunked(key, *args, most=int(per_prompt.max()))
      return self._program(key)(self.params, *args)

    if self.mesh is None:
      return run(*args, jnp.asarray(stop))
    # Typed keys travel as their raw data (a key array cannot be device_put onto devices of
    # other processes).
    args = args[:2] + (jax.random.key_data(seq_keys),) + args[3:]
    try:
      args = jax.device_put(args, parallel.batch_shardings(args, self.mesh))
    except ValueError:  # prompts do not divide over the batch axes: replicate them
      args = jax.device_put(args, parallel.replicated(self.mesh))
    keys = jax.random.wrap_key_data(args[2], impl=jax.random.key_impl(seq_keys))
    args = args[:2] + (keys,) + args[3:]
    with jax.set_mesh(self.mesh):
      return run(*args, jax.device_put(stop, parallel.replicated(self.mesh)))
