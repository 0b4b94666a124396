"""A MoE layer's routing tables in one Pallas kernel: the expert-sorted order of its (token,
slot) rows and its inverse, the rows per expert, and the FP4 grouped kernel's chunk tables.

Owns the kernel, its size limit and its wrapper. The results are defined by
`dispatch.sort_by_group`, `dispatch.count_by_group` and `fp4_mgpu.chunk_tables`: the same
values, bit for bit. At a decode step's size (512 rows at B=64, top-8, 128 experts) XLA
computed them as about nine dependent small kernels per layer on the H200 (session 8's listing:
reductions over [128], [216] and [512] rows and their selects; four since session 26,
`dispatch._routed_by_counts`); this is one program.

Everything is a comparison-and-sum over register tiles, as the XLA path computes it: a row's
sorted position counts the rows before it in (expert, row) order; the order is the row at each
position; group ends count the ids at or below each expert; the chunk tables follow
`chunk_tables`' arithmetic. The Triton lowering gathers from no register array, so a table
look-up (`al[ce]`) is a one-hot sum, and each tile of ids is loaded from memory rather than
sliced from registers. One program: it runs where the rows are few (`MAX_ROWS`); larger batches
(prefill) keep the XLA path, whose cost grows more gently.

Lowering: a portable Pallas body, `interpret=True` on CPU, the Triton lowering on the GPU (as
`row_quant`). Opt-in (`TRACE_JAX_ROUTING=kernel`), and slower: the H200 A/B (session 11, 4
layers, B=64) measured 187 us a call against about 10 us for the XLA kernels it replaces (decode
step 1.94 vs 1.23 ms of kernels). One program walking 512 rows serially leaves the GPU idle; a
faster version would spread the rows over programs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from trace_jax.kernels.attention_pallas import _pow2_at_least

MAX_ROWS = 1024  # rows (B x top-k) the one-program kernel takes: B = 128 at top-8
_TILE = 32  # rows of a comparison tile (a [tile, padded rows] block of int32 in registers)
_FAR = 2**30  # id of padding rows: sorted after every real one, equal to none


def kernel_supported(group_ids, num_groups: int) -> str | None:
  """None if the kernel builds the tables of these ids, else why not."""
  if group_ids.ndim != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
    return f"ids of shape {group_ids.shape} and dtype {group_ids.dtype}, not a vector of ints"
  if not 0 < group_ids.shape[0] <= MAX_ROWS:
    return f"{group_ids.shape[0]} rows: the one-program kernel takes 1 to {MAX_ROWS}"
  if not 0 < num_groups <= 1024:
    return f"{num_groups} groups"
  return None


def _kernel(ids_ref, order_ref, inv_ref, gs_ref, ce_ref, row0_ref, slot_ref, *, m: int, e: int,
            bm: int, c: int):
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  mp, ep, cp = _pow2_at_least(m, _TILE), _pow2_at_least(e, 16), _pow2_at_least(c, _TILE)
  i32 = jnp.int32
  # Tiles run past the arrays' ends under masks; a traced start (program 0 of 1) keeps Pallas
  # from refusing a static slice that does.
  zero = pl.program_id(0)
  at = lambda ref, start, size: ref.at[pl.ds(zero + start, size)]  # noqa: E731

  def ids(start, size):  # a tile of ids, padding rows at _FAR
    r = start + jnp.arange(size, dtype=i32)
    return plt.load(at(ids_ref, start, size), mask=r < m, other=_FAR).astype(i32), r

  g_all, i_all = ids(0, mp)
  e_all = jnp.arange(ep, dtype=i32)
  # rows per group and group ends (ids <= e), over tiles of rows
  gs = jnp.zeros((ep,), i32)
  ends = jnp.zeros((ep,), i32)
  # a row's sorted position: rows before it in (group, row) order, over tiles of other rows
  inverse = jnp.zeros((mp,), i32)
  for j0 in range(0, mp, _TILE):
    gj, j = ids(j0, _TILE)
    gs += jnp.sum((gj[None, :] == e_all[:, None]).astype(i32), axis=1)
    ends += jnp.sum((gj[None, :] <= e_all[:, None]).astype(i32), axis=1)
    before = (gj[None, :] < g_all[:, None]) | ((gj[None, :] == g_all[:, None])
                                               & (j[None, :] < i_all[:, None]))
    inverse += jnp.sum(before.astype(i32), axis=1)
  plt.store(at(inv_ref, 0, mp), inverse, mask=i_all < m)
  plt.store(at(gs_ref, 0, ep), gs, mask=e_all < e)
  for p0 in range(0, mp, _TILE):  # the row at each sorted position
    p = p0 + jnp.arange(_TILE, dtype=i32)
    hit = (inverse[None, :] == p[:, None]) & (i_all[None, :] < m)
    order = jnp.sum(jnp.where(hit, i_all[None, :], 0), axis=1)
    plt.store(at(order_ref, p0, _TILE), order, mask=p < m)

  # the chunk tables (fp4_mgpu.chunk_tables' arithmetic): windows of bm rows from each group's
  # first row rounded down to 8
  div = lambda a, d: lax.div(a, jnp.full_like(a, d))  # noqa: E731 - operands are >= 0
  real = e_all < e
  starts = ends - gs
  al = div(starts, 8) * 8
  nch = jnp.where(real & (gs > 0), div(gs + 7 + bm - 1, bm), 0)  # reserved (chunks_per_group)
  ch_end = jnp.sum(jnp.where(e_all[None, :] <= e_all[:, None], nch[None, :], 0), axis=1)
  ch_first = ch_end - nch
  n_used = jnp.sum(nch)
  n_rows = jnp.sum(gs)
  ch_end_cmp = jnp.where(real, ch_end, _FAR)  # padding groups end past every chunk
  ends_cmp = jnp.where(real, ends, _FAR)

  def look_up(table, idx):  # table[idx] for a [T] tile of group indices: a one-hot sum
    return jnp.sum(jnp.where(idx[:, None] == e_all[None, :], table[None, :], 0), axis=1)

  for c0 in range(0, cp, _TILE):
    ci = c0 + jnp.arange(_TILE, dtype=i32)
    ce = jnp.minimum(jnp.sum((ch_end_cmp[None, :] <= ci[:, None]).astype(i32), axis=1), e - 1)
    start = look_up(al, ce) + (ci - look_up(ch_first, ce)) * bm
    valid = (ci < n_used) & (start < look_up(ends, ce))  # reserved windows past the end: unused
    row0 = jnp.where(valid, start, 0)
    plt.store(at(ce_ref, c0, _TILE), jnp.where(valid, ce, -1), mask=ci < c)
    plt.store(at(row0_ref, c0, _TILE), row0, mask=ci < c)
  for r0 in range(0, mp, _TILE):
    r = r0 + jnp.arange(_TILE, dtype=i32)
    re = jnp.minimum(jnp.sum((ends_cmp[None, :] <= r[:, None]).astype(i32), axis=1), e - 1)
    rl = r - look_up(al, re)
    slot = jnp.where(r < n_rows, (look_up(ch_first, re) + div(rl, bm)) * bm
                     + lax.rem(rl, jnp.full_like(rl, bm)), c * bm)
    plt.store(at(slot_ref, r0, _TILE), slot, mask=r < m)


@functools.partial(jax.jit, static_argnames=("num_groups", "bm", "n_chunks", "num_warps",
                                             "interpret"))
def routing_tables(group_ids: jax.Array, *, num_groups: int, bm: int, n_chunks: int,
                   num_warps: int = 8, interpret: bool = False):
  """(order, inverse, group_sizes, chunk_expert, chunk_row, slot) of `[M]` int group ids:
  `sort_by_group(ids)`, `count_by_group(ids, num_groups)` and `chunk_tables(group_sizes, M,
  bm)` (with its `n_chunks`), from one kernel. interpret: run the body on CPU (tests)."""
  why = kernel_supported(group_ids, num_groups)
  if why:
    raise ValueError(f"routing kernel: {why}")
  m = group_ids.shape[0]
  vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
  whole = lambda n: pl.BlockSpec((n,), lambda i: (0,))  # noqa: E731
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - GPU lowering only
    compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  shapes = (m, m, num_groups, n_chunks, n_chunks, m)
  return tuple(pl.pallas_call(
      functools.partial(_kernel, m=m, e=num_groups, bm=bm, c=n_chunks),
      grid=(1,),
      in_specs=[whole(m)],
      out_specs=[whole(n) for n in shapes],
      out_shape=[vec(n) for n in shapes],
      compiler_params=compiler_params,
      interpret=interpret,
      name="moe_routing_tables",
  )(group_ids.astype(jnp.int32)))

