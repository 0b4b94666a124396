"""The decode step's MoE combine + residual add + RMS norm kernel (`kernels/moe_combine.py`)
against the model's ops (`combine_add_rms_norm_ref`: the rows' gather, `combine_experts`,
`x + h`, `transformer.rms_norm`): both outputs bit for bit in Pallas interpret mode on CPU,
and against a float64 computation to the roundings; the Triton lowering for CUDA where the
plugin is installed; in a two-layer model, the same logits, cache and records as the XLA path;
on the GPU (marked) within the stated tolerance."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import layout as L
from trace_jax.kernels import moe_combine as MC


def _case(seed, n, k, d, dtype, src_extra=7):
  """n tokens' residual rows over many magnitudes, k expert rows each in a chunk-row array of
  n * k + src_extra rows (shuffled, wider than d); the slot table sends one pair past the rows
  (zeros) and one to -1 (the last row, as jnp.take counts back); gates in [0, 1)."""
  rng = np.random.default_rng(seed)
  m, src = n * k, n * k + src_extra
  mag = np.exp(rng.uniform(-4, 4, (n, 1)))
  x = jnp.asarray(rng.standard_normal((n, 1, d)) * mag[:, :, None], jnp.float32).astype(dtype)
  rows = rng.standard_normal((src, d + 16)) * np.exp(rng.uniform(-4, 4, (src, 1)))
  rows = jnp.asarray(rows, jnp.float32).astype(dtype)
  slot = rng.permutation(src)[:m].astype(np.int32)
  slot[1], slot[2] = src, -1
  inverse = jnp.asarray(rng.permutation(m), jnp.int32)
  weights = jnp.asarray(rng.uniform(0, 1, (n, k)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.25, 2.0, d), jnp.float32).astype(dtype)
  return x, L.ChunkRows(rows, jnp.asarray(slot), d), inverse, weights, scale


def _bits(a):
  return [np.asarray(v).view(np.uint8) for v in jax.tree_util.tree_leaves(a)]


@pytest.mark.parametrize("n,k,d,dtype", [(37, 3, 64, jnp.bfloat16), (3, 8, 2048, jnp.bfloat16),
                                         (5, 8, 256, jnp.float32)],
                         ids=["rows_masked_bf16", "wide_bf16", "f32"])
def test_kernel_equals_model_ops(n, k, d, dtype):
  """37 tokens of 64 (32 a program: the second program's rows past 37 masked), top-3;
  2,048-wide rows (one a program), top-8; float32 rows."""
  x, rows, inverse, weights, scale = _case(0, n, k, d, dtype)
  args = (x, rows, inverse, weights, scale)
  got = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6, interpret=True))(*args)
  want = jax.jit(functools.partial(MC.combine_add_rms_norm_ref, eps=1e-6))(*args)
  for g, w in zip(got, want):
    assert g.shape == x.shape and g.dtype == x.dtype
  for g, w in zip(_bits(got), _bits(want)):
    np.testing.assert_array_equal(g, w)
  # independent: the weighted sum in float64 from numpy's own gather, to the roundings (each
  # product and the sum rounded to dtype, then the add)
  y = MC.pair_rows_numpy(rows, inverse, k)
  w = np.asarray(weights.astype(dtype), np.float64)
  h = np.einsum("nkd,nk->nd", y, w)
  s = np.asarray(got[0], np.float64).reshape(n, d)
  xs = np.asarray(x, np.float64).reshape(n, d)
  eps_d = 2.0 ** -8 if dtype == jnp.bfloat16 else 2.0 ** -23
  bound = (k + 2) * eps_d * (np.abs(y) * w[:, :, None]).sum(1) + eps_d * np.abs(s)
  assert (np.abs(s - (xs + h)) <= bound + 1e-30).all()
  norm = s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + 1e-6) * np.asarray(scale, np.float64)
  np.testing.assert_allclose(np.asarray(got[1], np.float64).reshape(n, d), norm,
                             rtol=3 * eps_d if dtype == jnp.bfloat16 else 1e-5, atol=1e-30)


def test_supported_and_errors():
  x, rows, inverse, weights, scale = _case(0, 4, 2, 64, jnp.bfloat16)
  assert MC.kernel_supported(x, rows, inverse, weights, scale) is None
  assert "powers of two" in MC.kernel_supported(x[..., :48], rows, inverse, weights, scale[:48])
  assert "expert rows" in MC.kernel_supported(x.astype(jnp.float32), rows, inverse, weights,
                                              scale)
  assert "gate weights" in MC.kernel_supported(x, rows, inverse, weights[:3], scale)
  assert "pair rows" in MC.kernel_supported(x, rows, inverse[:5], weights, scale)
  assert "scale of shape" in MC.kernel_supported(x, rows, inverse, weights, scale[:32])
  with pytest.raises(ValueError, match="gate weights"):
    MC.combine_add_rms_norm(x, rows, inverse, weights.astype(jnp.bfloat16), scale, 1e-6,
                            interpret=True)
  assert not kernels.combine_in_kernel()  # GPU only
  assert kernels.combine_add_rms_norm(x, rows, inverse, weights, scale, 1e-6) is None


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel (gathered row loads, masked stores), for an H200 at
  the 30B-A3B decode shape (B 256, top-8 of 2,048-wide rows in 220 chunks of 32)."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  sds = jax.ShapeDtypeStruct
  rows = L.ChunkRows(sds((220 * 32, 2048), jnp.bfloat16), sds((2048,), jnp.int32), 2048)
  args = (sds((256, 1, 2048), jnp.bfloat16), rows, sds((2048,), jnp.int32),
          sds((256, 8), jnp.float32), sds((2048,), jnp.bfloat16))
  text = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6)).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "moe_combine_add_rms_norm" in text
  # and at the rollout's 255 rows with the norm padded to 256 (`PaddedRows`)
  rows = L.ChunkRows(sds((220 * 32, 2048), jnp.bfloat16), sds((2040,), jnp.int32), 2048)
  args = (sds((255, 1, 2048), jnp.bfloat16), rows, sds((2040,), jnp.int32),
          sds((255, 8), jnp.float32), sds((2048,), jnp.bfloat16))
  text = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6, y_rows=256)).trace(
      *args).lower(lowering_platforms=("cuda",)).as_text()
  assert "tensor<256x2048xbf16>" in text


def test_kernel_pads_the_norms_rows():
  """y_rows (`layout.PaddedRows`, the attention's input norm padded for the bf16 q/k/v
  kernel): 37 tokens' norm in 40 rows, its first 37 bit for bit the unpadded kernel's, the
  rest zeros; the sum unchanged; fewer rows than tokens refused."""
  args = _case(4, 37, 3, 64, jnp.bfloat16)
  plain = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6, interpret=True))(*args)
  got = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6, interpret=True,
                                  y_rows=40))(*args)
  assert got[1].shape == (40, 64)
  np.testing.assert_array_equal(_bits(got[0])[0], _bits(plain[0])[0])
  np.testing.assert_array_equal(np.asarray(got[1][:37]).view(np.uint8),
                                np.asarray(plain[1]).reshape(37, 64).view(np.uint8))
  assert not np.asarray(got[1][37:], np.float32).any()
  value = L.PaddedRows(got[1], (37, 1, 64)).value()
  np.testing.assert_array_equal(_bits(value)[0], _bits(plain[1])[0])
  with pytest.raises(ValueError, match="y_rows 36"):
    MC.combine_add_rms_norm(*args, 1e-6, interpret=True, y_rows=36)


def _chunked_grouped_matmul(monkeypatch):
  """kernels.grouped_matmul returning its rows as the FP4 kernel leaves them where asked
  (`keep_chunks`): shuffled into a wider, taller chunk-row array, read through a slot table."""
  plain = kernels.grouped_matmul

  def chunked(x, w, group_sizes, **kw):
    keep = kw.pop("keep_chunks", False)
    y = plain(x, w, group_sizes, **kw)
    if not keep or kw.get("out_rows") is not None:
      return y
    m, n = y.shape
    src = m + 5
    perm = jnp.asarray(np.random.default_rng(m).permutation(src)[:m], jnp.int32)
    rows = jnp.zeros((src, n + 16), y.dtype).at[perm, :n].set(y)
    return kernels.ChunkRows(rows, perm, n)

  monkeypatch.setattr(kernels, "grouped_matmul", chunked)


@pytest.mark.slow  # ~25 s on 2 cores; the kernel's own tests stay in the default suite
@pytest.mark.parametrize("declines", [False, True], ids=["kernel", "declined"])
def test_model_with_kernel_is_bitwise_the_xla_path(monkeypatch, declines):
  """A two-layer bf16 model (FP4 "paper" policy, NVFP4 KV, guidance recorded) whose decode
  steps leave the MoE's output in chunk rows (`RoutedRows`) for the next norm: with the kernel
  (interpret mode) at the layer boundary and the final norm, or with the kernel declining (the
  XLA ops read the rows), the same logits, cache and records, bit for bit, as the XLA path
  over a prompt and decode steps."""
  from tests.kernels.test_glue_in_model import prompt_and_steps  # noqa: PLC0415
  cfg = M.tiny(num_layers=2, dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  params = jax.tree_util.tree_map_with_path(  # norm scales other than ones: a wrong one shows
      lambda p, a: a * 1.5 if "norm" in jax.tree_util.keystr(p) else a, params)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  run = functools.partial(prompt_and_steps, params, cfg, ctx, 3)
  want = run()
  calls = []

  def combine(*args, pad_rows=False):  # (unpadded: `test_model_with_padded_norm_rows_...`)
    calls.append(args[1].rows.shape)
    return None if declines else MC.combine_add_rms_norm(*args, interpret=True)

  _chunked_grouped_matmul(monkeypatch)
  monkeypatch.setattr(kernels, "combine_in_kernel", lambda: True)
  monkeypatch.setattr(kernels, "combine_add_rms_norm", combine)
  jax.clear_caches()
  got = run()
  assert len(calls) == 2  # the decode program's layer boundary and final norm (traced once)
  for a, b in zip(_bits(got), _bits(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.slow  # ~25 s on 2 cores, as the test above
def test_model_with_padded_norm_rows_is_bitwise_the_xla_path(monkeypatch):
  """`TRACE_JAX_NORM_ROWS=padded`'s path in a two-layer bf16 model with fused q/k/v (B 3): the
  layer boundary's norm comes from the kernel (interpret mode) as `PaddedRows` of 8 rows, the
  attention hands them as they are to the fused product (here XLA's dot of their value; the
  padding's zeros: `test_kernel_pads_the_norms_rows`), the final norm stays unpadded; logits,
  cache and records bit for bit those of the XLA path."""
  from tests.kernels.test_glue_in_model import prompt_and_steps  # noqa: PLC0415
  from tests.kernels.test_qkv_append import _fused_qkv_params  # noqa: PLC0415
  cfg = M.tiny(num_layers=2, dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = _fused_qkv_params(M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy))
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  run = functools.partial(prompt_and_steps, params, cfg, ctx, 3)
  want = run()
  padded_calls, plain_matmul = [], kernels.matmul

  def combine(x, rows, inverse, weights, scale, eps, pad_rows=False):
    s, y = MC.combine_add_rms_norm(x, rows, inverse, weights, scale, eps, interpret=True,
                                   y_rows=8 if pad_rows else None)
    return s, (L.PaddedRows(y, tuple(x.shape)) if pad_rows else y)

  def matmul(x, w, out_dtype=None, **kw):
    if isinstance(x, L.PaddedRows):
      padded_calls.append(x.rows.shape)
      x = x.value()
    return plain_matmul(x, w, out_dtype, **kw)

  _chunked_grouped_matmul(monkeypatch)
  monkeypatch.setattr(kernels, "combine_in_kernel", lambda: True)
  monkeypatch.setattr(kernels, "combine_add_rms_norm", combine)
  monkeypatch.setattr(kernels, "matmul", matmul)
  jax.clear_caches()
  got = run()
  assert padded_calls == [(8, cfg.hidden_size)]  # layer 1's q/k/v (traced once)
  for a, b in zip(_bits(got), _bits(want)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_kernel_on_gpu_agrees_with_model_ops():
  """The compiled kernel at the 30B-A3B decode shape (B 256, top-8, 2,048 wide, bf16): its sum
  equals numpy's computation of the model's rule bit for bit; XLA's ops stay within roundings
  of it ((k + 2) bf16 units of |x| + the products' magnitudes: on the H200 XLA:GPU's sum is off
  the rule in 29% of elements, session 40); the norm within two roundings of XLA's (2**-6 of
  the row's largest). The fractions off are printed."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  args = _case(3, 256, 8, 2048, jnp.bfloat16, src_extra=5000)
  got = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6))(*args)
  want = jax.jit(functools.partial(MC.combine_add_rms_norm_ref, eps=1e-6))(*args)
  rule, mag = MC.combine_add_numpy(*args[:4])
  s = np.asarray(got[0]).reshape(rule.shape)
  ws = np.asarray(want[0], np.float32).reshape(rule.shape)
  y, wy = np.asarray(got[1], np.float32), np.asarray(want[1], np.float32)
  print(f"sum elements off: kernel {(s.view(np.uint16) != rule.view(np.uint16)).mean():.2e}, "
        f"XLA {(ws != rule.astype(np.float32)).mean():.2e}; norm elements off XLA's: "
        f"{(y != wy).mean():.2e}")
  np.testing.assert_array_equal(s.view(np.uint16), rule.view(np.uint16))
  r = rule.astype(np.float32)
  assert (np.abs(ws - r) <= 10 * 2 ** -8 * mag).all()
  assert (np.abs(y - wy) <= 2 ** -6 * np.abs(wy).max(-1, keepdims=True)).all()


