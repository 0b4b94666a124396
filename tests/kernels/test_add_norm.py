"""The decode step's residual add + RMS norm kernel (`kernels/add_norm.py`) against the model's
ops (`add_rms_norm_ref`: `x + h`, `transformer.rms_norm`): both outputs bit for bit in Pallas
interpret mode on CPU; the Triton lowering for CUDA where the plugin is installed; on the GPU
(marked) the sum bit for bit and the norm within the stated tolerance."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.kernels import add_norm


def _case(seed, shape, dtype):
  """Rows over many magnitudes (a zero row, a row that cancels to zero in the sum), a scale
  around 1."""
  rng = np.random.default_rng(seed)
  mag = np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
  x = rng.standard_normal(shape) * mag
  h = rng.standard_normal(shape) * mag
  x.reshape(-1, shape[-1])[0] = 0.0
  h.reshape(-1, shape[-1])[0] = 0.0
  h.reshape(-1, shape[-1])[1] = -x.reshape(-1, shape[-1])[1]
  scale = rng.uniform(0.25, 2.0, shape[-1])
  return (jnp.asarray(x, jnp.float32).astype(dtype), jnp.asarray(h, jnp.float32).astype(dtype),
          jnp.asarray(scale, jnp.float32).astype(dtype))


@pytest.mark.parametrize("shape,dtype", [((40, 1, 64), jnp.bfloat16), ((3, 1, 2048), jnp.float32)],
                         ids=["rows_masked_bf16", "wide_f32"])
def test_kernel_equals_model_ops(shape, dtype):
  """40 rows of 64 (32 a program: the second program's rows past 40 masked), and 2,048-wide
  rows (one a program)."""
  x, h, scale = _case(0, shape, dtype)
  got = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6, interpret=True))(x, h, scale)
  want = jax.jit(functools.partial(add_norm.add_rms_norm_ref, eps=1e-6))(x, h, scale)
  for g, w in zip(got, want):
    assert g.shape == x.shape and g.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
  # the sum is the add, and the norm a float64 norm of it to bf16/float32 roundings
  s = np.asarray(got[0], np.float64)
  ref = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6) * np.asarray(scale, np.float64)
  tol = 3 * 2 ** -8 if dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(np.asarray(got[1], np.float64), ref, rtol=tol, atol=1e-30)


def _parts(seed, shape, n_parts=4):
  """float32 K parts of an h (`kernels.KParts`) whose sums carry bits below bf16's, and whose
  sum in another order would differ: part magnitudes apart by 2**10."""
  rng = np.random.default_rng(seed)
  p = rng.standard_normal((n_parts,) + shape) * (2.0 ** (10 * np.arange(n_parts) - 10)
                                                 ).reshape((n_parts,) + (1,) * len(shape))
  return kernels.KParts(jnp.asarray(p, jnp.float32))


def test_k_parts_are_added_in_order_then_rounded():
  """h as 4 float32 K parts (the o projection's with `bf16_mgpu.ksplit_launch`): the kernel
  (interpret mode) gives the reference's outputs bit for bit, and the reference adds the parts
  part 0 first, one add at a time, and rounds once (float64 check of the order: the sum in
  reverse order differs in some rows)."""
  x, _, scale = _case(1, (40, 1, 64), jnp.bfloat16)
  h = _parts(2, (40, 1, 64))
  got = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6, interpret=True))(x, h, scale)
  want = jax.jit(functools.partial(add_norm.add_rms_norm_ref, eps=1e-6))(x, h, scale)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16 and g.shape == x.shape
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
  p = np.asarray(h.parts)
  in_order = ((p[0] + p[1]) + p[2]) + p[3]  # float32 numpy: the rule
  np.testing.assert_array_equal(np.asarray(h.value(jnp.float32)), in_order)
  assert (in_order != ((p[3] + p[2]) + p[1]) + p[0]).any()  # (the order is seen)
  s = np.asarray(x, np.float32) + np.asarray(jnp.asarray(in_order).astype(jnp.bfloat16),
                                             np.float32)
  np.testing.assert_array_equal(np.asarray(got[0], np.float32),
                                np.asarray(jnp.asarray(s).astype(jnp.bfloat16), np.float32))


def test_supported_and_errors():
  x, h, scale = _case(0, (4, 64), jnp.bfloat16)
  assert add_norm.kernel_supported(x, h, scale) is None
  assert "differ" in add_norm.kernel_supported(x, h[:2], scale)
  assert "powers of two" in add_norm.kernel_supported(x[:, :48], h[:, :48], scale[:48])
  assert "scale of shape" in add_norm.kernel_supported(x, h, scale[:32])
  with pytest.raises(ValueError, match="differ"):
    add_norm.add_rms_norm(x, h.astype(jnp.float32), scale, 1e-6, interpret=True)
  assert kernels.add_rms_norm(x, h, scale, 1e-6) is None  # GPU only
  assert add_norm.kernel_supported(x, _parts(0, (4, 64)), scale) is None
  assert "parts" in add_norm.kernel_supported(x, _parts(0, (2, 64)), scale)
  half = kernels.KParts(_parts(0, (4, 64)).parts.astype(jnp.bfloat16))
  assert "parts bfloat16" in add_norm.kernel_supported(x, half, scale)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel (masked row loads and stores), for an H200, with h
  bf16 and as the o projection's 4 float32 K parts at 255 rows."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  sds = jax.ShapeDtypeStruct
  args = (sds((256, 1, 2048), jnp.bfloat16),) * 2 + (sds((2048,), jnp.bfloat16),)
  text = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "add_rms_norm" in text
  parts = kernels.KParts(sds((4, 255, 1, 2048), jnp.float32))  # the o projection's 4 K parts
  text = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6)).trace(
      sds((255, 1, 2048), jnp.bfloat16), parts, args[2]).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "add_rms_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("h_kind", ["bf16", "k_parts"])
def test_kernel_on_gpu_agrees_with_model_ops(h_kind):
  """The compiled kernel at the rollout's decode shape (B 255, 2,048 wide, bf16; h bf16, or the
  o projection's 4 float32 K parts) against XLA's ops: the sum bit for bit (the parts added in
  one order by both); the norm within two bf16 roundings of XLA's (rtol 2**-6: the float32 sum
  of squares runs in another order, and XLA may round its bf16 products otherwise); the
  fraction off is printed."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  x, h, scale = _case(3, (255, 1, 2048), jnp.bfloat16)
  if h_kind == "k_parts":
    h = _parts(4, (255, 1, 2048))
  got = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6))(x, h, scale)
  want = jax.jit(functools.partial(add_norm.add_rms_norm_ref, eps=1e-6))(x, h, scale)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  y, wy = np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)
  print(f"norm elements off: {(y != wy).sum()} of {y.size}")
  np.testing.assert_allclose(y, wy, rtol=2 ** -6, atol=0)
