"""The decode step's q/k/v kernel (`kernels/qkv_append.py`) against the model's XLA path it
replaces (`decode_qkv_ref`: split, per-head RMS norms, rope, the K/V quantization and cache
write, q in the Mosaic attention's physical order): every output bit for bit in Pallas
interpret mode on CPU; the Triton lowering for CUDA where the plugin is installed; on the GPU
(marked) within the stated tolerance."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import add_norm
from trace_jax.kernels import attention_mgpu as AM
from trace_jax.kernels import attention_ref as R
from trace_jax.kernels import qkv_append as DQ
from trace_jax.models import transformer as T

B, S, KVH, HD, NH = 3, 8, 4, 128, 32  # GQA 8 at head_dim 128: the Mosaic kernel's q layout


def _cache(seed, packing="nibbles", b=B, s=S):
  x = jax.random.normal(jax.random.key(seed), (b, s, KVH, HD), jnp.float32).astype(jnp.bfloat16)
  return tq.with_packing(tq.quantize(x, "nvfp4", second_level="row", validate=False), packing)


def _case(seed, b=B, dtype=jnp.bfloat16):
  """A projection row per sequence over many magnitudes (a zero head among them), rope
  positions from 0 to 40,000, norm scales around 1."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((b, NH + 2 * KVH, HD)) * np.exp(rng.uniform(-5, 5, (b, NH + 2 * KVH, 1)))
  x[0, 3] = 0.0
  x[0, NH + 1] = 0.0
  qkv = jnp.asarray(x.reshape(b, -1), jnp.float32).astype(dtype)
  pos = jnp.asarray(np.concatenate([[0, 40000], rng.integers(0, 8192, b - 2)]), jnp.int32)
  scales = [jnp.asarray(rng.uniform(0.25, 2.0, HD), jnp.float32).astype(dtype) for _ in (0, 1)]
  return qkv, pos, scales


def _bits(a):
  return [np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(a)]


@pytest.mark.parametrize("layout,packing,norm,index", [
    ("logical", "nibbles", True, 5), ("mosaic", "kv_words", True, [1, 7, 0]),
    ("logical", "kv_words", False, [2, 2, 6])], ids=["logical", "mosaic", "no_norm"])
def test_kernel_equals_xla_path(monkeypatch, layout, packing, norm, index):
  """q (in its layout), both caches (the written slot and the rest) and the new rows, bit for
  bit; with the Mosaic layout, the attention's merge counters (an output interpret mode fills
  with garbage) zeroed (`TRACE_JAX_ATTN_COUNTS=given`) and the new rows' compact guidance bits
  (`guidance_bits`) as `make_guidance` makes them from the reference's rows."""
  monkeypatch.setattr(AM, "GIVEN_COUNTS", True)
  qkv, pos, (qs, ks) = _case(0)
  kc, vc = _cache(1, packing), _cache(2, packing)
  kw = dict(num_heads=NH, q_scale=qs if norm else None, k_scale=ks if norm else None, eps=1e-6,
            theta=1e6, layout=layout)
  idx = jnp.asarray(index, jnp.int32)
  bits = layout == "mosaic"  # the new rows' guidance bits written by the kernel too
  got = jax.jit(functools.partial(DQ.decode_qkv, interpret=True, guidance_bits=bits, **kw))(
      qkv, pos, kc, vc, idx)
  want = jax.jit(functools.partial(DQ.decode_qkv_ref, **kw))(qkv, pos, kc, vc, idx)
  assert isinstance(got[0], AM.PhysicalQuery) == (layout == "mosaic")
  q = got[0].qp if layout == "mosaic" else got[0]
  assert q.shape == (B, NH, HD) and q.dtype == qkv.dtype
  for g, w in zip(_bits((q, *got[1:5])), _bits(want), strict=True):
    np.testing.assert_array_equal(g, w)
  assert [x.packing for x in got[1:5]] == [packing, packing, "nibbles", "nibbles"]
  if not bits:
    assert got[5] is None
  else:  # as `make_guidance` makes them from the reference's rows
    for g, w in zip(got[5], want[3:], strict=True):
      assert g.shape == (B, 1, KVH, HD // 8) and g.dtype == jnp.uint8
      np.testing.assert_array_equal(np.asarray(g), np.asarray(tq.make_guidance(w).payload))
  if layout == "mosaic":
    assert got[0].counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got[0].counts), np.zeros(B * KVH, np.int32))
    monkeypatch.setattr(AM, "GIVEN_COUNTS", False)  # the attention kernel's own counters
    assert DQ.decode_qkv(qkv, pos, kc, vc, idx, interpret=True, **kw)[0].counts is None


