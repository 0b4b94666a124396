"""The router's gates kernel (`kernels/router_topk.py`): softmax, top-k and renormalized gate
weights against the model's own ops (`nn.softmax`, `lax.top_k`), the experts exactly (ties to
the lower index) and the weights to rounding; interpret mode on CPU, the CUDA lowering where
the plugin is installed, the compiled kernel on a GPU (marked)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax.kernels import router_topk


def logits_case(n, e, seed):
  """Logits over several scales, rows with tied experts (equal logits, so equal probabilities)
  and a row of all-equal logits."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, e)) * rng.uniform(0.1, 8.0, (n, 1))
  x[1, 3] = x[1, 7] = x[1].max() + 1.0  # a tie at the top
  x[2, :] = 0.5  # every expert tied
  return jnp.asarray(x, jnp.float32)


@pytest.mark.parametrize("n,e,k,normalize", [(37, 128, 8, True), (20, 24, 2, False)],
                         ids=["e128_top8_norm", "e24_padded_top2"])
def test_equals_model_ops(n, e, k, normalize):
  """37 tokens (programs of 16, a partial last one), 128 experts top-8 renormalized; 24 experts
  (padded to 32 in the kernel) top-2 unnormalized. Experts equal; weights within 2 float32 ulp
  (the kernel's sums run in its own order)."""
  x = logits_case(n, e, n)
  w, i = jax.jit(lambda a: router_topk.topk_gates(a, k, normalize=normalize, interpret=True))(x)
  w_ref, i_ref = jax.jit(lambda a: router_topk.topk_gates_ref(a, k, normalize=normalize))(x)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(i_ref))
  np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2.5e-7, atol=0)
  # ties went to the lower index: row 1's top two are experts 3 then 7, row 2's 0, 1, ...
  assert list(np.asarray(i)[1, :2]) == [3, 7]
  assert list(np.asarray(i)[2]) == list(range(k))
  # and the reference itself against numpy
  p = np.exp(np.asarray(x, np.float64) - np.asarray(x, np.float64).max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  top = np.take_along_axis(p, np.asarray(i_ref), 1)
  if normalize:
    top /= top.sum(1, keepdims=True)
  np.testing.assert_allclose(np.asarray(w_ref), top, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, 32])
def test_rows_a_program(rows):
  """Other tokens a program (TRACE_JAX_ROUTER_TOPK_ROWS) give the same gates: 37 tokens in
  programs of 2 (a partial last one) and of 32; the weights to a few float32 ulps (2.5e-7
  relative seen at 2 on CPU, whose vectorized sums then run in another order)."""
  x = logits_case(37, 128, 5)
  w, i = jax.jit(lambda a: router_topk.topk_gates(a, 8, normalize=True, interpret=True,
                                                  rows=rows))(x)
  w_ref, i_ref = jax.jit(lambda a: router_topk.topk_gates_ref(a, 8, normalize=True))(x)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(i_ref))
  np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6, atol=0)
  with pytest.raises(ValueError, match="power of two"):
    router_topk.topk_gates(x, 8, normalize=True, interpret=True, rows=3)


def test_supported():
  assert router_topk.kernel_supported(jnp.zeros((4, 128), jnp.float32), 8) is None
  assert "float32" in router_topk.kernel_supported(jnp.zeros((4, 128), jnp.bfloat16), 8)
  assert "top-9 of 8" in router_topk.kernel_supported(jnp.zeros((4, 8), jnp.float32), 9)
  with pytest.raises(ValueError, match="float32"):
    router_topk.topk_gates(jnp.zeros((4, 2, 8)), 2, normalize=True, interpret=True)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel at the 30B-A3B router (B 256, 128 experts, top-8),
  for an H200."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  text = jax.jit(lambda a: router_topk.topk_gates(a, 8, normalize=True)).trace(
      jax.ShapeDtypeStruct((256, 128), jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "router_topk" in text


@pytest.mark.gpu
def test_kernel_on_gpu_against_model_ops():
  """The compiled kernel against XLA:GPU's own ops at the decode shape: experts equal, weights
  to rounding (H200, session 38: 3 of 2,048 off by a few float32 ulps, 2.8e-7 relative)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  x = logits_case(256, 128, 1)
  w, i = jax.jit(lambda a: router_topk.topk_gates(a, 8, normalize=True))(x)
  w_ref, i_ref = jax.jit(lambda a: router_topk.topk_gates_ref(a, 8, normalize=True))(x)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(i_ref))
  np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=1e-6, atol=0)


def test_in_model_routes_as_the_xla_ops(monkeypatch):
  """The kernel in place of the dispatch's choice (interpret mode) inside a one-layer model's
  rollout forward (top-2 of 8, renormalized): the same routes, logits to rounding."""
  from trace_jax import kernels  # noqa: PLC0415
  from trace_jax import models as M  # noqa: PLC0415
  from trace_jax import quant as tq  # noqa: PLC0415
  cfg = M.tiny(num_layers=1, norm_topk_prob=True)
  policy = tq.make_policy("paper", "nvfp4")
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  ctx = M.QuantContext(policy, "rollout")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 5)), jnp.int32)
  run = jax.jit(lambda p, t: M.apply(p, t, cfg, ctx))
  want = run(params, tokens)
  used = []

  def gates(logits, k, normalize):
    used.append(k)
    return router_topk.topk_gates(logits, k, normalize=normalize, interpret=True)

  monkeypatch.setattr(kernels, "topk_gates", gates)
  got = jax.jit(lambda p, t: M.apply(p, t, cfg, ctx))(params, tokens)
  assert used == [cfg.num_experts_per_tok]
  np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(want.routes))
  np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), rtol=1e-5,
                             atol=1e-5)
