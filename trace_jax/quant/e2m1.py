"""The E2M1 (FP4) element: encoding, decoding, neighbours and nibble packing.

One definition of each element rule lives here (see NUMERICS.md): round to nearest with ties to
the even mantissa bit, saturating at +-6; stochastic rounding between grid neighbours; the
bracket of grid neighbours used by guided rounding; two codes per byte, low nibble = even index.
Codes are `uint8` in 0..15: bit 3 is the sign, bits 2..0 index the magnitude grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# Magnitudes of codes 0..7. Adjacent magnitudes alternate their mantissa bit (code & 1).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# All 16 codes; code 8 is -0.
E2M1_VALUES = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)
E2M1_MAX = 6.0

# Rounding thresholds between neighbours i and i+1, and whether a tie goes up (to i+1) — it
# does exactly when i+1 is the even code, i.e. ties go to the even mantissa bit.
_MIDPOINTS = (E2M1_GRID[:-1] + E2M1_GRID[1:]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
_TIE_GOES_UP = tuple(((i + 1) % 2 == 0) for i in range(7))


def _sign_bit(z: jax.Array) -> jax.Array:
  """1 where the sign bit of float32 `z` is set (so -0.0 -> code 8, as ml_dtypes casts)."""
  bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.uint32)
  return (bits >> 31).astype(jnp.uint8)


def magnitude_index_rtne(a: jax.Array) -> jax.Array:
  """Grid index (0..7) of |z| = `a` >= 0 under round-to-nearest-even, saturating at 6."""
  idx = jnp.zeros(a.shape, jnp.uint8)
  for mid, up in zip(_MIDPOINTS, _TIE_GOES_UP):
    idx = idx + (a >= mid if up else a > mid).astype(jnp.uint8)
  return idx


def floor_index(a: jax.Array) -> jax.Array:
  """Index of the largest grid magnitude <= `a` (0..7); 7 for a >= 6."""
  idx = jnp.zeros(a.shape, jnp.uint8)
  for v in E2M1_GRID[1:]:
    idx = idx + (a >= v).astype(jnp.uint8)
  return idx


def grid_value(idx: jax.Array) -> jax.Array:
  """Magnitude of grid index `idx` (0..7) as float32."""
  return jnp.asarray(E2M1_GRID)[idx.astype(jnp.int32)]


def encode(z: jax.Array) -> jax.Array:
  """E2M1 codes of `z` (already divided by its scale): RTNE, saturating. NaN maps to a zero code
  (callers make NaN visible through the scale, never through the code)."""
  z = z.astype(jnp.float32)
  return magnitude_index_rtne(jnp.abs(z)) | (_sign_bit(z) << 3)


def encode_stochastic(z: jax.Array, key: jax.Array) -> jax.Array:
  """E2M1 codes with stochastic rounding: between neighbours lo <= |z| < hi round up with
  probability (|z| - lo) / (hi - lo); saturating at 6. For gradients only."""
  z = z.astype(jnp.float32)
  a = jnp.minimum(jnp.abs(z), E2M1_MAX)
  lo_idx = floor_index(a)
  hi_idx = jnp.minimum(lo_idx + 1, 7).astype(jnp.uint8)
  lo, hi = grid_value(lo_idx), grid_value(hi_idx)
  p_up = jnp.where(hi > lo, (a - lo) / jnp.where(hi > lo, hi - lo, 1.0), 0.0)
  u = jax.random.uniform(key, a.shape, jnp.float32)
  idx = jnp.where(u < p_up, hi_idx, lo_idx)
  return idx | (_sign_bit(z) << 3)


def decode(codes: jax.Array) -> jax.Array:
  """float32 values of E2M1 codes (0..15)."""
  return jnp.asarray(E2M1_VALUES)[codes.astype(jnp.int32) & 15]


E4M3_OF_E2M1_SCALE = 64.0  # e4m3 value of `as_e4m3_bits(c)` times this is E2M1(c)


def as_e4m3_bits(packed: jax.Array, high: bool) -> jax.Array:
  """The low (high: the high) E2M1 nibble of packed bytes, re-placed as a `float8_e4m3fn` bit
  pattern whose value is exactly `E2M1(code) * 2**-6`: sign to bit 7, the three magnitude bits
  `e1 e0 m` to bits 4..2 (exponent field `e`, bias 7; `e = 0` is the e4m3 subnormal `m/2 *
  2**-6`). Kernels decode FP4 with these four integer ops and the hardware e4m3 conversion."""
  b = packed.astype(jnp.uint8)
  if high:
    return ((b >> 2) & 0x1C) | (b & 0x80)
  return ((b & 7) << 2) | ((b & 8) << 4)


def mantissa_bit(codes: jax.Array) -> jax.Array:
  """The mantissa bit (0/1) of each code: the compact guidance TRACE records."""
  return (codes & 1).astype(jnp.uint8)


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """Pack codes (last axis even length) two per byte, even index in the low nibble."""
  if codes.shape[-1] % 2:
    raise ValueError(f"pack_nibbles needs an even last axis, got shape {codes.shape}")
  pairs = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return (pairs[..., 0] & 15) | ((pairs[..., 1] & 15) << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_nibbles`: (..., n) uint8 -> (..., 2n) codes."""
  lo = packed & 15
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_bits(bits: jax.Array) -> jax.Array:
  """Pack 0/1 values (last axis a multiple of 8) eight per byte, element i in bit i % 8."""
  if bits.shape[-1] % 8:
    raise ValueError(f"pack_bits needs a last axis that is a multiple of 8, got {bits.shape}")
  b = bits.astype(jnp.uint8).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
  weights = jnp.asarray([1 << i for i in range(8)], jnp.uint8)
  return jnp.sum(b * weights, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_bits`: (..., n) uint8 -> (..., 8n) values in {0, 1}."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  bits = (packed[..., None] >> shifts) & 1
  return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(jnp.uint8)
