"""Mosaic GPU (Pallas `plgpu`, Hopper sm_90) FP4-weight matmul kernels: W4A16 GEMV/GEMM for
decode shapes and the grouped (ragged, expert-sorted) variant, one kernel for both.

Owns the kernel body, its launch configuration and the per-call activation/output plumbing
(row chunk tables, K permutation, output gather). The weight layout and its decode rule live in
`layout.py`; the result is defined by `reference.py`.

Design (see ../shared/reference/fp4-kernel-probe.md for the measurements behind it):
- swap AB: a compute warpgroup owns 64 output columns; it decodes its 64x64 FP4 tile of W^T in
  registers straight into the wgmma A-operand layout (inline PTX `WEIGHT_DECODE_ASM`: per code
  word of 8 bit-placed codes of one row, a move and a mask per register, then one
  `mul.rn.bf16x2` by the block scale: 13 instructions a word; the kernels' time follows their
  loop's length: the GEMV's loop issued in 64% of cycles, its ALU pipe the busiest, Nsight
  Compute, session 23, and each shorter decode made it faster, sessions 23 and 25) and
  multiplies the activation tile in SMEM (B side, transposed, N = the row chunk `bm` of
  16/32/64 tokens).
- 4 compute warpgroups + 1 TMA warpgroup per CTA (`emit_pipeline_warp_specialized`), `kb`
  tiles of 64 K per step, `stages` buffers.
- grid (N / 256 / n_inner, chunks, K splits): a CTA runs n_inner column tiles as a chain of
  pipelines (the TMA warpgroup runs ahead into the next tile), by default all of its chunk's
  columns; where few groups hold rows (decode batches up to 8) fewer, and K split across CTAs
  (`grouped_parallelism`). A chunk is a window of `bm` consecutive rows starting at a
  multiple of 8 that covers (part of) one expert's rows; dense calls are one chunk. Chunk tables
  come from `group_sizes` (XLA, tiny); the kernel reads the activation rows in place (TMA at a
  dynamic row), so groups are padded to nothing: empty experts cost no weight traffic and
  empty chunks exit at once. Dense calls with fewer than 132 CTAs split K across CTAs (f32
  partial sums added by XLA), which made the 30B-A3B attention shapes 2.5-4x faster; where
  equal splits leave SMs idle (8192 x 28672: 112 tiles on 132 SMs) a stream-K schedule
  instead (`stream_k_plan`: every CTA the same run of (tile, K step) units, crossing tile
  ends; 47.1 -> 41.4 us kernel, 48.0 -> 44.0 a call at one row on the H200). Grouped calls
  at decode sizes take a stream-K schedule too (`_grouped_stream_k_kernel`, session 30): the
  (chunk, tile, K step) units of the chunks in use cut into one equal run per SM, the chunk
  tables read a step, the tiles a run's end cuts added by XLA in the output gather.
- epilogue: acc * column factor (g * 2**shift, from GMEM via TMA), stored transposed to SMEM
  (the accumulator is W^T x^T: columns by rows) -> out [splits, chunks, bm, N], row-major, so
  XLA's gather of the wanted rows reads whole rows. (Until 2026-11-30 the kernel wrote
  [.., N, bm] and XLA transposed every chunk before gathering: 17 us per MoE layer of the
  4-layer FP4 decode step on the H200, where 512 rows take 216 chunks of 16, 6.75x as many.)
- around the grouped kernel, XLA lays out the operand with two gathers (`layout.permute_k_rows`:
  the caller's row order, e.g. token -> expert-sorted, with the row pad as out-of-range fill,
  then the K permutation) and reads the output with one (composed with the caller's
  `out_rows`, e.g. back to token order).

Mosaic imports happen inside the functions: the module imports on CPU, where `dispatch.py` runs
the references and tests drive the wrappers with `emulate_chunked_matmul`.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from trace_jax.kernels import layout as L
from trace_jax.settings import choice_setting, declare

# wgmma N sides this kernel is built for (tokens per chunk)
BM_CHOICES = (16, 32, 64)
MAX_DECODE_ROWS = 64
ROW_CHUNKS = "row_chunks"  # the 5th element of chunk tables whose rows are in the caller's order


def by_rows(tables) -> bool:
  """Whether chunk tables are row chunks (`dispatch.row_chunks`: one chunk per row, rows in the
  caller's order, windows made for the tables' own bm)."""
  return tables is not None and len(tables) > 4 and isinstance(tables[4], str) and (
      tables[4] == ROW_CHUNKS)


def tables_total(tables):
  """The reserved-chunk count vector of chunk tables (`chunk_tables(..., with_total=True)`;
  the 5th element of `dispatch.route`'s), or None where they carry none."""
  if tables is None or len(tables) < 5 or isinstance(tables[4], str):
    return None
  return tables[4]


# TRACE_JAX_PDL (opt-in A/B): the Mosaic kernels launched with programmatic dependent launch.
# "wait": each kernel's threads first run `griddepcontrol.wait` (the previous kernel in the
# stream complete, its stores visible), which makes Mosaic launch it with programmatic stream
# serialization: it may be launched, its CTAs placed and its barriers set up while the previous
# kernel's last CTAs still run. "early": also `griddepcontrol.launch_dependents` first, so the
# kernel after it (if launched so) may be launched as soon as this one starts. Measured in
# session 49 (H100, the 4-layer step at B 255 under command buffers, window paces, two
# processes a side): off 1.748 / 1.840 ms a step, early 1.758 / 1.842, no gain; GPU tests pass
# under early (benchmarks/results/session49_h100_2026-12-06). Stays off.
PDL_MODES = ("off", "wait", "early")
PDL = choice_setting("TRACE_JAX_PDL", "off", PDL_MODES,
                     doc="programmatic dependent launch of the Mosaic kernels (opt-in)")


def mosaic_kernel(body, *, pdl: str | None = None, **kwargs):
  """`plgpu.kernel(body, **kwargs)` for this package's Mosaic kernels, with the `PDL` prologue
  (`pdl` overrides the setting) before anything of the body: nothing the body reads from global
  memory is read before the previous kernel is done."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  pdl = PDL if pdl is None else pdl
  if pdl not in PDL_MODES:
    raise ValueError(f"pdl must be one of {PDL_MODES}, got {pdl!r}")
  if pdl == "off":
    return plgpu.kernel(body, **kwargs)

  @functools.wraps(body)
  def with_prologue(*refs, **scratch):
    if pdl == "early":
      plgpu.griddepcontrol_launch_dependents()
    plgpu.griddepcontrol_wait()
    return body(*refs, **scratch)

  return plgpu.kernel(with_prologue, **kwargs)


def _patch_register_pool():
  """Mosaic's warp-specialized pipeline sizes compute registers from a 512-unit pool, but a CTA
  of 5 warpgroups launches with 96 registers/thread (480 units), so `setmaxnreg.inc` waits
  forever with 4 compute warpgroups (the prototype's hang). Size 4-warpgroup pools from 480."""
  from jax._src.pallas.mosaic_gpu import pipeline as mp
  orig = getattr(mp, "_trace_jax_orig_compute_registers", None)
  if orig is None:
    orig = mp._compute_registers
    mp._trace_jax_orig_compute_registers = orig

    def fixed(memory_registers, num_compute_wgs):
      if num_compute_wgs == 4:
        return int(min(256.0, (480 - memory_registers) / 4) // 8 * 8)
      return orig(memory_registers, num_compute_wgs)

    mp._compute_registers = fixed


# --------------------------------------------------------------------------- inline PTX decode

_SCALE_ASM = {
    # two bytes of the thread's scale word -> bf16x2 multipliers (same value in both halves)
    "nvfp4": """{{
.reg .b32 z;
mov.b32 z, 0;
prmt.b32 $0, $2, z, {sel0};
prmt.b32 $1, $2, z, {sel1};
shl.b32 $0, $0, 4;
shl.b32 $1, $1, 4;
add.u32 $0, $0, 0x76007600;
add.u32 $1, $1, 0x76007600;
}}""",
    "mxfp4": """{{
.reg .b32 z;
mov.b32 z, 0;
prmt.b32 $0, $2, z, {sel0};
prmt.b32 $1, $2, z, {sel1};
shl.b32 $0, $0, 7;
shl.b32 $1, $1, 7;
}}""",
}

# One code word ($4: 8 nibbles, logical elements e0..e7, even ones in low nibbles) and a
# multiplier ($5, bf16x2) -> bf16x2 (e0, e2), (e1, e3), (e4, e6), (e5, e7), each
# `E2M1 * 2**-126` times the multiplier.
# A nibble in the high half of a byte B: `prmt` puts B in the low byte of a 16-bit half and,
# in sign-replicate mode (selector bit 3), B's bit 7 (the nibble's sign) in all 8 bits of the
# high byte; shifted left by 2, the magnitude bits 6..4 land on bf16 bits 8..6 and a sign copy
# on bit 15; one `and` keeps those: `E2M1 * 2**-126`, then times the multiplier. The low
# nibbles are the high nibbles of the word shifted left by 4. 17 instructions per word, 8 of
# them on the integer (ALU) pipe: ptxas issues the shifts as IMAD.SHL on the FMA pipe. The
# decode attention's nibble-packed caches take it; the matmul weights took it in
# session 23 (`WEIGHT_DECODE_ASM` below since). (The attention's first decode took 22
# instructions a word.)
_MAG = "0x81C081C0"  # bf16 bits 15, 8, 7, 6 of both halves: the places of `s e1 e0 m`
_NIBBLES_ASM = f"""prmt.b32 y, SRC, SRC, SEL;
shl.b32 y, y, 2;
and.b32 y, y, {_MAG};
mul.rn.bf16x2 OUT, y, $5;
"""
DECODE_ASM = ("{\n.reg .b32 w4, y;\nshl.b32 w4, $4, 4;\n"
              + "".join(_NIBBLES_ASM.replace("SRC", src).replace("SEL", sel).replace("OUT", out)
                        for sel, src, out in (("0x9180", "w4", "$0"), ("0x9180", "$4", "$1"),
                                              ("0xB3A2", "w4", "$2"), ("0xB3A2", "$4", "$3")))
              + "}")

# The matmul weights' decode: one code word ($4, bit-placed by `e2m1.wgmma_bit_sources`) and a
# multiplier ($5, bf16x2) -> four bf16x2 registers, each `E2M1 * 2**-126` times the multiplier.
# Register 0 is the word masked to the bf16 places of `s e1 e0 m` (bits 15, 8, 7, 6 of each
# half), register 1 the word shifted left by 4, register 2 rotated left by 10, register 3 the
# word shifted left by 6 with its e1 bits from the word shifted right by 2 (one `lop3`: y | (z &
# mask)). 9 integer instructions a word and 4 multiplies, against 13 and 4 of `DECODE_ASM` on
# natural nibbles. The attention cache's "kv_words" (session 27, placed by
# `e2m1.KV_WORD_PLACES`) take it too. H200 (session 25, same run,
# us kernel, old decode -> this): GEMV 8192 x 28672 one row 39.4 -> 37.3, grouped gate+up 256
# rows 64.2 -> 59.1, 2,208 rows 83.1 -> 76.5. The same bits with the rotate and the right shift
# as `mul.wide` / `mul.hi` by powers of two (FMA pipe instead of ALU: 5 ALU instructions a word
# instead of 7) were slower than either: 40.0, 65.3, 87.7.
WEIGHT_DECODE_ASM = f"""{{
.reg .b32 y, z;
and.b32 y, $4, {_MAG};
mul.rn.bf16x2 $0, y, $5;
shl.b32 y, $4, 4;
and.b32 y, y, {_MAG};
mul.rn.bf16x2 $1, y, $5;
shf.l.wrap.b32 y, $4, $4, 10;
and.b32 y, y, {_MAG};
mul.rn.bf16x2 $2, y, $5;
shl.b32 y, $4, 6;
shr.b32 z, $4, 2;
and.b32 y, y, 0x80C080C0;
lop3.b32 y, y, z, 0x01000100, 0xF8;
mul.rn.bf16x2 $3, y, $5;
}}"""


def _make_tile_decoder(fmt: str, kb: int, j: int):
  """inline_mgpu function: (codes words of tile j, scale words of the step) -> bf16 (64, 64) in
  the WGMMA layout."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm, vector

  wlay = plgpu.Layout.WG_STRIDED((16, 32), vec_size=4)
  slay = plgpu.Layout.WG_STRIDED((2 * kb, 32), vec_size=kb // 2)
  u, b0 = j // 2, 2 * (j % 2)  # scale word and byte of rows r0 (b0) and r1 (b0 + 1)
  sel0 = 0x4040 | b0 | (b0 << 8)
  sel1 = 0x4040 | (b0 + 1) | ((b0 + 1) << 8)
  scale_asm = _SCALE_ASM[fmt].format(sel0=hex(sel0), sel1=hex(sel1))

  @plgpu.inline_mgpu(
      arg_types=(wlay, slay),
      return_type=plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA),
  )
  def decode(ctx, words, scales):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    [wreg] = list(words.registers.flat)  # vector<4xi32>: this thread's 16 bytes of the tile
    [sreg] = list(scales.registers.flat)  # vector<(kb/2)xi32>: its scale bytes of the step
    sw = vector.extract(sreg, [], [u])
    cs = llvm.inline_asm(llvm.StructType.get_literal([i32] * 2), [sw], scale_asm, "=r,=r,r")
    c0, c1 = llvm.extractvalue(i32, cs, [0]), llvm.extractvalue(i32, cs, [1])
    regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((64, 64)), dtype=object)
    for jw in range(4):  # word jw: 8 codes of row jw // 2 (`layout._slot_tables`)
      wj = vector.extract(wreg, [], [jw])
      st = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [wj, (c0, c1)[jw // 2]],
                           WEIGHT_DECODE_ASM, "=r,=r,=r,=r,r,r")
      for o in range(4):
        val = llvm.extractvalue(i32, st, [o])
        regs[0, 4 * (jw % 2) + o, 0, 0, jw // 2, 0, 0, 0, 0] = mutils.bitcast(val, bf16x2)
    return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

  return decode


# --------------------------------------------------------------------------- the kernel

@functools.cache
def _transposed_store():
  """inline_mgpu function: (x [64, bm] wgmma layout, ref [bm, 64] SMEM, untiled) -> ref = x^T,
  element by element at the positions the layout's own `thread_idxs` name. Pallas's store
  through `transpose_ref` of a tiled ref finds no layout (jax 0.11.2), and the epilogue's 8-32
  values per thread make scalar stores cheap beside the kernel's main loop."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref, vector

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def store(ctx, x, ref):
    del ctx
    index = ir.IndexType.get()
    for (row, col), pos in zip(x.layout.thread_idxs(x.shape), np.ndindex(x.registers.shape),
                               strict=True):
      reg = x.registers[pos]
      for j in range(ir.VectorType(reg.type).shape[0]):
        c = arith.addi(col, mutils.c(j, index)) if j else col  # thread_idxs are index values
        memref.store(vector.extract(reg, [], [j]), ref, [c, row])

  return store


def _out_smem(wgs: int, bm: int, dtype):
  """Output staging, [rows, 64 columns] per warpgroup, untiled (see `_transposed_store`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu.SMEM((wgs, bm, 64), dtype)


def chunk_coords(ce_gmem, cr_gmem, k_iters: int, dense: bool = False):
  """Inside a grouped kernel on the ("n", "c", "s") grid: (column-tile block, chunk, K split,
  the chunk's expert (-1: unused), its first row, its first K step). dense: one chunk of
  expert 0 from row 0, known without reading the tables (their load is a global round trip
  every CTA waits for before its first TMA: 2.2% of the 8192 x 28672 GEMV's warp stall
  samples on the H200, more of the short kernels at attention shapes)."""
  import jax.experimental.pallas as pl
  n_outer, c_idx, s_idx = lax.axis_index("n"), lax.axis_index("c"), lax.axis_index("s")
  if dense:
    return n_outer, c_idx, s_idx, 0, 0, s_idx * k_iters
  row0 = pl.multiple_of(cr_gmem[c_idx], 8)  # chunk_tables aligns windows to 8
  return n_outer, c_idx, s_idx, ce_gmem[c_idx], row0, s_idx * k_iters


def when_used(e):
  """Decorator: run the function where the chunk's expert `e` (from `chunk_coords`) is used,
  e >= 0 (`pl.when`); at once where e is the constant of a dense call."""
  import jax.experimental.pallas as pl
  if isinstance(e, int):
    return lambda f: f()
  return pl.when(e >= 0)


def store_tile(y, stage_ref, out_ref):
  """A warpgroup's finished tile (y: [64 columns, bm rows] in the WGMMA layout) to its output
  rows: transposed into SMEM, then one TMA copy to `out_ref` ([bm, 64] of the output), its
  SMEM read waited at once. (Waiting before the staging tile's next write instead, so that a
  chained tile's store overlaps the next tile's products, was no faster on the H200: sessions
  31 and 34, grouped kernels at 512-2,208 rows within +-1.5 us, benchmarks/results/
  session34_h200_2026-12-04/deferred_store.patch.)"""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  _transposed_store()(y, stage_ref)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(stage_ref, out_ref)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def run_tile_chain(tile_pipeline, refs, n_outer, n_inner: int):
  """A CTA's column tiles n_outer * n_inner + (0 .. n_inner - 1) over `refs`: one pipeline
  (`tile_pipeline(tile, state)`), or a chain of them sharing one set of SMEM buffers and
  barriers, the TMA warpgroup running ahead into the next tile."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  if n_inner == 1:
    tile_pipeline(n_outer, None)(*refs)
    return
  states = ([plgpu.PipelinePipeline.START] + [plgpu.PipelinePipeline.STEADY] * (n_inner - 2)
            + [plgpu.PipelinePipeline.STOP])
  pipes = [tile_pipeline(n_outer * n_inner + j, st) for j, st in enumerate(states)]

  def chain(allocations):
    for p in pipes:
      p(*refs, allocations=allocations)

  pl.run_scoped(chain, pipes[0].get_allocations(*refs), collective_axes="wg")


def gather_rows(out, slot, out_rows, n: int, out_dtype):
  """The rows a grouped call returns from the kernel's [S, C, bm, N_pad] output: `slot` order
  (C * bm: a row past the groups, read as zeros), composed with the caller's `out_rows`; one
  gather, no padded copy; K partial sums added after it (only the wanted rows)."""
  if out_rows is not None:
    slot = slot[out_rows]
  splits = out.shape[0]
  flat = out[:, :, :, :n].reshape(splits, -1, n)  # [S, C * bm, N]: chunk rows
  y = jnp.take(flat, slot, axis=1, mode="fill", fill_value=0)
  return y[0] if splits == 1 else jnp.sum(y, axis=0).astype(out_dtype)


# How many of a step's wgmma products the compute warpgroups leave in flight where the
# accumulator holds WGMMA_WAIT_MIN_ROWS rows or more: "one" (the newest; `_step_products`) or
# "all" (as ptxas allows: at 32 and 64 rows it serialized them all). H200, us kernel, all ->
# one, each side in its own process, relerr unchanged: gate+up 2,208 rows (bm 32) 81.7 -> 74.8
# (session 31) and 80.8 -> 75.6 (session 32), down 2,208 rows 44.6 -> 42.7, gate+up 32,768 rows
# (bm 64) 465.8 -> 441.9, dense 8192 x 28672 at 32 / 64 rows 43.7 / 59.2 -> 41.9 / 55.3
# (benchmarks/results/session31_h200_2026-12-04, session32_h200_2026-12-04).
WGMMA_IN_FLIGHT = choice_setting(
    "TRACE_JAX_WGMMA_IN_FLIGHT", "one", ("one", "all"),
    doc="grouped FP4 kernel: wait for all but the newest wgmma, or all")
WGMMA_WAIT_MIN_ROWS = 32


def _step_products(fmt: str, kb: int):
  """The compute warpgroup's work in one pipeline step: its kb 64x64 tiles of W^T decoded in
  registers (codes and the step's scale bytes from SMEM), each multiplied into the accumulator
  with the activation tile (SMEM, transposed). (Leaving a step's products in flight into the
  next step, buffers released a step late, was slower on the H200: 8192 x 28672, 1 row, 42.3
  -> 43.2 us at kb 4, 42.8 -> 60.9 at kb 8. One wgmma call over all kb tiles of a step, so
  that Mosaic makes the activation descriptor once instead of per tile, took the GEMV's loop
  from 403 to 373 SASS instructions and was no faster: us kernel 37.1 -> 37.4 (GEMV), 58.4 ->
  58.2 (grouped, 256 rows), 78.7 -> 82.4 (2,208 rows; spills at 32-row chunks), session 25.)
  Accumulators of WGMMA_WAIT_MIN_ROWS rows or more wait for all but the newest product before
  decoding the next tile (`WGMMA_IN_FLIGHT`): with every tile's decoded registers held until
  its asynchronous wgmma ends, ptxas found too few registers at 32- and 64-row chunks and
  serialized every wgmma (warning C7512; 32 warpgroup waits in the loop at 2,208 rows, 8 with
  the wait)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  decoders = [_make_tile_decoder(fmt, kb, j) for j in range(kb)]
  wlay = plgpu.Layout.WG_STRIDED((16, 32), vec_size=4)
  slay = plgpu.Layout.WG_STRIDED((2 * kb, 32), vec_size=kb // 2)

  def products(x_smem, w_smem, s_smem, acc_ref):
    wg = lax.axis_index("wg")
    sc = plgpu.load(s_smem.at[wg], layout=slay)
    wide = WGMMA_IN_FLIGHT == "one" and acc_ref.shape[1] >= WGMMA_WAIT_MIN_ROWS
    for j in range(kb):
      words = plgpu.load(w_smem.at[wg, pl.ds(j * 16, 16)], layout=wlay)
      plgpu.wgmma(acc_ref, decoders[j](words, sc), x_smem.at[:, pl.ds(j * 64, 64)].T)
      if wide and j < kb - 1:
        plgpu.wgmma_wait(1)  # tile j - 1's registers free before tile j + 1 is decoded
    plgpu.wgmma_wait(0)

  return products


def _in_specs(bm: int, kb: int, wgs: int, unit):
  """The pipeline's blocks at step i: activation (bm rows x 64*kb K, 128 B swizzle), codes and
  scale words of `wgs` column blocks of 64; unit(i) = (column tile of wgs*64, K step)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return [
      plgpu.BlockSpec((bm, 64 * kb), lambda i: (0, unit(i)[1]), transforms=(
          plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))),
      plgpu.BlockSpec((wgs, kb * 16, 32), lambda i: (*unit(i), 0)),
      plgpu.BlockSpec((wgs, kb * 2, 32), lambda i: (*unit(i), 0)),
  ]


@functools.partial(jax.jit, static_argnames=("fmt", "kb", "bm", "wgs", "stages", "splits",
                                             "n_inner", "stream_k", "out_dtype", "dense",
                                             "n_ctas", "merge"))
def fp4_chunked_matmul(xc, codes, scales, factor, chunk_expert, chunk_row, *, fmt: str,
                       kb: int, bm: int, wgs: int = 4, stages: int = 3, splits: int = 1,
                       n_inner: int = 1, stream_k: int = 0, out_dtype=jnp.bfloat16,
                       dense: bool = False, total=None, n_ctas: int = 0,
                       merge: str = "xla"):
  """The raw kernel. xc: bf16 [R, K_pad] (K permuted; R >= max(chunk_row) + bm); codes/scales/
  factor from a `PackedWeight` ([E, ...]); chunk_expert int32 [C] (-1: empty chunk, skipped);
  chunk_row int32 [C]: first row of xc of each chunk, a multiple of 8 (a chunk reads bm rows
  from there; rows outside its group are computed and never gathered). splits: K split across
  CTAs (partial sums). n_inner: column tiles (of wgs * 64) one CTA computes one after another,
  as a pipeline of pipelines (the TMA warpgroup streams the next tile's weights while the last
  steps of the current one compute): fewer, longer CTAs, so the per-CTA start (launch, barrier
  set-up, the first loads' latency) is paid once per n_inner tiles, which matters when K is
  short (the 30B-A3B down projection: 3 steps of 256 K per tile).
  Returns out_dtype [splits, C, bm, N_pad]: out[s, c, i, n] = row i of chunk c times column n
  over K part s (already times the column factor).
  dense: the call is one chunk of expert 0 from row 0 (a dense product): the kernel does not
  read the chunk tables (`chunk_coords`).
  stream_k: a dense call's (one chunk) stream-K schedule instead (`stream_k_plan`): CTA j
  computes the `stream_k` consecutive (column tile, K step) units from j * stream_k on, in
  column-tile-major order, so every CTA has the same work however many tiles there are; a CTA
  that ends a tile stores its partial sum there and starts the next from zero. Returns float32
  [slots, 1, bm, N_pad]: slot p of a tile holds the partial sum of the p-th CTA that touched it
  (unwritten slots are garbage: `stream_k_slots` says which are written), NOT times the column
  factor (the caller applies it after adding the slots).
  total: a grouped call's stream-K schedule instead (`_grouped_stream_k_kernel`, n_ctas CTAs):
  an int32 vector whose element 0 is the chunks in use (`chunk_tables`' reserved chunks);
  returns (out [C, bm, N_pad] out_dtype, part float32 [2, n_ctas, bm, 256]); with merge
  "kernel" out holds the cut tiles too and part is the kernel's scratch."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  _patch_register_pool()

  if total is not None:
    return _grouped_stream_k_kernel(xc, codes, scales, factor, chunk_expert, chunk_row, total,
                                    fmt=fmt, kb=kb, bm=bm, wgs=wgs, stages=stages,
                                    n_ctas=n_ctas, out_dtype=out_dtype, merge=merge)
  e_, nt, kr, _ = codes.shape
  n_pad, k_pad = nt * 64, kr // 16 * 64
  n_chunks = chunk_expert.shape[0]
  assert xc.shape[1] == k_pad, (xc.shape, k_pad)
  assert nt % (wgs * n_inner) == 0 and k_pad % (64 * kb * splits) == 0 and bm in BM_CHOICES
  if stream_k:
    return _stream_k_kernel(xc, codes, scales, chunk_expert, chunk_row, fmt=fmt, kb=kb, bm=bm,
                            wgs=wgs, stages=stages, steps=stream_k)
  k_iters = k_pad // (64 * kb) // splits
  if n_inner > 1 and k_iters % stages:
    raise ValueError(f"n_inner={n_inner} chains pipelines, which needs the {k_iters} steps per "
                     f"tile to be a multiple of stages={stages}")
  step_products = _step_products(fmt, kb)

  def kernel(ce_gmem, cr_gmem, x_gmem, w_gmem, s_gmem, f_gmem, out_gmem, out_smem, f_smem,
             f_bar):
    n_outer, c_idx, s_idx, e, row0, k0 = chunk_coords(ce_gmem, cr_gmem, k_iters, dense)

    def tile_pipeline(n_idx, state):
      """The pipeline of one column tile (wgs * 64 columns) over this CTA's K range."""
      def compute_context(eval_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, bm), jnp.float32))
        def _scope(acc_ref):
          wg = lax.axis_index("wg")
          col0 = (n_idx * wgs + wg) * 64
          plgpu.copy_gmem_to_smem(f_gmem.at[e, pl.ds(col0, 64)], f_smem.at[wg], f_bar.at[wg])
          eval_pipeline(acc_ref)
          plgpu.barrier_wait(f_bar.at[wg])
          f = plgpu.load(f_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
          store_tile((acc_ref[...] * f[:, None]).astype(out_dtype), out_smem.at[wg],
                     out_gmem.at[s_idx, c_idx, :, pl.ds(col0, 64)])

      def body(_, x_smem, w_smem, s_smem, acc_ref):
        step_products(x_smem, w_smem, s_smem, acc_ref)
        return acc_ref

      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40,
          in_specs=_in_specs(bm, kb, wgs, lambda i: (n_idx, k0 + i)),
          wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
          compute_context=compute_context, pipeline_state=state)

    @when_used(e)
    def _():
      run_tile_chain(tile_pipeline, (x_gmem.at[pl.ds(row0, bm)], w_gmem.at[e], s_gmem.at[e]),
                     n_outer, n_inner)

  return mosaic_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((splits, n_chunks, bm, n_pad), out_dtype),
      grid=(nt // wgs // n_inner, n_chunks, splits), grid_names=("n", "c", "s"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=_out_smem(wgs, bm, out_dtype),
                         f_smem=plgpu.SMEM((wgs, 64), jnp.float32),
                         f_bar=plgpu.Barrier(num_arrivals=1, num_barriers=wgs)),
  )(chunk_expert, chunk_row, xc, codes, scales, factor)


