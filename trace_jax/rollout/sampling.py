"""Token sampling: temperature, top-k, top-p, greedy, with one PRNG key per sequence so a
sequence's samples do not depend on what else is in the batch; settings shared by the batch
(`SamplingParams`, static) or per row (`RowSampling`, arrays: the slot decoder).

Three ways to draw from the filtered distribution (`TRACE_JAX_SAMPLER`); H200 figures of one
draw over 151,936 entries at B 256 (benchmarks/results/session29_h200_2026-12-03, same run):
- "gumbel" (default): `jax.random.categorical`, the argmax of the logits plus a Gumbel variate
  per vocabulary entry from the row's key (threefry bits for every entry): 301 us, as long as
  the model's lm_head product.
- "hashed_gumbel": the same Gumbel-max rule with each entry's uniform from a counter hash of
  (the row's two seed words, the entry's index) (`hashed_gumbel_sample`: two rounds of the
  murmur3 finalizer, a few integer operations an entry where threefry takes ~20 rounds):
  190 us (0.63x).
- "inverse_cdf": one uniform per row against the cumulative probabilities, in blocks
  (`inverse_cdf_sample`): 157 us (0.52x); the 4-layer FP4 decode step's kernels at the
  8k-capacity shape 1.709 (gumbel) / 1.603 (hashed_gumbel) / 1.549 ms.
The default stays "gumbel": the draws follow the same distribution (the same chi-square tests)
but not the same samples, and a draw's token moves when logit rounding moves it across the
noise. A tensor-parallel rollout (bf16 partial sums) drew the single-device rollout's tokens
bit for bit with the threefry Gumbel draws (tests/parallel/test_train.py); with the hashed ones
2 of 256 draws moved, with the inverse CDF (whose token moves when rounding shifts the
cumulative sums across the uniform at any entry, not only at the top two) 10% of positions
differed. Either opt-in saves 0.7-0.9% of a 48-layer decode step (16.8 ms) at B 256.
The "gumbel" draw as one Pallas kernel (threefry bits, Gumbel transform and argmax; the same
tokens bit for bit on the H200) took 250 us of the step against XLA's fusion's 257, and the
log-probabilities' max over the logits, which XLA had read in that fusion, became a 39 us pass
of its own: removed (benchmarks/results/session33_h200_2026-12-04/gumbel_argmax_kernel.patch).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.settings import choice_setting

SAMPLER = choice_setting(
    "TRACE_JAX_SAMPLER", "gumbel", ("gumbel", "hashed_gumbel", "inverse_cdf"),
    doc="the sampler's draw: Gumbel per entry, Gumbel from a counter hash, or inverse CDF")
CDF_BLOCK = 512  # vocabulary entries a block of `inverse_cdf_sample`'s two-level prefix sums


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


def _prefix_sums(v: jax.Array) -> jax.Array:
  """Inclusive prefix sums along the last axis of a short axis, as one [.., n, n] masked sum:
  every output sums the same tree with zeros for the entries past it, so the sums are
  nondecreasing wherever v >= 0 (floating-point addition is monotone)."""
  n = v.shape[-1]
  lower = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]
  return jnp.sum(jnp.where(lower, v[..., None, :], 0), axis=-1)


def inverse_cdf_sample(keys: jax.Array, logits: jax.Array) -> jax.Array:
  """One token `[B]` int32 per row of logits `[B, V]` (-inf: excluded), drawn with probability
  softmax(logits) by inverting the row's cumulative distribution at one uniform from its key
  (`invert_cdf`)."""
  u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
  return invert_cdf(u, logits)


def invert_cdf(u: jax.Array, logits: jax.Array) -> jax.Array:
  """The entry `[B]` at which each row's cumulative distribution first passes u `[B]` in [0, 1):
  the weights exp(logit - max) summed in blocks of `CDF_BLOCK`, the block whose cumulative sum
  first passes u * total, then the entry inside it. The entry always has a positive weight:
  blocks and entries are chosen where the (monotone) cumulative sums rise, a target that
  rounding puts at the total takes the last block with weight, and one past the block's own sum
  the block's last entry with weight."""
  b, v = logits.shape
  block = min(CDF_BLOCK, v)  # a short vocabulary is one block (its sums are [B, block, block])
  w = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))  # [B, V], 0 where excluded
  nb = -(-v // block)
  wb = jnp.pad(w, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
  ends = _prefix_sums(jnp.sum(wb, axis=-1))  # [B, nb] cumulative block sums
  total = ends[:, -1:]
  target = u * total[:, 0]
  # the first block whose end passes the target; at most the last one with weight (the first
  # whose end is the total), where u * total rounds up to the total
  blk = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), jnp.sum(ends < total, axis=-1))
  base = jnp.where(blk > 0, jnp.take_along_axis(ends, jnp.maximum(blk - 1, 0)[:, None],
                                                axis=-1)[:, 0], 0.0)
  inner = jnp.take_along_axis(wb, blk[:, None, None], axis=1)[:, 0]  # [B, block]
  k = jnp.sum(_prefix_sums(inner) <= (target - base)[:, None], axis=-1)
  last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)  # the block's last weight
  return (blk * block + jnp.where(k < block, k, last)).astype(jnp.int32)


def _mix32(h: jax.Array) -> jax.Array:
  """The murmur3 32-bit finalizer: every input bit flips each output bit with probability
  about 1/2."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def hashed_gumbel_sample(keys: jax.Array, logits: jax.Array) -> jax.Array:
  """One token `[B]` int32 per row of logits `[B, V]` (-inf: excluded): the argmax of the
  logits plus Gumbel noise -log(-log(u)), u from 24 bits of a hash of (the row's two seed words
  from its key, the entry's index), midpoints of 2^24 bins in (0, 1). Elementwise work fused
  into the argmax: the logits are read once and nothing the size of them is generated."""
  seeds = jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys)  # [B, 2]
  idx = jnp.arange(logits.shape[-1], dtype=jnp.uint32)[None, :]
  h = _mix32(_mix32(idx * jnp.uint32(0x9E3779B9) ^ seeds[:, :1]) ^ seeds[:, 1:])
  u = ((h >> 8).astype(jnp.float32) + 0.5) * (2.0 ** -24)
  return jnp.argmax(logits - jnp.log(-jnp.log(u)), axis=-1).astype(jnp.int32)


def _draw(keys: jax.Array, scaled: jax.Array) -> jax.Array:
  """Tokens `[B]` from temperature-scaled, filtered logits by the `SAMPLER` rule."""
  if SAMPLER == "inverse_cdf":
    return inverse_cdf_sample(keys, scaled)
  if SAMPLER == "hashed_gumbel":
    return hashed_gumbel_sample(keys, scaled)
  return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, scaled)


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
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), _draw(keys, scaled))
  else:
    logp_all = jax.nn.log_softmax(logits / params.logprob_temperature, axis=-1)
    if params.greedy:
      tokens = jnp.argmax(logits, axis=-1)
    else:
      scaled = filter_logits(logits / params.temperature, params.top_k, params.top_p)
      tokens = _draw(keys, scaled)
  tokens = tokens.astype(jnp.int32)
  return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
