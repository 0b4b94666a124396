"""Token sampling: temperature, top-k, top-p, greedy, with one PRNG key per sequence so a
sequence's samples do not depend on what else is in the batch; settings shared by the batch
(`SamplingParams`, static) or per row (`RowSampling`, arrays: the slot decoder)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 means greedy. top_k 0 and top_p 1 disable those filters. The recorded
  logprob is always under the temperature-scaled full softmax (temperature 1 when greedy), the
  distribution the trainer recomputes."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  @property
  def logprob_temperature(self) -> float:
    return 1.0 if self.greedy else self.temperature


@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Sampling settings as per-row arrays `[B]` (the slot decoder: every slot has its own), with
  `SamplingParams`' meaning: temperature 0 greedy, top_k 0 and top_p 1 off."""

  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32

  @staticmethod
  def of(params) -> "RowSampling":
    """Host arrays from a sequence of `SamplingParams`."""
    return RowSampling(np.asarray([p.temperature for p in params], np.float32),
                       np.asarray([p.top_k for p in params], np.int32),
                       np.asarray([p.top_p for p in params], np.float32))


jax.tree_util.register_dataclass(RowSampling, data_fields=["temperature", "top_k", "top_p"],
                                 meta_fields=[])


def _top_p_keep(logits: jax.Array, top_p) -> jax.Array:
  """Which entries the smallest prefix (by probability) of mass >= top_p keeps; the first
  token always stays. top_p a float or `[B, 1]`."""
  order = jnp.argsort(-logits, axis=-1)
  sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
  return jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
      keep_sorted)


def filter_logits(logits: jax.Array, top_k, top_p) -> jax.Array:
  """Mask (to -inf) what top-k and top-p exclude; logits `[B, V]` already temperature-scaled.
  top_k / top_p: Python numbers (one setting for the batch, filters off at 0 / 1 are not run)
  or per-row arrays `[B]` (rows at 0 / 1 pass through unchanged)."""
  if jnp.ndim(top_k) or jnp.ndim(top_p):
    b = logits.shape[0]
    top_k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), (b,))[:, None]
    top_p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), (b,))[:, None]
    # The k-th largest value, as lax.top_k's last one, for a k per row.
    kth = jnp.take_along_axis(-jnp.sort(-logits, axis=-1), jnp.maximum(top_k - 1, 0), axis=-1)
    logits = jnp.where((top_k > 0) & (logits < kth), -jnp.inf, logits)
    return jnp.where((top_p < 1.0) & ~_top_p_keep(logits, top_p), -jnp.inf, logits)
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    logits = jnp.where(_top_p_keep(logits, top_p), logits, -jnp.inf)
  return logits


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams | RowSampling):
  """(tokens `[B]`, logprobs `[B]`) from float32 logits `[B, V]` with per-row keys `[B]`;
  `params` one setting for the batch or one per row (`RowSampling`): a row samples the same
  token either way."""
  logits = logits.astype(jnp.float32)
  if isinstance(params, RowSampling):
    greedy = params.temperature == 0
    # Greedy rows: logprobs at temperature 1 (their sampled branch is computed, then unused).
    temperature = jnp.where(greedy, 1.0, params.temperature)[:, None]
    logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
    scaled = filter_logits(logits / temperature, params.top_k, params.top_p)
    sampled = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled)
  else:
    logp_all = jax.nn.log_softmax(logits / params.logprob_temperature, axis=-1)
    if params.greedy:
      tokens = jnp.argmax(logits, axis=-1)
    else:
      scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
      tokens = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