def _stream_k_kernel(xc, codes, scales, chunk_expert, chunk_row, *, fmt: str, kb: int, bm: int,
                     wgs: int, stages: int, steps: int):
  """`fp4_chunked_matmul`'s stream-K schedule (see there) for a dense call's one chunk (expert
  0 from row 0: the tables are not read)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  _, nt, kr, _ = codes.shape
  tiles, k_steps = nt // wgs, kr // 16 // kb
  units = tiles * k_steps
  n_ctas = -(-units // steps)
  slots = stream_k_slots(tiles, k_steps, steps).shape[0]
  step_products = _step_products(fmt, kb)

  def kernel(ce_gmem, cr_gmem, x_gmem, w_gmem, s_gmem, out_gmem, out_smem):
    cta, _, _, e, row0, _ = chunk_coords(ce_gmem, cr_gmem, 0, dense=True)
    u0 = cta * steps
    # the last CTA may hold fewer units (a dynamic pipeline length only where it does)
    n_steps = steps if units % steps == 0 else jnp.minimum(steps, units - u0)

    def flush(acc_ref, u):
      """Store the partial sum of unit u's tile (this warpgroup's 64 columns) in this CTA's slot
      there: the CTAs that touch a tile are consecutive, the first is slot 0."""
      wg = lax.axis_index("wg")
      t = u // k_steps
      slot = cta - t * k_steps // steps
      store_tile(acc_ref[...], out_smem.at[wg],
                 out_gmem.at[slot, 0, :, pl.ds((t * wgs + wg) * 64, 64)])

    def compute_context(eval_pipeline):
      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, bm), jnp.float32))
      def _scope(acc_ref):
        eval_pipeline(acc_ref)
        flush(acc_ref, u0 + n_steps - 1)

    def body(idx, x_smem, w_smem, s_smem, acc_ref):
      step_products(x_smem, w_smem, s_smem, acc_ref)
      u = u0 + idx[0]

      @pl.when((u % k_steps == k_steps - 1) & (idx[0] < n_steps - 1))
      def _():  # a tile ends before this CTA's last unit: store it, start the next from zero
        flush(acc_ref, u)
        acc_ref[...] = jnp.zeros((64, bm), jnp.float32)

      return acc_ref

    @when_used(e)
    def _():
      plgpu.emit_pipeline_warp_specialized(
          body, grid=(n_steps,), memory_registers=40,
          in_specs=_in_specs(bm, kb, wgs, lambda i: ((u0 + i) // k_steps, (u0 + i) % k_steps)),
          wg_axis="wg", num_compute_wgs=wgs, max_concurrent_steps=stages,
          compute_context=compute_context,
      )(x_gmem.at[pl.ds(row0, bm)], w_gmem.at[e], s_gmem.at[e])

  return mosaic_kernel(
      kernel, out_type=jax.ShapeDtypeStruct((slots, 1, bm, nt * 64), jnp.float32),
      grid=(n_ctas, 1, 1), grid_names=("n", "c", "s"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=_out_smem(wgs, bm, jnp.float32)),
  )(chunk_expert[:1], chunk_row[:1], xc, codes, scales)


def counted_in_last(t, count_addr, expected):
  """Inline PTX for inside an `inline_mgpu` function: this warpgroup's part of a result counted
  in, after its global stores: a `fence.acq_rel.gpu` and a warpgroup barrier, then thread t = 0
  adds 1 to the int32 at count_addr (i64, global) with `atom.acq_rel.gpu`. Returns an i32, 1
  on all 128 threads where the count before the add was `expected` (i32: this part is the last
  to arrive, the others' stores visible to it) and 0 elsewhere, told to every thread by
  `bar.red.or.pred`."""
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm

  i32 = ir.IntegerType.get_signless(32)
  bar = mutils.warpgroup_barrier_idx(sync=False)
  return llvm.inline_asm(
      i32, [t, count_addr, bar, expected],
      "{\n.reg .pred p, q;\n.reg .b32 old;\nfence.acq_rel.gpu;\n"
      "bar.sync $3, 128;\nsetp.eq.u32 p, $1, 0;\nmov.b32 old, 0xffffffff;\n"
      "@p atom.acq_rel.gpu.global.add.u32 old, [$2], 1;\n"
      "setp.eq.u32 q, old, $4;\nbar.red.or.pred q, $3, 128, q;\n"
      "selp.u32 $0, 1, 0, q;\nfence.acq_rel.gpu;\n}", "=r,r,l,r,r", has_side_effects=True)


def merger_scratch_size(n_ctas: int, wgs: int, bm: int) -> int:
  """float32 elements of `_cut_tile_merger`'s scratch: for each of the n_ctas * wgs warpgroup
  slots, 2 parts of a thread's bm / 2 registers x 128 threads."""
  return n_ctas * wgs * 2 * (bm // 2) * 128


@functools.cache
def _cut_tile_merger(out_bits: int, n_pad: int):
  """inline_mgpu function: the two parts of a tile cut by a stream-K run's end, added inside
  the grouped kernel by the part that finishes last (`_grouped_stream_k_kernel` with
  merge="kernel"). (y float32 [64, bm] wgmma layout: this warpgroup's part, times the column
  factor; part (0: the earlier run's, 1: the later's), pair (the cut tile's warpgroup slot,
  boundary * wgs + wg), out0 (element offset of out[chunk, 0, first column]) int32 scalars;
  refs: parts (float32, 2 * (bm / 2) * 128 a pair, each thread's registers at its own
  coalesced offsets), counts (a zeroed int32 semaphore a pair), out ([C, bm, n_pad]
  bfloat16 or float32)) -> nothing.

  Each part stores its registers with plain global stores, fences (`fence.acq_rel.gpu`), and
  one thread counts it in with an atomic add; the part that sees the other's count (told to
  all 128 threads by `bar.red.or.pred`) reads the other's registers back (`ld.global.cg`: from
  L2, never a stale L1 line), adds them (float32 addition commutes: the result does not depend
  on which came last) and writes the tile's rows to `out`. The attention's split merger
  (`attention_mgpu._split_merger`) is the same protocol over more parts."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, scf, vector

  wgmma, scalar, ref = plgpu.Layout.WGMMA, plgpu.Layout.WG_SPLAT, plgpu.RefType()

  @plgpu.inline_mgpu(arg_types=(wgmma, scalar, scalar, scalar, ref, ref, ref))
  def merge(ctx, y, part, pair, out0, parts_ref, counts, out):
    del ctx
    i32, i64, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                     ir.F32Type.get())
    c = lambda v: arith.constant(i32, v)  # noqa: E731
    add, mul = arith.addi, arith.muli
    part, pair, out0 = (v.registers.flat[0] for v in (part, pair, out0))
    t = arith.remui(mutils.thread_idx(), c(128))
    base = lambda r: llvm.ptrtoint(i64, mutils.memref_ptr(r))  # noqa: E731
    p_base, cnt_base, out_base = map(base, (parts_ref, counts, out))

    def addr(b64, elems, nbytes):  # i64 address of element `elems` (i32) of a buffer
      return arith.addi(b64, arith.muli(arith.extui(i64, elems), arith.constant(i64, nbytes)))

    def asm(ret, args, text, constraints):
      return llvm.inline_asm(ret, args, text, constraints, has_side_effects=True)

    regs = list(y.registers.flat)  # vector<2xf32> each
    pos = [tuple(arith.index_cast(i32, v) for v in p)
           for p in y.layout.thread_idxs(y.shape)]  # (column in 64, first of 2 rows)
    n_regs = len(regs)

    def slot(p, k):  # element offset of register k of part p of this pair, this thread
      return mul(add(mul(add(mul(add(mul(pair, c(2)), p), c(n_regs)), c(k)), c(128)), t), c(2))

    for k, reg in enumerate(regs):
      xy = [vector.extract(reg, [], [e]) for e in range(2)]
      asm(llvm.StructType.get_literal([]), [addr(p_base, slot(part, k), 4), *xy],
          "st.global.v2.f32 [$0], {$1, $2};", "l,f,f")
    last = counted_in_last(t, addr(cnt_base, pair, 4), c(1))
    is_last = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, last, c(0)))
    with ir.InsertionPoint(is_last.then_block):
      other = arith.subi(c(1), part)
      for k, reg in enumerate(regs):
        st = asm(llvm.StructType.get_literal([f32, f32]), [addr(p_base, slot(other, k), 4)],
                 "ld.global.cg.v2.f32 {$0, $1}, [$2];", "=f,=f,l")
        col, row = pos[k]
        for e in range(2):
          val = arith.addf(vector.extract(reg, [], [e]), llvm.extractvalue(f32, st, [e]))
          elem = add(out0, add(mul(add(row, c(e)), c(n_pad)), col))
          if out_bits == 16:
            asm(llvm.StructType.get_literal([]), [addr(out_base, elem, 2), val],
                "{\n.reg .b16 h;\ncvt.rn.bf16.f32 h, $1;\nst.global.b16 [$0], h;\n}", "l,f")
          else:
            asm(llvm.StructType.get_literal([]), [addr(out_base, elem, 4), val],
                "st.global.f32 [$0], $1;", "l,f")
      scf.yield_([])

  return merge


def grouped_stream_k_steps(total, units: int, k_steps: int, n_ctas: int):
  """Units (column tile of 256 x K step) per CTA of a grouped stream-K call over `total`
  chunks (int32 scalar, traced) of `units` units each: an even share over n_ctas CTAs, and at
  least one tile's k_steps, so that a tile's units meet at most two CTAs."""
  return jnp.maximum(lax.div(total * units + (n_ctas - 1), n_ctas), k_steps)


def _tile_parts(g, k_steps: int, steps):
  """(first, last) CTA of tile g's K steps under a stream-K run of `steps` units a CTA."""
  return lax.div(g * k_steps, steps), lax.div(g * k_steps + (k_steps - 1), steps)


def _grouped_stream_k_kernel(xc, codes, scales, factor, chunk_expert, chunk_row, total, *,
                             fmt: str, kb: int, bm: int, wgs: int, stages: int, n_ctas: int,
                             out_dtype, merge: str = "xla"):
  """`fp4_chunked_matmul`'s grouped stream-K schedule. The units of the chunks in use (chunk,
  column tile, K step; chunk-major) are cut into n_ctas equal runs (`grouped_stream_k_steps`),
  one CTA each, one pipeline a CTA whose index maps read the chunk tables a step (expert,
  window start), so a run crosses tile and chunk ends without a restart and every SM has the
  same work (the chunk-per-CTA schedule keeps 115 of 132 SMs busy at 256 rows: about 115
  chunks of 30B-A3B's gate+up). A tile that lies in one run ends as there (times the column
  factor, out_dtype, into `out`); one cut by a run's end leaves two float32 parts, times the
  factor, in `part[p, last CTA]` (p = 0: the first CTA's), added by the caller
  (`gather_stream_k`). Chunks from `total[0]` on are not computed, `out`'s tiles that are cut
  and `part` where no tile is cut not written. merge "kernel": the two runs of a cut tile add
  their parts in the kernel instead (`_cut_tile_merger`, the later to finish writes the tile
  into `out`; part is its scratch), so the caller gathers `out` alone (`gather_rows`)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  _, nt, kr, _ = codes.shape
  tiles, k_steps = nt // wgs, kr // 16 // kb
  units = tiles * k_steps
  n_chunks = chunk_expert.shape[0]
  step_products = _step_products(fmt, kb)
  if merge not in ("xla", "kernel"):
    raise ValueError(f"merge must be 'xla' or 'kernel', got {merge!r}")
  if merge == "kernel":
    merger = _cut_tile_merger(jnp.dtype(out_dtype).itemsize * 8, nt * 64)

  def kernel(ce_gmem, cr_gmem, tot_gmem, x_gmem, w_gmem, s_gmem, f_gmem, out_gmem, part_gmem,
             out_smem, part_smem):
    cta = lax.axis_index("c")
    counts = None
    if merge == "kernel":  # a zeroed counter a cut tile's warpgroup slot (boundary, wg)
      counts = pl.get_global(plgpu.SemaphoreType.REGULAR((n_ctas * wgs,)))
    chunks = tot_gmem[0]
    steps = grouped_stream_k_steps(chunks, units, k_steps, n_ctas)
    u0 = cta * steps
    n = jnp.minimum(jnp.maximum(chunks * units - u0, 0), steps)
    memo = {}

    def unit(i):  # (expert, window start, column tile, K step) of step i: one table read a
      if id(i) not in memo:  # step for all the specs' maps (each is called with the same i)
        u = u0 + i
        q, w = lax.div(u, units), lax.rem(u, units)
        memo[id(i)] = (i, (jnp.maximum(ce_gmem[q], 0), pl.multiple_of(cr_gmem[q], 8),
                           lax.div(w, k_steps), lax.rem(w, k_steps)))
      return memo[id(i)][1]

    def flush(acc_ref, u, f_smem):
      """This warpgroup's 64 columns of unit u's tile, times the column factor: the tile's
      result where one run holds it, else this run's part of it."""
      wg = lax.axis_index("wg")
      f = plgpu.load(f_smem.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
      y = acc_ref[...] * f[:, None]
      g = lax.div(u, k_steps)
      first, last = _tile_parts(g, k_steps, steps)
      col = (lax.rem(g, tiles) * wgs + wg) * 64

      @pl.when(first == last)
      def _():
        store_tile(y.astype(out_dtype), out_smem.at[wg],
                   out_gmem.at[lax.div(g, tiles), :, pl.ds(col, 64)])

      @pl.when(first != last)
      def _():
        if merge == "kernel":
          merger(y, cta - first, last * wgs + wg, lax.div(g, tiles) * (bm * nt * 64) + col,
                 part_gmem, counts, out_gmem)
        else:
          store_tile(y, part_smem.at[wg],
                     part_gmem.at[cta - first, last, :, pl.ds(wg * 64, 64)])

    def body(idx, x_smem, w_smem, s_smem, f_smem, acc_ref):
      step_products(x_smem, w_smem, s_smem, acc_ref)
      u = u0 + idx[0]

      @pl.when((lax.rem(u, k_steps) == k_steps - 1) | (idx[0] == n - 1))
      def _():  # a tile or the run ends: store it, start the next from zero
        flush(acc_ref, u, f_smem)
        acc_ref[...] = jnp.zeros((64, bm), jnp.float32)

      return acc_ref

    def compute_context(eval_pipeline):
      @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, bm), jnp.float32))
      def _scope(acc_ref):
        eval_pipeline(acc_ref)

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    in_specs = [
        plgpu.BlockSpec((pl.Element(bm), 64 * kb), lambda i: (unit(i)[1], unit(i)[3]),
                        transforms=tiled),
        plgpu.BlockSpec((None, wgs, kb * 16, 32), lambda i: (*unit(i)[::2], unit(i)[3], 0)),
        plgpu.BlockSpec((None, wgs, kb * 2, 32), lambda i: (*unit(i)[::2], unit(i)[3], 0)),
        plgpu.BlockSpec((None, wgs, 64), lambda i: (*unit(i)[::2], 0)),
    ]

    @pl.when(n > 0)
    def _():
      plgpu.emit_pipeline_warp_specialized(
          body, grid=(n,), memory_registers=40, in_specs=in_specs, wg_axis="wg",
          num_compute_wgs=wgs, max_concurrent_steps=stages, compute_context=compute_context,
      )(x_gmem, w_gmem, s_gmem, f_gmem)

  part_shape = ((2, n_ctas, bm, wgs * 64) if merge == "xla"
                else (merger_scratch_size(n_ctas, wgs, bm),))
  out_type = (jax.ShapeDtypeStruct((n_chunks, bm, nt * 64), out_dtype),
              jax.ShapeDtypeStruct(part_shape, jnp.float32))
  return mosaic_kernel(
      kernel, out_type=out_type, grid=(n_ctas,), grid_names=("c",),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(out_smem=_out_smem(wgs, bm, out_dtype),
                         part_smem=_out_smem(wgs, bm, jnp.float32)),
  )(chunk_expert, chunk_row, total, xc, codes, scales, factor.reshape(factor.shape[0], nt, 64))


