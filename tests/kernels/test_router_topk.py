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
  and its parts-summing form at B 255 with 16 parts, for an H200."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  text = jax.jit(lambda a: router_topk.topk_gates(a, 8, normalize=True)).trace(
      jax.ShapeDtypeStruct((256, 128), jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "router_topk" in text
  text = jax.jit(lambda p: router_topk.topk_gates_of_parts(p, 8, normalize=True)).trace(
      jax.ShapeDtypeStruct((16, 255, 128), jnp.float32)).lower(
          lowering_platforms=("cuda",)).as_text()
  assert "router_topk_parts" in text


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


def router_case(n, d, e, seed):
  """bf16 router input and weights, the experts' weight scales spread (logits up to ~30)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((d, e)) * rng.uniform(0.01, 0.2, (1, e)), jnp.bfloat16)
  return x, w


@pytest.mark.parametrize("s,n,e,k,normalize", [(16, 37, 128, 8, True), (3, 20, 24, 2, False)],
                         ids=["s16_e128_top8_norm", "s3_e24_padded_top2"])
def test_gates_of_parts_equal_summed_logits(s, n, e, k, normalize):
  """The gates kernel summing split-K parts (`topk_gates_of_parts`, interpret mode) against the
  model's ops on `sum_parts`' logits: experts equal, weights within 2 float32 ulp; and
  `sum_parts` adds in order (part 0 first) as a float64-checked running sum does."""
  rng = np.random.default_rng(s)
  parts = jnp.asarray(rng.standard_normal((s, n, e)) * rng.uniform(0.1, 3.0, (s, n, 1)),
                      jnp.float32)
  w, i = jax.jit(lambda p: router_topk.topk_gates_of_parts(p, k, normalize=normalize,
                                                           interpret=True))(parts)
  logits = router_topk.sum_parts(parts)
  w_ref, i_ref = router_topk.topk_gates_ref(logits, k, normalize=normalize)
  np.testing.assert_array_equal(np.asarray(i), np.asarray(i_ref))
  np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2.5e-7, atol=0)
  running = np.asarray(parts[0])
  for p in np.asarray(parts)[1:]:
    running = (running + p).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(logits), running)


def test_router_parts_against_float64():
  """`router_parts` at the 30B-A3B router (D 2,048 in 16 parts, 128 experts): each part the
  exact float64 product of its 128 columns of D to float32 accumulation, and their sum the whole
  product to 1e-6 of the largest logit."""
  x, w = router_case(24, 2048, 128, 1)
  parts = np.asarray(jax.jit(router_topk.router_parts)(x, w), np.float64)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = np.stack([x64[:, j * 128:(j + 1) * 128] @ w64[j * 128:(j + 1) * 128]
                   for j in range(16)])
  assert parts.shape == (16, 24, 128)
  assert np.max(np.abs(parts - want)) <= 1e-6 * np.max(np.abs(want))
  whole = x64 @ w64
  got = np.asarray(router_topk.sum_parts(jnp.asarray(parts, jnp.float32)), np.float64)
  assert np.max(np.abs(got - whole)) <= 1e-6 * np.max(np.abs(whole))


def test_parts_supported():
  x, w = router_case(4, 256, 128, 0)
  assert router_topk.parts_supported(x, w, 8) is None
  assert "bf16" in router_topk.parts_supported(x.astype(jnp.float32), w, 8)
  assert "multiples of 128" in router_topk.parts_supported(x[:, :200], w[:200], 8)
  assert "[N, D] @ [D, E]" in router_topk.parts_supported(x, w[:128], 8)
  assert "top-9 of 8" in router_topk.parts_supported(x, w[:, :8], 9)
  assert "1-32 multiples of 4" in router_topk.parts_supported(x, w, 8, part_k=4)  # 64 parts
  many = jnp.zeros((router_topk.MAX_PARTS_ROWS + 1, 256), jnp.bfloat16)  # a prefill
  assert "decode batches" in router_topk.parts_supported(many, w, 8)
  with pytest.raises(ValueError, match="bf16"):
    router_topk.router_parts(x.astype(jnp.float32), w)
  with pytest.raises(ValueError, match="parts"):
    router_topk.topk_gates_of_parts(jnp.zeros((33, 4, 8)), 2, normalize=True, interpret=True)


def test_router_gates_dispatch(monkeypatch):
  """`kernels.router_gates` takes the rollout router only on the GPU with
  TRACE_JAX_ROUTER_SUM=kernel (opt-in) and the gates kernel on; elsewhere the caller's ops."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  x, w = router_case(4, 256, 16, 0)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  calls = []
  monkeypatch.setattr(dispatch, "_router_gates", lambda x, w, **kw: calls.append(kw) or "gates")
  for sum_setting, topk_setting, taken in (("xla", "kernel", False), ("kernel", "xla", False),
                                           ("kernel", "kernel", True)):
    monkeypatch.setattr(dispatch, "_ROUTER_SUM", sum_setting)
    monkeypatch.setattr(dispatch, "_ROUTER_TOPK", topk_setting)
    assert (dispatch.router_gates(x, w, 2, True) == "gates") == taken
  assert dispatch.router_gates(x.astype(jnp.float32), w, 2, True) is None  # not bf16
  monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: False)
  assert dispatch.router_gates(x, w, 2, True) is None
  assert calls == [dict(k=2, normalize=True)]


