"""TRACE guided rounding: reproduces the rollout's codes where round-to-nearest cannot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.quant import np_reference as ref
from trace_jax import quant as tq


def _rollout_and_trainer(fmt, seed=0, shape=(8, 64), rel_noise=1e-3):
  """Rollout activations and a trainer recomputation perturbed by tiny numeric noise."""
  rng = np.random.default_rng(seed)
  x_roll = rng.standard_t(3, shape).astype(np.float32)
  x_train = (x_roll * (1 + rel_noise * rng.standard_normal(shape))).astype(np.float32)
  return jnp.asarray(x_roll), jnp.asarray(x_train)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("compact", [True, False])
def test_guided_reproduces_rollout_codes_under_perturbation(fmt, compact):
  x_roll, x_train = _rollout_and_trainer(fmt)
  q_roll = tq.quantize(x_roll, fmt, second_level="row")
  g = tq.make_guidance(q_roll, compact=compact)
  # Perturbation stays inside one grid step: guided rounding reproduces every code exactly.
  guided = tq.guided_quantize(x_train, g)
  np.testing.assert_array_equal(guided.unpacked_codes(), q_roll.unpacked_codes())
  np.testing.assert_array_equal(tq.guided_fake_quant(x_train, g), tq.dequantize(q_roll))
  # Round to nearest with the same scales flips codes at boundaries.
  rtn = tq.fake_quant(x_train, fmt, second_level="row")
  assert np.sum(np.asarray(rtn) != np.asarray(tq.dequantize(q_roll))) > 0


def test_rtn_fails_exactly_at_boundaries_where_guided_holds():
  # Values straddling every rounding boundary: rollout slightly below, trainer slightly above.
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  row = np.concatenate([mids - 1e-3, -(mids - 1e-3), [6.0, 0.0]]).astype(np.float32)
  x_roll = np.zeros((1, 32), np.float32)
  x_roll[0, :16] = row
  x_train = x_roll.copy()
  x_train[0, :14] = np.concatenate([mids + 1e-3, -(mids + 1e-3)])
  # MXFP4 with amax 6: scale 1, so z = x exactly.
  q = tq.quantize(jnp.asarray(x_roll), "mxfp4")
  assert int(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)[0, 0]) == 127
  rtn_codes = tq.quantize(jnp.asarray(x_train), "mxfp4").unpacked_codes()
  roll_codes = q.unpacked_codes()
  assert np.all(np.asarray(rtn_codes)[0, :14] != np.asarray(roll_codes)[0, :14])
  guided = tq.guided_quantize(jnp.asarray(x_train), tq.make_guidance(q))
  np.testing.assert_array_equal(guided.unpacked_codes(), roll_codes)


def test_guided_against_bracket_reference_for_far_perturbations():
  """With large noise the rollout code can be outside the bracket; check the rule itself."""
  rng = np.random.default_rng(3)
  x_roll = jnp.asarray(rng.standard_normal((4, 32)).astype(np.float32) * 3)
  x_train = jnp.asarray(np.asarray(x_roll) + rng.standard_normal((4, 32)).astype(np.float32))
  q = tq.quantize(x_roll, "mxfp4")
  e = np.asarray(jax.lax.bitcast_convert_type(q.scales, jnp.uint8)).astype(int) - 127
  roll_codes = np.asarray(q.unpacked_codes())
  for compact in (True, False):
    got = np.asarray(tq.guided_quantize(x_train, tq.make_guidance(q, compact)).unpacked_codes())
    for r in range(4):
      z_all = np.asarray(x_train)[r] / 2.0 ** e[r, 0]
      for j, z in enumerate(z_all):
        a = min(abs(z), 6.0)
        lo = max(i for i, v in enumerate(ref.GRID) if v <= a)
        hi = min(lo + 1, 7)
        if ref.GRID[lo] == a:
          want = lo
        elif compact:
          want = lo if lo % 2 == (roll_codes[r, j] & 1) else hi
        else:
          t = ref.GRID[roll_codes[r, j] & 7]
          dl, dh = abs(ref.GRID[lo] - t), abs(ref.GRID[hi] - t)
          want = (ref.e2m1_code(a) & 7) if dl == dh else (lo if dl < dh else hi)
        want |= 8 if np.signbit(z) else 0
        assert got[r, j] == want, (compact, r, j, z, roll_codes[r, j])


def test_guided_never_further_than_rtn_from_rollout_value():
  x_roll, x_train = _rollout_and_trainer("nvfp4", seed=5, rel_noise=0.05)
  q = tq.quantize(x_roll, "nvfp4", second_level="row")
  roll = np.asarray(tq.dequantize(q))
  g = np.asarray(tq.guided_fake_quant(x_train, tq.make_guidance(q, compact=False)))
  # RTN with the rollout's own scales (same candidates and scale as the paper's guarantee).
  s = q.scales.astype(jnp.float32) * q.global_scale
  z = np.asarray(x_train).reshape(8, 4, 16) * (1 / np.asarray(s))[..., None]
  rtn = np.vectorize(lambda v: ref.e2m1_value(ref.e2m1_code(v)))(np.clip(z, -6, 6))
  rtn = (rtn * np.asarray(s)[..., None]).reshape(8, 64)
  assert np.all(np.abs(g - roll) <= np.abs(rtn - roll) + 1e-6)
  assert np.sum(np.abs(g - roll) < np.abs(rtn - roll) - 1e-6) > 0


def test_guided_gradient_straight_through_and_jit():
  x_roll, x_train = _rollout_and_trainer("nvfp4", seed=6)
  g = tq.make_guidance(tq.quantize(x_roll, "nvfp4", second_level="row"))
  ct = jnp.asarray(np.random.default_rng(0).standard_normal(x_train.shape).astype(np.float32))
  y, vjp = jax.vjp(lambda x: tq.guided_fake_quant(x, g), x_train)
  np.testing.assert_array_equal(vjp(ct)[0], ct)  # nothing clipped at these magnitudes
  y_jit = jax.jit(tq.guided_fake_quant)(x_train, g)
  np.testing.assert_array_equal(y, y_jit)
  # The guidance pytree itself can be passed through jit and grad (no gradient flows into it).
  grad = jax.grad(lambda x, g: jnp.sum(tq.guided_fake_quant(x, g) * x))(x_train, g)
  assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("fmt,bits", [("mxfp4", 1.25), ("nvfp4", 1.5)])
def test_guidance_bytes(fmt, bits):
  x = jnp.ones((32, 256), jnp.float32)
  q = tq.quantize(x, fmt, second_level="row")
  gc = tq.make_guidance(q, compact=True)
  gf = tq.make_guidance(q, compact=False)
  assert tq.guidance_bits_per_element(fmt, True) == bits
  assert tq.guidance_bits_per_element(fmt, False) == bits + 3
  g_bytes = 0 if fmt == "mxfp4" else 32 * 4  # one fp32 second-level scale per row
  assert gc.nbytes == 32 * 256 * bits / 8 + g_bytes
  assert gf.nbytes == 32 * 256 * (bits + 3) / 8 + g_bytes
  assert gc.payload.dtype == jnp.uint8 and gc.payload.shape == (32, 32)


def test_guidance_errors():
  q = tq.quantize(jnp.ones((2, 32)), "nvfp4")
  g = tq.make_guidance(q)
  with pytest.raises(ValueError, match=r"shape \(2, 32\).*shape \(2, 64\)"):
    tq.guided_fake_quant(jnp.ones((2, 64)), g)
  with pytest.raises(ValueError, match="FP4"):
    tq.make_guidance(tq.quantize(jnp.ones((2, 32)), "mxfp8"))
  with pytest.raises(TypeError, match="QArray"):
    tq.make_guidance(jnp.ones((2, 32)))
  # a kernel's payload is taken as it is, where it is what make_guidance would make
  np.testing.assert_array_equal(np.asarray(tq.make_guidance(q, payload=g.payload).payload),
                                np.asarray(g.payload))
  with pytest.raises(ValueError, match=r"compact uint8\[2, 4\].*uint8\[2, 8\]"):
    tq.make_guidance(q, payload=jnp.zeros((2, 8), jnp.uint8))
  with pytest.raises(ValueError, match="compact"):
    tq.make_guidance(q, compact=False, payload=g.payload)


def test_take_rows_gathers_every_field_exactly():
  """`take_rows` (every field's row bytes gathered at once) equals gathering each field on its
  own, bit for bit, for a QArray and its guidance (uint8 codes and bits, e4m3 block scales,
  float32 row scales), with repeated and reordered rows."""
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((6, 64)) * np.exp(rng.normal(size=(6, 1))), jnp.float32)
  q = tq.quantize(x, "nvfp4", second_level="row", validate=False)
  idx = jnp.asarray([5, 0, 0, 3, 1], jnp.int32)
  for obj in (q, tq.make_guidance(q)):
    got = jax.jit(tq.take_rows)(obj, idx)
    assert got.shape == (5, 64) and type(got) is type(obj)
    for f in ("scales", "global_scale", "codes" if obj is q else "payload"):
      a, b = getattr(got, f), getattr(obj, f)[idx]
      assert a.dtype == b.dtype and a.shape == b.shape
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
