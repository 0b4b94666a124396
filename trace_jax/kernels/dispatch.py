"""Choose a GPU kernel or the `jnp` reference for each matmul and decode attention call.

Kernel path (GPU backend, an FP4 `PackedWeight` from `prepare_weight`, bf16/f32 array
activations): the Mosaic GPU kernel of `fp4_mgpu.py` for decode shapes (dense: <= 64 rows) and
for grouped expert matmuls of any size; dense prefill (> 64 rows) decodes the weight once to
bf16 (`q * scale`, exact) and uses XLA's dot, then applies the fp32 column factor. Everything
else (CPU, plain `QArray` weights, FP4 activations) runs the reference in `reference.py`.
`use_kernel=False` forces the reference; `use_kernel=True` forces the kernel (errors off-GPU).

Decode attention: on a GPU backend, the Pallas kernel of `attention_pallas.py` for the operands
it supports (`attention_pallas.kernel_supported`); the reference `attention_ref` everywhere
else. Setting the environment variable `TRACE_JAX_DECODE_ATTENTION=reference` keeps the model on
the reference on GPU too (read at import).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from trace_jax.kernels import attention_ref, reference
from trace_jax.kernels.layout import PackedWeight, decode_parts, prepare_weight

__all__ = ["decode_attention", "grouped_matmul", "matmul", "on_gpu", "prepare_weight"]

_ATTENTION_KERNEL = os.environ.get("TRACE_JAX_DECODE_ATTENTION", "kernel") != "reference"


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _kernel_ok(x, w, use_kernel) -> bool:
  if use_kernel is False or not isinstance(w, PackedWeight) or not isinstance(x, jax.Array):
    return False
  if use_kernel:
    return True
  return on_gpu() and x.dtype in (jnp.bfloat16, jnp.float32)


def _out_dtype(x, out_dtype):
  return out_dtype or (x.dtype if isinstance(x, jax.Array) else jnp.bfloat16)


def matmul(x, w, out_dtype=None, *, use_kernel: bool | None = None, config=None) -> jax.Array:
  """`x @ w`; w `[K, N]` array, FP4 `QArray` (blocks along K) or `PackedWeight`."""
  if not _kernel_ok(x, w, use_kernel) or w.experts:
    return reference.matmul_ref(x, w, out_dtype)
  from trace_jax.kernels import fp4_mgpu
  out_dtype = _out_dtype(x, out_dtype)
  rows = x.size // x.shape[-1]
  if rows <= fp4_mgpu.MAX_DECODE_ROWS:
    return fp4_mgpu.matmul(x, w, out_dtype=out_dtype, config=config)
  a, factor = decode_parts(w)  # prefill: one bf16 decode, amortized over the rows
  y = jnp.einsum("...k,kn->...n", x.astype(jnp.bfloat16), a[0],
                 preferred_element_type=jnp.float32)
  return (y * factor[0]).astype(out_dtype)


def grouped_matmul(x, w, group_sizes, out_dtype=None, *, use_kernel: bool | None = None,
                   bm: int | None = None, config=None) -> jax.Array:
  """Grouped (ragged) matmul of expert-sorted rows `x [M, K]` with `w [E, K, N]`."""
  if not _kernel_ok(x, w, use_kernel) or not w.experts:
    return reference.grouped_matmul_ref(x, w, group_sizes, out_dtype)
  from trace_jax.kernels import fp4_mgpu
  return fp4_mgpu.grouped_matmul(x, w, group_sizes, out_dtype=_out_dtype(x, out_dtype), bm=bm,
                                 config=config)


def decode_attention(q, k, v, valid, *, scale: float | None = None, out_dtype=None,
                     use_kernel: bool | None = None, config=None) -> jax.Array:
  """Attention of one query token per sequence over a KV cache (`[B, H, hd]`), see
  `attention_ref.decode_attention_ref`; k/v bf16 arrays or FP4/FP8 `QArray`s."""
  from trace_jax.kernels import attention_pallas
  if use_kernel is None:
    use_kernel = (_ATTENTION_KERNEL and on_gpu()
                  and attention_pallas.kernel_supported(q, k, v) is None)
  if not use_kernel:
    return attention_ref.decode_attention_ref(q, k, v, valid, scale, out_dtype)
  return attention_pallas.decode_attention(q, k, v, valid, scale=scale, out_dtype=out_dtype,
                                           config=config)
