"""The quantization rules compiled by XLA for the GPU against the numpy references, bit for bit
(marked gpu). XLA:GPU's float32 division is not correctly rounded and its default pipeline
deletes `f32 -> float8 -> f32` convert pairs (formats.py); these tests are what caught both, so
they run the rollout's (quantize_with_value), the trainer's (fake_quant) and the stored (quantize)
paths inside one jitted program each, where those passes apply."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from tests.quant import np_reference as ref
from trace_jax import quant as tq
from trace_jax.quant import formats as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _gpu_only():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")


def _x(seed, shape=(48, 256)):
  """Rows over many magnitudes (block scales at both clip bounds), E2M1 midpoints."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape[:-1] + (1,)))
  x[0] = 0.0
  x[1, :] = 1e-6
  x[1, 5] = 3e4
  x[2, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
  return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_4o6"])
@pytest.mark.parametrize("scope", ["tensor", "row"])
def test_nvfp4_paths_on_gpu_equal_reference(fmt, scope):
  x = _x(len(fmt) + len(scope))
  codes, scales, gs, want = ref.quantize_nvfp4_rows(x, scope, fmt.endswith("4o6"))

  @jax.jit
  def paths(a):
    q = tq.quantize(a, fmt, second_level=scope, validate=False)
    qv, value = tq.quantize_with_value(a, fmt, second_level=scope, validate=False)
    fq = tq.fake_quant(a, fmt, second_level=scope)
    return (q.unpacked_codes(), F.e4m3_value(q.scales), tq.dequantize(q), qv.unpacked_codes(),
            value, fq)

  q_codes, q_scales, deq, v_codes, value, fq = jax.device_get(paths(jnp.asarray(x)))
  np.testing.assert_array_equal(q_codes, codes)
  np.testing.assert_array_equal(q_scales, scales)
  np.testing.assert_array_equal(v_codes, codes)
  for got in (deq, value, fq):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


def test_mxfp8_fake_quant_on_gpu_equals_reference():
  """MXFP8 elements are float8 casts: fake quant decodes them in the same program."""
  x = _x(3, (8, 64))
  _, _, want = ref.quantize_mx_rows(x, 32, "ceil", elem="e4m3")
  got = jax.jit(lambda a: tq.fake_quant(a, "mxfp8"))(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), want.astype(np.float32))


def test_reciprocal_on_gpu_is_ieee_division():
  rng = np.random.default_rng(5)
  d = rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
  d = d[np.isfinite(d) & (d != 0)]
  got = np.asarray(jax.jit(F.reciprocal)(jnp.asarray(d))).view(np.uint32)
  with np.errstate(over="ignore"):
    want = (np.float32(1) / d).view(np.uint32)
  np.testing.assert_array_equal(got, want)