def test_in_model_router_parts_route_as_the_xla_ops(monkeypatch):
  """The router's parts summed in the gates kernel (interpret mode, D 64 in parts of 16) in
  place of the dispatch's choice inside a one-layer bf16 model's rollout forward: the same
  routes, logits to bf16 rounding."""
  from trace_jax import kernels  # noqa: PLC0415
  from trace_jax import models as M  # noqa: PLC0415
  from trace_jax import quant as tq  # noqa: PLC0415
  cfg = M.tiny(num_layers=1, norm_topk_prob=True, dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4")
  params = M.quantize_params(M.init_params(cfg, jax.random.key(1), "bfloat16"), policy)
  ctx = M.QuantContext(policy, "rollout")
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 5)), jnp.int32)
  want = jax.jit(lambda p, t: M.apply(p, t, cfg, ctx))(params, tokens)
  used = []

  def gates(x, w, k, normalize):
    used.append((x.dtype, w.dtype))
    parts = router_topk.router_parts(x, w, part_k=16)
    return router_topk.topk_gates_of_parts(parts, k, normalize=normalize, interpret=True)

  monkeypatch.setattr(kernels, "router_gates", gates)
  got = jax.jit(lambda p, t: M.apply(p, t, cfg, ctx))(params, tokens)
  assert used == [(jnp.bfloat16, jnp.bfloat16)]
  np.testing.assert_array_equal(np.asarray(got.routes), np.asarray(want.routes))
  np.testing.assert_allclose(np.asarray(got.logits, np.float32),
                             np.asarray(want.logits, np.float32), rtol=2e-2, atol=2e-2)


def float64_gates(x, w, k, normalize):
  """The router's gates in float64 from the bf16 operands (exact products and sums): weights
  `[N, k]` at the experts of each row's top k, the experts, and the logits."""
  logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  p = np.exp(logits - logits.max(axis=1, keepdims=True))
  p /= p.sum(axis=1, keepdims=True)
  idx = np.argsort(-p, axis=1, kind="stable")[:, :k]
  top = np.take_along_axis(p, idx, axis=1)
  return (top / top.sum(axis=1, keepdims=True) if normalize else top), idx, logits


@pytest.mark.gpu
def test_router_parts_on_gpu_against_product_then_gates():
  """The rollout router with its split-K parts summed in the gates kernel (XLA's batched
  product, then the compiled kernel) at the 30B-A3B router (B 255 and 256, D 2048, 128 experts,
  top-8) against XLA:GPU's bf16 product and the model's ops, both judged by float64 gates of the
  same operands: experts equal to XLA's but where the k-th and next expert's float64 logits are
  within 1e-4 of each other; weights no further from float64 than twice XLA's own distance (at
  least 1e-6 relative)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  gates = jax.jit(lambda x, w: router_topk.topk_gates_of_parts(
      router_topk.router_parts(x, w), 8, normalize=True))
  ref = jax.jit(lambda x, w: router_topk.topk_gates_ref(
      jnp.dot(x, w, preferred_element_type=jnp.float32), 8, normalize=True))
  for n in (255, 256):
    x, w = router_case(n, 2048, 128, n)
    got, want = gates(x, w), ref(x, w)
    w64, i64, logits = float64_gates(x, w, 8, True)
    gap = -np.diff(np.sort(logits, axis=1)[:, ::-1][:, 7:9], axis=1)[:, 0]
    differ = (np.asarray(got[1]) != np.asarray(want[1])).any(axis=1)
    assert (gap[differ] < 1e-4).all(), (n, gap[differ])
    same = ~differ & (np.asarray(want[1]) == i64).all(axis=1)
    err = {name: np.max(np.abs(np.asarray(g[0], np.float64)[same] - w64[same]) / w64[same])
           for name, g in (("parts", got), ("xla", want))}
    print(f"B {n}: weights' largest relative error against float64 {err}, "
          f"{int(differ.sum())} rows route otherwise than XLA")
    assert err["parts"] <= max(2 * err["xla"], 1e-6), (n, err)
