"""The rollout's token draw, `jax.random.categorical` per row (the Gumbel-max rule with
threefry bits), in one Pallas kernel: the same token bit for bit, without XLA's fusion cost.

Owns the kernel, its support rule and its wrapper. The result is defined by
`jax.vmap(jax.random.categorical)(keys, logits)` under JAX's defaults (the threefry2x32 PRNG,
`jax_threefry_partitionable` on, low-range Gumbel draws): for entry v of a row with key words
(k0, k1), bits = x0 ^ x1 of threefry2x32((k0, k1), (0, v)); u = max(tiny, float(bits >> 9 |
1.0f) - 1 + tiny); the token is the first index of the largest logit - log(-log(u)). The kernel
computes exactly those operations in float32 (the logarithms are libdevice's `__nv_logf`, as
XLA's), keeps a running best (value, index) per lane over tiles of the row, and reduces the
lanes and the row's programs at the end with ties to the lower index, as `jnp.argmax`.

Why: at B 256 over 151,936 entries XLA's fusion of the threefry bits, the two logarithms and
the argmax took 257 us a step on the H200 (session 29 and 33 profiles), about twice the
instructions' time; the row's logits are read once either way.

Lowering: a portable Pallas body, `interpret=True` on CPU (tests), the Triton lowering on the
GPU. Rows a program takes: `TILE`-entry tiles of a `splits`-th of the row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

TILE = 1024  # entries a loop step (a program's lanes)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA
_TINY = float(np.finfo(np.float32).tiny)
_IDX_NONE = np.iinfo(np.int32).max


def _rotl(x, r: int):
  return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32, 20 rounds (the JAX PRNG's hash), on uint32 arrays; (y0, y1)."""
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def gumbel_noise(k0, k1, index):
  """float32 -log(-log(u)) of entries `index` (uint32) for key words (k0, k1), as
  `jax.random.gumbel` draws them (low-range mode)."""
  y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(index), index)
  bits = (y0 ^ y1) >> np.uint32(9) | np.uint32(0x3F800000)
  floats = lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(1.0)
  u = jnp.maximum(jnp.float32(_TINY), floats * jnp.float32(1.0) + jnp.float32(_TINY))
  return -jnp.log(-jnp.log(u))


def _better(val, idx, best_val, best_idx):
  """(val, idx) ranks before (best_val, best_idx) in `jnp.argmax`'s order: NaN first, then the
  larger value, then the lower index."""
  nan, best_nan = jnp.isnan(val), jnp.isnan(best_val)
  return (nan & ~best_nan) | (~nan & ~best_nan & (val > best_val)) | (
      (nan == best_nan) & ((val == best_val) | nan) & (idx < best_idx))


def _kernel(keys_ref, logits_ref, val_ref, idx_ref, *, v: int, span: int):
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  row, part = pl.program_id(0), pl.program_id(1)
  k0, k1 = keys_ref[row, 0], keys_ref[row, 1]
  start = part * span
  lane = jnp.arange(TILE, dtype=jnp.int32)

  def step(t, best):
    best_val, best_idx = best
    idx = start + t * TILE + lane
    live = idx < jnp.minimum(start + span, v)
    x = plt.load(logits_ref.at[row, pl.ds(start + t * TILE, TILE)], mask=live,
                 other=-jnp.inf)
    val = x + gumbel_noise(k0, k1, idx.astype(jnp.uint32))
    take = live & _better(val, idx, best_val, best_idx)
    return jnp.where(take, val, best_val), jnp.where(take, idx, best_idx)

  best = lax.fori_loop(0, span // TILE, step,
                       (jnp.full((TILE,), -jnp.inf, jnp.float32),
                        jnp.full((TILE,), _IDX_NONE, jnp.int32)))
  # lanes to one (the Triton lowering slices no register array: reductions): the first NaN,
  # else the lowest index of the largest value
  best_val, best_idx = best
  nan = jnp.isnan(best_val)
  top = jnp.max(jnp.where(nan, -jnp.inf, best_val))
  first_nan = jnp.min(jnp.where(nan, best_idx, _IDX_NONE))
  first_top = jnp.min(jnp.where(best_val == top, best_idx, _IDX_NONE))
  any_nan = first_nan < _IDX_NONE
  best_val = jnp.full((1,), jnp.where(any_nan, jnp.nan, top), jnp.float32)
  best_idx = jnp.full((1,), jnp.where(any_nan, first_nan, first_top), jnp.int32)
  one = jnp.arange(1) < 1
  plt.store(val_ref.at[row, pl.ds(part, 1)], best_val, mask=one)
  plt.store(idx_ref.at[row, pl.ds(part, 1)], best_idx, mask=one)


