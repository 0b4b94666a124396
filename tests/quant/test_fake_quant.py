"""fake_quant: bit-exact forward, straight-through gradients, stochastic gradient quantization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.quant import np_reference as ref
from trace_jax import quant as tq
from trace_jax.quant import qarray as Q

FORMATS = ["mxfp4", "mxfp4_floor", "nvfp4", "nvfp4_4o6", "mxfp8"]


def _x(shape=(6, 80), seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.standard_t(3, shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_is_dequantize_of_quantize_bit_for_bit(fmt, dtype):
  x = _x(dtype=dtype)  # K=80 is not a multiple of 32: padding path too
  for sl in ("tensor", "row"):
    want = tq.dequantize(tq.quantize(x, fmt, second_level=sl), dtype)
    got = tq.fake_quant(x, fmt, second_level=sl)
    got_jit = jax.jit(lambda x: tq.fake_quant(x, fmt, second_level=sl))(x)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(got_jit.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.float32)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_with_value_is_quantize_then_dequantize(fmt):
  """One encoding, two results: the same QArray fields as `quantize` and, bit for bit, the
  value `dequantize` gives (the rollout's activation sites return that value)."""
  x = _x(dtype=jnp.bfloat16).at[1, 3].set(jnp.nan)  # a NaN block stays NaN in both
  for axis, sl in ((-1, "row"), (0, "tensor")):
    q, v = jax.jit(lambda x: tq.quantize_with_value(x, fmt, axis=axis, second_level=sl,
                                                    validate=False))(x)
    want_q = tq.quantize(x, fmt, axis=axis, second_level=sl, validate=False)
    for got_f, want_f in zip(jax.tree.leaves(q), jax.tree.leaves(want_q)):
      np.testing.assert_array_equal(np.asarray(got_f.astype(jnp.float32)),
                                    np.asarray(want_f.astype(jnp.float32)))
    want_v = tq.dequantize(want_q, jnp.bfloat16)
    assert v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)),
                                  np.asarray(want_v.astype(jnp.float32)))


def test_fake_quant_along_axis0_matches_transposed():
  x = _x((64, 5), seed=1)
  a = tq.fake_quant(x, "nvfp4", axis=0, second_level="row")
  b = tq.fake_quant(x.T, "nvfp4", axis=-1, second_level="row").T
  np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", ["mxfp4_floor", "nvfp4"])
def test_ste_gradient_is_identity_except_where_saturated(fmt):
  x = _x((16, 64), seed=2)
  f = tq.get_format(fmt)
  ct = _x((16, 64), seed=3)
  _, vjp = jax.vjp(lambda x: tq.fake_quant(x, fmt, second_level="row"), x)
  (grad,) = vjp(ct)
  # Independent saturation mask: |x / scale| > 7 (6 plus half the last grid step).
  q = tq.quantize(x, fmt, second_level="row")
  s, g = q.blocked_scales()
  z = np.asarray(Q.from_blocks(Q.scaled_blocks(Q.to_blocks(x, 1, f.block), s, g, f), 1, 64))
  clipped = np.abs(z) > 7.0
  np.testing.assert_array_equal(np.asarray(grad), np.where(clipped, 0.0, np.asarray(ct)))
  if fmt == "mxfp4_floor":
    assert clipped.any()  # the floor rule clips (6, 8) x scale: the mask is exercised
  else:
    assert (np.abs(z) > 6.0).any()  # E4M3 scale rounded down: just above 6 keeps its gradient


def test_quantize_grad_identity_forward_unbiased_backward():
  x = _x((4, 64), seed=4)
  y = tq.quantize_grad(x, jax.random.key(0), "nvfp4")
  np.testing.assert_array_equal(y, x)
  ct = _x((4, 64), seed=5)

  @jax.jit
  def grad_of(key):
    return jax.vjp(lambda x: tq.quantize_grad(x, key, "nvfp4"), x)[1](ct)[0]

  grads = np.stack([np.asarray(grad_of(jax.random.key(i))) for i in range(300)])
  # Each sample is one of the two grid neighbours of ct / d, d the row's (RTN-chosen) scale.
  q = tq.quantize(ct, "nvfp4", second_level="row")
  d = np.repeat(np.asarray(q.scales.astype(jnp.float32) * q.global_scale), 16, axis=1)
  z = np.abs(np.asarray(ct)) * (1 / d)
  lo = np.vectorize(lambda a: max(v for v in ref.GRID if v <= min(a, 6)))(z)
  hi = np.vectorize(lambda a: min(v for v in ref.GRID if v >= min(a, 6)))(z)
  mag = np.abs(grads) / d
  assert np.all(np.isclose(mag, lo, rtol=1e-6) | np.isclose(mag, hi, rtol=1e-6))
  # Unbiased: the mean over samples approaches the true gradient much closer than RTN does.
  rtn = np.asarray(tq.fake_quant(ct, "nvfp4", second_level="row"))
  err_sr = np.abs(grads.mean(0) - np.asarray(ct)).mean()
  err_rtn = np.abs(rtn - np.asarray(ct)).mean()
  assert err_sr < 0.3 * err_rtn
  assert len({g.tobytes() for g in grads[:5]}) > 1  # different keys, different roundings
