"""Token sampling: temperature, top-k, top-p, greedy, with one PRNG key per sequence so a
sequence's samples do not depend on what else is in the batch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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


def filter_logits(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """Mask (to -inf) what top-k and top-p exclude; logits `[B, V]` already temperature-scaled."""
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(
        keep_sorted)
    logits = jnp.where(keep, logits, -jnp.inf)
  return logits


def sample(logits: jax.Array, keys: jax.Array, params: SamplingParams):
  """(tokens `[B]`, logprobs `[B]`) from float32 logits `[B, V]` with per-row keys `[B]`."""
  logits = logits.astype(jnp.float32)
  logp_all = jax.nn.log_softmax(logits / params.logprob_temperature, axis=-1)
  if params.greedy:
    tokens = jnp.argmax(logits, axis=-1)
  else:
    scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
    tokens = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
