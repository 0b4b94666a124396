"""Mosaic GPU (Pallas `plgpu`, Hopper sm_90) grouped matmul for bf16 expert weights at decode
sizes: the FP4 grouped kernel's plan (`fp4_mgpu`) with the weight tile taken from SMEM as it is.

Owns this kernel, its launch configuration and its wrapper, and a dense variant with K split in
a thread block cluster (`cluster_matmul`, opt-in: `TRACE_JAX_BF16_CLUSTER=on`). The result is
defined by `reference.grouped_matmul_ref`; the row chunk tables, the CTA plan for few active
experts (`grouped_parallelism`), the transposed epilogue and the output gather are `fp4_mgpu`'s.

Why: at a batch of 1 (8 rows over 8 experts) tokamax's `ragged_dot` took 18.5 us a call inside
the H200 decode loop (gate+up and down, 37 us a layer, session 11) against 15.7 us a layer of
weight bytes at 4.8 TB/s; the FP4 kernel's plan (swap AB, a chunk of <= 16 rows per expert,
few experts spread over the SMs by column tiles and K splits) is what made its own batch-1 call
3.6x faster. Here the A operand is the bf16 weight tile [64 K, 64 N] read by TMA (128-byte
swizzle) and given to wgmma transposed from SMEM; nothing is decoded.

The GPU default up to `dispatch.BF16_KERNEL_ROWS` (256) rows since its H200 rows (session 13:
1.6-1.7x tokamax's kernel time at 8 rows, 1.2x / 1.0x at 64 and 256); `TRACE_JAX_BF16_GROUPED=
kernel` takes it to MAX_ROWS, `=tokamax` opts out. Its lowering is tested on CPU
(`jax-cuda13-plugin`), its results against the reference on the GPU
(tests/kernels/test_kernels_gpu.py, passed on the H200).
"""

from __future__ import annotations

import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax

from trace_jax.kernels import fp4_mgpu as F
from trace_jax.kernels import layout as L
from trace_jax.settings import choice_setting

KB = 2  # 64-wide K tiles per pipeline step: 64 KB of weights per step with 4 warpgroups
WGS = 4  # compute warpgroups, 64 output columns each
MAX_ROWS = 1024  # (token, slot) rows this path takes: decode batches (B <= 128 at top-8)


def kernel_supported(x, w, group_sizes) -> str | None:
  """None if the kernel takes this call, else why not."""
  if w.ndim != 3 or w.dtype != jnp.bfloat16:
    return f"weight {w.shape} {w.dtype}, not bf16 [E, K, N]"
  e, k, n = w.shape
  if k % (64 * KB) or n % (64 * WGS):
    return f"K={k} (needs a multiple of {64 * KB}) or N={n} (of {64 * WGS})"
  if not 0 < x.shape[0] <= MAX_ROWS:
    return f"{x.shape[0]} rows (takes 1 to {MAX_ROWS})"
  if group_sizes.shape != (e,):
    return f"group sizes {group_sizes.shape} for {e} experts"
  return None


