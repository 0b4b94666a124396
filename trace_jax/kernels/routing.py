"""A MoE layer's routing tables from two Pallas kernels: the expert-sorted order of its
(token, slot) rows and its inverse, the rows per expert, and the FP4 grouped kernel's chunk
tables with their reserved-chunk count.

Owns the kernels, their size limit and their wrapper. The results are defined by
`dispatch.sort_by_group`, `dispatch.count_by_group` and `fp4_mgpu.chunk_tables` (with_total):
the same values, bit for bit. At the 8k-capacity decode step (2,048 rows at B 256, top-8, 128
experts) XLA computes them as three dependent reductions over [2,176 x 2,048] terms and two
small kernels a layer (`dispatch._routed_by_counts`), ~13 us a layer on the H200 (session 32's
profile).

1. Rows (`ROW_TILE` rows a program: 128 programs at 2,048 rows, one wave on 132 SMs): a row's
   sorted position counts the rows before it in (group, row) order (a [ROW_TILE, rows]
   compare-and-sum, tiles unrolled and summed elementwise, one reduction at the end); the
   order by a scatter of the rows to those positions; the program's rows per group, a row of
   partial counts [programs, groups].
2. Chunks (`TILE` chunks and sorted rows a program): the group sizes (the partial counts
   summed), their ends (a prefix sum over groups), then the program's tile of chunk owners and
   window starts (`chunk_tables`' arithmetic from the sizes) and its tile of row slots.
The Triton lowering gathers from no register array, so a table look-up (`al[ce]`) is a one-hot
sum.

Lowering: portable Pallas bodies, `interpret=True` on CPU, the Triton lowering on the GPU (as
`row_quant`). The GPU default since session 45 (`TRACE_JAX_ROUTING=xla` opts out). History on
the H200 (bench_routing, us a call at 256 / 512 / 2,048 / 4,096 rows; XLA 7.8 / 6.5 / 10.4 /
21.1): the one-kernel grid of session 33, where every program counted every row's group, 7.9 /
9.0 / 15.4 / 24.9 at 16 warps (51.7 at 2,048 rows with 4 warps: the count of all rows set a
program's time); its first version, a loop of tiles each reduced, 43.8 us at 2,048 rows; session
11's one program walking the rows, 187 us at 512. These two kernels count each row's group once
(session 34, both kernels together, 4 / 8 / 16 warps): 4.5 / 4.1 / 4.3 at 256 rows, 7.7 / 6.4 /
6.2 at 2,048, 16.1 / 10.1 / 10.3 at 4,096, all tables bit for bit. Faster than XLA alone, but
not in the step: the 4-layer FP4 decode step at the 8k-capacity shape (B 256, 4 warps) took
1.641 ms of kernels against 1.643 with XLA's tables. By source, the kernels' ~8.1 us a layer
replaced ~11 us of XLA reductions, XLA then split the router's top-k into two kernels (+1.1 us a
layer), and other rows moved by the rest; -2 us a step is within run-to-run spread
(benchmarks/results/session34_h200_2026-12-04, call 1). Once the top-k was a kernel of its own
(`router_topk.py`) nothing split: at B 255 on an H100 (session 45, stage s45a) 103 kernels and
1.765 ms a step against 116 and 1.774 with XLA's tables (kernels 4.4 + 3.7 us a layer against
XLA's ~10 us of reductions, selects and maxima).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from trace_jax.kernels.attention_pallas import _pow2_at_least

MAX_ROWS = 4096  # rows (B x top-k) the kernels take: B = 512 at top-8 (dispatch.SMALL_SORT)
ROW_TILE = 16  # rows a program of the rows kernel owns
TILE = 32  # chunks (and sorted rows) a program of the chunks kernel owns
_COUNT_TILE = 64  # other rows a step of the sorted positions' count
_FAR = 2**30  # id of padding rows: sorted after every real one, equal to none


def kernel_supported(group_ids, num_groups: int) -> str | None:
  """None if the kernel builds the tables of these ids, else why not."""
  if group_ids.ndim != 1 or not jnp.issubdtype(group_ids.dtype, jnp.integer):
    return f"ids of shape {group_ids.shape} and dtype {group_ids.dtype}, not a vector of ints"
  if not 0 < group_ids.shape[0] <= MAX_ROWS:
    return f"{group_ids.shape[0]} rows: the kernel takes 1 to {MAX_ROWS}"
  if not 0 < num_groups <= 1024:
    return f"{num_groups} groups"
  return None


def _ids(ids_ref, m: int, start, size: int):
  """A tile of ids from a traced start (Pallas refuses a static slice past the array's end),
  padding rows at _FAR, and their row numbers."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  r = start + jnp.arange(size, dtype=jnp.int32)
  return plt.load(ids_ref.at[pl.ds(start, size)], mask=r < m, other=_FAR).astype(jnp.int32), r


def _rows_kernel(ids_ref, order_ref, inv_ref, part_ref, *, m: int, e: int):
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  i32 = jnp.int32
  pid = pl.program_id(0)
  mp, ep = _pow2_at_least(m, _COUNT_TILE), _pow2_at_least(e, 16)
  gi, i = _ids(ids_ref, m, pid * ROW_TILE, ROW_TILE)
  earlier = jnp.zeros((ROW_TILE, _COUNT_TILE), i32)
  for t in range(mp // _COUNT_TILE):  # unrolled: the loads do not wait on each other
    gj, j = _ids(ids_ref, m, pid * 0 + t * _COUNT_TILE, _COUNT_TILE)
    earlier += ((gj[None, :] < gi[:, None])
                | ((gj[None, :] == gi[:, None]) & (j[None, :] < i[:, None]))).astype(i32)
  inverse = jnp.sum(earlier, axis=1)
  mine = i < m
  plt.store(inv_ref.at[pl.ds(pid * ROW_TILE, ROW_TILE)], inverse, mask=mine)
  # (the order buffer is padded to the grid's rows: a padding lane stores at its own row, so
  # no two lanes share a place, masked or not; interpret mode writes masked lanes back)
  plt.store(order_ref.at[jnp.where(mine, inverse, i)], i)
  e_all = jnp.arange(ep, dtype=i32)
  counts = jnp.sum((gi[None, :] == e_all[:, None]).astype(i32), axis=1)  # padding ids: none
  plt.store(part_ref.at[pid, pl.ds(pid * 0, ep)], counts, mask=e_all < e)


def _chunks_kernel(part_ref, gs_ref, ce_ref, row0_ref, slot_ref, total_ref, *, m: int, e: int,
                   bm: int, c: int, p: int):
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  i32 = jnp.int32
  pid = pl.program_id(0)
  ep, pp = _pow2_at_least(e, 16), _pow2_at_least(p, 2)
  e_all = jnp.arange(ep, dtype=i32)
  real = e_all < e
  rows = jnp.arange(pp, dtype=i32)
  part = plt.load(part_ref.at[pl.ds(pid * 0, pp), pl.ds(pid * 0, ep)],
                  mask=(rows[:, None] < p) & real[None, :], other=0)
  gs = jnp.sum(part, axis=0)
  ends = jnp.sum(jnp.where(e_all[None, :] <= e_all[:, None], gs[None, :], 0), axis=1)

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
    plt.store(gs_ref.at[pl.ds(pid, ep)], gs, mask=real)
    plt.store(total_ref.at[pl.ds(pid, 8)], jnp.full((8,), n_used, i32),
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
  r = ci  # (sorted positions, as many a program as chunks)
  re = jnp.minimum(jnp.sum((ends_cmp[None, :] <= r[:, None]).astype(i32), axis=1), e - 1)
  rl = r - look_up(al, re)
  slot = jnp.where(r < n_rows, (look_up(ch_first, re) + div(rl, bm)) * bm
                   + lax.rem(rl, jnp.full_like(rl, bm)), c * bm)
  plt.store(slot_ref.at[pl.ds(pid * TILE, TILE)], slot, mask=r < m)


@functools.partial(jax.jit, static_argnames=("num_groups", "bm", "n_chunks", "num_warps",
                                             "interpret"))
def routing_tables(group_ids: jax.Array, *, num_groups: int, bm: int, n_chunks: int,
                   num_warps: int = 4, interpret: bool = False):
  """(order, inverse, group_sizes, chunk_expert, chunk_row, slot, total) of `[M]` int group
  ids: `sort_by_group(ids)`, `count_by_group(ids, num_groups)` and `chunk_tables(group_sizes,
  M, bm, with_total=True)` (with its `n_chunks`; total `[1]`, the chunks reserved in all),
  from two kernels. interpret: run the bodies on CPU (tests)."""
  why = kernel_supported(group_ids, num_groups)
  if why:
    raise ValueError(f"routing kernel: {why}")
  m = group_ids.shape[0]
  vec = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)  # noqa: E731
  whole = lambda *shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - GPU lowering only
    compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
  p = -(-m // ROW_TILE)
  order, inverse, part = pl.pallas_call(
      functools.partial(_rows_kernel, m=m, e=num_groups),
      grid=(p,),
      in_specs=[whole(m)],
      out_specs=[whole(p * ROW_TILE), whole(m), whole(p, num_groups)],
      out_shape=[vec(p * ROW_TILE), vec(m),
                 jax.ShapeDtypeStruct((p, num_groups), jnp.int32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name="moe_routing_rows",
  )(group_ids.astype(jnp.int32))
  shapes = (num_groups, n_chunks, n_chunks, m, 1)
  gs, ce, row0, slot, total = pl.pallas_call(
      functools.partial(_chunks_kernel, m=m, e=num_groups, bm=bm, c=n_chunks, p=p),
      grid=(-(-max(m, n_chunks) // TILE),),
      in_specs=[whole(p, num_groups)],
      out_specs=[whole(n) for n in shapes],
      out_shape=[vec(n) for n in shapes],
      compiler_params=compiler_params,
      interpret=interpret,
      name="moe_routing_chunks",
  )(part)
  return order[:m], inverse, gs, ce, row0, slot, total
