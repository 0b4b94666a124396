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


def test_float32_h_is_rounded_first():
  """A float32 h (the decode step's output projection left unrounded, `add_norm_rounds_h`) with
  bf16 x: both outputs bit for bit those of h rounded to bf16 first, by the kernel (interpret
  mode) and by the reference; h chosen with float32 bits below bf16's, so a missing rounding
  shows."""
  x, _, scale = _case(1, (40, 1, 64), jnp.bfloat16)
  rng = np.random.default_rng(2)
  h = jnp.asarray(rng.standard_normal((40, 1, 64)) * np.exp(rng.uniform(-6, 6, (40, 1, 1))),
                  jnp.float32)
  assert (np.asarray(h) != np.asarray(h.astype(jnp.bfloat16), np.float32)).mean() > 0.9
  got = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6, interpret=True))(x, h, scale)
  ref = functools.partial(add_norm.add_rms_norm_ref, eps=1e-6)
  want = jax.jit(ref)(x, h.astype(jnp.bfloat16), scale)
  for g, w in zip(got, want):
    assert g.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
  for g, w in zip(jax.jit(ref)(x, h, scale), want):  # the reference rounds h as well
    np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_decode_steps_with_float32_projection_are_bitwise(monkeypatch):
  """A two-layer bf16 model's prompt and decode steps (tests/kernels/test_glue_in_model) with
  `TRACE_JAX_O_PROJ_OUT=float32`'s path (faked on: the attention's output projection in
  float32, the add + norm kernel, interpret mode, rounding it): logits, records and cache bit
  for bit those of the XLA path; the kernel saw the float32 projection."""
  from tests.kernels.test_glue_in_model import prompt_and_steps  # noqa: PLC0415
  from trace_jax import models as M  # noqa: PLC0415
  from trace_jax import quant as tq  # noqa: PLC0415
  cfg = M.tiny(num_layers=2, dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  run = functools.partial(prompt_and_steps, params, cfg, ctx, 2)
  want = run()
  seen = []

  def kernel(x, h, scale, eps):
    seen.append(h.dtype)
    return add_norm.add_rms_norm(x, h, scale, eps, interpret=True)

  monkeypatch.setattr(kernels, "add_rms_norm", kernel)
  monkeypatch.setattr(kernels, "add_norm_rounds_h", lambda: True)
  jax.clear_caches()
  got = run()
  assert jnp.float32 in seen and jnp.bfloat16 in seen  # after attention; between layers
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_supported_and_errors():
  x, h, scale = _case(0, (4, 64), jnp.bfloat16)
  assert add_norm.kernel_supported(x, h, scale) is None
  assert "differ" in add_norm.kernel_supported(x, h[:2], scale)
  assert "powers of two" in add_norm.kernel_supported(x[:, :48], h[:, :48], scale[:48])
  assert "scale of shape" in add_norm.kernel_supported(x, h, scale[:32])
  assert add_norm.kernel_supported(x, h.astype(jnp.float32), scale) is None  # rounded first
  with pytest.raises(ValueError, match="differ"):
    add_norm.add_rms_norm(x, h.astype(jnp.float16), scale, 1e-6, interpret=True)
  assert kernels.add_rms_norm(x, h, scale, 1e-6) is None  # GPU only


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel (masked row loads and stores), for an H200."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  sds = jax.ShapeDtypeStruct
  args = (sds((256, 1, 2048), jnp.bfloat16),) * 2 + (sds((2048,), jnp.bfloat16),)
  text = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "add_rms_norm" in text


@pytest.mark.gpu
@pytest.mark.parametrize("h_dtype", [jnp.bfloat16, jnp.float32], ids=["h_bf16", "h_float32"])
def test_kernel_on_gpu_agrees_with_model_ops(h_dtype):
  """The compiled kernel at the 30B-A3B decode shape (B 255, 2,048 wide, bf16; h bf16 or the
  float32 projection `add_norm_rounds_h` hands it) against XLA's ops: the sum bit for bit; the
  norm within two bf16 roundings of XLA's (rtol 2**-6: the float32 sum of squares runs in
  another order, and XLA may round its bf16 products otherwise); the fraction off is
  printed."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  x, h, scale = _case(3, (255, 1, 2048), jnp.bfloat16)
  if h_dtype == jnp.float32:  # float32 bits below bf16's
    h = h.astype(jnp.float32) * (1 + jnp.asarray(np.random.default_rng(4).uniform(
        -2 ** -9, 2 ** -9, h.shape), jnp.float32))
  got = jax.jit(functools.partial(add_norm.add_rms_norm, eps=1e-6))(x, h, scale)
  want = jax.jit(functools.partial(add_norm.add_rms_norm_ref, eps=1e-6))(x, h, scale)
  np.testing.assert_array_equal(np.asarray(got[0]).view(np.uint8),
                                np.asarray(want[0]).view(np.uint8))
  y, wy = np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)
  print(f"norm elements off: {(y != wy).sum()} of {y.size}")
  np.testing.assert_allclose(y, wy, rtol=2 ** -6, atol=0)
