"""Pure-`jnp` references: the definition of every kernel's result.

Weights are `[K, N]` (dense) or `[E, K, N]` (experts), blocks along K (`axis` 0, resp. 1).
Quantized operands are dequantized in float32 exactly as `trace_jax.quant.dequantize` defines
(a kernel-layout `PackedWeight` by `layout.decode_packed`, the same values up to float32
rounding of the NVFP4 `s * g`),
then multiplied with float32 accumulation; kernels must match within rounding-level tolerance
(they decode the same codes and scales; only the accumulation order and the operand dtype of the
tensor-core product may differ).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.kernels import tiled_grouped
from trace_jax.kernels.layout import PackedWeight, decode_packed
from trace_jax.quant import QArray, dequantize

_QUANTIZED = (QArray, PackedWeight)


def _operand(a) -> jax.Array:
  if isinstance(a, PackedWeight):
    return decode_packed(a, jnp.float32)
  return dequantize(a, jnp.float32) if isinstance(a, QArray) else a


def _out_dtype(x):
  return jnp.bfloat16 if isinstance(x, QArray) else x.dtype


def matmul_ref(x, w, out_dtype=None) -> jax.Array:
  """`x @ w` for x `[..., K]` (array or QArray with axis -1) and w `[K, N]` (array or QArray,
  axis 0)."""
  out_dtype = out_dtype or _out_dtype(x)
  xo, wo = _operand(x), _operand(w)
  # Float32 operands (exact for bf16) also when the result stays float32 (the vocab projection):
  # XLA:CPU sums a bf16 dot in an order that depends on the row count, which a float32 result
  # shows (a decode step's logits then differ from a full forward's in the last bit).
  if (isinstance(x, _QUANTIZED) or isinstance(w, _QUANTIZED)
      or jnp.dtype(out_dtype) == jnp.float32):
    xo, wo = xo.astype(jnp.float32), wo.astype(jnp.float32)
  y = jnp.einsum("...k,kn->...n", xo, wo, preferred_element_type=jnp.float32,
                 precision=jax.lax.Precision.HIGHEST)
  return y.astype(out_dtype)


def grouped_matmul_ref(x, w, group_sizes: jax.Array, out_dtype=None,
                       tile: int | None = None, per_step: int = 1) -> jax.Array:
  """Rows of x `[M, K]` sorted by group; rows of group e multiply w[e] `[K, N]`. Rows past
  sum(group_sizes) produce zeros. Empty groups are allowed. tile: the same products by
  `tiled_grouped` in tiles of at most that many rows, where the rows are many enough
  (`tiled_grouped.tile_for`), `per_step` tiles a loop step; None: `jax.lax.ragged_dot`, the
  definition."""
  out_dtype = out_dtype or _out_dtype(x)
  xo, wo = _operand(x), _operand(w)
  if isinstance(x, _QUANTIZED) or isinstance(w, _QUANTIZED):
    xo, wo = xo.astype(jnp.float32), wo.astype(jnp.float32)
  if tile is not None:  # (sized to the rows: at most `tile`; None for few rows)
    tile = tiled_grouped.tile_for(xo.shape[0], wo.shape[0], tile)
  if tile is not None:
    return tiled_grouped.grouped_matmul(xo, wo, group_sizes, tile=tile,
                                        per_step=per_step).astype(out_dtype)
  y = jax.lax.ragged_dot(xo, wo, group_sizes.astype(jnp.int32),
                         precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
  return y.astype(out_dtype)