def gather_stream_k(out, part, slot, out_rows, total, n: int, *, k_steps: int, out_dtype):
  """The rows a grouped stream-K call returns from `_grouped_stream_k_kernel`'s out and part:
  as `gather_rows`, but a tile cut by a run's end is the sum of its two parts; one XLA gather
  fusion over the wanted rows."""
  if out_rows is not None:
    slot = slot[out_rows]
  c, bm, n_pad = out.shape
  m, n_ctas, tiles = slot.shape[0], part.shape[1], n_pad // 256
  steps = grouped_stream_k_steps(total[0], tiles * k_steps, k_steps, n_ctas)
  q, i = slot // bm, slot % bm
  first, last = _tile_parts(q[:, None] * tiles + jnp.arange(tiles)[None, :], k_steps, steps)
  y = jnp.take(out[:, :, :n].reshape(c * bm, n), slot, axis=0, mode="fill", fill_value=0)
  # the parts as whole 256-column rows of each (row, tile) (a row gather, as the one above:
  # XLA gathered per element far slower, 61 us beside a 83 us kernel at 2,208 rows on the H200)
  at = (jnp.minimum(last, n_ctas - 1) * bm + i[:, None]).reshape(-1)
  p0, p1 = (jnp.take(part[p].reshape(n_ctas * bm, 256), at, axis=0).reshape(m, n_pad)[:, :n]
            for p in range(2))
  cut = jnp.repeat((first != last) & (slot < c * bm)[:, None], 256, axis=1)[:, :n]
  return jnp.where(cut, (p0 + p1).astype(out_dtype), y.astype(out_dtype))