def kernel_supported(key_words, logits) -> str | None:
  """None if the kernel draws `jax.random.categorical`'s tokens for these key words `[B, 2]`
  uint32 and logits `[B, V]`, else why not."""
  if logits.ndim != 2 or logits.dtype != jnp.float32:
    return f"logits of shape {logits.shape} and dtype {logits.dtype}, not [B, V] float32"
  if key_words.shape != (logits.shape[0], 2) or key_words.dtype != jnp.uint32:
    return f"key words of shape {key_words.shape} and dtype {key_words.dtype}, not [B, 2] uint32"
  if not 0 < logits.shape[1] < 2**31 - 2 * TILE:
    return f"{logits.shape[1]} entries a row"
  if jax.config.jax_default_prng_impl != "threefry2x32":
    return f"the PRNG is {jax.config.jax_default_prng_impl}, the kernel computes threefry2x32"
  if not jax.config.jax_threefry_partitionable:
    return "jax_threefry_partitionable is off (the kernel counts entries as it does when on)"
  if jax.config.jax_high_dynamic_range_gumbel:
    return "high-range Gumbel draws are on (the kernel draws the low-range ones)"
  return None


def default_splits(b: int, v: int) -> int:
  """Programs a row: enough for about four waves of 132 SMs (a batch-1 draw is 148 programs
  of one tile at V 151,936; B 256 three a row), each at least a tile."""
  return int(max(1, min(-(-4 * 132 // b), v // TILE)))


@functools.partial(jax.jit, static_argnames=("splits", "num_warps", "interpret"))
def gumbel_argmax(key_words: jax.Array, logits: jax.Array, *, splits: int | None = None,
                  num_warps: int = 4, interpret: bool = False) -> jax.Array:
  """Tokens `[B]` int32: `jax.vmap(jax.random.categorical)(keys, logits)` for raw threefry key
  words `[B, 2]` uint32 (`jax.random.key_data` of the keys) and float32 logits `[B, V]` (-inf:
  excluded), bit for bit. interpret: run the body on CPU (tests)."""
  why = kernel_supported(key_words, logits)
  if why:
    raise ValueError(f"gumbel_argmax kernel: {why}")
  b, v = logits.shape
  s = splits or default_splits(b, v)
  span = -(-(-(-v // s)) // TILE) * TILE  # a program's entries, whole tiles
  s = -(-v // span)
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - GPU lowering only
    compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=2)
  whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, 0))  # noqa: E731
  vals, idxs = pl.pallas_call(
      functools.partial(_kernel, v=v, span=span),
      grid=(b, s),
      in_specs=[whole((b, 2)), whole((b, v))],
      out_specs=[whole((b, s)), whole((b, s))],
      out_shape=[jax.ShapeDtypeStruct((b, s), jnp.float32),
                 jax.ShapeDtypeStruct((b, s), jnp.int32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="gumbel_argmax",
  )(key_words, logits)
  # the row's programs in order: the first best part (jnp.argmax: NaN first, first of ties)
  part = jnp.argmax(vals, axis=-1)
  return jnp.take_along_axis(idxs, part[:, None], axis=-1)[:, 0]
