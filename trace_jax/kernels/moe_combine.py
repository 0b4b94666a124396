"""A decode step's MoE output, the residual add and the next RMS norm as one Pallas kernel: each
token's k expert rows read where the down-projection kernel left them (its chunk rows, through
the slot table), weighted by the gates and summed (`transformer.combine_experts`), added to the
residual stream, and the sum normalized by the next layer's input norm (or the final norm).

Owns the kernel, its support check, its wrapper and its reference (`combine_add_rms_norm_ref`:
the model's ops, `RoutedRows.value` (the rows' gather, `combine_experts`), `x + h`,
`transformer.rms_norm`). The body calls the same `combine_experts` on the slots it loads: each
product rounded to the rows' dtype, summed in float32 one slot after another, the sum rounded,
then added and normalized. In interpret mode on CPU both outputs equal the reference bit for
bit (bf16; float32 products may be contracted into the sum otherwise). Compiled, the norm's
float32 sum of squares runs in Triton's order, so the GPU test states a tolerance.

In the 8k-capacity decode step (B 256) XLA makes these four kernels a layer: the gates' gather
and the slots' validity, the gather + weighted sum, the residual add, the norm (deviceless
census, `benchmarks/results/session39_cpu_2026-12-04`; session 38's profile had the adds at ~8
us a layer with o_proj's, the norms ~1.9 us each). The GPU default since session 40
(`dispatch.combine_add_rms_norm`; `TRACE_JAX_MOE_COMBINE=xla` opts out): on the H200 its sum
equals numpy's computation of the model's rule bit for bit, where XLA's ops are off it in 29% of
elements by roundings (XLA:GPU does not keep the rule's roundings), and it takes 3.4 us a call
alone against XLA's 7.7 (`benchmarks/results/session40_h200_2026-12-05`).

Lowering: a portable Pallas body, whole rows a program, `interpret=True` on CPU and the Triton
lowering on the GPU (as `row_quant`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from trace_jax.kernels import add_norm as AN
from trace_jax.kernels import layout as L
from trace_jax.kernels import row_quant as RQ
from trace_jax.models import transformer as T
from trace_jax.settings import int_setting

# Whole rows a program, as `add_norm` (`AN.TILE_ELEMS` elements: one 2,048-wide token row at the
# 30B-A3B shape, its k expert rows read one after another), and its warps
# (TRACE_JAX_MOE_COMBINE_WARPS). H200, us a
# call alone at B 256 / 64 (session 40, bench_moe_combine): 4 warps 4.90 / 4.13, 8 3.89 / 3.26,
# 16 3.36 / 2.37, XLA's ops 7.68 / 5.31; in the 4-layer decode step 7.9 us a call at 4 warps,
# 5.1 at 16
NUM_WARPS = int_setting("TRACE_JAX_MOE_COMBINE_WARPS", 16, minimum=1,
                        doc="warps a program of the MoE combine kernel")


def kernel_supported(x, rows: L.ChunkRows, inverse, weights, scale) -> str | None:
  """None if the kernel combines these rows: x `[..., D]` of N tokens (floating, D and scale
  `[D]` as `add_norm.norm_rows_supported` takes them); rows of x's dtype with D
  result columns; weights `[N, k]` float32; inverse int32 `[N * k]` (pair (t, j)'s row of
  rows' slot table). Else the reason it does not."""
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 1:
    return f"x of dtype {x.dtype}, shape {list(x.shape)}"
  d = x.shape[-1]
  n = math.prod(x.shape[:-1])
  why = AN.norm_rows_supported(d, scale)
  if why:
    return why
  if rows.rows.dtype != x.dtype or rows.n != d or rows.rows.ndim != 2 or rows.rows.shape[1] < d:
    return (f"expert rows {rows.rows.dtype}{list(rows.rows.shape)} with {rows.n} columns for x "
            f"{x.dtype} of {d}")
  if weights.dtype != jnp.float32 or weights.ndim != 2 or weights.shape[0] != n:
    return f"gate weights {weights.dtype}{list(weights.shape)}, not float32 [{n}, k]"
  k = weights.shape[1]
  if tuple(inverse.shape) != (n * k,) or inverse.dtype != jnp.int32:
    return f"pair rows {inverse.dtype}{list(inverse.shape)}, not int32 [{n} x {k}]"
  return None


def _kernel(inv_ref, slot_ref, w_ref, x_ref, rows_ref, scale_ref, s_ref, y_ref, *, n: int, k: int,
            d: int, m: int, src: int, rows: int, eps: float, interpret: bool, y_rows: int):
  plt = RQ.triton_primitives()
  t0 = pl.program_id(0) * rows
  ok = ((t0 + jnp.arange(rows)) < n)[:, None]  # [R, 1]
  cols = jnp.arange(d)[None, :]
  dt = x_ref.dtype

  def slots():
    """Each slot's rows [R, D] and gates [R, 1], loaded as `combine_experts` takes them."""
    for j in range(k):
      col = lambda ref: ref.at[pl.ds(t0, rows), pl.ds(j, 1)]  # noqa: E731,B023
      # pair (t, j)'s sorted row, clamped as jnp indexing clamps it, then its chunk row
      pair = plt.load(col(inv_ref), mask=ok, other=0)
      pair = jnp.clip(jnp.where(pair < 0, pair + m, pair), 0, m - 1)
      r, r_ok = L.chunk_row_index(plt.load(slot_ref.at[pair], mask=ok, other=0), src, ok)
      yield (plt.load(rows_ref.at[r, cols], mask=r_ok, other=0),
             plt.load(col(w_ref), mask=ok, other=0))

  rnd = RQ.rounding(dt, interpret)
  h = T.combine_experts(slots(), dt, rnd)
  AN.add_and_norm(lambda ref: ref.at[pl.ds(t0, rows)], ok, x_ref, h, scale_ref, s_ref, y_ref,
                  eps=eps, rnd=rnd)
  if y_rows > n:  # the normalized rows' padding (`PaddedRows`): zeros
    r = t0 + jnp.arange(rows)
    plt.store(y_ref.at[pl.ds(t0, rows)], jnp.zeros((rows, d), dt),
              mask=((r >= n) & (r < y_rows))[:, None])


def combine_add_rms_norm(x: jax.Array, rows: L.ChunkRows, inverse: jax.Array, weights: jax.Array,
                         scale: jax.Array, eps: float, *, interpret: bool = False,
                         num_warps: int | None = None, y_rows: int | None = None):
  """`(s, rms_norm(s, scale, eps))`, s = x + the tokens' expert rows weighted and summed, from
  one kernel, both in x's dtype and shape (as `combine_add_rms_norm_ref`). y_rows (at least
  the N rows): the norm's rows `[y_rows, D]` instead, zeros past N (`layout.PaddedRows`)."""
  why = kernel_supported(x, rows, inverse, weights, scale)
  if why:
    raise ValueError(f"MoE combine + add + RMS norm kernel: {why}")
  d = x.shape[-1]
  n, k = weights.shape
  m = rows.slot.shape[0]
  y_rows = n if y_rows is None else y_rows
  if y_rows < n:
    raise ValueError(f"MoE combine + add + RMS norm kernel: y_rows {y_rows} < {n} rows")
  per = max(1, AN.TILE_ELEMS // d)
  out = [jax.ShapeDtypeStruct((n, d), x.dtype), jax.ShapeDtypeStruct((y_rows, d), x.dtype)]
  s, y = RQ.launch(
      functools.partial(_kernel, n=n, k=k, d=d, m=m, src=rows.rows.shape[0], rows=per, eps=eps,
                        interpret=interpret, y_rows=y_rows),
      inverse.reshape(n, k), rows.slot.astype(jnp.int32), weights, x.reshape(n, d), rows.rows,
      scale, programs=-(-y_rows // per), out_shape=out, interpret=interpret,
      num_warps=num_warps or NUM_WARPS, name="moe_combine_add_rms_norm")
  return s.reshape(x.shape), (y.reshape(x.shape) if y_rows == n else y)


def combine_add_rms_norm_ref(x: jax.Array, rows: L.ChunkRows, inverse: jax.Array,
                             weights: jax.Array, scale: jax.Array, eps: float):
  """The model's ops: each pair's row gathered, the gates' weighted sum
  (`transformer.combine_experts`), the residual add, `transformer.rms_norm` of the sum."""
  s = x + T.RoutedRows(rows, inverse, weights, x.shape).value()
  return s, T.rms_norm(s, scale, eps)


def pair_rows_numpy(rows: L.ChunkRows, inverse, k: int):
  """Each (token, slot) pair's row `[N, k, D]` (float64) by numpy, read as `ChunkRows.gather`
  reads `rows.slot[inverse]` (a negative slot counts back, one past the rows reads zeros)."""
  src, d = rows.rows.shape[0], rows.n
  slot = np.asarray(rows.slot)[np.asarray(inverse)]
  slot = np.where(slot < 0, slot + src, slot)
  y = np.asarray(rows.rows).astype(np.float64)[np.clip(slot, 0, src - 1), :d]
  return np.where((slot < src)[:, None], y, 0.0).reshape(-1, k, d)


def combine_add_numpy(x, rows: L.ChunkRows, inverse, weights):
  """The sum `s` of `combine_add_rms_norm` by numpy, apart from JAX and XLA (what the GPU test and
  `bench_moe_combine` hold the kernel to): each pair's row times its gate cast to x's dtype,
  rounded to it, summed in float32 slot after slot, rounded, added to x -> (s `[N, D]` in x's
  dtype, |x| + the sum of the products' magnitudes: the scale of any rounding's error)."""
  dt = np.asarray(x).dtype
  n, k = weights.shape
  y = pair_rows_numpy(rows, inverse, k).astype(np.float32)
  w = np.asarray(weights).astype(dt).astype(np.float32)
  acc = (y[:, 0] * w[:, :1]).astype(dt).astype(np.float32)
  for j in range(1, k):
    acc = acc + (y[:, j] * w[:, j:j + 1]).astype(dt).astype(np.float32)
  xs = np.asarray(x).reshape(n, -1).astype(np.float32)
  mag = np.abs(xs) + np.einsum("nkd,nk->nd", np.abs(y), w)
  return (xs + acc.astype(dt).astype(np.float32)).astype(dt), mag