def test_reference_is_the_rope_and_norm_of_the_model():
  """The rules the kernel shares with the model: `rotate_halves` on a row's halves (the
  kernel's form) equals `rope` bit for bit in bf16 (zeros' signs included), and `rms_norm`
  equals a float64 numpy norm to its three bf16 roundings (the scale, the normalized row, their
  product: half an ulp each, up to 2**-8 relative)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((2, 3, 4, HD)) * 3, jnp.float32).astype(jnp.bfloat16)
  x = x.at[0, 0, 0, :4].set(0.0).at[0, 0, 0, 64:68].set(-0.0)
  pos = jnp.asarray(rng.integers(0, 40000, (2, 3)), jnp.int32)

  def halves(x, positions, theta):
    freqs = positions.astype(jnp.float32)[..., None] * T.rope_inv_freq(HD, theta)
    cos, sin = (f(freqs)[:, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    return jnp.concatenate(T.rotate_halves(*jnp.split(x, 2, axis=-1), cos, sin), axis=-1)

  got = jax.jit(T.rope, static_argnums=2)(x, pos, 1e6)
  np.testing.assert_array_equal(_bits(got)[0], _bits(jax.jit(halves, static_argnums=2)(
      x, pos, 1e6))[0])
  scale = jnp.asarray(rng.uniform(0.5, 2, HD), jnp.float32)
  xf = np.asarray(x, np.float64)
  want = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * np.asarray(scale)
  np.testing.assert_allclose(np.asarray(T.rms_norm(x, scale, 1e-6), np.float64), want,
                             rtol=3 * 2 ** -8, atol=1e-30)


def test_physical_query_in_decode_attention():
  """A `PhysicalQuery` is read as it is by the Mosaic path (the same output as the logical q it
  stands for, the stream kernel emulated), and un-permuted for any other path."""
  b, s = 2, 152
  kv = [_cache(seed, b=b, s=s) for seed in (3, 4)]
  q = jax.random.normal(jax.random.key(5), (b, NH, HD), jnp.float32).astype(jnp.bfloat16)
  pq = AM.PhysicalQuery(AM.to_physical(q))
  np.testing.assert_array_equal(np.asarray(pq.logical()), np.asarray(q))
  assert pq.shape == q.shape and pq.dtype == q.dtype and pq.ndim == 3
  valid = jnp.asarray(np.arange(s)[None, :] < np.array([[s], [70]]))
  run = jax.jit(functools.partial(AM.decode_attention, schedule="stream",
                                  kernel_fn=AM.emulate_stream_kernel))
  np.testing.assert_array_equal(np.asarray(run(pq, *kv, valid)), np.asarray(run(q, *kv, valid)))
  with_counts = AM.PhysicalQuery(pq.qp, jnp.zeros((b * KVH,), jnp.int32))
  np.testing.assert_array_equal(np.asarray(run(with_counts, *kv, valid)),
                                np.asarray(run(q, *kv, valid)))
  with pytest.raises(ValueError, match=r"counters int32\[4\], not int32\[8\]"):
    run(AM.PhysicalQuery(pq.qp, jnp.zeros((4,), jnp.int32)), *kv, valid)
  ref = jax.jit(functools.partial(kernels.decode_attention, use_kernel=False))
  np.testing.assert_array_equal(np.asarray(ref(pq, *kv, valid)),
                                np.asarray(R.decode_attention_ref(q, *kv, valid)))


def test_supported_and_errors():
  qkv, pos, (qs, ks) = _case(0)
  kc, vc = _cache(1), _cache(2)
  assert DQ.kernel_supported(qkv, kc, vc, NH) is None
  assert DQ.kernel_supported(qkv, kc, vc, NH, "mosaic") is None
  assert "shape" in DQ.kernel_supported(qkv[:, :-HD], kc, vc, NH)
  assert "power of two" in DQ.kernel_supported(
      jnp.zeros((B, (24 + 2 * KVH) * HD), jnp.bfloat16), kc, vc, 24)
  assert "layout" in DQ.kernel_supported(qkv, kc, vc, NH, "tiled")
  mx = tq.quantize(jnp.zeros((B, S, KVH, HD)), "mxfp4", validate=False)
  assert "mxfp4" in DQ.kernel_supported(qkv, mx, mx, NH)
  with pytest.raises(ValueError, match="both given or both None"):
    DQ.decode_qkv(qkv, pos, kc, vc, 0, num_heads=NH, q_scale=qs, interpret=True)
  with pytest.raises(ValueError, match="positions of shape"):
    DQ.decode_qkv(qkv, pos[:2], kc, vc, 0, num_heads=NH, interpret=True)
  with pytest.raises(ValueError, match=r"norm scale of shape \(64,\)"):
    DQ.decode_qkv(qkv, pos, kc, vc, 0, num_heads=NH, q_scale=qs[:64], k_scale=ks,
                  interpret=True)
  assert kernels.decode_qkv(qkv, pos, kc, vc, 0, num_heads=NH) is None  # GPU only


def test_dispatch_writes_q_for_the_attention_that_reads_it(monkeypatch):
  """`kernels.decode_qkv` asks for q in the Mosaic kernel's order exactly where decode
  attention will run that kernel (a cache past the short-cache bound), else logical; nothing
  where it is off (`TRACE_JAX_DECODE_QKV=xla`) or the shapes do not fit."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  layouts = []
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "_DECODE_QKV", "kernel")
  monkeypatch.setattr(dispatch, "_decode_qkv",
                      lambda *a, layout, **kw: layouts.append(layout) or layout)
  qkv, pos, (qs, ks) = _case(0)
  # short, then past the bound (a multiple of 8 slots, as the Mosaic kernel takes)
  for slots in (S, (dispatch.SHORT_CACHE_SLOTS // B // 8 + 1) * 8):
    kc = jax.eval_shape(lambda: _cache(1, "kv_words", s=slots))
    assert dispatch.decode_qkv(qkv, pos, kc, kc, 0, num_heads=NH, q_scale=qs, k_scale=ks)
  assert layouts == ["logical", "mosaic"]
  assert dispatch.decode_qkv(qkv[:, :-HD], pos, kc, kc, 0, num_heads=NH) is None
  monkeypatch.setattr(dispatch, "_DECODE_QKV", "xla")
  assert dispatch.decode_qkv(qkv, pos, kc, kc, 0, num_heads=NH) is None


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel (the halves' split and join, the physical order's
  transposition, the fp8 stores, the inline division, the guidance bits), for an H200; the
  stream attention lowered on its queries takes the merge counters it zeroed, with no zero
  fill of XLA's."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  monkeypatch.setattr(AM, "GIVEN_COUNTS", True)
  qkv, pos, (qs, ks) = _case(0)
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  args = jax.tree.map(sds, (qkv, pos, _cache(1, "kv_words"), _cache(2, "kv_words"),
                            jnp.zeros((B,), jnp.int32), qs, ks))
  fn = lambda qkv, p, kc, vc, i, qs, ks: DQ.decode_qkv(  # noqa: E731
      qkv, p, kc, vc, i, num_heads=NH, q_scale=qs, k_scale=ks, layout="mosaic",
      guidance_bits=True)
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "qkv_append_nvfp4" in text

  # the stream attention on the queries: the merge counters the kernel zeroed, not XLA's zero
  # fill of the attention kernel's own (which a query without them still gets)
  def attend(own, *a):
    q, kc, vc, *_ = fn(*a[:-1])
    return AM.decode_attention(AM.PhysicalQuery(q.qp) if own else q, kc, vc, a[-1],
                               schedule="stream")

  valid = jax.ShapeDtypeStruct((B, S), jnp.bool_)
  for own in (False, True):
    text = jax.jit(functools.partial(attend, own)).trace(*args, valid).lower(
        lowering_platforms=("cuda",)).as_text()
    fills = [ln for ln in text.splitlines()
             if "broadcast_in_dim" in ln and f"-> tensor<{B * KVH}xi32>" in ln]
    assert "mosaic_gpu" in text and len(fills) == own, fills


def _fused_qkv_params(params):
  """The attention's q, k and v kernels side by side in q_proj's (as the rollout's weight sync
  leaves them: `kernels.fuse_projections`), so the model makes them in one product."""
  def fuse(tree):
    if not isinstance(tree, dict):
      return tree
    tree = {k: fuse(v) for k, v in tree.items()}
    if {"q_proj", "k_proj", "v_proj"} <= set(tree):
      parts = [tree[p]["kernel"] for p in ("q_proj", "k_proj", "v_proj")]
      tree = dict(tree, q_proj={"kernel": jnp.concatenate(parts, axis=1)},
                  k_proj={"kernel": None}, v_proj={"kernel": None})
    return tree
  return fuse(params)


@pytest.mark.slow  # ~25 s on 2 cores; the kernel's own tests stay in the default suite
def test_model_with_kernel_is_bitwise_the_xla_path(monkeypatch):
  """A two-layer bf16 model (Qwen3's per-head q/k norms, NVFP4 KV, guidance recorded) whose
  decode steps take the kernel (interpret mode, logical q), and with it the add + norm kernel
  (`add_norm.py`, after attention and at the layer boundary: the opt-in glue kernels together),
  gives the same logits, cache and records, bit for bit, as the XLA path over a prompt and
  decode steps."""
  from tests.kernels.test_glue_in_model import prompt_and_steps  # noqa: PLC0415
  cfg = M.tiny(num_layers=2, qk_norm="head", dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  # norm scales other than the initial ones, so a wrong scale shows
  params = jax.tree_util.tree_map_with_path(
      lambda p, a: a * 1.5 if "norm" in jax.tree_util.keystr(p) else a, params)
  params = _fused_qkv_params(params)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  run = functools.partial(prompt_and_steps, params, cfg, ctx, 2)
  want = run()
  calls = []

  def kernel(*args, **kw):
    calls.append(1)
    return DQ.decode_qkv(*args, interpret=True, **kw)

  def add_rms_norm(*args):
    calls.append(2)
    return add_norm.add_rms_norm(*args, interpret=True)

  monkeypatch.setattr(kernels, "decode_qkv", kernel)
  monkeypatch.setattr(kernels, "add_rms_norm", add_rms_norm)
  jax.clear_caches()
  got = run()
  assert sorted(set(calls)) == [1, 2]  # the decode steps' program took both (traced once)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["mosaic", "logical"])
def test_kernel_on_gpu_agrees_with_xla_path(layout):
  """The compiled kernel at the 30B-A3B decode shape (B 64, 384 slots, bit-placed cache) against
  the XLA path: V's fields bit for bit (nothing is computed before its quantization); q within
  two bf16 roundings of its head's largest element of XLA's (2**-6 of it: the norm's float32
  sum runs in another order, XLA may round its bf16 chain otherwise, and the rotation's sum
  can cancel, so no relative bound holds element by element); K's codes, block and row
  scales, which follow k, at most 2% off. The fractions off are printed."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  b = 64
  qkv, pos, (qs, ks) = _case(7, b=b)
  kc, vc = _cache(8, "kv_words", b=b, s=384), _cache(9, "kv_words", b=b, s=384)
  idx = jnp.asarray(np.arange(b) * 5 % 384, jnp.int32)
  kw = dict(num_heads=NH, q_scale=qs, k_scale=ks, eps=1e-6, theta=1e6, layout=layout)
  got = jax.jit(functools.partial(DQ.decode_qkv, guidance_bits=layout == "mosaic", **kw))(
      qkv, pos, kc, vc, idx)
  for bits, rows in zip(got[5] or (), got[3:5]):  # the kernel's guidance bits of its own rows
    np.testing.assert_array_equal(np.asarray(bits), np.asarray(tq.make_guidance(rows).payload))
  want = jax.jit(functools.partial(DQ.decode_qkv_ref, **kw))(qkv, pos, kc, vc, idx)
  q = np.asarray(got[0].qp if layout == "mosaic" else got[0], np.float32)
  wq = np.asarray(want[0], np.float32)
  k_off = [float((g != w).mean()) for g, w in zip(_bits(got[3]), _bits(want[3]))]
  print(f"q elements off: {(q != wq).mean():.2e}; K codes, scales, row scales off: {k_off}")
  assert (np.abs(q - wq) <= 2 ** -6 * np.abs(wq).max(axis=-1, keepdims=True)).all()
  assert max(k_off) <= 0.02
  for g, w in zip(_bits((got[2], got[4])), _bits((want[2], want[4]))):  # V: cache and rows
    np.testing.assert_array_equal(g, w)


@pytest.mark.gpu
def test_model_with_kernel_on_gpu(monkeypatch):
  """A one-layer model of the 30B-A3B attention shape (32 query heads, 4 KV heads of 128,
  per-head norms; FP4 "paper" policy, NVFP4 KV; fused q/k/v) whose decode steps take the
  kernel, q read by the Mosaic decode attention as the kernel wrote it (`PhysicalQuery`), gives
  the XLA path's logits to rounding (relative error < 1e-2) over a prompt and decode steps."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  cfg = M.tiny(num_layers=1, vocab_size=256, hidden_size=256, num_heads=NH, num_kv_heads=KVH,
               head_dim=HD, qk_norm="head", dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = _fused_qkv_params(M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy))
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  b, slots = 16, 512  # 8,192 slots: past the short-cache bound, so the Mosaic kernel reads it
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (b, 6)), jnp.int32)

  def run():
    step = jax.jit(lambda p, t, c, i: M.apply(p, t, cfg, ctx, cache=c, cache_index=i))
    out = step(params, tokens[:, :3], M.init_cache(cfg, b, slots, policy.kv_format), 0)
    logits = [out.logits]
    for i in range(3, tokens.shape[1]):
      out = step(params, tokens[:, i:i + 1], out.cache, i)
      logits.append(out.logits)
    return jnp.concatenate(logits, axis=1).astype(jnp.float32)

  monkeypatch.setattr(dispatch, "_DECODE_QKV", "xla")  # the XLA path
  want = run()
  physical = []
  kernel = kernels.decode_qkv

  def counted(*args, **kw):
    out = kernel(*args, **kw)
    physical.append(out is not None and isinstance(out[0], AM.PhysicalQuery))
    return out

  monkeypatch.setattr(dispatch, "_DECODE_QKV", "kernel")
  monkeypatch.setattr(kernels, "decode_qkv", counted)
  jax.clear_caches()
  got = run()
  assert physical and all(physical), physical
  err = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
  print(f"logits relative error {err:.2e}")
  assert err < 1e-2
