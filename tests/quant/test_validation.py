"""Bad input: non-finite values, unknown formats, wrong shapes and dtypes, padding rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import quant as tq


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_eager_non_finite_raises_clear_error(bad, fmt):
  x = np.ones((2, 32), np.float32)
  x[1, 5] = bad
  with pytest.raises(ValueError, match=r"non-finite.*index \(1, 5\)"):
    tq.quantize(jnp.asarray(x), fmt)
  with pytest.raises(ValueError, match="non-finite"):
    tq.fake_quant(jnp.asarray(x), fmt)


def test_in_jit_nan_is_never_hidden_as_zero():
  x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
  x[1, 40] = np.nan
  # MXFP4: the block holding the NaN decodes to NaN (E8M0 byte 0xFF); other blocks are intact.
  q = jax.jit(lambda x: tq.quantize(x, "mxfp4"))(x)
  assert int(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)[1, 1]) == 0xFF
  d = np.asarray(tq.dequantize(q))
  assert np.all(np.isnan(d[1, 32:])) and np.all(np.isfinite(d[1, :32]))
  assert np.all(np.isfinite(d[[0, 2]]))
  # NVFP4 row scope: the row is NaN, other rows intact. Tensor scope: everything is NaN.
  d = np.asarray(jax.jit(lambda x: tq.fake_quant(x, "nvfp4", second_level="row"))(x))
  assert np.all(np.isnan(d[1])) and np.all(np.isfinite(d[[0, 2]]))
  d = np.asarray(jax.jit(lambda x: tq.fake_quant(x, "nvfp4"))(x))
  assert np.all(np.isnan(d))
  # Inf too: never silently clipped to the largest code.
  y = x.copy()
  y[1, 40] = np.inf
  d = np.asarray(jax.jit(lambda x: tq.dequantize(tq.quantize(x, "nvfp4", second_level="row")))(y))
  assert np.all(np.isnan(d[1]))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_nan_in_a_large_weight_reaches_its_scale(fmt):
  # XLA:CPU's vectorized max dropped this NaN once (shape-dependent): it must still decode NaN.
  w = np.random.default_rng(2).standard_normal((200, 300)).astype(np.float32)
  w[123, 45] = np.nan
  d = np.asarray(tq.dequantize(tq.quantize(jnp.asarray(w), fmt, axis=0, validate=False)))
  assert np.isnan(d[123, 45])
  if fmt == "mxfp4":
    assert np.isnan(d[96:128, 45]).all() and np.isfinite(d[:96]).all()
  else:
    assert np.isnan(d).all()  # per-tensor second-level scale


def test_unknown_format_and_bad_arguments():
  x = jnp.ones((2, 32))
  with pytest.raises(ValueError, match=r"unknown quantization format 'fp3'.*known formats"):
    tq.quantize(x, "fp3")
  with pytest.raises(ValueError, match="second_level"):
    tq.quantize(x, "nvfp4", second_level="column")
  with pytest.raises(ValueError, match="block axis"):
    tq.quantize(x, "nvfp4", axis=2)
  with pytest.raises(ValueError, match="floating-point"):
    tq.quantize(jnp.ones((2, 32), jnp.int32), "nvfp4")
  with pytest.raises(ValueError, match="include the block axis"):
    tq.quantize(jnp.ones((2, 32, 4)), "nvfp4", axis=1, second_level=(1,))
  with pytest.raises(TypeError, match="QArray"):
    tq.dequantize(x)


def test_non_multiple_of_block_is_padded_consistently():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 50)).astype(np.float32))
  padded = jnp.pad(x, ((0, 0), (0, 14)))
  for fmt in ("mxfp4", "nvfp4", "mxfp8"):
    q = tq.quantize(x, fmt, second_level="row")
    assert q.shape == (3, 50)

    @jax.jit  # one compile, not one per eager op (28 s of the suite before)
    def paths(x, padded, q, fmt=fmt):
      # Exactly the same as quantizing the zero-padded tensor and slicing.
      want = tq.dequantize(tq.quantize(padded, fmt, second_level="row"))[:, :50]
      g = tq.guided_fake_quant(x, tq.make_guidance(q)) if fmt != "mxfp8" else want
      return want, tq.dequantize(q), tq.fake_quant(x, fmt, second_level="row"), g

    want, *got = paths(x, padded, q)
    for y in got:
      np.testing.assert_array_equal(y, want)
