"""A MoE layer's routing tables in one Pallas kernel: the expert-sorted order of its (token,
slot) rows and its inverse, the rows per expert, and the FP4 grouped kernel's chunk tables
with their reserved-chunk count.

Owns the kernel, its size limit and its wrapper. The results are defined by
`dispatch.sort_by_group`, `dispatch.count_by_group` and `fp4_mgpu.chunk_tables` (with_total):
the same values, bit for bit. At the 8k-capacity decode step (2,048 rows at B 256, top-8, 128
experts) XLA computes them as three dependent reductions over [2,176 x 2,048] terms and two
small kernels a layer (`dispatch._routed_by_counts`), ~13 us a layer on the H200 (session 32's
profile); this is one launch.

Programs of `TILE` rows each (64 at 2,048 rows: one wave on 132 SMs). Every program counts the
group ends and sizes over all rows (one compare-and-sum over [groups, rows] tiles, both counts
packed in one int32: sizes << 16 | ends), then for its own rows: the sorted position (the rows
before it in (group, row) order, a [TILE, rows] compare-and-sum), the order by a scatter of
its rows to those positions, its tile of chunk owners and window starts (`chunk_tables`'
arithmetic from the sizes) and its tile of row slots. The Triton lowering gathers from no
register array, so a table look-up (`al[ce]`) is a one-hot sum.

Lowering: a portable Pallas body, `interpret=True` on CPU, the Triton lowering on the GPU (as
`row_quant`). Opt-in (`TRACE_JAX_ROUTING=kernel`): slower than the XLA path on the H200. Every
program counts every row's group, so a program's time grows with the rows; more warps share
that count (benchmarks/results/session33_h200_2026-12-04, bench_routing, us a call, XLA / this
kernel at 4, 8, 16 warps): 256 rows 7.8 / 10.1, 8.0, 7.9; 512 rows 6.5 / 12.3, 9.1, 9.0; 2,048
rows 10.4 / 51.7, 23.7, 15.4; 4,096 rows 21.1 / 95.6, 47.1, 24.9. The first grid version (a
loop of tiles, each reduced) took 43.8 us at 2,048 rows with 8 warps and lengthened the 4-layer
decode step's kernels by 170 us; session 11's, one program walking the rows, 187 us at 512.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from trace_jax.kernels.attention_pallas import _pow2_at_least

MAX_ROWS = 4096  # rows (B x top-k) the kernel takes: B = 512 at top-8 (dispatch.SMALL_SORT)
TILE = 32  # rows (and chunks) a program owns
_COUNT_TILE = 64  # rows a step of the group counts ([groups, 64] int32 terms in registers)
_FAR = 2**30  # id of padding rows: sorted after every real one, equal to none
_SIZE_SHIFT = 16  # the packed counts: size << 16 | end (rows < 2**16)


def kernel_supported(group_ids, num_groups: int) -> str | None:
  """None if the kernel builds the tables of these ids, else why not."""
  if group_ids.ndim != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
    return f"ids of shape {group_ids.shape} and dtype {group_ids.dtype}, not a vector of ints"
  if not 0 < group_ids.shape[0] <= MAX_ROWS:
    return f"{group_ids.shape[0]} rows: the kernel takes 1 to {MAX_ROWS}"
  if not 0 < num_groups <= 1024:
    return f"{num_groups} groups"
  return None


def _kernel(ids_ref, order_ref, inv_ref, gs_ref, ce_ref, row0_ref, slot_ref, total_ref, *,
            m: int, e: int, bm: int, c: int):
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  mp, ep = _pow2_at_least(m, _COUNT_TILE), _pow2_at_least(e, 16)
  i32 = jnp.int32
  pid = pl.program_id(0)
  e_all = jnp.arange(ep, dtype=i32)
  real = e_all < e

  def ids(start, size):  # a tile of ids, padding rows at _FAR
    r = start + jnp.arange(size, dtype=i32)
    # (a traced start: Pallas refuses a static slice that runs past the array's end)
    return plt.load(ids_ref.at[pl.ds(pid * 0 + start, size)], mask=r < m,
                    other=_FAR).astype(i32), r

  # group sizes and ends (ids <= e) over all rows, packed; and this program's rows' sorted
  # positions (rows before them in (group, row) order). The tiles are unrolled and summed
  # elementwise, one cross-thread reduction at the end: a reduction per tile, and loads that
  # wait for the one before them (a loop), made the first version 44 us at 2,048 rows
  packed = jnp.zeros((ep, _COUNT_TILE), i32)
  gi, i = ids(pid * TILE, TILE)
  earlier = jnp.zeros((TILE, _COUNT_TILE), i32)
  for t in range(mp // _COUNT_TILE):
    gj, j = ids(t * _COUNT_TILE, _COUNT_TILE)
    packed += (jnp.where(gj[None, :] <= e_all[:, None], 1, 0)
               + jnp.where(gj[None, :] == e_all[:, None], 1 << _SIZE_SHIFT, 0))
    earlier += ((gj[None, :] < gi[:, None])
                | ((gj[None, :] == gi[:, None]) & (j[None, :] < i[:, None]))).astype(i32)
  packed = jnp.sum(packed, axis=1)
  ends = packed & ((1 << _SIZE_SHIFT) - 1)
  gs = jnp.where(real, packed >> _SIZE_SHIFT, 0)
  inverse = jnp.sum(earlier, axis=1)
  mine = i < m
  plt.store(inv_ref.at[pl.ds(pid * TILE, TILE)], inverse, mask=mine)
  # (the order buffer is padded to the grid's rows: a padding lane stores at its own row, so
  # no two lanes share a place, masked or not; interpret mode writes masked lanes back)
  plt.store(order_ref.at[jnp.where(mine, inverse, i)], i)

  @pl.when(pid == 0)
  def _():
    plt.store(gs_ref.at[pl.ds(0, ep)], gs, mask=real)

  # the chunk tables (fp4_mgpu.chunk_tables' arithmetic): windows of bm rows from each group's
  # first row rounded down to 8
  div = lambda a, d: lax.div(a, jnp.full_like(a, d))  # noqa: E731 - operands are >= 0
  starts = ends - gs
  al = div(starts, 8) * 8
  nch = jnp.where(real & (gs > 0), div(gs + 7 + bm - 1, bm), 0)  # reserved (chunks_per_group)
  ch_end = jnp.sum(jnp.where(e_all[None, :] <= e_all[:, None], nch[None, :], 0), axis=1)
  ch_first = ch_end - nch
  n_used = jnp.sum(nch)
  n_rows = jnp.sum(gs)
  ch_end_cmp = jnp.where(real, ch_end, _FAR)  # padding groups end past every chunk
  ends_cmp = jnp.where(real, ends, _FAR)

  @pl.when(pid == 0)
  def _():
    plt.store(total_ref.at[pl.ds(0, 8)], jnp.full((8,), n_used, i32),
              mask=jnp.arange(8, dtype=i32) < 1)

  def look_up(table, idx):  # table[idx] for a [T] tile of group indices: a one-hot sum
    return jnp.sum(jnp.where(idx[:, None] == e_all[None, :], table[None, :], 0), axis=1)

  ci = pid * TILE + jnp.arange(TILE, dtype=i32)
  ce = jnp.minimum(jnp.sum((ch_end_cmp[None, :] <= ci[:, None]).astype(i32), axis=1), e - 1)
  start = look_up(al, ce) + (ci - look_up(ch_first, ce)) * bm
  valid = (ci < n_used) & (start < look_up(ends, ce))  # reserved windows past the end: unused
  plt.store(ce_ref.at[pl.ds(pid * TILE, TILE)], jnp.where(valid, ce, -1), mask=ci < c)
  plt.store(row0_ref.at[pl.ds(pid * TILE, TILE)], jnp.where(valid, start, 0), mask=ci < c)
  # slots of the sorted rows at this program's positions
  re = jnp.minimum(jnp.sum((ends_cmp[None, :] <= i[:, None]).astype(i32), axis=1), e - 1)
  rl = i - look_up(al, re)
  slot = jnp.where(i < n_rows, (look_up(ch_first, re) + div(rl, bm)) * bm
                   + lax.rem(rl, jnp.full_like(rl, bm)), c * bm)
  plt.store(slot_ref.at[pl.ds(pid * TILE, TILE)], slot, mask=mine)


@functools.partial(jax.jit, static_argnames=("num_groups", "bm", "n_chunks", "num_warps",
                                             "interpret"))
def routing_tables(group_ids: jax.Array, *, num_groups: int, bm: int, n_chunks: int,
                   num_warps: int = 16, interpret: bool = False):
  """(order, inverse, group_sizes, chunk_expert, chunk_row, slot, total) of `[M]` int group
  ids: `sort_by_group(ids)`, `count_by_group(ids, num_groups)` and `chunk_tables(group_sizes,
  M, bm, with_total=True)` (with its `n_chunks`; total `[1]`, the chunks reserved in all),
  from one kernel. interpret: run the body on CPU (tests)."""
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
  grid = -(-max(m, n_chunks) // TILE)
  shapes = (grid * TILE, m, num_groups, n_chunks, n_chunks, m, 1)
  order, *rest = pl.pallas_call(
      functools.partial(_kernel, m=m, e=num_groups, bm=bm, c=n_chunks),
      grid=(grid,),
      in_specs=[whole(m)],
      out_specs=[whole(n) for n in shapes],
      out_shape=[vec(n) for n in shapes],
      compiler_params=compiler_params,
      interpret=interpret,
      name="moe_routing_tables",
  )(group_ids.astype(jnp.int32))
  return (order[:m], *rest)
