"""A decode step's attention inputs as one Pallas kernel: from each sequence's row of the fused
q/k/v projection, q's and k's per-head RMS norms (Qwen3's `qk_norm="head"`, or none) and rotary
embedding, q written in the order the decode attention reads it, and K and V quantized into the
NVFP4 cache in place.

Owns the kernel, its support check, its wrapper and its reference. The reference
(`decode_qkv_ref`) is the model's own XLA path for one token: the split of the projection,
`transformer.rms_norm`, `transformer.rope`, then `kv_append`'s XLA path (`quantize(...,
second_level="row")` of the new rows and `kv_cache.write_layer`), and for the Mosaic decode
attention q in its physical head_dim order (`attention_mgpu.to_physical`). The kernel body
traces the same rules (`rms_norm`, `rope_inv_freq`, `rotate_halves`, `to_physical`, and
`kv_append.write_rows` for the encoding and stores): in interpret mode on CPU every output
equals the reference bit for bit. Compiled, the transcendentals are libdevice's (as XLA's) and
the norm's sum is Triton's in its own order, so q and K may differ from XLA's by a rounding
(the GPU test states the tolerance).

In the 8k-capacity decode step (B 256, 30B-A3B attention) XLA's ops for these are about seven
kernels a layer beside the K/V append kernel (q's and k's norms and their reductions, q's rope
fused with its permutation to the physical order, k's rope, the V split: ~17 us a layer on
the H200, session 38's profile); this is one, in the append kernel's place.

The GPU default since session 40 (`dispatch.decode_qkv`; `TRACE_JAX_DECODE_QKV=xla` opts out):
on the H200 q, K and V equal XLA's bit for bit, and the 4-layer decode step's kernels took 1.630
-> 1.600 ms (`benchmarks/results/session40_h200_2026-12-05`).

Lowering: a portable Pallas body, one program per sequence, `interpret=True` on CPU and the
Triton lowering on the GPU (as `kv_append`). The cache fields are aliased to the outputs. The
row halves the rotation pairs are `jnp.split`'s (the Triton lowering slices no register arrays
otherwise) and are joined again by a stack and a transposition.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import quant as tq
from trace_jax.kernels import attention_mgpu as AM
from trace_jax.kernels import kv_append
from trace_jax.kernels.row_quant import reciprocal, rounding, whole
from trace_jax.settings import int_setting
from trace_jax.models import kv_cache as kvc
from trace_jax.models import transformer as T

LAYOUTS = ("logical", "mosaic")  # q's head_dim order: the model's, or the Mosaic kernel's
# Warps a program (one sequence: 32 q heads and 8 K/V heads of 128 at the 30B-A3B shape);
# TRACE_JAX_QKV_WARPS for the GPU's A/B (8 not yet timed)
NUM_WARPS = int_setting("TRACE_JAX_QKV_WARPS", 4, minimum=1,
                        doc="warps a program of the q/k/v kernel")


def kernel_supported(qkv, k_cache, v_cache, num_heads: int, layout: str = "logical"):
  """None if the kernel makes this decode step's inputs: qkv `[B, (H + 2 KVH) hd]` (bf16 or
  float32) for NVFP4 caches `[B, S, KVH, hd]` that `kv_append` writes, H a power of two, and for
  the "mosaic" layout the Mosaic kernel's head_dim (128) and H / KVH one of its query-lane
  counts; else the reason it does not."""
  if layout not in LAYOUTS:
    return f"q layout {layout!r}, not one of {LAYOUTS}"
  if not isinstance(k_cache, tq.QArray) or len(k_cache.shape) != 4:
    return "the cache is not a quantized [B, S, KVH, hd] array"
  b, _, kvh, hd = k_cache.shape
  why = (kv_append.kernel_supported(k_cache, jax.ShapeDtypeStruct((b, 1, kvh, hd), qkv.dtype))
         or kv_append.kernel_supported(v_cache, jax.ShapeDtypeStruct((b, 1, kvh, hd), qkv.dtype)))
  if why:
    return why
  if qkv.dtype not in (jnp.bfloat16, jnp.float32):
    return f"projection of dtype {qkv.dtype}"
  if qkv.shape != (b, (num_heads + 2 * kvh) * hd):
    return (f"projection of shape {qkv.shape}, not [{b}, ({num_heads} + 2 x {kvh}) x {hd}] for "
            f"the caches")
  if not kv_append.pow2(num_heads) or num_heads % kvh:
    return f"{num_heads} query heads: the kernel takes a power of two, a multiple of {kvh}"
  return mosaic_layout_supported(k_cache, num_heads) if layout == "mosaic" else None


def mosaic_layout_supported(k_cache, num_heads: int):
  """None if q can be written in the Mosaic attention's physical order for this cache `[B, S,
  KVH, hd]` and num_heads query heads (its head_dim, H / KVH one of its query-lane counts); else
  the reason it cannot."""
  _, _, kvh, hd = k_cache.shape
  if hd != AM.HEAD_DIM or num_heads // kvh not in AM.GP_CHOICES:
    return (f"head_dim {hd} with {num_heads // kvh} query heads per KV head: the physical order "
            f"is the Mosaic kernel's ({AM.HEAD_DIM}, {AM.GP_CHOICES})")
  return None


def _join_halves(a, b):
  """Two halves `[n, h]` side by side as `[n, 2h]` (a concatenation the Triton lowering takes:
  a stack along a new last axis, then a transposition)."""
  n, h = a.shape
  return jnp.swapaxes(jnp.stack([a, b], axis=-1), -1, -2).reshape(n, 2 * h)


def _kernel(idx_ref, pos_ref, freq_ref, qs_ref, ks_ref, x_ref, *refs, num_heads, kv_heads, eps,
            norm, layout, counts, guidance_bits, interpret, **kw):
  # refs: 6 aliased cache inputs (their buffers are the outputs), 6 cache outputs, 6 new-row
  # outputs (`kv_append.write_rows`), q's row, with `counts` the row's attention merge
  # counters (`attention_mgpu.GIVEN_COUNTS`), with `guidance_bits` K's and V's guidance bits
  caches, rows, q_ref = refs[6:12], refs[12:18], refs[18]
  b = pl.program_id(0)
  dt = x_ref.dtype
  freqs = pos_ref[b].astype(jnp.float32) * freq_ref[...]  # [hd / 2], as `rope` forms them
  cos, sin = jnp.cos(freqs).astype(dt), jnp.sin(freqs).astype(dt)

  def norm_rope(x, scale_ref):  # rows [n, hd] of heads
    if norm:
      x = T.rms_norm(x, scale_ref[...], eps, rounding(dt, interpret))
    return _join_halves(*T.rotate_halves(*jnp.split(x, 2, axis=-1), cos, sin))

  q = norm_rope(x_ref[pl.ds(0, num_heads), :], qs_ref)
  q_ref[...] = AM.to_physical(q) if layout == "mosaic" else q
  if counts:  # zeroed here, where XLA would fill and copy them a layer
    refs[19][...] = jnp.zeros(refs[19].shape, refs[19].dtype)
  k = norm_rope(x_ref[pl.ds(num_heads, kv_heads), :], ks_ref)
  v = x_ref[pl.ds(num_heads + kv_heads, kv_heads), :]
  kv_append.write_rows(b, idx_ref[b], [k.astype(jnp.float32), v.astype(jnp.float32)], caches,
                       rows, bits=refs[-2:] if guidance_bits else None, **kw)


def _scales(q_scale, k_scale, hd: int, dtype):
  """The norms' scales as the kernel reads them (ones where there is no norm: unread)."""
  if (q_scale is None) != (k_scale is None):
    raise ValueError("q/k/v kernel: q and k norm scales are both given or both None")
  if q_scale is None:
    return jnp.ones((hd,), dtype), jnp.ones((hd,), dtype)
  for name, s in (("q", q_scale), ("k", k_scale)):
    if tuple(s.shape) != (hd,):
      raise ValueError(f"q/k/v kernel: {name} norm scale of shape {tuple(s.shape)}, not ({hd},)")
  return q_scale, k_scale


def decode_qkv(qkv, positions, k_cache: tq.QArray, v_cache: tq.QArray, index, *, num_heads: int,
               q_scale=None, k_scale=None, eps: float = 1e-6, theta: float = 10000.0,
               layout: str = "logical", guidance_bits: bool = False, interpret: bool = False):
  """One decode token's attention inputs: qkv `[B, (H + 2 KVH) hd]` (the fused projection),
  positions `[B]` (rope's), the caches and the slot `index` (a scalar or `[B]`); q_scale /
  k_scale `[hd]` the per-head norms' scales (None: no norm). Returns (q, k_cache, v_cache, kq,
  vq, bits): q `[B, H, hd]` (layout "logical"), or an `attention_mgpu.PhysicalQuery` ("mosaic",
  with the zeroed counters its stream kernel merges by: `PhysicalQuery.counts`); kq/vq the new
  rows as nibble-packed `QArray`s `[B, 1, KVH, hd]`; bits, with guidance_bits, their compact
  guidance payloads (`make_guidance(kq).payload`, uint8 `[B, 1, KVH, hd / 8]`, K's then V's),
  else None."""
  why = kernel_supported(qkv, k_cache, v_cache, num_heads, layout)
  if why:
    raise ValueError(f"q/k/v kernel: {why}")
  b, _, kvh, hd = k_cache.shape
  if tuple(jnp.shape(positions)) != (b,):
    raise ValueError(f"q/k/v kernel: positions of shape {jnp.shape(positions)}, not ({b},)")
  qs, ks = _scales(q_scale, k_scale, hd, qkv.dtype)
  rows = num_heads + 2 * kvh
  # (computed in the program, as `rope` computes it: evaluated eagerly at trace time, XLA:CPU's
  # power gave other bits than in a fusion; on the GPU it is one small kernel a step)
  args = (jnp.asarray(positions, jnp.int32), T.rope_inv_freq(hd, theta), qs, ks,
          qkv.reshape(b, rows, hd))
  specs = [whole(a) for a in args[:4]] + [pl.BlockSpec((None, rows, hd), lambda i: (i, 0, 0))]
  counts = layout == "mosaic" and AM.GIVEN_COUNTS  # the stream attention's merge counters
  body = functools.partial(
      _kernel, num_heads=num_heads, kv_heads=kvh, eps=eps, norm=q_scale is not None,
      layout=layout, counts=counts, guidance_bits=guidance_bits, interpret=interpret,
      fmt=k_cache.fmt, recip=reciprocal(interpret), packings=(k_cache.packing, v_cache.packing))
  more_out = [jax.ShapeDtypeStruct((b, num_heads, hd), qkv.dtype)]
  more_specs = [pl.BlockSpec((None, num_heads, hd), lambda i: (i, 0, 0))]
  if counts:
    more_out.append(jax.ShapeDtypeStruct((b, kvh), jnp.int32))
    more_specs.append(pl.BlockSpec((None, kvh), lambda i: (i, 0)))
  if guidance_bits:
    more_out += [jax.ShapeDtypeStruct((b, 1, kvh, hd // 8), jnp.uint8)] * 2
    more_specs += [pl.BlockSpec((None, None, kvh, hd // 8), lambda i: (i, 0, 0, 0))] * 2
  k_new, v_new, kq, vq, q, *more = kv_append.cache_call(
      body, args, specs, k_cache, v_cache, index, interpret=interpret, name="qkv_append_nvfp4",
      num_warps=NUM_WARPS, more_out=more_out, more_specs=more_specs)
  if layout == "mosaic":
    q = AM.PhysicalQuery(q, more[0].reshape(b * kvh) if counts else None)
  return q, k_new, v_new, kq, vq, tuple(more[-2:]) if guidance_bits else None


def decode_qkv_ref(qkv, positions, k_cache: tq.QArray, v_cache: tq.QArray, index, *,
                   num_heads: int, q_scale=None, k_scale=None, eps: float = 1e-6,
                   theta: float = 10000.0, layout: str = "logical"):
  """`decode_qkv` by the model's XLA path (the kernel's definition): split, per-head RMS norms,
  rope, the K/V quantization and cache write; q in `layout` (a plain array either way)."""
  b, _, kvh, hd = k_cache.shape
  nq = num_heads * hd
  q, k, v = jnp.split(qkv, [nq, nq + kvh * hd], axis=-1)
  q = q.reshape(b, 1, num_heads, hd)
  k, v = k.reshape(b, 1, kvh, hd), v.reshape(b, 1, kvh, hd)
  if q_scale is not None:
    q, k = T.rms_norm(q, q_scale, eps), T.rms_norm(k, k_scale, eps)
  pos = jnp.asarray(positions, jnp.int32)[:, None]
  q, k = T.rope(q, pos, theta)[:, 0], T.rope(k, pos, theta)
  kq, vq = (tq.quantize(a, k_cache.fmt, second_level="row", validate=False) for a in (k, v))
  layer = kvc.write_layer(kvc.LayerKV(k_cache, v_cache), kq, vq, index)
  return (AM.to_physical(q) if layout == "mosaic" else q), layer.k, layer.v, kq, vq