def stream_k_slots(tiles: int, k_steps: int, steps: int) -> np.ndarray:
  """Which K steps of each column tile each slot of a stream-K call holds: bool
  [slots, tiles, k_steps] (slot p of tile t: the p-th CTA, in order, whose `steps` units
  meet t's). A slot's partial sum is written where any of its steps is True."""
  units = tiles * k_steps
  u = np.arange(units)
  cta, t = u // steps, u // k_steps
  slot = cta - t * k_steps // steps
  out = np.zeros((int(slot.max()) + 1, tiles, k_steps), bool)
  out[slot, t, u % k_steps] = True
  return out


def stream_k_written(tiles: int, k_steps: int, steps: int) -> np.ndarray:
  """bool [slots, tiles * 256]: the output columns each slot of a stream-K call writes."""
  return np.repeat(stream_k_slots(tiles, k_steps, steps).any(axis=2), 256, axis=1)


def dense_stream_k(tiles: int, k_steps: int, bm: int) -> int:
  """Units per CTA of the stream-K schedule a dense call of `tiles` column tiles, `k_steps`
  K steps and `bm`-row chunks takes by default (`STREAM_K`, `stream_k_plan` against the equal
  K splits `default_config` would give it); 0: none."""
  if STREAM_K != "auto":
    return 0
  splits = default_config(bm, 4, jnp.bfloat16, k_steps=k_steps, n_ctas=tiles,
                          split=True)["splits"]
  return stream_k_plan(tiles, k_steps, splits, bm)