def config(bm: int, k_steps: int, out_dtype, n_inner: int, splits: int) -> dict:
  """The most pipeline stages (<= 4) that fit SMEM beside the output staging; with n_inner > 1
  a divisor of the steps per tile (chained pipelines need it)."""
  if k_steps % splits:
    raise ValueError(f"splits={splits} must divide the {k_steps} K steps")
  out_bytes = 4 if splits > 1 else jnp.dtype(out_dtype).itemsize
  per_stage = bm * 64 * KB * 2 + 64 * KB * 64 * WGS * 2
  fixed = WGS * 64 * bm * out_bytes
  stages = F.fit_stages(per_stage, fixed, k_steps // splits, n_inner)
  if stages < 1:
    raise ValueError(f"{bm}-row chunks do not fit SMEM")
  return dict(stages=stages, splits=splits, n_inner=n_inner)


def parallelism(m: int, e: int, k: int, n: int, n_inner=None, splits=None) -> tuple[int, int]:
  """(n_inner, splits) of a call with m rows over e experts of [K, N] weights: the FP4 grouped
  kernel's rule (`fp4_mgpu.grouped_parallelism`) on this kernel's column tiles and K steps."""
  return F.grouped_parallelism(min(m, e), n // (64 * WGS), k // (64 * KB), n_inner, splits)


# wgmma N sides (rows per chunk) this kernel is built for: the FP4 kernel's, and 128 / 256 for
# dense products of decode batches (`dense_matmul`)
BM_CHOICES = F.BM_CHOICES + (128, 256)


def _weight_tile_pipeline(*, bm: int, kb: int, wgs: int, stages: int, k_iters: int, k0, n_idx,
                          compute_context, state=None):
  """The warp-specialized pipeline of a CTA's column tile n_idx over K steps k0 .. k0 +
  k_iters: per step each compute warpgroup adds its 64 columns' products of kb 64-wide K tiles,
  A = the weight tile transposed from SMEM (swap AB), B = the chunk's bm rows; to be called on
  (x rows [bm, K], w [K, N]) refs. compute_context: Mosaic's (the accumulator's scope)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  swizzled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

  def body(_, x_smem, w_smem, acc_ref):
    wg = lax.axis_index("wg")
    for j in range(kb):
      # A = W^T tile [64 N, 64 K]: the [64 K, 64 N] tile in SMEM, transposed
      a = w_smem.at[pl.ds(j * 64, 64), pl.ds(wg * 64, 64)].T
      plgpu.wgmma(acc_ref, a, x_smem.at[:, pl.ds(j * 64, 64)].T)
    plgpu.wgmma_wait(0)
    return acc_ref

  return plgpu.emit_pipeline_warp_specialized(
      body, grid=(k_iters,), memory_registers=40,
      in_specs=[
          plgpu.BlockSpec((bm, 64 * kb), lambda i: (0, k0 + i), transforms=swizzled),
          plgpu.BlockSpec((64 * kb, 64 * wgs), lambda i: (k0 + i, n_idx), transforms=swizzled),
      ],
      wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
      compute_context=compute_context, pipeline_state=state)


@functools.partial(jax.jit, static_argnames=("bm", "stages", "splits", "n_inner", "out_dtype",
                                             "wgs", "kb", "rows"))
def bf16_chunked_matmul(xc, w, chunk_expert, chunk_row, *, bm: int, stages: int,
                        splits: int = 1, n_inner: int = 1, out_dtype=jnp.bfloat16,
                        wgs: int = WGS, kb: int = KB, rows: int | None = None):
  """The raw kernel. xc: bf16 [R, K] (R >= max(chunk_row) + bm, R % 8 == 0); w: bf16
  [E, K, N]; chunk_expert / chunk_row as for `fp4_mgpu.fp4_chunked_matmul`. Returns out_dtype
  [splits, C, bm, N]: out[s, c, i, n] = row i of chunk c times column n over K part s.
  Both tables None: a dense product, chunk c of expert 0 from row c * bm, C = ceil(R / bm) (no
  tables: as operands XLA made them two small kernels a call), returning [splits, rows, N]
  (rows <= R, default R): the last chunk's rows past R are read as zeros and none past rows is
  written (TMA skips what lies out of bounds), so the caller pads only to a multiple of 8 (the
  operand's TMA tiling) and slices nothing (at the rollout's 255 rows, session 44: a pad to 256
  rows and a slice back were two kernels a layer, 1.5 + 2.4 us). wgs: compute warpgroups (64
  columns each), kb: 64-wide K tiles a pipeline step."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  F._patch_register_pool()

  _, k, n = w.shape
  dense = chunk_expert is None
  n_chunks = -(-xc.shape[0] // bm) if dense else chunk_expert.shape[0]
  n_tiles = n // 64
  assert xc.shape[1] == k and n_tiles % (wgs * n_inner) == 0 and k % (64 * kb * splits) == 0
  assert bm in BM_CHOICES
  k_iters = k // (64 * kb) // splits
  if n_inner > 1 and k_iters % stages:
    raise ValueError(f"n_inner={n_inner} chains pipelines, which needs the {k_iters} steps per "
                     f"tile to be a multiple of stages={stages}")

  def kernel(*refs, out_smem):
    ce_gmem, cr_gmem, x_gmem, w_gmem, out_gmem = (None, None) * dense + refs
    n_outer, c_idx, s_idx, e, row0, k0 = F.chunk_coords(ce_gmem, cr_gmem, k_iters, dense)
    if dense:
      row0 = pl.multiple_of(c_idx * bm, 8)

    def tile_pipeline(n_idx, state):
      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, bm), jnp.float32))
        def _scope(acc_ref):
          wg = lax.axis_index("wg")
          col0 = (n_idx * wgs + wg) * 64
          eval_pipeline(acc_ref)
          out = (out_gmem.at[s_idx, pl.ds(row0, bm), pl.ds(col0, 64)] if dense
                 else out_gmem.at[s_idx, c_idx, :, pl.ds(col0, 64)])
          F.store_tile(acc_ref[...].astype(out_dtype), out_smem.at[wg], out)

      return _weight_tile_pipeline(bm=bm, kb=kb, wgs=wgs, stages=stages, k_iters=k_iters,
                                   k0=k0, n_idx=n_idx, compute_context=compute_context,
                                   state=state)

    @F.when_used(e)
    def _():
      F.run_tile_chain(tile_pipeline, (x_gmem.at[pl.ds(row0, bm)], w_gmem.at[e]), n_outer,
                       n_inner)

  out_shape = (splits, rows or xc.shape[0], n) if dense else (splits, n_chunks, bm, n)
  return F.mosaic_kernel(
      kernel, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
      grid=(n_tiles // wgs // n_inner, n_chunks, splits), grid_names=("n", "c", "s"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=F._out_smem(wgs, bm, out_dtype)),
  )(*((xc, w) if dense else (chunk_expert, chunk_row, xc, w)))


def dense_stages(bm: int, kb: int, wgs: int, k_steps: int, out_dtype) -> int:
  """The most pipeline stages (<= 4) of a `dense_matmul` launch that fit SMEM (0: none)."""
  per_stage = bm * 64 * kb * 2 + 64 * kb * 64 * wgs * 2
  return F.fit_stages(per_stage, wgs * 64 * bm * jnp.dtype(out_dtype).itemsize, k_steps, 1)


# `dense_launch`'s launch: 128-row chunks, 2 compute warpgroups (128 columns a CTA), two 64-wide
# K tiles a step, no K split. H200, 256 rows, us a call (benchmarks/results/
# session32_h200_2026-12-04, `bench_small_dots.py`): q/k/v 2048 x 5120 14.94 against XLA's
# 19.69 (80 CTAs); o 4096 x 2048 23.21 against 17.47 (32 CTAs: left to XLA by DENSE_MIN_CTAS).
DENSE_LAUNCH = dict(bm=128, wgs=2, kb=2, splits=1)
# How `dense_matmul` meets rows that are not whole chunks: "exact" (the default) pads them to a
# multiple of 8 only (TMA's tiling of the operand: none at 200 or 256 rows) and the kernel writes
# exactly the rows asked for (TMA reads zeros past the operand's end and skips stores past the
# output's); "chunks" pads them to whole chunks and slices the output back. At the rollout's 255
# rows "chunks" costs a slice of [255, 5120] a layer (H100, 4-layer decode step at B 255,
# session 45: 120 -> 116 kernels and 1.763 -> 1.750 ms of kernels a step with "exact"; the pad
# to 256 stays). TRACE_JAX_BF16_DENSE_ROWS=chunks: the A/B side
DENSE_ROWS = choice_setting(
    "TRACE_JAX_BF16_DENSE_ROWS", "exact", ("chunks", "exact"),
    doc="bf16 dense rows padded to a multiple of 8 and written exactly, or to chunks")
DENSE_MIN_CTAS = 64
DENSE_MAX_N = 8192  # past the attention projections' widths (the lm_head's 151,936): untimed
# Products with too few CTAs for `DENSE_LAUNCH` (the o projection at 255 rows: 16 column tiles
# x 2 chunks = 32 CTAs on 132 SMs, which XLA's cuBLAS launch also runs) with K split in as many
# parts of `DENSE_KSPLIT_LAUNCH` as fit the SMs in one wave (o: 4 parts, 128 CTAs) ("on",
# opt-in), or left to XLA / `cluster_matmul` ("off", the default). The float32 parts: for the o
# projection of a decode step left unadded (`layout.KParts`) for the add + norm kernel after it,
# which adds them instead of XLA's convert kernel (one kernel a layer fewer); elsewhere added by
# XLA in the convert the bf16 output takes anyway. Session 32 timed only 2 parts with 128-row
# chunks (17.70 us at o on the H200 against XLA's 17.47: 64 CTAs); 4 parts are the
# bench_small_dots rows `mgpu_bm128_wg2_kb{1,2}_s4` (session 49: prepared, not run)
DENSE_KSPLIT = choice_setting("TRACE_JAX_BF16_DENSE_KSPLIT", "off", ("off", "on"),
                              doc="bf16 dense products of too few CTAs split along K (opt-in)")
DENSE_KSPLIT_LAUNCH = dict(bm=128, wgs=2, kb=1)
KSPLIT_PARTS = (2, 4, 8)


def dense_launch(rows: int, k: int, n: int) -> dict | None:
  """`dense_matmul`'s launch for a bf16 product of rows x [K, N], or None where XLA's dot is
  the measured better choice or nothing was measured: 129-256 rows (at 128 XLA's dot took 12.1
  us against 16.3 for 64-row chunks, session 29), at least DENSE_MIN_CTAS CTAs (one per 128
  columns of each 128-row chunk; fewer: `ksplit_launch`'s K parts, opt-in), N up to
  DENSE_MAX_N."""
  c = DENSE_LAUNCH
  if not 128 < rows <= 256 or k % (64 * c["kb"]) or n % (64 * c["wgs"]) or n > DENSE_MAX_N:
    return None
  if n // (64 * c["wgs"]) * -(-rows // c["bm"]) < DENSE_MIN_CTAS:
    return ksplit_launch(rows, k, n)
  return dict(c)


def ksplit_launch(rows: int, k: int, n: int) -> dict | None:
  """With `DENSE_KSPLIT` on, `DENSE_KSPLIT_LAUNCH` with the most K parts (`KSPLIT_PARTS`) whose
  CTAs (column tiles x chunks x parts) fit the SMs in one wave and reach DENSE_MIN_CTAS, each
  part whole K tiles; else None."""
  c = DENSE_KSPLIT_LAUNCH
  if DENSE_KSPLIT != "on" or n % (64 * c["wgs"]):
    return None
  ctas = n // (64 * c["wgs"]) * -(-rows // c["bm"])
  fits = [p for p in KSPLIT_PARTS if ctas * p <= F.NUM_SMS and k % (64 * c["kb"] * p) == 0]
  if not fits or ctas * max(fits) < DENSE_MIN_CTAS:
    return None
  return dict(c, splits=max(fits))


def dense_matmul(x: jax.Array, w: jax.Array, *, bm: int, wgs: int, kb: int, splits: int = 1,
                 out_dtype=jnp.bfloat16, kernel_fn=None, exact_rows: bool | None = None,
                 rows: int | None = None, keep_parts: bool = False):
  """x [M, K] @ bf16 w [K, N] through this kernel with the rows as chunks of bm (128 / 256:
  one or two chunks at decode batches, so the weight is read once or twice): a CTA computes
  64 * wgs columns of a chunk over a K part (splits > 1: float32 parts added by XLA).
  kernel_fn: the kernel's stand-in (`emulate_chunked_matmul` in CPU tests). The engine's path
  on the GPU (`dispatch.BF16_DENSE`, TRACE_JAX_BF16_DENSE=xla opts out), where `dense_launch`
  gives a launch; at 256 rows no launch beat XLA's dot for o 4096 x 2048 (17.47 us; best
  17.70; 4 K parts untimed, `ksplit_launch`). exact_rows: `DENSE_ROWS` "exact" (None: the
  setting). rows: the product's rows where x holds more (`layout.PaddedRows`: a multiple of 8,
  so no pad is left to do): `[rows, N]`. keep_parts: with splits > 1, the float32 parts
  unadded (`layout.KParts`, `[splits, rows, N]`)."""
  k = x.shape[1]
  part = jnp.float32 if splits > 1 else out_dtype
  stages = dense_stages(bm, kb, wgs, k // (64 * kb) // splits, part)
  if stages < 1:
    raise ValueError(f"bm={bm} wgs={wgs} kb={kb} does not fit SMEM")
  m = x.shape[0] if rows is None else rows
  if not 0 < m <= x.shape[0]:
    raise ValueError(f"rows {m} of an operand of {x.shape[0]}")
  if exact_rows is None:
    exact_rows = DENSE_ROWS == "exact"
  # exact: rows padded to a multiple of 8 only, the kernel's last chunk reads zeros past them
  # and writes none past m; else padded to whole chunks and sliced back
  xc = jnp.pad(x.astype(jnp.bfloat16), ((0, -x.shape[0] % (8 if exact_rows else bm)), (0, 0)))
  out = (kernel_fn or bf16_chunked_matmul)(
      xc, w[None], None, None, bm=bm, stages=stages, splits=splits, out_dtype=part, wgs=wgs,
      kb=kb, rows=m if exact_rows else None)[:, :m]
  if splits == 1:
    return out[0].astype(out_dtype)
  return L.KParts(out) if keep_parts else L.sum_parts(out).astype(out_dtype)


def emulate_chunked_matmul(xc, w, chunk_expert, chunk_row, *, bm: int, splits: int = 1,
                           out_dtype=jnp.bfloat16, rows: int | None = None, **unused_config):
  """A `jnp` model of `bf16_chunked_matmul` (same inputs and output; unused chunks give 0), for
  CPU tests of the wrapper's tables, K split and output gather."""
  if chunk_expert is None:  # a dense product (see there): [splits, rows, N]
    r = xc.shape[0]
    c = -(-r // bm)
    out = emulate_chunked_matmul(jnp.pad(xc, ((0, c * bm - r), (0, 0))), w,
                                 np.zeros((c,), np.int32), np.arange(c, dtype=np.int32) * bm,
                                 bm=bm, splits=splits, out_dtype=out_dtype)
    return out.reshape(splits, c * bm, -1)[:, :rows or r]
  row_ids = chunk_row[:, None] + jnp.arange(bm)[None, :]
  xr = xc.astype(jnp.float32)[row_ids]  # [C, bm, K]
  ce = jnp.maximum(chunk_expert, 0)
  c, k = ce.shape[0], xc.shape[1]
  w_s = w.astype(jnp.float32)[ce].reshape(c, splits, k // splits, -1)
  x_s = xr.reshape(c, bm, splits, k // splits)
  out = jnp.einsum("cskn,cisk->scin", w_s, x_s, precision=lax.Precision.HIGHEST)
  return jnp.where((chunk_expert >= 0)[None, :, None, None], out, 0).astype(out_dtype)


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                   out_dtype=jnp.bfloat16, config_override: dict | None = None, kernel_fn=None,
                   rows: jax.Array | None = None, out_rows: jax.Array | None = None,
                   tables=None):
  """Ragged x [M, K] (rows sorted by expert) @ bf16 w [E, K, N], as `fp4_mgpu.grouped_matmul`
  (rows / out_rows: gathers folded into the operand and output gathers; rows past
  sum(group_sizes) give zeros; tables: `dispatch.route`'s chunk tables, used when their rows
  per chunk are this call's). config_override: n_inner / splits / stages."""
  m = x.shape[0] if rows is None else rows.shape[0]
  e, k, n = w.shape
  if m == 0:
    return jnp.zeros((0, n), out_dtype)
  bm = tables[0] if F.by_rows(tables) else F.grouped_bm(m, e)  # row chunks: their own bm
  over = dict(config_override or {})
  n_inner, splits = parallelism(m, e, k, n, over.pop("n_inner", None), over.pop("splits", None))
  cfg = dict(config(bm, k // (64 * KB), out_dtype, n_inner, splits), **over)
  part_dtype = jnp.float32 if cfg["splits"] > 1 else out_dtype
  if tables is not None and tables[0] == bm:
    ce, row0, slot = tables[1:4]
  else:
    ce, row0, slot = F.chunk_tables(group_sizes, m, bm)
  n_rows = -(-(m + bm) // 8) * 8  # chunks read bm rows from their first row on; TMA: rows % 8
  src = jnp.arange(x.shape[0], dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
  src = jnp.pad(src, (0, n_rows - m), constant_values=x.shape[0])  # past the rows: zeros
  xc = jnp.take(x.astype(jnp.bfloat16), src, axis=0, mode="fill", fill_value=0)
  out = (kernel_fn or bf16_chunked_matmul)(xc, w, ce, row0, bm=bm, out_dtype=part_dtype, **cfg)
  return F.gather_rows(out, slot, out_rows, n, out_dtype)


# --------------------------------------------------------------------------- K split in a cluster

# A decode batch's bf16 product of 129-256 rows whose column tiles leave most SMs idle (the
# `paper` policy's o projection, 4096 x 2048: 16 tiles of 128 columns; XLA's GEMM plus its
# convert to bf16 took 11-14.5 + 2.4 us a layer in the 48-layer step against 3.5 us of weight
# bytes, session 44) split over K inside a thread block cluster: the cluster's CTAs compute one
# column tile over their own K parts, then each CTA owns 1/s of the tile's rows, receives the
# other CTAs' float32 partial sums of those rows through distributed shared memory, adds the s
# parts in a fixed order (split 0 first: the same bits on every run) and writes bf16. No partial
# goes through global memory and no XLA reduction or convert follows.
CLUSTER_SPLITS = (2, 4, 8)  # portable cluster sizes whose row slices are whole 8-row tiles
# Products `dense_launch` leaves to XLA for want of CTAs (the o projection) through
# `cluster_matmul` ("on") or XLA's dot ("off", the default: session 47's 4-layer step at B 255,
# H100, 1.776 -> 1.782 ms of kernels; the kernel 16.4 us a layer against XLA's GEMM and convert
# 16.9, but the attention's 255 rows take a 2.3 us pad to 256 on this path)
DENSE_CLUSTER = choice_setting(
    "TRACE_JAX_BF16_CLUSTER", "off", ("off", "on"),
    doc="small bf16 products with K split over a thread block cluster (opt-in)")
# H100, 256 rows, o 4096 x 2048, us a call (session 46, bench_small_dots): one 256-row chunk in
# clusters of 8 / 4 / 2, 2 warpgroups: 35.0 / 21.9 / 31.9 against XLA's 18.9 (two pipeline
# stages beside the received partials: too few bytes in flight). Session 47 (H100, rotated
# sends, partials in the pipeline's SMEM): 128-row chunks in clusters of 2 / 4 / 8: 18.4 / 26.9
# / 42.6; 256-row chunks in clusters of 4: 20.0; XLA's 18.9, the chunked kernel + XLA's sum 17.5
CLUSTER_LAUNCH = dict(splits=2, wgs=2, kb=1, bm=128)


def cluster_grid(rows: int, n: int, wgs: int, bm: int) -> tuple[int, int]:
  """`cluster_matmul`'s grid of clusters: (64 * wgs-wide column tiles, bm-row chunks)."""
  return n // (64 * wgs), -(-rows // bm)


def cluster_launch(rows: int, k: int, n: int) -> dict | None:
  """`cluster_matmul`'s launch for a bf16 product of rows x [K, N] (129-256 rows, with
  `DENSE_CLUSTER` on, at most one CTA per SM), or None."""
  c = CLUSTER_LAUNCH
  if DENSE_CLUSTER != "on" or not 128 < rows <= 256:
    return None
  if k % (64 * c["kb"] * c["splits"]) or n % (64 * c["wgs"]):
    return None
  cols, chunks = cluster_grid(rows, n, c["wgs"], c["bm"])
  if cols * chunks * c["splits"] > F.NUM_SMS:
    return None
  return dict(c)


def cluster_recv_bytes(bm: int, wgs: int, splits: int) -> int:
  """SMEM of a CTA's received partials: the other splits' float32 rows of its own slice."""
  return wgs * (splits - 1) * 64 * (bm // splits) * 4


def cluster_stages(bm: int, kb: int, wgs: int, k_steps: int, splits: int, out_dtype,
                   alias: bool = True) -> int:
  """The most pipeline stages (<= 4) of a `cluster_matmul` launch that fit SMEM beside the
  output staging and, unless `alias` puts them in the pipeline's buffers, the received
  partials (0: none)."""
  per_stage = bm * 64 * kb * 2 + 64 * kb * 64 * wgs * 2
  fixed = (0 if alias else cluster_recv_bytes(bm, wgs, splits)
           # each buffer a multiple of 1 KB (Pallas)
           + -(-wgs * (bm // splits) * 64 * jnp.dtype(out_dtype).itemsize // 1024) * 1024
           + 1024)  # the barriers
  stages = F.fit_stages(per_stage, fixed, k_steps, 1)
  if alias and max(stages * per_stage, cluster_recv_bytes(bm, wgs, splits)) + fixed > F.SMEM_BUDGET:
    return 0  # the partials alone do not fit
  return stages


@functools.cache
def _cluster_barriers_init(arrivals: tuple[int, ...]):
  """inline_mgpu function: (bars uint32 [len(arrivals), 2] SMEM) -> thread 0 of the CTA makes
  them mbarriers of `arrivals[i]` arrivals, then every thread of the CTA joins a cluster
  barrier, so that no peer signals one of them before it is made."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm

  inits = "".join(f"@p mbarrier.init.shared::cta.b64 [$0+{8 * i}], {a};\n"
                  for i, a in enumerate(arrivals))

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def init(ctx, bars):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    addr = llvm.ptrtoint(i32, mutils.memref_ptr(bars))
    llvm.inline_asm(
        llvm.StructType.get_literal([]), [addr, mutils.thread_idx()],
        "{\n.reg .pred p;\nsetp.eq.u32 p, $1, 0;\n" + inits
        + "fence.mbarrier_init.release.cluster;\n"
        "barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n}",
        "r,r", has_side_effects=True)

  return init


@functools.cache
def _cluster_reduce(bm: int, splits: int, order: str = "rotate", ready_bar: int | None = None):
  """inline_mgpu function: (acc float32 [64, bm] WGMMA layout: a warpgroup's partial tile,
  recv float32 SMEM [wgs, splits - 1, regs, 128, 2], bars uint32 [wgs (+ 1: `ready_bar`), 2]
  SMEM) -> the tile's rows (wgmma N side) of this CTA's slice, [64, bm / splits] WGMMA layout,
  summed over the cluster's splits in order 0, 1, ...

  Each thread stores its registers of slice j into CTA j's `recv` (the slot of its own split
  there, the same thread position), arrives on CTA j's barrier of its warpgroup (release,
  cluster scope), waits for its own barrier's (splits - 1) x 128 arrivals (acquire), and adds
  the parts its peers' same threads sent it: no layout is assumed beyond the registers' order,
  which is the same in every CTA. order: the peers' order of the sends (see there).
  ready_bar: where `recv` shares SMEM with the pipeline's buffers, the index in `bars` of a
  barrier of splits x wgs x 128 arrivals: every thread first arrives on it in every CTA of the
  cluster, its own included, and waits on its own, so that no part is sent before every CTA's
  K loop is done with its buffers."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, scf, vector

  r = bm // splits
  out = plgpu.ShapeDtypeStruct((64, r), jnp.float32, layout=plgpu.Layout.WGMMA)
  ref = plgpu.RefType()

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ref, ref), return_type=out)
  def reduce(ctx, acc, recv, bars):
    del ctx
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    c = lambda v: arith.constant(i32, v)  # noqa: E731
    add, mul = arith.addi, arith.muli

    def asm(ret, args, text, constraints):
      return llvm.inline_asm(ret, args, text, constraints, has_side_effects=True)

    none = llvm.StructType.get_literal([])
    me = asm(i32, [], "mov.u32 $0, %cluster_ctarank;", "=r")
    tid = mutils.thread_idx()
    wg, t = arith.divui(tid, c(128)), arith.remui(tid, c(128))
    recv0 = llvm.ptrtoint(i32, mutils.memref_ptr(recv))
    bar = add(llvm.ptrtoint(i32, mutils.memref_ptr(bars)), mul(wg, c(8)))
    regs = acc.registers  # [1, bm / 8, 1, 1, 2, 1, ...] of vector<2xf32>
    assert regs.shape[1] == bm // 8, regs.shape
    per = r // 8  # register columns of a slice
    slice_regs = lambda j: regs[:, j * per:(j + 1) * per]  # noqa: E731
    nregs = slice_regs(0).size

    def slot_addr(base, src_slot, v):  # byte address of this thread's vector v in a slot
      return add(base, mul(add(mul(add(mul(add(mul(wg, c(splits - 1)), src_slot), c(nregs)),
                                           c(v)), c(128)), t), c(8)))

    def mapa(addr, cta):  # the address of my SMEM `addr` in the cluster's CTA `cta`
      return asm(i32, [addr, c(cta)], "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r")

    def arrive(barrier, cta):  # on CTA cta's barrier (release, cluster scope)
      asm(none, [mapa(barrier, cta)],
          "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [$0];", "r")

    def send(src, dst):  # slice dst of my tile (I am split src, both static) to CTA dst
      slot = c(src if src < dst else src - 1)  # my slot in dst's recv
      for v in range(nregs):
        reg = slice_regs(dst).flat[v]
        vals = [vector.extract(reg, [], [e]) for e in range(2)]
        asm(none, [mapa(slot_addr(recv0, slot, v), dst), *vals],
            "st.shared::cluster.v2.f32 [$0], {$1, $2};", "r,f,f")
      arrive(bar, dst)

    def wait(barrier):
      asm(none, [barrier],
          "{\n.reg .pred p;\nWAIT:\n"
          "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [$0], 0;\n"
          "@!p bra WAIT;\n}", "r")

    if ready_bar is not None:
      ready = add(llvm.ptrtoint(i32, mutils.memref_ptr(bars)), c(8 * ready_bar))
      for j in range(splits):
        arrive(ready, j)
      wait(ready)

    # one branch per split, its peers in a static order: "rotate" (split i sends to i + 1,
    # i + 2, ...: at each moment every CTA receives from one peer) or "fixed" (to 0, 1, ...:
    # every CTA sends to the same peer at once)
    for src in range(splits):
      peers = ([(src + d) % splits for d in range(1, splits)] if order == "rotate"
               else [j for j in range(splits) if j != src])
      branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.eq, me, c(src)))
      with ir.InsertionPoint(branch.then_block):
        for dst in peers:
          send(src, dst)
        scf.YieldOp([])
    wait(bar)
    # the sum in split order: split s's part from recv (slot s, or s - 1 past me), mine from
    # the registers
    out_regs = np.empty(slice_regs(0).shape, dtype=object)
    for v, pos in enumerate(np.ndindex(out_regs.shape)):
      mine = None
      for jj in range(splits):
        reg = slice_regs(jj).flat[v]
        hit = arith.cmpi(arith.CmpIPredicate.eq, me, c(jj))
        pair = [vector.extract(reg, [], [e]) for e in range(2)]
        mine = pair if mine is None else [arith.select(hit, p, q) for p, q in zip(pair, mine)]
      total = None
      for s in range(splits):
        slot = c(s) if s == 0 else arith.select(
            arith.cmpi(arith.CmpIPredicate.ult, c(s), me), c(s), c(s - 1))
        st = asm(llvm.StructType.get_literal([f32, f32]), [slot_addr(recv0, slot, v)],
                 "ld.shared.v2.f32 {$0, $1}, [$2];", "=f,=f,r")
        got = [llvm.extractvalue(f32, st, [e]) for e in range(2)]
        is_me = arith.cmpi(arith.CmpIPredicate.eq, me, c(s))
        part = [arith.select(is_me, m, g) for m, g in zip(mine, got)]
        total = part if total is None else [arith.addf(a, b) for a, b in zip(total, part)]
      vec = vector.broadcast(ir.VectorType.get((2,), f32), total[0])
      out_regs[pos] = vector.insert(total[1], vec, [], [1])
    return fa.FragmentedArray(_registers=out_regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return reduce


@functools.partial(jax.jit, static_argnames=("splits", "wgs", "kb", "stages", "rows",
                                             "out_dtype", "bm", "order", "alias"))
def cluster_matmul(x, w, *, splits: int, wgs: int = 2, kb: int = 1, stages: int | None = None,
                   rows: int | None = None, out_dtype=jnp.bfloat16, bm: int | None = None,
                   order: str = "rotate", alias: bool = True):
  """x bf16 [R, K] (R <= 256, a multiple of 8) @ w bf16 [K, N] -> out_dtype [rows, N] (rows
  <= R, default R), K split `splits` ways in a cluster of as many CTAs, one cluster per
  64 * wgs columns and chunk of bm rows (128 or 256; default one chunk: the weight is read
  once; see CLUSTER_SPLITS). Rows past R are read as zeros (TMA), none past rows is
  written. order: "rotate" (default) or "fixed", the order of the partials' sends (the
  first GPU run, session 46, had "fixed": each moment's sends all went to one CTA). alias
  (default): the received partials share SMEM with the pipeline's buffers (`plgpu.RefUnion`),
  which leaves room for more stages, and the cluster's CTAs wait for each other's K loops
  before the exchange; False: buffers of their own (the first GPU run's)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  F._patch_register_pool()

  m, k = x.shape
  n = w.shape[1]
  bm = bm or (256 if m > 128 else 128)
  if splits not in CLUSTER_SPLITS or m % 8 or m > 256 or bm not in (128, 256):
    raise ValueError(f"cluster K split: splits {splits} (takes {CLUSTER_SPLITS}), {m} rows "
                     f"(a multiple of 8, at most 256), bm {bm} (128 or 256)")
  if k % (64 * kb * splits) or n % (64 * wgs):
    raise ValueError(f"K={k} N={n} do not split into {splits} parts of {64 * kb}-wide steps "
                     f"and {64 * wgs}-wide column tiles")
  k_iters = k // (64 * kb) // splits
  if stages is None:
    stages = cluster_stages(bm, kb, wgs, k_iters, splits, out_dtype, alias)
  if stages < 1:
    raise ValueError(f"bm={bm} wgs={wgs} kb={kb} splits={splits} does not fit SMEM")
  r = bm // splits
  out_rows = rows or m
  recv_type = plgpu.SMEM((wgs, splits - 1, r // 8 * 2, 128, 2), jnp.float32)
  arrivals = ((splits - 1) * 128,) * wgs + ((splits * wgs * 128,) if alias else ())
  init = _cluster_barriers_init(arrivals)
  reduce = _cluster_reduce(bm, splits, order, wgs if alias else None)

  def kernel(x_gmem, w_gmem, out_gmem, bars, out_smem, recv=None):
    n_idx, s_idx = lax.axis_index("n"), lax.axis_index("k")
    row0 = pl.multiple_of(lax.axis_index("c") * bm, 8)
    x_rows = x_gmem.at[pl.ds(row0, bm)]
    init(bars)

    def pipeline(recv):
      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, bm), jnp.float32))
        def _scope(acc_ref):
          wg = lax.axis_index("wg")
          eval_pipeline(acc_ref)
          mine = reduce(acc_ref[...], recv, bars)
          col0 = (n_idx * wgs + wg) * 64
          F.store_tile(mine.astype(out_dtype), out_smem.at[wg],
                       out_gmem.at[pl.ds(row0 + s_idx * r, r), pl.ds(col0, 64)])

      return _weight_tile_pipeline(bm=bm, kb=kb, wgs=wgs, stages=stages, k_iters=k_iters,
                                   k0=s_idx * k_iters, n_idx=n_idx,
                                   compute_context=compute_context)

    if not alias:
      pipeline(recv)(x_rows, w_gmem)
      return
    allocs = pipeline(None).get_allocations(x_rows, w_gmem)
    buffers = allocs.pop("flat_in_smem_refs")

    @functools.partial(pl.run_scoped, union=plgpu.RefUnion(buffers, recv_type), rest=allocs,
                       collective_axes="wg")
    def _(union, rest):
      own_buffers, recv = union
      pipeline(recv)(x_rows, w_gmem, allocations=dict(flat_in_smem_refs=own_buffers, **rest))

  scratch = dict(bars=plgpu.SMEM((len(arrivals), 2), jnp.uint32),
                 out_smem=plgpu.SMEM((wgs, r, 64), out_dtype))
  if not alias:
    scratch["recv"] = recv_type
  return F.mosaic_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((out_rows, n), out_dtype),
      grid=cluster_grid(m, n, wgs, bm), grid_names=("n", "c"), cluster=(splits,),
      cluster_names=("k",),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=scratch,
  )(x, w)