@pytest.mark.gpu
def test_model_with_kernel_on_gpu(monkeypatch):
  """A one-layer model with FP4 kernel-layout experts (hidden 256, 16 experts of 256, top-8,
  40 sequences) whose decode steps take the kernel on the down kernel's own chunk rows: its
  records and cache bit for bit the XLA path's (made before the combine), its logits within
  rounding (relative error < 1e-2), over a prompt and decode steps."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  from tests.kernels.test_glue_in_model import expert_kernel_model  # noqa: PLC0415
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  run = expert_kernel_model()
  monkeypatch.setattr(dispatch, "_MOE_COMBINE", "xla")  # the XLA path
  want = run()
  used = []
  kernel = kernels.combine_add_rms_norm

  def counted(*args, **kw):  # (kw: the attention's input norm passes pad_rows)
    out = kernel(*args, **kw)
    used.append(out is not None)
    return out

  monkeypatch.setattr(dispatch, "_MOE_COMBINE", "kernel")
  monkeypatch.setattr(kernels, "combine_add_rms_norm", counted)
  jax.clear_caches()
  got = run()
  assert used and all(used), used
  (got_steps, got_cache), (want_steps, want_cache) = got, want
  for a, b in zip(_bits((got_cache, [r for _, r in got_steps])),
                  _bits((want_cache, [r for _, r in want_steps]))):
    np.testing.assert_array_equal(a, b)
  g = jnp.concatenate([lg for lg, _ in got_steps], axis=1)
  w = jnp.concatenate([lg for lg, _ in want_steps], axis=1)
  err = float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w))
  print(f"logits relative error {err:.2e}")
  assert err < 1e-2


@pytest.mark.gpu
def test_padded_norm_on_gpu_equals_unpadded():
  """The compiled kernel at the rollout's shape (B 255, top-8, 2,048 wide, bf16) with its norm
  padded to 256 rows (`PaddedRows`): the sum and the first 255 rows of the norm bit for bit the
  unpadded call's, the last row zeros."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  args = _case(5, 255, 8, 2048, jnp.bfloat16, src_extra=5000)
  plain = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6))(*args)
  got = jax.jit(functools.partial(MC.combine_add_rms_norm, eps=1e-6, y_rows=256))(*args)
  np.testing.assert_array_equal(_bits(got[0])[0], _bits(plain[0])[0])
  np.testing.assert_array_equal(np.asarray(got[1][:255]).view(np.uint8),
                                np.asarray(plain[1]).reshape(255, 2048).view(np.uint8))
  assert not np.asarray(got[1][255:], np.float32).any()
