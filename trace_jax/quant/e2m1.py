"""The E2M1 (FP4) element: encoding, decoding, neighbours and nibble packing.

One definition of each element rule lives here (see NUMERICS.md): round to nearest with ties to
the even mantissa bit, saturating at +-6; stochastic rounding between grid neighbours; the
bracket of grid neighbours used by guided rounding; two codes per byte, low nibble = even index;
the bit placement of 32-bit code words that the Mosaic GPU kernels decode in registers
(`wgmma_bit_sources`, the KV cache's `place_kv_words`).
Codes are `uint8` in 0..15: bit 3 is the sign, bits 2..0 index the magnitude grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.settings import choice_setting

# Magnitudes of codes 0..7. Adjacent magnitudes alternate their mantissa bit (code & 1).
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
# All 16 codes; code 8 is -0.
E2M1_VALUES = np.concatenate([E2M1_GRID, -E2M1_GRID]).astype(np.float32)
E2M1_MAX = 6.0

# Rounding thresholds between neighbours i and i+1, and whether a tie goes up (to i+1) — it
# does exactly when i+1 is the even code, i.e. ties go to the even mantissa bit.
_MIDPOINTS = (E2M1_GRID[:-1] + E2M1_GRID[1:]) / 2  # 0.25 0.75 1.25 1.75 2.5 3.5 5
_TIE_GOES_UP = tuple(((i + 1) % 2 == 0) for i in range(7))
# x + 1.5 * 2**23 rounds float32 x (|x| < 2**22) to an integer in one rounding; the sum's bits
# less the constant's are that integer
_RINT_MAGIC = 1.5 * 2**23
_RINT_MAGIC_BITS = np.uint32(np.float32(_RINT_MAGIC).view(np.uint32))
# TRACE_JAX_E2M1_INDEX=midpoints: `magnitude_index_rtne` by its comparisons (the same values; the
# A/B side when timing the quantizing kernels)
_INDEX_BY = choice_setting(
    "TRACE_JAX_E2M1_INDEX", "bits", ("bits", "midpoints"),
    doc="quantizing kernels' E2M1 index by float32 arithmetic, or midpoint comparisons")


def _sign_bit(z: jax.Array) -> jax.Array:
  """1 where the sign bit of float32 `z` is set (so -0.0 -> code 8, as ml_dtypes casts)."""
  bits = jax.lax.bitcast_convert_type(z.astype(jnp.float32), jnp.uint32)
  return (bits >> 31).astype(jnp.uint8)


def magnitude_index_rtne(a: jax.Array) -> jax.Array:
  """Grid index (0..7) of |z| = `a` >= 0 under round-to-nearest-even, saturating at 6; NaN -> 0.

  By float32 arithmetic instead of a comparison per midpoint (7 compares and adds an element,
  in every quantizing kernel's body). Below 1 the grid is the multiples of 0.5
  (indices 0-2): 2a rounded to an integer by one float32 addition of 1.5 * 2**23, whose
  rounding is to nearest even, which is the even index. From 1 up the grid is float32 with one
  mantissa bit, index `2 * exponent field + mantissa bit - 252`: the bits rounded to that bit
  by an integer addition (half an ulp less one, plus the kept bit: ties to even), then
  saturated. Both are exact: `magnitude_index_by_midpoints` is the same function."""
  a = a.astype(jnp.float32)
  if _INDEX_BY == "midpoints":
    return magnitude_index_by_midpoints(a)
  u32 = jnp.uint32
  magic = np.float32(_RINT_MAGIC)
  below_1 = jax.lax.bitcast_convert_type(a * np.float32(2) + magic, u32) - _RINT_MAGIC_BITS
  u = jax.lax.bitcast_convert_type(a, u32)
  r = (u + (u32(0x1FFFFF) + ((u >> 22) & 1))) >> 22  # |a| < 2**128: no overflow
  from_1 = jnp.minimum(r, u32(259)) - u32(252)  # 259: 6.0's (or more) index 7
  idx = jnp.where(a < 1, below_1, from_1)
  return jnp.where(jnp.isnan(a), u32(0), idx).astype(jnp.uint8)


def magnitude_index_by_midpoints(a: jax.Array) -> jax.Array:
  """`magnitude_index_rtne` as one comparison per midpoint between grid neighbours (the plain
  statement of the rule, kept as its check)."""
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


def nibble_mantissa_bits(packed: jax.Array, *, in_kernel: bool = False) -> jax.Array:
  """`pack_bits(mantissa_bit(unpack_nibbles(packed)))` from nibble-packed codes `(..., n)`, n a
  multiple of 4: `(..., n / 4)`. Each 4-byte word's eight mantissa bits (its bits 4i) moved
  together by shifts, masks and ors, element-wise rather than a sum over eight, so XLA can
  fuse it into what reads the guidance (the step's records, a gather): the 48-layer FP4 decode
  step's 96 reduction kernels of the guided sites (4 a guided layer) became 63 element-wise
  ones, the rest fused, 1,107 -> 1,074 kernels a step (deviceless census, B 256, session 42).
  in_kernel: the words as Pallas kernel bodies form them (`_bytes_to_words`; the Triton
  lowering slices no register arrays), else by slices XLA fuses."""
  if packed.shape[-1] % 4:
    raise ValueError(f"nibble_mantissa_bits needs a last axis that is a multiple of 4, got "
                     f"{packed.shape}")
  if in_kernel:
    w = _bytes_to_words(packed)
  else:
    b = packed.astype(jnp.uint32).reshape(*packed.shape[:-1], packed.shape[-1] // 4, 4)
    w = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
  m = w & jnp.uint32(0x11111111)  # code i's mantissa bit is bit 4i
  m = (m | (m >> 3)) & jnp.uint32(0x03030303)  # pairs: bits 8k, 8k + 1
  m = (m | (m >> 6)) & jnp.uint32(0x000F000F)  # quads: bits 16k .. 16k + 3
  return ((m | (m >> 12)) & jnp.uint32(0xFF)).astype(jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_bits`: (..., n) uint8 -> (..., 8n) values in {0, 1}."""
  shifts = jnp.arange(8, dtype=jnp.uint8)
  bits = (packed[..., None] >> shifts) & 1
  return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(jnp.uint8)


# --------------------------------------------------------------------------- bit-placed words

def wgmma_bit_sources() -> np.ndarray:
  """src[o, v, b]: bit of a 32-bit code word feeding E2M1 bit b (0 m, 1 e0, 2 e1, 3 s) of
  decoded register o (0..3), half v (`kernels.fp4_mgpu.WEIGHT_DECODE_ASM`). Each bit lands on
  its bf16 place (m 6, e0 7, e1 8, s 15, + 16 v) by one word-wide move and one mask: register 0
  in place, register 1 shifted left by 4, register 2 rotated left by 10, register 3 shifted
  left by 6 but for e1, shifted right by 2. (No four moves of one mask cover the word: the e1
  bits of register 3 take a second move.)"""
  dst = np.array([6, 7, 8, 15])[None, None, :] + 16 * np.arange(2)[None, :, None]  # [1, v, b]
  rot = np.array([0, 4, 10, 6])[:, None, None] + np.zeros((1, 2, 4), int)  # left by, per reg
  rot[3, :, 2] = -2  # register 3's e1: right by 2
  src = (dst - rot) % 32
  assert sorted(src.ravel().tolist()) == list(range(32))
  return src


def _kv_word_places() -> np.ndarray:
  """places[n]: the bit of a placed KV word that holds bit n of the natural word (8 codes,
  code e in bits 4e..4e+3, as `pack_nibbles` lays 4 bytes out little-endian). The decode
  attention kernel pairs the word's codes as (0, 2), (1, 3), (4, 6), (5, 7) into its four
  bf16x2 registers (the head_dim order `attention_mgpu.PHYS_TO_LOGICAL` undoes), so code
  `e = 4 (o // 2) + o % 2 + 2 v` goes to register o, half v of `wgmma_bit_sources`."""
  src = wgmma_bit_sources()
  places = np.empty(32, int)
  for o in range(4):
    for v in range(2):
      e = 4 * (o // 2) + o % 2 + 2 * v
      places[4 * e:4 * e + 4] = src[o, v]
  return places


KV_WORD_PLACES = _kv_word_places()


def _rotations(places: np.ndarray) -> list[tuple[int, int]]:
  """A bit permutation (bit n -> places[n]) as (mask, left rotation) pairs: the bits that
  move by the same rotation travel together (9 pairs for the KV words)."""
  turn = (places - np.arange(32)) % 32
  return [(sum(1 << int(n) for n in np.flatnonzero(turn == d)), int(d))
          for d in np.unique(turn)]


def _permute_word_bits(w: jax.Array, places: np.ndarray) -> jax.Array:
  """uint32 words with bit n moved to bit places[n] (shifts, masks and ors only: traceable
  inside Pallas kernel bodies)."""
  out = jnp.zeros_like(w)
  for mask, d in _rotations(places):
    m = w & jnp.uint32(mask)
    out = out | (m if d == 0 else (m << jnp.uint32(d)) | (m >> jnp.uint32(32 - d)))
  return out


def _bytes_to_words(packed: jax.Array) -> jax.Array:
  """[..., 4n] uint8 -> [..., n] uint32, byte k of each 4 in bits 8k.. (little-endian, the
  GPU's view of the bytes as words). A sum of disjoint bits, not a bitcast: Pallas's Triton
  lowering slices and bitcasts no register arrays."""
  *lead, n4 = packed.shape
  if n4 % 4:
    raise ValueError(f"code words need a last axis that is a multiple of 4 bytes, got {n4}")
  b = packed.reshape(*lead, n4 // 4, 4).astype(jnp.uint32)
  shift = (8 * jax.lax.broadcasted_iota(jnp.int32, (1,) * len(lead) + (1, 4), len(lead) + 1))
  return jnp.sum(b << shift.astype(jnp.uint32), axis=-1, dtype=jnp.uint32)


def _words_to_bytes(w: jax.Array) -> jax.Array:
  """Inverse of `_bytes_to_words`."""
  *lead, n = w.shape
  shift = (8 * jax.lax.broadcasted_iota(jnp.int32, (1,) * len(lead) + (1, 4), len(lead) + 1))
  b = (w[..., None] >> shift.astype(jnp.uint32)) & jnp.uint32(0xFF)
  return b.astype(jnp.uint8).reshape(*lead, 4 * n)


def place_kv_words(packed: jax.Array) -> jax.Array:
  """Nibble-packed FP4 codes `[..., 4n]` uint8 (`pack_nibbles`, the last axis the block axis)
  -> the same bytes with each 4-byte word's bits in the decode attention kernel's order
  (`KV_WORD_PLACES`): its decode then takes 13 instructions a word instead of 17."""
  return _words_to_bytes(_permute_word_bits(_bytes_to_words(packed), KV_WORD_PLACES))


def unplace_kv_words(packed: jax.Array) -> jax.Array:
  """Inverse of `place_kv_words`."""
  return _words_to_bytes(_permute_word_bits(_bytes_to_words(packed), np.argsort(KV_WORD_PLACES)))
