"""The decode-step K/V append kernel (`kernels/kv_append.py`) against the XLA path it replaces:
`quantize(..., second_level="row")` of the new rows and `kv_cache.write_layer`, every cache
field bit for bit; the kernel body runs in Pallas interpret mode on CPU, and lowers for CUDA
where the plugin is installed."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import quant as tq
from trace_jax.kernels import kv_append
from trace_jax.models import kv_cache as kvc

B, S, KVH, HD = 3, 8, 4, 64


def _cache(seed):
  """A cache holding random rows (not the empty cache's constants), NVFP4 row scales."""
  x = jax.random.normal(jax.random.key(seed), (B, S, KVH, HD), jnp.float32).astype(jnp.bfloat16)
  return tq.quantize(x, "nvfp4", second_level="row", validate=False)


def _rows(seed):
  """New rows over many magnitudes: a zero head, a head with one huge and tiny elements (block
  scales at both clip bounds), values that sit on E2M1 rounding midpoints."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, 1, KVH, HD)) * np.exp(rng.uniform(-6, 6, (B, 1, KVH, 1)))
  x[0, 0, 1] = 0.0
  x[1, 0, 2] = 1e-6
  x[1, 0, 2, 5] = 3e4
  x[2, 0, 3, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)


def decode_case(index):
  """The 30B-A3B decode shape (B=64, 4 KV heads x 128, 384 slots): caches holding random rows,
  new K/V rows over 16 orders of magnitude, the write index (`"per_row"`: one per sequence).
  -> (k_cache, v_cache, k, v, index); `benchmarks/probe_glue.py` studies the same case."""
  b, s, kvh, hd = 64, 384, 4, 128
  x = jax.random.normal(jax.random.key(0), (2, b, s, kvh, hd), jnp.float32)
  kc, vc = (tq.quantize(x[i].astype(jnp.bfloat16), "nvfp4", second_level="row",
                        validate=False) for i in (0, 1))
  scale = jnp.exp(jax.random.uniform(jax.random.key(1), (2, b, 1, kvh, 1), minval=-8, maxval=8))
  new = (jax.random.normal(jax.random.key(2), (2, b, 1, kvh, hd)) * scale).astype(jnp.bfloat16)
  idx = (jnp.arange(b, dtype=jnp.int32) * 5 % s if index == "per_row"
         else jnp.asarray(index, jnp.int32))
  return kc, vc, new[0], new[1], idx


def _bits(q):
  return [np.asarray(a).view(np.uint8) for a in (q.codes, q.scales, q.global_scale)]


@pytest.mark.parametrize("index,packing", [(5, "nibbles"), ([0, 7, 3], "nibbles"),
                                            ([0, 7, 3], "kv_words")],
                         ids=["shared", "per_row", "per_row_kv_words"])
def test_append_equals_quantize_and_write(index, packing):
  """Every field bit for bit; a cache of bit-placed words ("kv_words") gets its new codes
  placed (as `write_layer` places the XLA path's), the returned rows stay nibble-packed."""
  kc, vc = (tq.with_packing(c, packing) for c in (_cache(0), _cache(1)))
  k, v = _rows(2), _rows(3)
  idx = jnp.asarray(index, jnp.int32)
  got = jax.jit(lambda *a: kv_append.append(*a, interpret=True))(kc, vc, k, v, idx)
  kq = tq.quantize(k, "nvfp4", second_level="row", validate=False)
  vq = tq.quantize(v, "nvfp4", second_level="row", validate=False)
  want = kvc.write_layer(kvc.LayerKV(kc, vc), kq, vq, idx)
  assert [g.packing for g in got] == [packing, packing, "nibbles", "nibbles"]
  for g, w in zip(got, (want.k, want.v, kq, vq)):
    assert g.shape == w.shape and g.fmt == w.fmt and g.axis == w.axis
    assert g.packing == w.packing
    for a, b in zip(_bits(g), _bits(w)):
      np.testing.assert_array_equal(a, b)
  # the slots not written keep their bytes
  keep = np.ones(S, bool)
  keep[np.broadcast_to(np.asarray(index), (B,))[0]] = False
  np.testing.assert_array_equal(_bits(got[0])[0][0, keep], _bits(kc)[0][0, keep])


def test_supported_and_errors():
  kc = _cache(0)
  assert kv_append.kernel_supported(kc, _rows(2)) is None
  mx = tq.quantize(jnp.zeros((B, S, KVH, HD)), "mxfp4", validate=False)
  assert "mxfp4" in kv_append.kernel_supported(mx, _rows(2))
  assert "one slot" in kv_append.kernel_supported(kc, jnp.zeros((B, 2, KVH, HD)))
  with pytest.raises(ValueError, match="not quantized"):
    kv_append.append(jnp.zeros((B, S, KVH, HD)), kc, _rows(2), _rows(3), 0, interpret=True)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel (block shapes, fp8 stores, the inline division), for
  an H200 (the lowering asks the device for its compute capability: a CPU machine has none)."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  kc, vc = _cache(0), _cache(1)
  sds = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
  args = jax.tree.map(sds, (kc, vc, _rows(2), _rows(3), jnp.zeros((B,), jnp.int32)))
  text = jax.jit(kv_append.append).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "kv_append_nvfp4" in text


@pytest.mark.gpu
@pytest.mark.parametrize("index,packing", [(100, "nibbles"), ("per_row", "nibbles"),
                                            ("per_row", "kv_words")])
def test_kernel_on_gpu_equals_xla_path(index, packing):
  """The compiled kernel (Triton, the PTX division; the in-kernel bit placement of a
  "kv_words" cache) at the 30B-A3B decode shape against the XLA path, every field bit for
  bit."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  kc, vc, *rest = decode_case(index)
  case = (*(tq.with_packing(c, packing) for c in (kc, vc)), *rest)
  got = jax.jit(kv_append.append)(*case)

  def xla(kc, vc, k, v, i):
    kq = tq.quantize(k, "nvfp4", second_level="row", validate=False)
    vq = tq.quantize(v, "nvfp4", second_level="row", validate=False)
    layer = kvc.write_layer(kvc.LayerKV(kc, vc), kq, vq, i)
    return layer.k, layer.v, kq, vq

  want = jax.jit(xla)(*case)
  for g, w in zip(got, want):
    for a, c in zip(_bits(g), _bits(w)):
      np.testing.assert_array_equal(a, c)
