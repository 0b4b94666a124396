"""The decode step's K/V cache write for NVFP4 caches as one Pallas kernel: quantize the step's K
and V rows and store their codes, block scales and row scales into the cache slot in place.

Owns the kernel, its support check and its wrapper. The result is defined by the XLA path it
replaces (`quant.quantize(..., second_level="row")` of the new rows, then
`kv_cache.write_layer`): the same bits in every cache field (codes bit-placed in the kernel
where the cache's packing is "kv_words"; the new rows it returns stay nibble-packed). That
path is ten kernels per layer in a decode step on the H200 (the K/V stack, block and row
maxima, the codes, six dynamic-update-slices: 12.5 us per layer in the session-7 profile); this
is one.

The encoding is `quant.qarray.encode_blocks` itself, traced inside the kernel
(`row_quant.encode_tile`), with one difference of means, not of result: the correctly rounded
reciprocal it needs is the PTX `div.rn.f32` instruction on the GPU (the Triton lowering's own
float32 `/` is `div.full.f32`, not correctly rounded), and `formats.reciprocal` in interpret mode
(CPU tests).

Lowering: a portable Pallas body (`pl.pallas_call`, one program per sequence) that runs with
`interpret=True` on CPU and on the GPU through the Triton lowering (as `attention_pallas`;
deprecated since jax 0.11, shipped in 0.11.2). The cache fields are aliased to the outputs, so
only the written slot moves. Bit-exact against the XLA path on the H200 (session 8); the GPU
default in `dispatch` (`TRACE_JAX_KV_APPEND=xla` opts out).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax import quant as tq
from trace_jax.kernels.row_quant import encode_tile, launch_params, reciprocal, whole
from trace_jax.quant import e2m1
from trace_jax.quant import qarray as Q


def pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def kernel_supported(k_cache, k_new) -> str | None:
  """None if the kernel writes this cache (an NVFP4 `QArray` `[B, S, KVH, hd]` with row scales)
  for these rows (`[B, 1, KVH, hd]`), else the reason it does not."""
  if not isinstance(k_cache, tq.QArray):
    return "the cache is not quantized"
  if k_cache.fmt.name != "nvfp4":
    return f"cache format {k_cache.fmt.name}, the kernel writes nvfp4"
  if len(k_cache.shape) != 4 or k_cache.axis != 3:
    return f"cache of shape {k_cache.shape} blocked along axis {k_cache.axis}"
  b, _, kvh, hd = k_cache.shape
  if k_new.shape != (b, 1, kvh, hd):
    return f"new rows of shape {k_new.shape}, the kernel writes one slot ({b}, 1, {kvh}, {hd})"
  if k_cache.global_scale is None or k_cache.global_scale.shape[-1] != 1:
    return "the cache has no per-row second-level scale"
  if not (pow2(kvh) and pow2(hd) and hd >= k_cache.fmt.block):
    return f"{kvh} KV heads x head_dim {hd}: the kernel takes powers of two, head_dim >= 16"
  return None


def write_rows(b, slot, xs, caches, rows, *, fmt, recip, packings, bits=None) -> None:
  """Inside a kernel body: sequence b's new K and V rows `xs` (float32 [KVH, hd] each) encoded
  (`encode_tile`) and stored: nibble-packed into the new-row outputs `rows`, and into the cache
  outputs `caches` at slot `slot` (codes bit-placed where the cache's packing is "kv_words").
  Both are six refs: K's codes, block scales and row scales, then V's. bits: two refs (K's,
  V's) for the rows' compact guidance payloads (`e2m1.nibble_mantissa_bits`, [KVH, hd / 8]),
  or None."""
  for j, x in enumerate(xs):
    kvh, hd = x.shape
    blk, packed = encode_tile(x.reshape(kvh, hd // fmt.block, fmt.block), fmt, recip)
    fields = (packed.reshape(kvh, hd // 2), blk.scales, blk.g.reshape(kvh, 1))
    if bits is not None:
      bits[j][...] = e2m1.nibble_mantissa_bits(fields[0], in_kernel=True)
    for f, val in enumerate(fields):
      rows[3 * j + f][...] = val  # the new rows stay nibble-packed
      if f == 0 and packings[j] == "kv_words":
        val = e2m1.place_kv_words(val)
      caches[3 * j + f][pl.ds(b, 1), pl.ds(slot, 1)] = val[None, None]


def _kernel(idx_ref, k_ref, v_ref, *refs, **kw):
  # refs: 6 aliased cache inputs (unused: their buffers are the outputs), 6 cache outputs
  # (K codes, scales, row scales, then V's), 6 new-row outputs in the same order
  b = pl.program_id(0)
  write_rows(b, idx_ref[b], [r[...].astype(jnp.float32) for r in (k_ref, v_ref)], refs[6:12],
             refs[12:18], **kw)


def cache_call(body, args, specs, k_cache: tq.QArray, v_cache: tq.QArray, index, *,
               interpret: bool, name: str, more_out=(), more_specs=(), num_warps: int = 4):
  """A pallas_call of `body` with one program per sequence that writes a decode step's K/V rows
  into the caches in place: the body's refs are the write index [B] (int32, broadcast from
  `index`), `args` (their `specs`), the six cache fields (aliased to the first six outputs),
  then the outputs: the six cache fields, the six new-row fields (`write_rows`) and `more_out`
  (`more_specs`). Returns (k_cache, v_cache, kq, vq, *more), kq/vq nibble-packed `QArray`s
  `[B, 1, KVH, hd]`."""
  b, _, kvh, hd = k_cache.shape
  fmt = k_cache.fmt
  idx = jnp.broadcast_to(jnp.asarray(index, jnp.int32).reshape(-1), (b,))
  leaves = [c for q in (k_cache, v_cache) for c in (q.codes, q.scales, q.global_scale)]
  row_shapes = [(kvh, hd // 2), (kvh, hd // fmt.block), (kvh, 1)]
  row_dtypes = [leaves[0].dtype, leaves[1].dtype, leaves[2].dtype]
  row_specs = [pl.BlockSpec((None, None, *s), lambda i: (i, 0, 0, 0)) for s in row_shapes] * 2
  out_shape = ([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in leaves]
               + [jax.ShapeDtypeStruct((b, 1, *s), d) for s, d in zip(row_shapes, row_dtypes)] * 2
               + list(more_out))
  first = 1 + len(args)
  out = pl.pallas_call(
      body,
      grid=(b,),
      in_specs=[whole(idx), *specs] + [whole(a) for a in leaves],
      out_specs=[whole(a) for a in leaves] + row_specs + list(more_specs),
      out_shape=out_shape,
      input_output_aliases={first + i: i for i in range(6)},
      compiler_params=launch_params(interpret, num_warps),
      interpret=interpret,
      name=name,
  )(idx, *args, *leaves)
  as_q = lambda f, like, shape, packing: Q.QArray(  # noqa: E731
      *f, like.fmt, like.axis, tuple(shape), packing)
  return (as_q(out[0:3], k_cache, k_cache.shape, k_cache.packing),
          as_q(out[3:6], v_cache, v_cache.shape, v_cache.packing),
          as_q(out[6:9], k_cache, (b, 1, kvh, hd), "nibbles"),
          as_q(out[9:12], v_cache, (b, 1, kvh, hd), "nibbles"), *out[12:])


def append(k_cache: tq.QArray, v_cache: tq.QArray, k: jax.Array, v: jax.Array, index, *,
           interpret: bool = False):
  """Write the NVFP4 encodings of `k`, `v` `[B, 1, KVH, hd]` into slot `index` (a scalar shared
  by the batch, or `[B]`) of the caches, in each cache's code packing; returns (k_cache,
  v_cache, kq, vq), kq/vq the new rows as nibble-packed `QArray`s `[B, 1, KVH, hd]` (what
  guidance and code records take)."""
  for cache, new in ((k_cache, k), (v_cache, v)):
    why = kernel_supported(cache, new)
    if why:
      raise ValueError(f"K/V append kernel: {why}")
  _, _, kvh, hd = k_cache.shape
  new_spec = pl.BlockSpec((None, None, kvh, hd), lambda i: (i, 0, 0, 0))
  body = functools.partial(_kernel, fmt=k_cache.fmt, recip=reciprocal(interpret),
                           packings=(k_cache.packing, v_cache.packing))
  return cache_call(body, (k, v), (new_spec, new_spec), k_cache, v_cache, index,
                    interpret=interpret, name="kv_append_nvfp4")
