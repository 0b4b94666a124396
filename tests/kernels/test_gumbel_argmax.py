"""The token-draw kernel (`kernels/gumbel_argmax.py`) against `jax.random.categorical`, its
definition, bit for bit: in Pallas interpret mode on CPU (rows with excluded entries, a row
with none left, NaN logits, a vocabulary that is not a multiple of the tile, one and several
programs a row); the sampler's choice of it; its CUDA lowering; on the GPU the compiled kernel
at the rollout's shape (marked)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax.kernels import gumbel_argmax as G


def _case(b: int, v: int, seed: int):
  rng = np.random.default_rng(seed)
  logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
  logits[1 % b, ::3] = -np.inf  # a filtered row
  if b > 3:
    logits[2, :] = -np.inf  # nothing left: jnp.argmax's first index
    logits[3, [17, v - 5]] = np.nan  # the first NaN
  keys = jax.random.split(jax.random.key(seed), b)
  return keys, jnp.asarray(logits)


def _categorical(keys, logits):
  return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, logits)


def test_noise_is_jax_gumbel():
  """The kernel's threefry bits and Gumbel transform give `jax.random.gumbel`'s draws."""
  for seed in (0, 5):
    key = jax.random.key(seed)
    words = jax.random.key_data(key)
    idx = jnp.arange(3000, dtype=jnp.uint32)
    np.testing.assert_array_equal(np.asarray(G.gumbel_noise(words[0], words[1], idx)),
                                  np.asarray(jax.random.gumbel(key, (3000,), jnp.float32)))


@pytest.mark.parametrize("b,v,splits", [(6, 5000, 1), (6, 5000, 3), (4, 2 * G.TILE, None),
                                        (3, 700, 2)])
def test_kernel_equals_categorical(b, v, splits):
  keys, logits = _case(b, v, b + v)
  got = G.gumbel_argmax(jax.random.key_data(keys), logits, splits=splits, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(_categorical(keys, logits)))


def test_sampler_draws_with_the_kernel_on_gpu(monkeypatch):
  """`sampling.sample` on the GPU (its branch, the kernel in interpret mode here) draws the
  tokens XLA's `jax.random.categorical` draws, temperature and top-k included; off the GPU,
  with TRACE_JAX_GUMBEL=xla, and for keys of another PRNG it keeps XLA's."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  from trace_jax.rollout import sampling  # noqa: PLC0415
  keys, logits = _case(5, 3000, 3)
  logits = jnp.where(jnp.isnan(logits), 0.0, logits)  # (the engine's logits hold no NaN)
  params = sampling.SamplingParams(temperature=0.7, top_k=50)
  want = sampling.sample(logits, keys, params)
  calls, real = [], G.gumbel_argmax

  def kernel(words, scaled, **kw):
    calls.append(scaled.shape)
    return real(words, scaled, interpret=True, **kw)

  monkeypatch.setattr(G, "gumbel_argmax", kernel)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  got = sampling.sample(logits, keys, params)
  assert calls == [(5, 3000)]
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  monkeypatch.setattr(sampling, "GUMBEL", "xla")
  sampling.sample(logits, keys, params)
  monkeypatch.setattr(sampling, "GUMBEL", "kernel")
  rbg = jax.random.split(jax.random.key(0, impl="rbg"), 5)
  sampling.sample(logits, rbg, params)
  assert len(calls) == 1


def test_supported():
  words = jnp.zeros((4, 2), jnp.uint32)
  assert G.kernel_supported(words, jnp.zeros((4, 100), jnp.float32)) is None
  assert "float32" in G.kernel_supported(words, jnp.zeros((4, 100), jnp.bfloat16))
  assert "key words" in G.kernel_supported(words[:3], jnp.zeros((4, 100), jnp.float32))
  with pytest.raises(ValueError, match="gumbel_argmax kernel"):
    G.gumbel_argmax(words, jnp.zeros((4, 100), jnp.float16), interpret=True)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel at the rollout's shape."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  sds = jax.ShapeDtypeStruct
  text = jax.jit(G.gumbel_argmax).trace(sds((256, 2), jnp.uint32),
                                        sds((256, 151936), jnp.float32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "gumbel_argmax" in text


@pytest.mark.gpu
@pytest.mark.parametrize("b,v", [(256, 151936), (7, 5000), (1, 151936), (64, 32000)])
def test_kernel_on_gpu_equals_categorical(b, v):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  keys, logits = _case(b, v, 11 * b + v)
  got = jax.jit(G.gumbel_argmax)(jax.random.key_data(keys), logits)
  want = jax.jit(_categorical)(keys, logits)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # and steps of a rollout: the keys folded with the step, temperature-scaled logits
  for step in range(3):
    step_keys = jax.vmap(functools.partial(jax.random.fold_in, data=step))(keys)
    scaled = logits / 0.8
    np.testing.assert_array_equal(
        np.asarray(jax.jit(G.gumbel_argmax)(jax.random.key_data(step_keys), scaled)),
        np.asarray(jax.jit(_categorical)(step_keys, scaled)))