def stream_k_plan(tiles: int, k_steps: int, splits: int, bm: int = 16) -> int:
  """Units (column tile of 256 x K step) per CTA of a dense call's stream-K schedule: the fewest
  that need at most NUM_SMS CTAs; 0 (no stream-K) where the default schedule (`splits` equal K
  splits of every tile, one CTA each, in waves of NUM_SMS) runs no more steps on its busiest
  SM, or for chunks of more than STREAM_K_MAX_BM rows. H200, 8192 x 28672 (112 tiles of 32
  steps of 256 K; 28 units a CTA on 128 SMs against 32 on 112), us kernel / call, stream-K vs
  not: 1 row 42.3 / 45.0 vs 47.9 / 48.8; 16 rows 42.3 / 45.5 vs 47.6 / 48.5; 64 rows 61.4 /
  67.2 vs 65.3 / 66.6 (the slots' float32 sum, 4.6 us there, eats the gain)
  (benchmarks/results/session18_h200_2026-12-01)."""
  if bm > STREAM_K_MAX_BM:
    return 0
  steps = -(-tiles * k_steps // NUM_SMS)
  waves = -(-tiles * splits // NUM_SMS)
  return steps if steps < waves * (k_steps // splits) else 0


# --------------------------------------------------------------------------- configuration

def pick_bm(rows_per_chunk: int) -> int:
  for bm in BM_CHOICES:
    if rows_per_chunk <= bm:
      return bm
  return BM_CHOICES[-1]


# Of the 227 KiB (232,448 bytes) a Hopper CTA may use, 1 KiB is left for the barriers and
# Mosaic's own (96 bytes beyond the buffers counted here, measured by a deviceless compile at 4
# stages). With 224 KiB, the capacity batch's gate+up (2,208 rows, bm 32, 8 steps a tile in
# chained pipelines) missed 3 stages by 1 KiB, and chaining needs a divisor of 8: it ran 2.
SMEM_BUDGET = 227 * 1024 - 1024
NUM_SMS = 132


def default_config(bm: int, kb: int, out_dtype, *, k_steps: int, n_ctas: int,
                   split: bool, n_inner: int = 1, splits: int = 1) -> dict:
  """4 compute warpgroups; the most pipeline stages (<= 4) that fit SMEM (with n_inner > 1, a
  divisor of the steps per tile: chained pipelines need it); for dense calls with fewer CTAs
  than SMs, split K across CTAs so that about 132 run (partial sums in f32); splits: the K
  split when not `split` (grouped calls choose theirs in `grouped_parallelism`)."""
  if k_steps % splits:
    raise ValueError(f"splits={splits} must divide the {k_steps} K steps")
  if split:
    splits = 1
    while (n_ctas * splits * 2 <= NUM_SMS and k_steps % (splits * 2) == 0
           and k_steps // (splits * 2) >= 1):
      splits *= 2
  out_bytes = 4 if splits > 1 else jnp.dtype(out_dtype).itemsize
  fixed = 4 * 64 * bm * out_bytes + 4 * 64 * 4
  steps = max(1, k_steps // splits)
  stages = fit_stages(stage_bytes(bm, kb), fixed, steps, n_inner)
  if stages < 1:
    raise ValueError(f"kb={kb} with {bm}-row chunks does not fit SMEM; prepare with kb=4")
  return dict(wgs=4, stages=stages, splits=splits, n_inner=n_inner)


def stage_bytes(bm: int, kb: int) -> int:
  """SMEM bytes of one pipeline stage of the FP4 kernels (4 compute warpgroups): the activation
  tile (bm rows x 64 * kb K, bf16), the codes and the scale words of 256 columns x 64 * kb K."""
  return bm * 64 * kb * 2 + 4 * kb * 2048 + 4 * kb * 256


def fit_stages(per_stage: int, fixed: int, steps: int, n_inner: int) -> int:
  """Pipeline stages of a grouped/dense kernel: the most (<= 4, <= steps) whose buffers of
  `per_stage` bytes fit SMEM beside `fixed` bytes; with n_inner > 1 a divisor of the steps per
  tile (chained pipelines need it). 0: not even one fits."""
  stages = min(4, (SMEM_BUDGET - fixed) // per_stage, steps)
  while stages > 1 and n_inner > 1 and steps % stages:
    stages -= 1
  return int(stages)


# Column tiles per CTA of the grouped kernel (`fp4_chunked_matmul`'s n_inner): "all" (a CTA
# computes every column of its chunk; default), "1" (one tile per CTA), or a number. H200,
# 30B-A3B expert shapes, kernel us for n_inner 1 -> all: gate+up 256 rows 79.2 -> 69.4, 512 rows
# 89.5 -> 72.7, 32768 rows 495 -> 488; down 256 rows 56.8 -> 44.3 (n_inner 4)
# (benchmarks/results/bench_kernels_h200_2026-11-30_inner.json).
GROUPED_N_INNER = os.environ.get(declare(
    "TRACE_JAX_GROUPED_N_INNER", "all", "all, or a number",
    "column tiles a CTA of the grouped FP4 kernel computes"), "all")

# Dense calls' stream-K schedule (`stream_k_plan`): "auto" (where it runs fewer steps on the
# busiest SM than equal K splits) or "off".
STREAM_K = choice_setting(
    "TRACE_JAX_STREAM_K", "auto", ("auto", "off"),
    doc="dense FP4 calls whose column tiles leave SMs idle by a stream-K schedule")
STREAM_K_MAX_BM = 32


def grouped_n_inner(n_tiles: int, setting: str | int | None = None) -> int:
  """n_inner for a grouped call with `n_tiles` column tiles of 256: the setting ("all" or a
  number; None: `GROUPED_N_INNER`), reduced to the largest divisor of n_tiles it does not
  exceed."""
  setting = GROUPED_N_INNER if setting is None else setting
  want = n_tiles if setting == "all" else int(setting)
  if want < 1:
    raise ValueError(f"grouped n_inner must be >= 1 or 'all', got {setting!r}")
  return max(d for d in range(1, n_tiles + 1) if n_tiles % d == 0 and d <= want)


def grouped_parallelism(active_groups: int, n_tiles: int, k_steps: int, n_inner=None,
                        splits: int | None = None) -> tuple[int, int]:
  """(n_inner, splits) of a grouped call in which at most `active_groups` groups hold rows.

  Chaining a chunk's column tiles in one CTA (n_inner) pays when many groups hold rows (a
  decode batch of 32-64 touches nearly all 128 experts). With few (batch 1: 8 rows, 8 experts)
  it leaves most SMs idle: 8 CTAs each streaming 1.5 MB of gate+up weights took 66 us (kernel)
  on the H200. So, unless n_inner is given: fewer tiles per CTA until at least NUM_SMS / 2 CTAs
  can hold rows, then (one tile per CTA and still short of that) K split across CTAs, the most
  splits that divide the steps with at most NUM_SMS such CTAs (f32 partial sums). H200, 30B-A3B
  experts, batch 1 (8 rows), us per call: gate+up 76.1 (old: all 6 tiles chained) -> 23.9 (one
  tile per CTA) -> 20.4 (and K split 2) / 20.9 (split 4); down 25.4 (4 chained) -> 12.3
  (one tile) / 13.6 (split 3); batch 8 (64 rows) gate+up 78.4 -> 50.0 (3 chained)
  (benchmarks/results/session11_h200_2026-11-30/bench_kernels_small_batch.json)."""
  ni = grouped_n_inner(n_tiles, n_inner)
  if n_inner is None:
    while ni > 1 and active_groups * (n_tiles // ni) < NUM_SMS // 2:
      ni = max(d for d in range(1, ni) if n_tiles % d == 0)
  if splits is None:
    ctas = active_groups * (n_tiles // ni)
    splits = 1
    if ni == 1 and ctas < NUM_SMS // 2:
      splits = max(s for s in range(1, k_steps + 1)
                   if k_steps % s == 0 and ctas * s <= NUM_SMS)
  return ni, splits


def emulate_chunked_matmul(xc, codes, scales, factor, chunk_expert, chunk_row, *, fmt: str,
                           kb: int, bm: int, splits: int = 1, stream_k: int = 0,
                           out_dtype=jnp.bfloat16, total=None, n_ctas: int = 0,
                           merge: str = "xla", **unused_config):
  """A `jnp` model of `fp4_chunked_matmul` (same inputs and output; unused chunks give 0, a
  stream-K call's unwritten slots NaN, as a grouped stream-K call's unwritten tiles and parts):
  decode the layout, multiply in the kernel's physical K order, scale columns. Lets CPU tests
  cover the chunk tables, K permutation, split-K, stream-K slots and parts and the output
  gathers around the kernel."""
  e_ = codes.shape[0]
  shape = (e_, codes.shape[2] // 16 * 64, codes.shape[1] * 64)
  pw = L.PackedWeight(codes, scales, factor, fmt, shape, kb)
  a, fac = L.decode_parts(pw)  # [E, K_pad, N_pad] logical K
  a_phys = L.permute_k(jnp.swapaxes(a, 1, 2)).astype(jnp.float32)  # [E, N, K] physical K
  rows = chunk_row[:, None] + jnp.arange(bm)[None, :]
  xr = xc.astype(jnp.float32)[rows]  # [C, bm, K]
  if total is not None:
    return _emulate_grouped_stream_k(a_phys, fac, xr, chunk_expert, total, kb=kb,
                                     n_ctas=n_ctas, out_dtype=out_dtype, merge=merge)
  if stream_k:  # per K step products, summed over each slot's steps of each tile
    k_steps = xc.shape[1] // (64 * kb)
    held = stream_k_slots(shape[2] // 256, k_steps, stream_k)  # [slots, tiles, k_steps]
    a_s = a_phys[0].reshape(shape[2], k_steps, 64 * kb)
    x_s = xr[0].reshape(bm, k_steps, 64 * kb)
    per_step = jnp.einsum("nsk,isk->ins", a_s, x_s, precision=lax.Precision.HIGHEST)
    sel = jnp.asarray(np.repeat(held, 256, axis=1), jnp.float32)  # [slots, N_pad, k_steps]
    out = jnp.einsum("ins,pns->pin", per_step, sel, precision=lax.Precision.HIGHEST)
    written = stream_k_written(shape[2] // 256, k_steps, stream_k)[:, None, :]
    return jnp.where(written, out, jnp.nan)[:, None].astype(jnp.float32)
  ce = jnp.maximum(chunk_expert, 0)
  kp = xc.shape[1] // splits
  a_s = a_phys[ce].reshape(ce.shape[0], -1, splits, kp)
  x_s = xr.reshape(ce.shape[0], bm, splits, kp)
  out = jnp.einsum("cnsk,cisk->scin", a_s, x_s, precision=lax.Precision.HIGHEST)
  out = out * fac[ce][None, :, None, :]
  return jnp.where((chunk_expert >= 0)[None, :, None, None], out, 0).astype(out_dtype)


def _emulate_grouped_stream_k(a_phys, fac, xr, chunk_expert, total, *, kb: int, n_ctas: int,
                              out_dtype, merge: str = "xla"):
  """`_grouped_stream_k_kernel`'s (out, part) from the decoded weights a_phys [E, N, K]
  (physical K), factors fac [E, N] and chunk windows xr [C, bm, K]: per K step products, a cut
  tile's steps summed per run (merge "kernel": added into out, part NaN)."""
  c, bm, k_pad = xr.shape
  n_pad = a_phys.shape[1]
  tiles, k_steps = n_pad // 256, k_pad // (64 * kb)
  ce = jnp.maximum(chunk_expert, 0)
  steps = grouped_stream_k_steps(total[0], tiles * k_steps, k_steps, n_ctas)
  per_step = jnp.einsum("cnsk,cisk->cins", a_phys[ce].reshape(c, n_pad, k_steps, -1),
                        xr.reshape(c, bm, k_steps, -1), precision=lax.Precision.HIGHEST)
  g = (jnp.arange(c)[:, None] * tiles + jnp.arange(n_pad)[None, :] // 256)  # [C, N] tiles
  first, last = _tile_parts(g, k_steps, steps)
  in_first = lax.div(g[:, :, None] * k_steps + jnp.arange(k_steps), steps) == first[..., None]
  f = fac[ce][:, None, :]
  p0 = jnp.sum(jnp.where(in_first[:, None], per_step, 0), axis=-1) * f  # [C, bm, N]
  p1 = jnp.sum(jnp.where(in_first[:, None], 0, per_step), axis=-1) * f
  used = (jnp.arange(c) < total[0])[:, None]
  cut = (first != last) & used  # [C, N]
  written = used if merge == "kernel" else used & ~cut
  out = jnp.where(written[:, None, :], p0 + p1, jnp.nan).astype(out_dtype)
  if merge == "kernel":
    return out, jnp.full((merger_scratch_size(n_ctas, 4, bm),), jnp.nan, jnp.float32)
  b = jnp.where(cut, last, n_ctas)  # uncut tiles: dropped
  col = jnp.broadcast_to(jnp.arange(n_pad) % 256, (c, n_pad))
  part = jnp.full((2, n_ctas, bm, 256), jnp.nan, jnp.float32)
  for p, val in enumerate((p0, p1)):
    part = part.at[p, b, :, col].set(jnp.swapaxes(val, 1, 2), mode="drop")
  return out, part


def matmul(x: jax.Array, pw: L.PackedWeight, *, out_dtype=jnp.bfloat16, config=None,
           kernel_fn=None):
  """x [..., K] (bf16) @ dense PackedWeight [K, N], rows (prod of lead dims) <= 64.
  config: overrides the kernel's launch (`fp4_chunked_matmul`'s keywords; stream_k 0 turns the
  stream-K schedule off).
  kernel_fn: replaces the Mosaic kernel (tests pass `emulate_chunked_matmul`)."""
  *lead, k = x.shape
  rows = int(np.prod(lead)) if lead else 1
  if rows == 0:
    return jnp.zeros((*lead, pw.n), out_dtype)
  if rows > MAX_DECODE_ROWS:
    raise ValueError(f"kernel handles <= {MAX_DECODE_ROWS} rows, got {rows}")
  bm = pick_bm(rows)
  k_steps = pw.k_pad // (64 * pw.kb)
  tiles = pw.n_pad // 256
  config = dict(config or {})
  cfg = default_config(bm, pw.kb, out_dtype, k_steps=k_steps, n_ctas=tiles, split=True)
  steps = config.pop("stream_k", None)
  if steps is None:
    steps = dense_stream_k(tiles, k_steps, bm)
  if steps:  # float32 slots, the column factor applied after adding them
    cfg = dict(default_config(bm, pw.kb, jnp.float32, k_steps=steps, n_ctas=0, split=False),
               stream_k=steps)
  cfg.update(config)
  part_dtype = jnp.float32 if cfg["splits"] > 1 or steps else out_dtype
  x2 = x.reshape(rows, k).astype(jnp.bfloat16)
  xc = L.permute_k_rows(x2, None, bm, pw.k_pad)
  zero = jnp.zeros((1,), jnp.int32)
  out = (kernel_fn or fp4_chunked_matmul)(
      xc, pw.codes, pw.scales, pw.factor, zero, zero, fmt=pw.fmt, kb=pw.kb, bm=bm,
      out_dtype=part_dtype, dense=True, **cfg)
  part = out[:, 0, :rows, :pw.n]
  if steps:
    written = stream_k_written(tiles, k_steps, steps)[:, None, :pw.n]
    y = jnp.sum(jnp.where(written, part, 0), axis=0) * pw.factor[0, :pw.n]
  else:
    y = jnp.sum(part, axis=0, dtype=part_dtype)
  return y.astype(out_dtype).reshape(*lead, pw.n)


def matmul_as_group(x: jax.Array, pw: L.PackedWeight, *, out_dtype=jnp.bfloat16, config=None,
                    kernel_fn=None):
  """x [..., K] (bf16) @ dense PackedWeight [K, N] for more rows than `matmul` takes: the
  grouped kernel with every row in one group (chunks of bm rows, each decoding the weight
  again; config: `grouped_matmul`'s, default `dense_group_config`)."""
  *lead, k = x.shape
  rows = int(np.prod(lead)) if lead else 1
  if pw.experts:
    raise ValueError(f"a dense weight is needed, got experts {pw.shape}")
  if config is None:
    config = dense_group_config(rows, pw.n_pad // 256, pw.k_pad // (64 * pw.kb))
  y = grouped_matmul(x.reshape(rows, k), pw, jnp.full((1,), rows, jnp.int32),
                     out_dtype=out_dtype, config=config, kernel_fn=kernel_fn)
  return y.reshape(*lead, pw.n)


def dense_group_config(rows: int, n_tiles: int, k_steps: int) -> dict:
  """`matmul_as_group`'s launch: `grouped_parallelism`'s rule with one column tile a CTA and
  every row chunk counted as a group holding rows (the grouped default counts the one group
  once): K split across CTAs the most ways that keep them within one wave of NUM_SMS."""
  chunks = -(-rows // grouped_bm(rows, 1))
  n_inner, splits = grouped_parallelism(chunks, n_tiles, k_steps, n_inner=1)
  return dict(n_inner=n_inner, splits=splits)


def _prefix_sums(gs: jax.Array, bm: int):
  """(ends, ch_first, ch_end, total) of a short vector of group sizes: the groups' inclusive
  row ends, their first and end chunks (exclusive and inclusive prefix sums of
  `chunks_per_group`) and, in every element, the chunks reserved in all: four sibling [E, E]
  reductions of terms made from the sizes alone, one kernel (no scan kernels)."""
  n = gs.shape[0]
  j, i = jnp.arange(n)[None, :], jnp.arange(n)[:, None]
  nch = chunks_per_group(gs, bm)[None, :]
  return (jnp.sum(jnp.where(j <= i, gs[None, :], 0), axis=1, dtype=jnp.int32),
          jnp.sum(jnp.where(j < i, nch, 0), axis=1, dtype=jnp.int32),
          jnp.sum(jnp.where(j <= i, nch, 0), axis=1, dtype=jnp.int32),
          jnp.sum(jnp.where(j < i + n, nch, 0), axis=1, dtype=jnp.int32))  # (all j: a sibling)


def grouped_bm(m: int, e: int) -> int:
  """The grouped kernel's rows per chunk for m rows over e experts: a chunk that holds a group
  of the mean size, a quarter more (the spread of group sizes) and the start's misalignment
  (chunks start on a multiple of 8) in one piece. Wider chunks waste MMA columns, narrower ones
  decode an expert's weights once more per extra chunk. The constants fit these H200 figures
  (30B-A3B experts, kernel us for bm 16/32/64; benchmarks/results/session14_h200_2026-12-01):
  gate+up 2,208 rows (17.3 a group) 135.0/89.7/110.2, 3,072 rows 198.1/167.2/112.5, 4,096 rows
  199.9/164.7/114.6; down 2,208 rows 75.1/-/87.4. With 128 experts it differs from the rule
  before (twice the mean: 64) only at 2,049-2,688 rows."""
  mean = max(1, -(-m // e))
  return pick_bm(mean + mean // 4 + 6)


def chunk_count(m: int, e: int, bm: int) -> int:
  """Chunks the tables hold for m rows over e groups: at least sum_e ceil((size_e + 7) / bm)
  (`chunks_per_group`) for any sizes, and m where that is up to `JOINT_TABLE_SLACK` more, so
  that `chunk_tables` makes the chunk owners and the row slots in one reduction."""
  ne = min(e, m)  # groups that can hold rows
  need = -(-(m + 7 * ne) // bm) + ne
  return m if need < m <= need + JOINT_TABLE_SLACK else need


# Up to this many chunks past the need (`chunk_count`) are added so that the chunk owners and
# the row slots come from one reduction over the same rows (`chunk_tables`). They are empty
# CTAs of the grouped kernel, which exit at once (256 rows over 128 experts, bm 16: 200
# chunks needed, 256 held; 88 empty CTAs before).
JOINT_TABLE_SLACK = NUM_SMS // 2


def chunk_tables(group_sizes: jax.Array, m: int, bm: int, ends: jax.Array | None = None,
                 with_total: bool = False):
  """Cover expert-sorted rows with chunks: windows of bm rows that start on a multiple of 8
  (the activation tile's TMA tiling) at or below the group's first row, stepping by bm until
  past its last row. A window also holds rows of neighbouring groups; they are computed and
  never gathered. Returns (chunk_expert [C] (-1 = unused), chunk_row [C] (window start), slot
  [m]: each row's index in the kernel output's (chunk, row-in-window) order, C*bm for rows past
  the sum). ends: the inclusive prefix sum of group_sizes if the caller has it.

  Group e reserves `chunks_per_group` chunks, a count of its size alone, so two small
  reductions make the tables: the prefix sums (group ends, first and end chunks:
  `_prefix_sums`), then the chunk owners and window starts (`chunk_owners`' terms) beside the
  slots (each row has at most one owning group, and its slot is the owner's term: a min over
  groups of [M, E] terms, so no look-up follows a search). Beside, not after: one reduction
  over C rows where M <= C (`chunk_count` makes C = M where M is a little past the need),
  where the H200 ran four kernels, ~1.2 us each, around a 59 us kernel at 256 rows.
  (`dispatch.route`, which has each row's group, makes the slots without a search.)
  with_total: a 4th table, [E] int32, every element the chunks reserved in all (the grouped
  stream-K kernel's unit count; a sibling of the prefix sums)."""
  gs = group_sizes.astype(jnp.int32)
  prefix = _prefix_sums(gs, bm)
  ends = prefix[0] if ends is None else ends.astype(jnp.int32)
  n_chunks = chunk_count(m, gs.shape[0], bm)
  ce_t, row0_t, off = _owner_terms(jnp.arange(n_chunks, dtype=jnp.int32)[:, None], gs, ends,
                                   *prefix[1:3], bm)
  # the slots' rows: the chunks' where m fits (one reduction with the owners', sliced after)
  r = jnp.arange(max(m, n_chunks), dtype=jnp.int32)[:, None]
  holds = ((ends - gs)[None, :] <= r) & (r < ends[None, :])  # [R, E]: the row's group, if any
  ce, row0 = jnp.max(ce_t, axis=1), jnp.max(row0_t, axis=1)
  slot = jnp.min(jnp.where(holds, r + off[None, :], n_chunks * bm), axis=1)
  # materialize the small tables: fused into the big gathers they would be recomputed per
  # element (measured: 140 us of XLA glue around a 73 us kernel at 256 rows)
  ce, row0, slot = lax.optimization_barrier((ce, row0, slot))
  return (ce, row0, slot[:m]) + ((prefix[3],) if with_total else ())


# The grouped kernel's stream-K schedule (`_grouped_stream_k_kernel`): "auto" (calls of
# GROUPED_STREAM_K_MIN_ROWS to _MAX_ROWS rows, chunks up to STREAM_K_MAX_BM rows), "on"
# (wherever the chunks allow it) or "off". H200, 30B-A3B experts, us a call / kernel,
# stream-K against the chunk schedule (benchmarks/results/session30_h200_2026-12-03):
# gate+up 64 rows 37.2 / 29.4 vs 40.4 / 33.8, 128 rows 47.6 / 39.0 vs 64.1 / 57.0, 256 rows
# 62.2 / 53.4 vs 66.2 / 58.8 (tokamax bf16 190.0 a call); down 128 rows 29.6 / 25.2 vs 37.2 /
# 33.5, 256 rows 37.4 / 32.8 vs 38.2 / 34.4. Past 256 rows every SM has a chunk already and
# the kernel was slower (gate+up 512 rows 65.6 vs 63.2 us, 2,208 rows 83.3 vs 79.2).
GROUPED_STREAM_K = choice_setting("TRACE_JAX_GROUPED_STREAM_K", "auto", ("auto", "on", "off"),
                                  doc="grouped FP4 calls of 32-256 rows as equal runs of work a SM")
GROUPED_STREAM_K_MIN_ROWS, GROUPED_STREAM_K_MAX_ROWS = 32, 256
# Where the two parts of a tile cut by a stream-K run's end are added: "xla" (float32 parts,
# added in the output gather; the default) or "kernel" (in the kernel by the part that
# finishes last, `_cut_tile_merger`: no parts to gather). "kernel" is correct on the H200 and
# slower: us a call, xla / kernel, gate+up 64 rows 37.5 / 42.3, 128 rows 50.2 / 55.6, 256 rows
# 65.2 / 69.1; down 64 rows 23.1 / 26.6, 128 rows 31.0 / 35.7, 256 rows 37.9 / 37.8
# (benchmarks/results/session31_h200_2026-12-04): its kernel lost 3-6 us, more than the XLA
# add's kernel costs (0.5-1.4 us).
GROUPED_STREAM_K_MERGE = choice_setting(
    "TRACE_JAX_GROUPED_STREAM_K_MERGE", "xla", ("xla", "kernel"),
    doc="where grouped stream-K tile parts are added: XLA's gather, or the kernel")


def grouped_stream_k(m: int, bm: int, row_chunks: bool, config: dict) -> bool:
  """Whether a grouped call of m rows in chunks of bm takes the stream-K schedule by default
  (`GROUPED_STREAM_K`): not for row chunks (rows in the caller's order), K splits or chained
  tiles asked for, or chunks of more than STREAM_K_MAX_BM rows (two staging tiles and the
  pipeline's stages do not fit SMEM at 64)."""
  if GROUPED_STREAM_K == "off" or row_chunks or bm > STREAM_K_MAX_BM:
    return False
  if config.get("splits", 1) != 1 or config.get("n_inner") is not None:
    return False
  return GROUPED_STREAM_K == "on" or (
      GROUPED_STREAM_K_MIN_ROWS <= m <= GROUPED_STREAM_K_MAX_ROWS)


def _grouped_stream_k_call(x, pw, group_sizes, m: int, bm: int, k_steps: int, *, out_dtype,
                           config: dict, kernel_fn, rows, out_rows, tables, keep_chunks=False):
  """`grouped_matmul` under the stream-K schedule: tables with the reserved-chunk count, the
  operand as there, the kernel over min(NUM_SMS, tiles) CTAs, `gather_stream_k`."""
  if by_rows(tables):
    raise ValueError("the grouped stream-K schedule needs expert-sorted rows, not row chunks")
  total = tables_total(tables) if tables is not None and tables[0] == bm else None
  if total is not None:
    ce, row0, slot = tables[1:4]
  else:
    ce, row0, slot, total = chunk_tables(group_sizes, m, bm, with_total=True)
  tiles = pw.n_pad // 256
  per_stage = stage_bytes(bm, pw.kb) + 4 * 64 * 4  # and the column factors, a block a step
  fixed = 4 * 64 * bm * (jnp.dtype(out_dtype).itemsize + 4)  # bf16/f32 and f32 staging
  cfg = dict(wgs=4, stages=fit_stages(per_stage, fixed, 4, 1),
             n_ctas=min(NUM_SMS, ce.shape[0] * tiles), merge=GROUPED_STREAM_K_MERGE)
  cfg.update(config)
  if cfg["stages"] < 1:
    raise ValueError(f"the grouped stream-K kernel with {bm}-row chunks does not fit SMEM")
  xc = _operand(x, rows, m, bm, pw)
  out, part = (kernel_fn or fp4_chunked_matmul)(
      xc, pw.codes, pw.scales, pw.factor, ce, row0, fmt=pw.fmt, kb=pw.kb, bm=bm,
      out_dtype=out_dtype, total=total, **cfg)
  if cfg["merge"] == "kernel":
    if keep_chunks and out_rows is None:
      return _chunk_rows(out, slot, pw.n)
    return gather_rows(out[None], slot, out_rows, pw.n, out_dtype)
  return gather_stream_k(out, part, slot, out_rows, total, pw.n, k_steps=k_steps,
                         out_dtype=out_dtype)


def chunks_per_group(group_sizes: jax.Array, bm: int) -> jax.Array:
  """Chunks `chunk_tables` reserves for each group: ceil((size + 7) / bm), 0 for an empty
  group, enough for a window from its first row rounded down to 8 (any of 8 alignments) that
  steps by bm past its last row; the reserved windows that start past the last row are unused.
  A count of the size alone, so the chunk ends are a prefix sum beside the row ends'."""
  if bm & (bm - 1):
    raise ValueError(f"rows per chunk must be a power of two, got {bm}")
  return jnp.where(group_sizes > 0, (group_sizes + 7 + bm - 1) >> (bm.bit_length() - 1), 0)


def _owner_terms(c: jax.Array, group_sizes, ends, ch_first, ch_end, bm: int):
  """[C, E] terms whose max over groups is chunk c's owning group (-1: none; a reserved window
  that starts past its group's last row has none) and its window start (0 where none), and off
  [E]: group e's row r lands at slot r + off[e], its chunk c starts at row c * bm - off[e] (off
  = first chunk * bm - first row rounded down to 8; bm a power of two: nothing divides)."""
  off = ch_first * bm - ((ends - group_sizes) & -8)
  g = jnp.arange(group_sizes.shape[0], dtype=jnp.int32)[None, :]
  start = c * bm - off[None, :]
  owns = (ch_first[None, :] <= c) & (c < ch_end[None, :]) & (start < ends[None, :])
  return jnp.where(owns, g, -1), jnp.where(owns, start, 0), off


def chunk_owners(group_sizes: jax.Array, ends: jax.Array, ch_first: jax.Array, ch_end: jax.Array,
                 m: int, bm: int):
  """(chunk_expert, chunk_row, off) of `chunk_tables` from the groups' row ends and first and
  end chunks (`_prefix_sums`): each chunk's owning group (-1: none) and window start, one kernel
  (two max-reductions over the same [C, E] terms, `_owner_terms`, which XLA fuses as
  siblings); off as there."""
  c = jnp.arange(chunk_count(m, group_sizes.shape[0], bm), dtype=jnp.int32)[:, None]
  ce_t, row0_t, off = _owner_terms(c, group_sizes, ends, ch_first, ch_end, bm)
  return *lax.optimization_barrier((jnp.max(ce_t, axis=1), jnp.max(row0_t, axis=1))), off


def operand_rows(m: int, bm: int) -> int:
  """Rows of a grouped call's activation operand for m rows in chunks of bm: chunks read bm rows
  from their first row on, so pad that the last stays in bounds; TMA: rows % 8."""
  return -(-(m + bm) // 8) * 8


def operand_shape(m: int, pw: L.PackedWeight, tables=None) -> tuple[int, int]:
  """(rows, columns) of the operand `grouped_matmul(x, pw, ..., tables=tables)` lays out for m
  rows (no bm or config given): what a producer writing `L.OperandRows` for it makes."""
  bm = tables[0] if by_rows(tables) else grouped_bm(m, pw.codes.shape[0])
  return operand_rows(m, bm), pw.k_pad


def _operand(x, rows, m: int, bm: int, pw: L.PackedWeight) -> jax.Array:
  """The kernel's activation operand: `permute_k_rows` of x, or x's own data where it arrives
  laid out (`L.OperandRows`, checked against this call's shape)."""
  n_rows = operand_rows(m, bm)
  if isinstance(x, L.OperandRows):
    if rows is not None or x.data.shape != (n_rows, pw.k_pad):
      raise ValueError(f"an operand laid out as {list(x.data.shape)} for a grouped call that "
                       f"takes [{n_rows}, {pw.k_pad}] (m {m}, bm {bm})"
                       + ("" if rows is None else " and no row gather"))
    return x.data
  return L.permute_k_rows(x, rows, n_rows, pw.k_pad)


def grouped_matmul(x: jax.Array | L.OperandRows, pw: L.PackedWeight, group_sizes: jax.Array, *,
                   out_dtype=jnp.bfloat16, bm: int | None = None, config=None,
                   kernel_fn=None, rows: jax.Array | None = None,
                   out_rows: jax.Array | None = None, tables=None, keep_chunks: bool = False):
  """Ragged x [M, K] (bf16, rows sorted by expert) @ expert PackedWeight [E, K, N]; rows past
  sum(group_sizes) give zeros. kernel_fn: as in `matmul`. rows [M]: the sorted rows are
  `x[rows]` (fused into the one gather that lays out the kernel's operand); out_rows: return
  `result[out_rows]` (fused into the output gather). tables: (bm, chunk_expert, chunk_row,
  slot) made for these rows (`dispatch.route`), used when bm is this call's; row-chunk tables
  (`dispatch.row_chunks`: a 5th element; rows in any order) always, with their bm.
  x may arrive laid out (`L.OperandRows`, of `operand_shape`). keep_chunks: return the
  kernel's rows ungathered (`L.ChunkRows`) where they are the result's (one K split, no
  out_rows, no stream-K parts to add)."""
  m = x.m if isinstance(x, L.OperandRows) else x.shape[0] if rows is None else rows.shape[0]
  e = pw.codes.shape[0]
  if m == 0:
    return jnp.zeros((0, pw.n), out_dtype)
  config = dict(config or {})
  bm = config.pop("bm", None) or bm or grouped_bm(m, e)
  if by_rows(tables):
    bm = tables[0]  # row chunks: their windows are made for their bm
  k_steps = pw.k_pad // (64 * pw.kb)
  stream_k = config.pop("stream_k", None)
  if stream_k is None:
    stream_k = grouped_stream_k(m, bm, by_rows(tables), config)
  if stream_k:
    return _grouped_stream_k_call(x, pw, group_sizes, m, bm, k_steps, out_dtype=out_dtype,
                                  config=config, kernel_fn=kernel_fn, rows=rows,
                                  out_rows=out_rows, tables=tables, keep_chunks=keep_chunks)
  n_inner, splits = grouped_parallelism(min(m, e), pw.n_pad // 256, k_steps,
                                        config.pop("n_inner", None), config.pop("splits", None))
  cfg = dict(default_config(bm, pw.kb, out_dtype, k_steps=k_steps, n_ctas=0, split=False,
                            n_inner=n_inner, splits=splits), **config)
  part_dtype = jnp.float32 if cfg["splits"] > 1 else out_dtype
  if tables is not None and tables[0] == bm:
    ce, row0, slot = tables[1:4]
  else:
    ce, row0, slot = chunk_tables(group_sizes, m, bm)
  xc = _operand(x, rows, m, bm, pw)
  out = (kernel_fn or fp4_chunked_matmul)(
      xc, pw.codes, pw.scales, pw.factor, ce, row0, fmt=pw.fmt, kb=pw.kb, bm=bm,
      out_dtype=part_dtype, **cfg)
  if keep_chunks and out_rows is None and out.shape[0] == 1:
    return _chunk_rows(out[0], slot, pw.n)
  return gather_rows(out, slot, out_rows, pw.n, out_dtype)


def _chunk_rows(out, slot, n: int) -> L.ChunkRows:
  """A grouped call's result as its kernel's chunk rows `out [C, bm, N_pad]`, ungathered."""
  c, bm, n_pad = out.shape
  return L.ChunkRows(out.reshape(c * bm, n_pad), slot, n)
