"""E2M1 element rules: exhaustive codes, every tie, saturation, packing, stochastic rounding."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.quant import np_reference as ref
from trace_jax.quant import e2m1


def test_decode_all_16_codes():
  got = np.asarray(e2m1.decode(jnp.arange(16, dtype=jnp.uint8)))
  want = [ref.e2m1_value(c) for c in range(16)]
  np.testing.assert_array_equal(got, want)
  assert np.signbit(got[8])  # code 8 is -0
  # And it agrees with ml_dtypes' own float4_e2m1fn decoding of every bit pattern.
  ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
  np.testing.assert_array_equal(got, ml)


@pytest.mark.parametrize("v,code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # all ties
    (-0.25, 8), (-0.75, 10), (-1.25, 10), (-1.75, 12), (-2.5, 12), (-3.5, 14), (-5.0, 14),
    (6.0, 7), (7.0, 7), (1e30, 7), (-100.0, 15), (0.0, 0), (-0.0, 8), (-0.1, 8)])
def test_every_tie_and_saturation(v, code):
  assert int(e2m1.encode(jnp.float32(v))) == code
  assert ref.e2m1_code(v) == code


def test_encode_every_grid_value_and_neighbourhood():
  vals = []
  for g in ref.GRID:
    for d in (0.0, 1e-6, -1e-6, 0.124, -0.124):
      vals += [g + d, -(g + d)]
  vals = np.array(vals, np.float32)
  got = np.asarray(e2m1.encode(jnp.asarray(vals)))
  np.testing.assert_array_equal(got, [ref.e2m1_code(v) for v in vals])


def test_encode_random_matches_reference_and_ml_dtypes():
  rng = np.random.default_rng(0)
  z = np.concatenate([rng.uniform(-7, 7, 4000), rng.standard_normal(2000) * 3]).astype(np.float32)
  # Add exact ties and their float32 neighbours.
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  z = np.concatenate([z, mids, -mids, np.nextafter(mids, 10), np.nextafter(mids, -10)])
  got = np.asarray(e2m1.encode(jnp.asarray(z)))
  np.testing.assert_array_equal(got, [ref.e2m1_code(v) for v in z])
  ml = z.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 15
  np.testing.assert_array_equal(got, ml)


def test_pack_layout_matches_bitcast_and_roundtrips():
  rng = np.random.default_rng(1)
  codes = rng.integers(0, 16, size=(3, 10), dtype=np.uint8)
  packed = e2m1.pack_nibbles(jnp.asarray(codes))
  assert packed.shape == (3, 5) and packed.dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(e2m1.unpack_nibbles(packed)), codes)
  # Low nibble = even index: exactly what bitcasting a byte to two float4_e2m1fn returns.
  as_fp4 = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
  assert as_fp4.shape == (3, 5, 2)
  want = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32).reshape(3, 5, 2)
  np.testing.assert_array_equal(np.asarray(as_fp4.astype(jnp.float32)), want)
  np.testing.assert_array_equal(np.asarray(packed)[0, 0], codes[0, 0] | (codes[0, 1] << 4))
  with pytest.raises(ValueError, match="even"):
    e2m1.pack_nibbles(jnp.zeros((3,), jnp.uint8))


def test_bit_packing_roundtrip():
  rng = np.random.default_rng(2)
  bits = rng.integers(0, 2, size=(4, 24), dtype=np.uint8)
  packed = np.asarray(e2m1.pack_bits(jnp.asarray(bits)))
  assert packed.shape == (4, 3)
  np.testing.assert_array_equal(packed[1, 0], sum(int(bits[1, i]) << i for i in range(8)))
  np.testing.assert_array_equal(np.asarray(e2m1.unpack_bits(jnp.asarray(packed))), bits)


def test_nibble_mantissa_bits_equal_unpacked_bit_packing():
  """The compact guidance payload straight from nibble-packed codes equals unpacking the codes,
  taking each code's mantissa bit and packing eight a byte: every byte value at every one of a
  word's four places (the others random), and random arrays, with the words formed either way;
  its layout checked by hand."""
  rng = np.random.default_rng(3)
  words = rng.integers(0, 256, size=(4, 256, 4), dtype=np.uint8)
  for j in range(4):
    words[j, :, j] = np.arange(256)
  cases = [words.reshape(4, 1024), rng.integers(0, 256, size=(3, 2, 36), dtype=np.uint8)]
  for packed in cases:
    want = e2m1.pack_bits(e2m1.mantissa_bit(e2m1.unpack_nibbles(jnp.asarray(packed))))
    for in_kernel in (False, True):  # the words by slices (XLA) or by sums (kernel bodies)
      got = jax.jit(functools.partial(e2m1.nibble_mantissa_bits, in_kernel=in_kernel))(
          jnp.asarray(packed))
      assert got.dtype == jnp.uint8 and got.shape == packed.shape[:-1] + (packed.shape[-1] // 4,)
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # codes 1, 0, 3, 2, 5, 4, 7, 6 (mantissa bits 1 0 1 0 1 0 1 0) -> 0b01010101
  codes = np.array([1, 0, 3, 2, 5, 4, 7, 6], np.uint8)
  assert int(e2m1.nibble_mantissa_bits(e2m1.pack_nibbles(jnp.asarray(codes)))[0]) == 0x55
  with pytest.raises(ValueError, match="multiple of 4"):
    e2m1.nibble_mantissa_bits(jnp.zeros((6,), jnp.uint8))


def test_mantissa_bits_alternate_along_grid():
  bits = np.asarray(e2m1.mantissa_bit(jnp.arange(16, dtype=jnp.uint8)))
  np.testing.assert_array_equal(bits, [0, 1] * 8)


def _np_index_by_midpoints(a: np.ndarray) -> np.ndarray:
  """The RTNE grid index as numpy comparisons with the midpoints (ties up to even indices)."""
  mids = (np.array(ref.GRID[:-1], np.float32) + np.array(ref.GRID[1:], np.float32)) / 2
  idx = np.zeros(a.shape, np.uint8)
  for i, mid in enumerate(mids):
    idx += (a >= mid) if (i + 1) % 2 == 0 else (a > mid)
  return idx


def test_magnitude_index_by_bits_equals_the_midpoint_rule():
  # every exponent and top 11 mantissa bits with low bits 0, 1, the ulps around the half and the
  # top (ties and their neighbours), every pattern within 2,048 ulps of each midpoint and grid
  # value, inf and NaNs
  hi = np.arange(1 << 19, dtype=np.uint32)[:, None] << 12
  lo = np.array([0, 1, 0x7FF, 0x800, 0x801, 0xFFF], np.uint32)
  near = np.array(ref.GRID[1:] + [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  near = near.view(np.uint32)[:, None] + np.arange(-2048, 2048, dtype=np.int64)
  special = np.array([0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF], np.uint32)
  u = np.concatenate([(hi | lo).ravel(), near.ravel().astype(np.uint32), special])
  a = u.view(np.float32)
  got = np.asarray(jax.jit(e2m1.magnitude_index_rtne)(a))
  np.testing.assert_array_equal(got, _np_index_by_midpoints(a))
  assert (got[-3:] == 0).all()  # NaN -> 0


@pytest.mark.slow
def test_magnitude_index_by_bits_every_float32():
  # all 2**31 non-negative float32 bit patterns against the midpoint comparisons (~10 s)
  as_f32 = lambda u: jax.lax.bitcast_convert_type(u, jnp.float32)  # noqa: E731
  bits = jax.jit(lambda u: e2m1.magnitude_index_rtne(as_f32(u)))
  mids = jax.jit(lambda u: e2m1.magnitude_index_by_midpoints(as_f32(u)))
  n = 1 << 26
  for start in range(0, 1 << 31, n):
    u = jnp.arange(start, start + n, dtype=jnp.uint32)
    assert int(jnp.sum(bits(u) != mids(u))) == 0, hex(start)


@pytest.mark.gpu
def test_magnitude_index_by_bits_every_float32_on_gpu():
  # all non-negative float32 bit patterns, compiled by XLA:GPU and inside a Pallas (Triton)
  # kernel body as the quantizing kernels trace it, against the midpoint comparisons (XLA)
  from jax.experimental import pallas as pl  # noqa: PLC0415
  from trace_jax.kernels import row_quant  # noqa: PLC0415
  as_f32 = lambda u: jax.lax.bitcast_convert_type(u, jnp.float32)  # noqa: E731
  n, block = 1 << 28, 1 << 14

  def body(u_ref, o_ref):
    o_ref[...] = e2m1.magnitude_index_rtne(as_f32(u_ref[...])).astype(jnp.int32)

  in_kernel = jax.jit(lambda u: pl.pallas_call(
      body, grid=(n // block,), in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
      out_specs=pl.BlockSpec((block,), lambda i: (i,)),
      out_shape=jax.ShapeDtypeStruct((n,), jnp.int32),
      compiler_params=row_quant.launch_params(False, 4))(u))
  xla = jax.jit(lambda u: e2m1.magnitude_index_rtne(as_f32(u)).astype(jnp.int32))
  mids = jax.jit(lambda u: e2m1.magnitude_index_by_midpoints(as_f32(u)).astype(jnp.int32))
  for start in range(0, 1 << 31, n):
    u = jnp.arange(start, start + n, dtype=jnp.uint32)
    want = mids(u)
    assert int(jnp.sum(xla(u) != want)) == 0, ("xla", hex(start))
    assert int(jnp.sum(in_kernel(u) != want)) == 0, ("kernel", hex(start))


def test_stochastic_rounding_neighbours_and_unbiased():
  z = jnp.asarray(np.array([0.1, 0.3, 1.2, 2.25, -2.75, 4.5, 5.5, 6.0, 9.0, 0.0], np.float32))
  n = 20000
  zz = jnp.broadcast_to(z, (n, z.size))
  codes = e2m1.encode_stochastic(zz, jax.random.key(0))
  vals = np.asarray(e2m1.decode(codes))
  zn = np.asarray(z)
  for j, v in enumerate(zn):
    a = min(abs(v), 6.0)
    lo = max(g for g in ref.GRID if g <= a)
    hi = min([g for g in ref.GRID if g >= a])
    seen = set(np.abs(vals[:, j]).tolist())
    assert seen <= {lo, hi}, (v, seen)
    # Unbiased: the mean equals the (saturated) value within 4 standard errors.
    sd = (hi - lo) / 2 / np.sqrt(n) + 1e-9
    assert abs(np.mean(np.abs(vals[:, j])) - a) < 4 * sd + 1e-7, v
  # Deterministic given the key.
  np.testing.assert_array_equal(codes, e2m1.encode_stochastic(zz, jax.random.key(0)))


def test_as_e4m3_bits_is_e2m1_over_64_for_every_code_pair():
  b = jnp.arange(256, dtype=jnp.uint8)
  for high, codes in ((False, np.arange(256) & 15), (True, np.arange(256) >> 4)):
    f8 = jax.lax.bitcast_convert_type(e2m1.as_e4m3_bits(b, high), jnp.float8_e4m3fn)
    got = np.asarray(f8.astype(jnp.float32)) * e2m1.E4M3_OF_E2M1_SCALE
    want = np.asarray(e2m1.decode(jnp.asarray(codes)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


# ------------------------------------------------------------------ bit-placed KV words

def _np_place(words: np.ndarray, places) -> np.ndarray:
  """Bit n of each uint32 word to bit places[n], one bit at a time (numpy)."""
  out = np.zeros_like(words)
  for n, p in enumerate(places):
    out |= ((words >> np.uint32(n)) & np.uint32(1)) << np.uint32(p)
  return out


def test_kv_word_places_route_codes_to_the_decoders_registers():
  """`KV_WORD_PLACES` sends code e's bits (m, e0, e1, s) to the bits `wgmma_bit_sources` names
  for register o, half v, where the decode attention kernel wants code 4 (o // 2) + o % 2 + 2 v
  (its registers hold codes (0, 2), (1, 3), (4, 6), (5, 7) of a word); a permutation."""
  src = e2m1.wgmma_bit_sources()
  pairs = {0: (0, 2), 1: (1, 3), 2: (4, 6), 3: (5, 7)}
  for o, codes in pairs.items():
    for v, e in enumerate(codes):
      np.testing.assert_array_equal(e2m1.KV_WORD_PLACES[4 * e:4 * e + 4], src[o, v])
  assert sorted(e2m1.KV_WORD_PLACES.tolist()) == list(range(32))


def test_place_kv_words_moves_every_bit_and_round_trips():
  """Every single-bit word and random bytes against a bit-by-bit numpy permutation of the
  little-endian words (the GPU's view of 4 cache bytes); `unplace_kv_words` inverts it."""
  rng = np.random.default_rng(0)
  single = (np.uint32(1) << np.arange(32, dtype=np.uint32))
  words = np.concatenate([single, rng.integers(0, 2**32, 500, dtype=np.uint64).astype(np.uint32)])
  packed = words.view(np.uint8).reshape(-1, 8)  # rows of two words
  got = np.asarray(e2m1.place_kv_words(jnp.asarray(packed)))
  want = _np_place(words, e2m1.KV_WORD_PLACES).view(np.uint8).reshape(-1, 8)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(np.asarray(e2m1.unplace_kv_words(jnp.asarray(got))), packed)
  with pytest.raises(ValueError, match="multiple of 4 bytes"):
    e2m1.place_kv_words(jnp.zeros((3, 6), jnp.uint8))
