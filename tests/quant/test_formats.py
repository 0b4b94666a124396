"""quantize/dequantize for every format against the slow numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.quant import np_reference as ref
from trace_jax import quant as tq
from trace_jax.quant import formats as F


def _data(kind, shape, seed):
  rng = np.random.default_rng(seed)
  if kind == "normal":
    return rng.standard_normal(shape).astype(np.float32)
  if kind == "student_t":
    return rng.standard_t(3, shape).astype(np.float32)
  # Wide dynamic range across blocks: exercises many exponents, tiny and huge blocks.
  scale = 2.0 ** rng.integers(-30, 30, size=shape[:-1] + (shape[-1] // 16, 1))
  x = rng.standard_normal(shape[:-1] + (shape[-1] // 16, 16)) * scale
  return x.reshape(shape).astype(np.float32)


def test_e8m0_exponent_exact_boundaries():
  fmt = tq.get_format("mxfp4")
  floor = tq.get_format("mxfp4_floor")
  vals = []
  for e in (-100, -3, -1, 0, 1, 5, 100):
    b = 6.0 * 2.0**e
    vals += [b, np.nextafter(np.float32(b), 0), np.nextafter(np.float32(b), np.inf),
             2.0**e, 0.75 * 2.0**e, 4.5 * 2.0**e]
  vals = np.array(vals, np.float32)
  got = np.asarray(F.e8m0_exponent(jnp.asarray(vals), fmt))
  np.testing.assert_array_equal(got, [ref.e8m0_exp(float(v), 6.0, "ceil") for v in vals])
  got = np.asarray(F.e8m0_exponent(jnp.asarray(vals), floor))
  np.testing.assert_array_equal(got, [ref.e8m0_exp(float(v), 6.0, "floor") for v in vals])
  assert int(F.e8m0_exponent(jnp.float32(0.0), fmt)) == -127


def test_e4m3_block_scale_rounding_matches_enumeration():
  rng = np.random.default_rng(3)
  r = np.concatenate([rng.uniform(0, 448, 3000), 2.0 ** rng.uniform(-12, 9, 3000),
                      ref.E4M3_POS, (ref.E4M3_POS[1:] + ref.E4M3_POS[:-1]) / 2]).astype(np.float32)
  got = np.asarray(F.e4m3_block_scale(jnp.asarray(r), jnp.float32(1 / 6)).astype(jnp.float32))
  want = [ref.e4m3_round(float(np.clip(v * (np.float32(1) / np.float32(6 * np.float32(1 / 6))),
                                       2.0**-9, 448))) for v in r]
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_floor"])
@pytest.mark.parametrize("kind", ["normal", "student_t", "wide"])
def test_mxfp4_matches_reference(fmt, kind):
  x = _data(kind, (6, 96), seed=hash((fmt, kind)) % 1000)
  q = tq.quantize(jnp.asarray(x), fmt)
  codes, exps, want = ref.quantize_mx_rows(x, 32, tq.get_format(fmt).scale_rule)
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), codes)
  got_e = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)).astype(int) - 127
  np.testing.assert_array_equal(got_e, exps)
  np.testing.assert_array_equal(np.asarray(tq.dequantize(q)), want.astype(np.float32))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_4o6"])
@pytest.mark.parametrize("kind", ["normal", "student_t", "wide"])
@pytest.mark.parametrize("scope", ["tensor", "row"])
def test_nvfp4_matches_reference(fmt, kind, scope):
  x = _data(kind, (5, 64), seed=7 + len(fmt) + len(kind))
  q = tq.quantize(jnp.asarray(x), fmt, second_level=scope)
  codes, scales, gs, want = ref.quantize_nvfp4_rows(x, scope, fmt.endswith("4o6"))
  np.testing.assert_array_equal(np.asarray(q.unpacked_codes()), codes)
  np.testing.assert_array_equal(np.asarray(q.scales.astype(jnp.float32)), scales)
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(q.global_scale), (5, 1))[:, 0], gs)
  np.testing.assert_array_equal(np.asarray(tq.dequantize(q)), want)


def test_four_over_six_never_worse_per_block():
  x = _data("student_t", (8, 256), 11)
  e6 = (np.asarray(tq.dequantize(tq.quantize(jnp.asarray(x), "nvfp4", second_level="row"))) - x)
  # 4/6 uses g with 256; compare against its own scale-6-only choice by reference.
  _, _, _, only6 = ref.quantize_nvfp4_rows(x, "row", four_over_six=False)
  assert np.array_equal(e6 + x, only6)
  q46 = tq.dequantize(tq.quantize(jnp.asarray(x), "nvfp4_4o6", second_level="row"))
  assert np.mean((np.asarray(q46) - x) ** 2) < np.mean(e6**2)


def test_mxfp8_matches_reference():
  x = _data("student_t", (4, 64), 5)
  q = tq.quantize(jnp.asarray(x), "mxfp8")
  _, exps, want = ref.quantize_mx_rows(x, 32, "ceil", elem="e4m3")
  got_e = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)).astype(int) - 127
  np.testing.assert_array_equal(got_e, exps)
  np.testing.assert_array_equal(np.asarray(tq.dequantize(q)), want.astype(np.float32))


def test_axis_padding_and_stacked_expert_scope():
  rng = np.random.default_rng(4)
  w = rng.standard_normal((3, 40, 8)).astype(np.float32)  # [E, K, N], K=40 not a multiple
  w[1] *= 100.0  # expert 1 much larger: per-expert g must not leak into the others
  q = tq.quantize(jnp.asarray(w), "nvfp4", axis=1, second_level=(0,))
  assert q.shape == (3, 40, 8) and q.axis == 1
  assert q.codes.shape == (3, 24, 8)  # K padded to 48, two codes per byte
  assert q.scales.shape == (3, 3, 8) and q.global_scale.shape == (3, 1, 1)
  got = np.asarray(tq.dequantize(q))
  for e in range(3):
    # Same as quantizing each expert on its own, transposed so K is last and padded by hand.
    xe = np.zeros((8, 48), np.float32)
    xe[:, :40] = w[e].T
    _, _, _, want = ref.quantize_nvfp4_rows(xe, "tensor")
    np.testing.assert_array_equal(got[e], want[:, :40].T)
  # Dequantize to bf16 equals the f32 result rounded to bf16.
  np.testing.assert_array_equal(np.asarray(tq.dequantize(q, jnp.bfloat16)),
                                np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))


@pytest.mark.parametrize("fmt,bits", [("mxfp4", 4.25), ("nvfp4", 4.5), ("mxfp8", 8.25)])
def test_nbytes_is_true_packed_size(fmt, bits):
  x = jnp.ones((64, 256), jnp.float32)
  q = tq.quantize(x, fmt, second_level="tensor")
  extra = 4 if fmt == "nvfp4" else 0
  assert q.nbytes == int(64 * 256 * bits / 8) + extra
  assert tq.get_format(fmt).bits_per_element == bits
  assert q.dtype == (jnp.float8_e4m3fn if fmt == "mxfp8" else jnp.float4_e2m1fn)
  assert q.ndim == 2 and q.size == 64 * 256


def test_qarray_is_a_pytree_through_jit():
  x = jnp.asarray(_data("normal", (4, 64), 9))
  q = tq.quantize(x, "nvfp4")
  leaves, treedef = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 3
  q2 = jax.jit(lambda q: q)(q)
  np.testing.assert_array_equal(tq.dequantize(q2), tq.dequantize(q))
  qj = jax.jit(lambda x: tq.quantize(x, "nvfp4"))(x)
  np.testing.assert_array_equal(qj.codes, q.codes)
  np.testing.assert_array_equal(qj.scales.astype(jnp.float32), q.scales.astype(jnp.float32))



def test_e8m0_from_bits_is_the_dtype_value():
  """The integer E8M0 decoder kernels use (Hopper has no e8m0 type) for every byte."""
  b = jnp.arange(256, dtype=jnp.uint8)
  want = np.arange(256, dtype=np.float64)
  want = np.where(want == 255, np.nan, 2.0 ** (want - 127))
  got = np.asarray(F.e8m0_from_bits(b), np.float64)
  np.testing.assert_array_equal(got[1:], want[1:])
  assert got[0] in (0.0, 2.0**-127)  # subnormal: XLA:CPU flushes it (as `pow2` documents)
  dtype = np.asarray(jax.lax.bitcast_convert_type(b, jnp.float8_e8m0fnu).astype(jnp.float32))
  np.testing.assert_array_equal(got[1:], dtype[1:].astype(np.float64))


def _f32_bits(a):
  return np.asarray(a, np.float32).view(np.uint32)


def test_reciprocal_is_ieee_division():
  """`reciprocal_long_division` (the GPU's) against numpy's IEEE float32 `1 / d`, bit for bit:
  every mantissa of one binade, random bit patterns over all exponents (subnormal inputs and
  results, overflow to inf), and the special values; `reciprocal` (XLA:CPU's division here) the
  same where neither d nor 1/d is subnormal."""
  rng = np.random.default_rng(11)
  binade = (np.uint32(127 << 23) | np.arange(1 << 23, dtype=np.uint32)).view(np.float32)
  patterns = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32)
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -2.0, 2.0**-149, 2.0**-126,
                      2.0**126, 2.0**127, np.float32(3.4028235e38), 2.0**-128, 2.0**-127,
                      np.nextafter(np.float32(2.0**-128), np.float32(1))], np.float32)
  d = np.concatenate([binade, patterns.view(np.float32), special, -special])
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    want = _f32_bits(np.float32(1) / d)
  nan = np.isnan(d)
  got = _f32_bits(jax.jit(F.reciprocal_long_division)(jnp.asarray(d)))
  np.testing.assert_array_equal(got[~nan], want[~nan])
  assert np.all(np.isnan(np.asarray(got[nan].view(np.float32))))
  normal = ~nan & (np.abs(d) >= 2.0**-126) & (np.abs(d) <= 2.0**126)
  np.testing.assert_array_equal(_f32_bits(jax.jit(F.reciprocal)(jnp.asarray(d)))[normal],
                                want[normal])


def test_e4m3_value_of_every_byte():
  """The E4M3 decode built from bits equals ml_dtypes' value of each of the 256 bytes."""
  import ml_dtypes  # noqa: PLC0415

  b = np.arange(256, dtype=np.uint8)
  want = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  got = np.asarray(F.e4m3_value(jax.lax.bitcast_convert_type(jnp.asarray(b),
                                                             jnp.float8_e4m3fn)))
  nan = np.isnan(want)
  assert np.array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(_f32_bits(got[~nan]), _f32_bits(want[~nan]))
