"""Mosaic GPU (Pallas `plgpu`, Hopper sm_90) decode attention over an NVFP4 KV cache: K and V
decoded in registers straight into wgmma operands, the technique of the FP4 matmul kernels.

Owns the kernel body, its inline PTX (the code word decodes, the scale
multipliers, the split merge), the per-call plumbing (q permutation, validity row) and a
`jnp` model of the kernel (`emulate_kernel`) for CPU tests of that plumbing. The result is
defined by `attention_ref.decode_attention_ref`.

Design (one query token per sequence, GQA with 4 KV heads, head_dim 128, G <= 16 query heads
per KV head, padded to the wgmma N side `gp` of 8 or 16 (`query_lanes`); other shapes use
`attention_pallas`):
- a CTA holds 4 compute warpgroups, one per KV head, and a TMA warpgroup
  (`emit_pipeline_warp_specialized`) streaming 64-token tiles of the cache in place
  (`[B, S, KVH, ...]`): codes (64 x 256 B), scale bytes (64 x 32 B), the row scales g (64 x 4
  float32), and a per-call validity row. Two schedules of the tiles over the SMs: stream (the
  default, `mgpu_stream_kernel`): one CTA per SM, the rows' needed tiles laid end to end and cut
  into equal runs (`stream_tables`), each CTA's run one pipeline that crosses rows, finishing a
  row's part at its last tile; splits (`mgpu_decode_kernel`): grid (batch row, split of the
  cache), a split's needed tiles one pipeline. At rollout shapes (cache sized for the longest
  context, the live one shorter) splits launch CTAs that exit at once and leave waves of
  unequal length: on the H200 at B 276, 8k cache, 1536 live, 146.8 us a kernel with splits,
  119.7 with the stream schedule (session 21), 108.3 with 3 stages and no automatic barriers
  (session 22).
- K step, swap-AB: S^T[64 tokens, gp heads] = K (registers) @ q^T (SMEM). A warpgroup loads
  its head's codes as uint32 `[64, 16]` in the wgmma layout: a thread gets rows r, r+8 and
  words (2c, 2c+1), (2c+8, 2c+9) = one 16-element block of each 64-wide head_dim half
  (c = lane % 4). The head_dim permutation `PHYS_TO_LOGICAL` (applied to q outside) makes the
  fragment's column pairs the pairs one `prmt` (sign-replicating) + shift + mask produce from a
  byte pair: E2M1 magnitude to bf16 bits 8..6 and sign to 15 gives `E2M1 * 2**-126`; times the
  block scale multiplier `s * 2**118` (bf16x2, exact from the E4M3 byte via f16 and f32) gives
  `E2M1 * s * 2**-8`, exact in bf16. The row factor `g * 2**8 * softmax_scale` is applied to
  S^T's rows (`_row_scaler`: each thread reads its rows' g from the SMEM tile), so K enters
  the product as `code * s * g` up to float32 rounding.
  Scale bytes: a wgmma-layout load of `[64, 8]` uint32 gives lane c head c's 8 bytes; one
  `shfl` per word brings the warpgroup's head to every lane.
- softmax over tokens (rows): column max / sum across the warpgroup, online over tiles, as
  `exp2` (one `ex2.approx`) of scores that carry log2(e) in their row factor. The running max
  is lazy (`LAZY_TAU`): a tile raises it (cross-warp max, state rescaled) only when one of the
  warpgroup's scores passes it by more than 8, decided by one `bar.red.or` vote
  (`_raise_vote`); otherwise the probabilities are taken against the old max (<= 2**8, so
  nothing overflows; the softmax is invariant to the shift).
- V step: V decoded the same way, stored bf16 to SMEM one head_dim half at a time (the first
  half's product waited before the second half overwrites it: `V_HALVES`); O^T[64 hd, gp] +=
  V^T (SMEM, transposed A) @ P' (SMEM, stored transposed as `[gp, 64 tokens]` so that it can
  share V's 128 B swizzle; `[64, 8]` bf16 rows are too narrow for any swizzle), accumulated onto
  the rescaled O^T in place, with P' = p * g_v * 2**8 (the V row factor varies along the
  contraction, so it rides on the probabilities: rounded to bf16 there).
- instructions per thread and 64-token tile in the loop (SASS, deviceless compile for sm_90a):
  830 with the earlier decode (22 a code word), accurate exp, N 16, a zeroed PV accumulator
  and the wgmma descriptors computed in the loop (H200, B 16 x 8k: 51.4 us kernel); 518 with
  the exact max every tile (38.4 us); 495 on a tile that leaves the lazy max as it is (45 more
  where it rises), 272 of them the nibble decode (17 a word). Caches of "kv_words"
  (`QArray.packing`, the GPU default since session 27: each word's bits placed by
  `e2m1.KV_WORD_PLACES`) take the matmul weights' `WEIGHT_DECODE_ASM`, 13 a word, for the same
  registers (H200, kernel us, nibbles -> kv_words: B 16 x 8k 39.7 -> 38.2, B 64 x 8k 132.9 ->
  121.6, B 64 x 32k 470.8 -> 436.6).
- per part of a row (a split, or a stream CTA's share of the row): unnormalized O^T, running
  max and sum. A row of one part writes its normalized output; otherwise the last part of a
  row to finish merges them all (`_split_merger`: plain global stores, a fence and an atomic
  count, reads from L2) and writes the output in logical head_dim order, then zeroes the count
  again. The stream kernel's counters can come zeroed with the queries from the q/k/v kernel
  (`PhysicalQuery.counts`) instead of XLA's zero fill and copy a call (`GIVEN_COUNTS`).
  (TRACE_JAX_ATTN_MERGE=xla, split schedule: the partials go out and `merge_partials`
  (`attention_pallas.combine_splits`) merges them after the kernel, splits past the live tiles
  masked out: ~5 more small kernels a call, reading every split's partials, live or not.)

Mosaic constraints behind this shape (jax 0.11.2, found by lowering for CUDA on CPU): a
wgmma-layout load of a column block of a 2-D SMEM ref works, of a 3-D strided slice does not
("no transfer pattern that avoids bank conflicts"); a row-vector load of a strided column does
not ("cannot apply swizzle to non-contiguous refs"), hence the row scales are read per thread
through `_row_scaler` (a per-call transposed `[B, KVH, S]` copy, the first design, was 4-7%
slower per call on the H200); wgmma with both operands in SMEM needs equal swizzles, and
swizzles of 16 B are refused (hence P^T); SMEM has room for 3 pipeline stages (~38 KB each)
beside ~80 KB of buffers, 4 with decoded V through SMEM one head_dim half at a time (~48 KB of
buffers: `V_HALVES`, `max_stages`), the default (a third stage paid only once Mosaic's
automatic barriers around SMEM stores were off: `AUTO_BARRIERS`, session 22; the fourth 2-4%,
session 34).

Numerics against the reference (which rounds `code * s * g` to bf16 and the normalized
probabilities to bf16): K's values are exact products times an f32 row factor; the V row factor
is rounded with the probabilities. Relative differences are at bf16 rounding level of K and of
the probabilities, amplified by sharp softmaxes: up to 2.3e-2 of max |ref| seen on the H200 at
8k context with log-normal K row scales (tests allow 3e-2; the Pallas kernel, which rounds K as
the reference does, stays under 2e-2).

Cross-warp reductions (the softmax's column max and sum) go through `_column_reducer` with a
scratch row per warpgroup: Pallas's lowering of `x.max(axis=0)` shares one scratch offset among
all warpgroups of the CTA (a race, found on the H200).

Mosaic imports happen inside the functions: the module imports on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import quant as tq
from trace_jax.kernels import attention_ref as R
from trace_jax.kernels.attention_pallas import combine_splits
from trace_jax.kernels.fp4_mgpu import (DECODE_ASM, WEIGHT_DECODE_ASM, counted_in_last,
                                        mosaic_kernel)
from trace_jax.settings import choice_setting, int_setting
from trace_jax.quant import e2m1

NUM_SMS = 132  # H200
KV_HEADS = 4  # compute warpgroups per CTA: one per KV head
HEAD_DIM = 128
GP_CHOICES = (8, 16)  # the wgmma N sides built: 8 where G <= 8 (30B-A3B's GQA 8)
GP = GP_CHOICES[-1]  # the most query heads per KV head the kernel takes
TILE = 64  # tokens per pipeline step
SLOT_MULTIPLE = 8  # cache lengths the kernel takes (its TMA tiles of cache rows: S = 17 refused)
ROW_SHIFT = 8  # the decoded products carry 2**-8, the row factors 2**8
LOG2E, LN2 = float(np.log2(np.e)), float(np.log(2.0))  # the kernel's softmax runs on exp2
# The running max rises only when a tile's score passes it by more than this (log2 units), so
# the probabilities stay <= 2**8 and most tiles skip the cross-warp max and the rescale.
# TRACE_JAX_ATTN_LAZY_MAX=off: the exact running max every tile (the A/B side).
LAZY_TAU = 8.0 if choice_setting(
    "TRACE_JAX_ATTN_LAZY_MAX", "on", ("on", "off"),
    doc="FP4 decode attention's lazy running max (off: the exact max every tile)") == "on" else None
_MULT_F32 = "0f7A800000"  # 2**118 as a PTX float32 literal
# The split combine: in the kernel, by the last split of a row to finish (`_split_merger`), or
# TRACE_JAX_ATTN_MERGE=xla: as XLA ops after the kernel (the A/B side).
MERGE_IN_KERNEL = choice_setting(
    "TRACE_JAX_ATTN_MERGE", "kernel", ("kernel", "xla"),
    doc="the split schedule's partials merged in the kernel, or by XLA after it") == "kernel"
MERGE_UNROLL = 4  # parts whose partials the merging part loads at once
# TMA pipeline stages, 38 KB each (`max_stages`; fewer where 4 do not fit: 3 with V through SMEM
# whole). Without the automatic barriers a third stage pays (H200, session 22: B 64 x 32k 496.8
# -> 468.4 us a kernel; with them it did not, session 21); with V in halves a fourth (`V_HALVES`).
# TRACE_JAX_ATTN_STAGES: another default (A/B)
STAGES = int_setting(
    "TRACE_JAX_ATTN_STAGES", 4, minimum=1,
    doc="TMA pipeline stages of the FP4 decode attention (fewer where they do not fit)")
# Mosaic brackets each SMEM store of a warpgroup with warpgroup barriers (earlier reads done
# before, the writes done after). These kernels need none of them: their stores (P^T, decoded V)
# are read only by wgmma, after `commit_smem` (a fence and a barrier, always emitted), and are
# overwritten only after their reader, the last tile's PV wgmma (with V in halves, half 1's
# store: half 0's product), has been waited by every warp;
# the cross-warp reductions bring their own barriers; each thread releases a pipeline slot
# itself (mbarrier arrive with release order). Off: 8 -> 4 barriers a tile, kernels 2-3%
# shorter on the H200 (session 22). The split kernel with XLA's merge keeps them (its partials
# go out through an SMEM buffer rewritten after a single thread's TMA wait).
# TRACE_JAX_ATTN_AUTO_BARRIERS=on: back on (A/B)
AUTO_BARRIERS = choice_setting(
    "TRACE_JAX_ATTN_AUTO_BARRIERS", "off", ("on", "off"),
    doc="Mosaic's automatic warpgroup barriers around the FP4 attention's SMEM stores") == "on"


# Decoded V goes through SMEM as the PV products' A operand: "halves" (the default: one head_dim
# half at a time, the first product waited before the second half is stored; 32 KB for the CTA's
# 4 heads, which leaves room for a 4th pipeline stage, `max_stages`) or "whole" (both halves, 64
# KB, 3 stages). H200, kernel us, whole (3 stages) -> halves (4), same run (session 34,
# bench_attention): B 16 x 8k 40.2 -> 39.3, B 64 x 8k 130.3 -> 126.3, B 64 x 32k 470.3 -> 451.2
# (61.0 -> 63.6% of 4.27 TB/s); rollout-shaped (8k cache, L live) B 256 L 1,600 106.7 -> 102.4,
# B 64 L 1,536 32.2 -> 31.4, B 16 L 2,048 17.4 both; the outputs are bit for bit the same.
# (Half 1 decoded after half 0's product is issued, to run under it, was slower: B 64 x 32k
# 450.5 -> 481.8, B 256 L 1,600 102.3 -> 108.2; benchmarks/results/session34_h200_2026-12-04/
# v1_decode_overlap.patch.) TRACE_JAX_ATTN_V_SMEM=whole: the other (A/B)
V_HALVES = choice_setting(
    "TRACE_JAX_ATTN_V_SMEM", "halves", ("whole", "halves"),
    doc="decoded V through SMEM one head_dim half at a time, or whole") == "halves"

# With V in halves: a tile's V code words and scale bytes loaded from SMEM with K's, before the
# S product ("on"), so that the loads' latency runs under the S product and the softmax, or
# after the softmax, where V is decoded ("off", the default). No spills at 96 registers, the
# same instruction count (deviceless SASS), the same outputs. H200, one run a side (session
# 44), kernel us off -> on: B 16 x 8k 37.6 -> 37.5, B 16 x 32k 121.4 -> 119.1, B 64 x 8k
# 121.3 -> 118.6, B 64 x 32k 432.0 -> 424.1; rollout-shaped (8k cache, L live) B 256 L 1,600
# 102.8 -> 104.2, B 64 L 1,536 31.2 -> 31.4: 2% faster over whole caches, 1% slower at the
# rollout's shape, so off until a second run decides. TRACE_JAX_ATTN_PREFETCH_V=on: the A/B side
PREFETCH_V = choice_setting(
    "TRACE_JAX_ATTN_PREFETCH_V", "off", ("off", "on"),
    doc="V's code words and scales loaded from SMEM with K's (opt-in)") == "on"


# The schedule of the tiles over the SMs: "stream" (`mgpu_stream_kernel`: one CTA per SM, each
# a run of (row, tile) units crossing rows) or "splits" (`mgpu_decode_kernel`: a CTA per row and
# split of the cache). Stream: the 48-layer FP4 decode step at 8k capacity 19.93 -> 18.17 ms on
# the H200 (session 21). TRACE_JAX_ATTN_SCHEDULE: the other (A/B runs)
SCHEDULE = choice_setting(
    "TRACE_JAX_ATTN_SCHEDULE", "stream", ("stream", "splits"),
    doc="FP4 decode attention: one CTA per SM streaming across rows, or (row, split)")

# The stream kernel's merge counters: "own" (a semaphore array of the kernel's, which XLA fills
# with zeros and copies for every call: 48 kernels of a 48-layer step's 1,155, deviceless
# census) or "given" (zeroed by the q/k/v kernel that writes the queries, `PhysicalQuery.counts`;
# the kernel leaves them zero: 1,107 kernels). "given" is the default since its H200 tests
# passed (stage s42b, session 43); TRACE_JAX_ATTN_COUNTS=own for the kernel's own
GIVEN_COUNTS = choice_setting(
    "TRACE_JAX_ATTN_COUNTS", "given", ("given", "own"),
    doc="the stream attention's merge counters zeroed by the q/k/v kernel, or its own") == "given"


def default_v_halves(overlap: bool, merge: bool) -> bool:
  """Whether `decode_attention` puts decoded V through SMEM in halves unless told (`V_HALVES`):
  not with overlap, and only with the in-kernel merge (the configuration its GPU tests and
  timings ran; XLA's merge keeps whole V)."""
  return V_HALVES and not overlap and merge


def max_stages(gp: int, merge: bool, v_halves: bool = False) -> int:
  """The most pipeline stages that fit the H200's 227 KB of SMEM beside the kernels' buffers
  (Mosaic's totals, deviceless compiles): with the in-kernel merge 158 KB with 2 stages at gp 8,
  196 KB with 3 (212 at gp 16), 4 do not fit (235 KB); XLA's merge stages the partials through
  SMEM too: 3 stages at gp 16 need 229 KB. With V through SMEM in halves (`V_HALVES`), 32 KB
  less: 4 stages with the in-kernel merge."""
  if v_halves and merge:
    return 4
  return 2 if gp == 16 and not merge else 3


def _phys_to_logical() -> np.ndarray:
  """Logical head_dim element of each physical position (the kernel's K order of q and the row
  order of its output): in each 64 half, physical `8*cg + 2*c + v` holds logical
  `16*c + 4*(cg // 2) + cg % 2 + 2*v`."""
  p = np.arange(64)
  cg, c, v = p // 8, (p % 8) // 2, p % 2
  half = 16 * c + 4 * (cg // 2) + cg % 2 + 2 * v
  return np.concatenate([half, 64 + half])


PHYS_TO_LOGICAL = _phys_to_logical()
# The same permutation as a transposition, for the output: a 64 half's physical position
# 16a + 8b + 2c + v (axes a, b, c, v of sizes 4, 2, 4, 2) holds logical 16c + 4a + 2v + b.
_HALF_AXES, _HALF_TO_LOGICAL = (4, 2, 4, 2), (2, 0, 3, 1)
assert (np.arange(64).reshape(_HALF_AXES).transpose(_HALF_TO_LOGICAL).reshape(64)
        == np.argsort(PHYS_TO_LOGICAL[:64])).all()
# ... and its inverse, for q: logical axes (c, a, v, b) of sizes 4, 4, 2, 2 to physical order
_LOGICAL_AXES = tuple(_HALF_AXES[a] for a in _HALF_TO_LOGICAL)
_LOGICAL_TO_HALF = tuple(int(a) for a in np.argsort(_HALF_TO_LOGICAL))


def to_physical(x: jax.Array) -> jax.Array:
  """`x[..., PHYS_TO_LOGICAL]` for a last axis of 128, as a transposition: XLA fuses it into
  the producer of q, where the gather was a kernel of its own (~3 us a layer in the B 256
  decode step on the H200, session 34's profile); the q/k/v kernel of `qkv_append.py` traces
  it in its body."""
  lead, n = x.shape[:-1], x.ndim  # the (half, c, a, v, b) axes start at n - 1 + 1
  x = x.reshape(*lead, 2, *_LOGICAL_AXES)
  return x.transpose(*range(n), *(n + a for a in _LOGICAL_TO_HALF)).reshape(*lead, HEAD_DIM)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PhysicalQuery:
  """A decode step's queries `[B, H, 128]` already in this kernel's physical head_dim order
  (`to_physical`), H = KVH x G with G one of `GP_CHOICES` (the kernel's query lanes, so no
  padding): what the q/k/v kernel of `qkv_append.py` writes where the decode attention runs
  this kernel, which then reads it as it is. Shaped like the logical q it stands for.

  counts: int32 `[B x KVH]` zeros for the stream kernel's merges (`_split_merger`), made by that
  kernel (or None: the kernel's own, which XLA fills and copies for each call: 47 copies of a
  48-layer step). The kernel leaves them zero, so they are zeros after the call as before it."""
  qp: jax.Array
  counts: jax.Array | None = None

  shape = property(lambda self: self.qp.shape)
  dtype = property(lambda self: self.qp.dtype)
  ndim = property(lambda self: self.qp.ndim)

  def logical(self) -> jax.Array:
    """The queries in logical head_dim order (for any other attention path)."""
    return self.qp[..., np.argsort(PHYS_TO_LOGICAL)]


def cache_supported(fmt_name: str, kv_heads: int, head_dim: int) -> str | None:
  """None if this kernel reads a quantized cache of this format and head shape, else the reason
  it does not (also what `kernels.kv_packing` asks before placing a new cache's words)."""
  if fmt_name != "nvfp4":
    return f"K/V format {fmt_name}, the kernel reads nvfp4"
  if (kv_heads, head_dim) != (KV_HEADS, HEAD_DIM):
    return f"{kv_heads} KV heads x head_dim {head_dim}, the kernel takes 4 x 128"
  return None


def kernel_supported(q, k, v) -> str | None:
  """None if this kernel handles these operands, else the reason it does not."""
  if q.dtype != jnp.bfloat16:
    return f"queries are {q.dtype}, the kernel takes bfloat16"
  if not (isinstance(k, tq.QArray) and isinstance(v, tq.QArray)):
    return "K/V are not quantized"
  for x in (k, v):
    why = cache_supported(x.fmt.name, x.shape[2], x.shape[-1])
    if why:
      return why
  if k.packing != v.packing:
    return f"K codes packed as {k.packing}, V as {v.packing}"
  if q.shape[1] // k.shape[2] > GP:
    return f"more than {GP} query heads per KV head"
  if k.shape[1] % SLOT_MULTIPLE:
    return f"cache length {k.shape[1]} is not a multiple of {SLOT_MULTIPLE}"
  return None


# --------------------------------------------------------------------------- inline PTX

# Scale multipliers of one row: $2, $3 = this lane's scale words (head c = lane % 4, blocks 0-3
# and 4-7); shuffle in the words of this warpgroup's head (tid / 128), take byte c of each
# (block c of head_dim half 0 and half 1), E4M3 -> f16 -> f32 (exact), times 2**118, -> bf16x2.
_SCALE_ASM = """{
.reg .b32 lane, h, src, w0, w1, sel, pk;
.reg .b16 e, junk, f0, f1;
.reg .b32 hh;
.reg .f32 x0, x1;
mov.u32 lane, %laneid;
mov.u32 h, %tid.x;
shr.u32 h, h, 7;
and.b32 src, lane, 0x1c;
or.b32 src, src, h;
shfl.sync.idx.b32 w0, $2, src, 0x1f, 0xffffffff;
shfl.sync.idx.b32 w1, $3, src, 0x1f, 0xffffffff;
and.b32 sel, lane, 3;
shl.b32 pk, sel, 4;
or.b32 sel, sel, pk;
add.u32 sel, sel, 0x40;
prmt.b32 pk, w0, w1, sel;
mov.b32 {e, junk}, pk;
cvt.rn.f16x2.e4m3x2 hh, e;
mov.b32 {f0, f1}, hh;
cvt.f32.f16 x0, f0;
cvt.f32.f16 x1, f1;
mul.f32 x0, x0, """ + _MULT_F32 + """;
mul.f32 x1, x1, """ + _MULT_F32 + """;
cvt.rn.bf16x2.f32 $0, x0, x0;
cvt.rn.bf16x2.f32 $1, x1, x1;
}"""



@functools.cache
def _tile_decoder(stacked: bool = False, placed: bool = False):
  """inline_mgpu function: (codes uint32 [64, 16], scales uint32 [64, 8], both wgmma layout)
  -> the two 64 x 64 halves of head_dim as bf16 wgmma-layout arrays (physical order), or with
  `stacked` one [128, 64] array, half j in rows 64j.. (one SMEM store instead of two: Mosaic
  brackets each store of a warpgroup with barriers). placed: the code words are "kv_words"
  (`e2m1.KV_WORD_PLACES`), decoded by the matmul weights' `WEIGHT_DECODE_ASM` (13
  instructions a word) instead of `DECODE_ASM` (17): the same registers, bit for bit."""
  word_asm = WEIGHT_DECODE_ASM if placed else DECODE_ASM
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm, vector

  half = plgpu.ShapeDtypeStruct((64, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA)
  both = plgpu.ShapeDtypeStruct((128, 64), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                     return_type=both if stacked else (half, half))
  def decode(ctx, codes, scales):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
    cregs, sregs = codes.registers, scales.registers  # [0, group, 0, 0, row, ...] vector<2xi32>
    outs = []
    mults = []
    for ri in range(2):
      sw = sregs[0, 0, 0, 0, ri, 0, 0, 0, 0]
      w0, w1 = vector.extract(sw, [], [0]), vector.extract(sw, [], [1])
      st = llvm.inline_asm(llvm.StructType.get_literal([i32] * 2), [w0, w1], _SCALE_ASM,
                           "=r,=r,r,r", has_side_effects=True)
      mults.append([llvm.extractvalue(i32, st, [j]) for j in range(2)])
    for j in range(2):  # head_dim half
      regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((64, 64)), dtype=object)
      for ri in range(2):
        cw = cregs[0, j, 0, 0, ri, 0, 0, 0, 0]
        for wi in range(2):  # word 2c (block elements 0-7), 2c + 1 (8-15)
          word = vector.extract(cw, [], [wi])
          st = llvm.inline_asm(llvm.StructType.get_literal([i32] * 4), [word, mults[ri][j]],
                               word_asm, "=r,=r,=r,=r,r,r")
          for o in range(4):
            regs[0, 4 * wi + o, 0, 0, ri, 0, 0, 0, 0] = mutils.bitcast(
                llvm.extractvalue(i32, st, [o]), bf16x2)
      outs.append(regs)
    if stacked:  # the WGMMA layout's first register axis is the 64-row block
      return fa.FragmentedArray(_registers=np.concatenate(outs, axis=0),
                                _layout=fa.WGMMA_LAYOUT, _is_signed=None)
    return tuple(fa.FragmentedArray(_registers=r, _layout=fa.WGMMA_LAYOUT, _is_signed=None)
                 for r in outs)

  return decode


def query_lanes(g: int) -> int:
  """The kernel's N side (query heads per KV head, padded) for G query heads per KV head."""
  return next(n for n in GP_CHOICES if g <= n)


@functools.cache
def _column_reducer(op: str, gp: int):
  """inline_mgpu function: (x float32 [64, gp] wgmma layout, scratch float32 [red_elems(gp)]
  SMEM) -> x reduced over its 64 rows (op "max" or "add").

  Pallas's own lowering of `x.max(axis=0)` under warpgroup semantics (jax 0.11.2) puts the
  cross-warp scratch at one SMEM offset for the whole CTA: four compute warpgroups reducing at
  once overwrite each other's partials (seen on the H200: wrong running maxima in warpgroups
  0-2, warpgroup 3 right). Each warpgroup here passes its own scratch row."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                     return_type=plgpu.ShapeDtypeStruct((gp,), jnp.float32,
                                                        layout=plgpu.Layout.WGMMA.reduce(0)))
  def reduce(ctx, x, scratch):
    del ctx
    return x.reduce(op, 0, scratch=scratch)

  return reduce


def red_elems(gp: int) -> int:
  """Scratch floats of one warpgroup's column reduction: 4 warps x 32 lanes x 2 floats per
  output register, one register per 8 columns."""
  return 4 * 32 * 2 * (gp // 8)


@functools.cache
def _row_scaler(factor: float, gp: int):
  """inline_mgpu function: (x float32 [64, gp] wgmma layout, g float32 [64, KV_HEADS] SMEM: a
  tile of the cache's own `[S, KVH]` row scales) -> x with row r times `g[r, warpgroup] *
  factor` (the product rounded to float32 first). Rows come from the layout's own
  `thread_idxs`, so no register order is assumed here."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, memref, vector

  out = plgpu.ShapeDtypeStruct((64, gp), jnp.float32, layout=plgpu.Layout.WGMMA)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()), return_type=out)
  def scale(ctx, x, g_ref):
    del ctx
    f32, i32, index = ir.F32Type.get(), ir.IntegerType.get_signless(32), ir.IndexType.get()
    wg = arith.index_castui(index, arith.divui(mutils.thread_idx(), mutils.c(128, i32)))
    const = mutils.c(float(factor), f32)
    regs = np.empty(x.registers.shape, dtype=object)
    for (row, _), pos in zip(x.layout.thread_idxs(x.shape), np.ndindex(x.registers.shape),
                             strict=True):
      reg = x.registers[pos]
      g = arith.mulf(memref.load(g_ref, [row, wg]), const)
      regs[pos] = arith.mulf(reg, vector.broadcast(reg.type, g))
    return fa.FragmentedArray(_registers=regs, _layout=x.layout, _is_signed=None)

  return scale


@functools.cache
def _raise_vote():
  """inline_mgpu function: (d float32 [64, gp] wgmma layout, flags int32 [KV_HEADS] SMEM) ->
  flags[warpgroup] = 1 if any of the warpgroup's d is > 0, else 0: each thread's maximum, then
  one `bar.red.or.pred` over the warpgroup's 128 threads on its own named barrier (the one
  Mosaic's warpgroup barriers use). Every thread writes the same flag and reads back its own
  write, so no further barrier is needed before the read."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, memref, vector

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
  def vote(ctx, d, flags):
    del ctx
    i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
    mx = None
    for reg in d.registers.flat:
      for j in range(ir.VectorType(reg.type).shape[0]):
        x = vector.extract(reg, [], [j])
        mx = x if mx is None else arith.maximumf(mx, x)
    over = arith.extui(i32, arith.cmpf(arith.CmpFPredicate.OGT, mx, mutils.c(0.0, mx.type)))
    bar = mutils.warpgroup_barrier_idx(sync=False)
    flag = llvm.inline_asm(
        i32, [over, bar],
        "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\nbar.red.or.pred q, $2, 128, p;\n"
        "selp.u32 $0, 1, 0, q;\n}", "=r,r,r", has_side_effects=True)
    wg = arith.index_castui(index, arith.divui(mutils.thread_idx(), mutils.c(128, i32)))
    memref.store(flag, flags, [wg])

  return vote


@functools.cache
def _split_merger(gp: int, heads: int, out_dtype):
  """inline_mgpu function: the combine of a row's parts (splits, or a stream CTA's segments)
  inside the kernel, by the last part to finish. (o0, o1 float32 [64, gp] wgmma layout: this
  warpgroup's unnormalized O^T halves; m, l float32 [gp]: its running max (log2 units) and
  sum; bi, part, n_parts, slot0 int32 scalars: batch row, this part's index among the row's
  n_parts, the partials slot of part 0 (part p's is slot0 + p); refs: part_o / part_ml (the
  partials, float32 [slots, 4, 2, 64, gp] / [slots, 4, 2, gp] in any shape of that order),
  counts (a zeroed int32 counter a row and KV head; the last part zeroes it again), out
  `[B, H, 128]` (logical head_dim order, out_dtype bfloat16 or float32)) -> nothing.

  A row of one part writes O / l from its registers. Otherwise each part stores its partials
  with plain global stores, fences (`fence.acq_rel.gpu`), and one thread of the warpgroup
  counts it in with an atomic add; the part that sees the count reach n_parts - 1 (told to all
  128 threads by `bar.red.or.pred`) reads every part's partials back (`ld.global.cg`: from L2,
  never a stale L1 line) in part order, so the result does not depend on which part came
  last, and merges them online, MERGE_UNROLL parts a round: out = sum w_s O_s / sum w_s l_s
  with w_s = 2**(m_s - max m) (0 where the sum is 0: a row with no visible slot). Query lanes
  past `heads` are not written. The XLA combine this replaces read every split's partials,
  live or not, in ~5 small kernels a layer."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  from jax.experimental.mosaic.gpu import utils as mutils
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm, scf, vector

  out_bits = {jnp.dtype(jnp.bfloat16): 16, jnp.dtype(jnp.float32): 32}[jnp.dtype(out_dtype)]
  wgmma, cols = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
  scalar = plgpu.Layout.WG_SPLAT
  ref = plgpu.RefType()
  nb = gp // 8  # column blocks of 8 query lanes (a thread holds 2 lanes of each)
  assert fa.WGMMA_LAYOUT.registers_shape((64, gp)) == (1, nb, 1, 1, 2, 1, 1, 1, 1)
  assert fa.WGMMA_LAYOUT.reduce((0,)).registers_shape((gp,)) == (nb, 1, 1)

  @plgpu.inline_mgpu(arg_types=(wgmma, wgmma, cols, cols, scalar, scalar, scalar, scalar, ref,
                                ref, ref, ref))
  def merge(ctx, o0, o1, m, l, bi, part, n_parts, slot0, part_o, part_ml, counts, out):
    del ctx
    i32, i64, f32 = (ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64),
                     ir.F32Type.get())
    index = ir.IndexType.get()
    c = lambda v: arith.constant(i32, v)  # noqa: E731
    add, mul = arith.addi, arith.muli
    bi, part, n_parts, slot0 = (x.registers.flat[0] for x in (bi, part, n_parts, slot0))
    tid = mutils.thread_idx()
    wg, t = arith.divui(tid, c(128)), arith.remui(tid, c(128))
    base = lambda r: llvm.ptrtoint(i64, mutils.memref_ptr(r))  # noqa: E731
    o_base, ml_base, cnt_base, out_base = map(base, (part_o, part_ml, counts, out))

    def addr(b64, elems, nbytes):  # i64 address of element `elems` (i32) of a buffer
      return arith.addi(b64, arith.muli(arith.extui(i64, elems), arith.constant(i64, nbytes)))

    def asm(ret, args, text, constraints):
      return llvm.inline_asm(ret, args, text, constraints, has_side_effects=True)

    # this thread's positions: rows (head_dim, physical) and the first of two query lanes
    pos = [tuple(arith.index_cast(i32, v) for v in p)
           for p in o0.layout.thread_idxs(o0.shape)]  # per register, [cb][ri] order
    regs = [[o.registers[0, cb, 0, 0, ri, 0, 0, 0, 0] for cb in range(nb) for ri in range(2)]
            for o in (o0, o1)]
    col_of = [pos[cb * 2][1] for cb in range(nb)]  # a column block's lanes, as m's registers
    mreg = [m.registers[cb, 0, 0] for cb in range(nb)]
    lreg = [l.registers[cb, 0, 0] for cb in range(nb)]
    split = lambda r: [vector.extract(r, [], [e]) for e in range(2)]  # noqa: E731
    slot = lambda s: add(mul(add(slot0, s), c(KV_HEADS)), wg)  # noqa: E731

    def o_elem(s, j, k):  # register k of half j of part s
      row, col = pos[k]
      return add(mul(add(mul(add(mul(slot(s), c(2)), c(j)), c(64)), row), c(gp)), col)

    def ml_elem(s, which, cb):
      return add(mul(add(mul(slot(s), c(2)), c(which)), c(gp)), col_of[cb])

    def load2(a):
      st = asm(llvm.StructType.get_literal([f32, f32]), [a],
               "ld.global.cg.v2.f32 {$0, $1}, [$2];", "=f,=f,l")
      return [llvm.extractvalue(f32, st, [e]) for e in range(2)]

    def store2(a, xy, pred):
      asm(llvm.StructType.get_literal([]), [a, *xy, pred],
          "{\n.reg .pred p;\nsetp.ne.u32 p, $3, 0;\n@p st.global.v2.f32 [$0], {$1, $2};\n}",
          "l,f,f,r")

    def write_out(o_vals, l_vals):  # o_vals[j][k] / l_vals[cb]: 2 lanes each
      for cb in range(nb):
        for e in range(2):
          den = l_vals[cb][e]
          pos_den = arith.cmpf(arith.CmpFPredicate.OGT, den, arith.constant(f32, 0.0))
          inv = arith.select(pos_den, arith.divf(arith.constant(f32, 1.0), den),
                             arith.constant(f32, 0.0))
          lane = add(col_of[cb], c(e))
          ok = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.ult, lane, c(heads)))
          head = add(mul(wg, c(heads)), lane)
          for j in range(2):
            for ri in range(2):
              k = cb * 2 + ri
              r = pos[k][0]  # physical 16a + 8b + 2c + v holds logical 16c + 4a + 2v + b
              bits = lambda sh, mk: arith.andi(arith.shrui(r, c(sh)), c(mk))  # noqa: E731
              logical = add(add(mul(bits(1, 3), c(16)), mul(bits(4, 3), c(4))),
                            add(mul(bits(0, 1), c(2)), bits(3, 1)))
              elem = add(mul(add(mul(bi, c(4 * heads)), head), c(HEAD_DIM)),
                         add(c(64 * j), logical))
              val = arith.mulf(o_vals[j][k][e], inv)
              if out_bits == 16:
                asm(llvm.StructType.get_literal([]), [addr(out_base, elem, 2), val, ok],
                    "{\n.reg .pred p;\n.reg .b16 h;\nsetp.ne.u32 p, $2, 0;\n"
                    "cvt.rn.bf16.f32 h, $1;\n@p st.global.b16 [$0], h;\n}", "l,f,r")
              else:
                asm(llvm.StructType.get_literal([]), [addr(out_base, elem, 4), val, ok],
                    "{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n@p st.global.f32 [$0], $1;\n}",
                    "l,f,r")

    def ex2(x):
      return asm(f32, [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")

    def merge_from_memory():
      # One online pass over the parts, MERGE_UNROLL at a time, so that a group's loads
      # are in flight together (each round waits on L2 once): per lane, M the running max,
      # the sums rescaled by 2**(M_old - M) as it rises. Parts past n_parts (the last group's
      # tail) load part n_parts - 1 again and weigh 0.
      zero, neg = arith.constant(f32, 0.0), arith.constant(f32, R.NEG)
      n_o = 2 * len(pos) * 2  # halves x registers x 2 lanes
      # acc: the sums l (lane 2 cb + e), then O (half j, register k = 2 cb + ri, lane e)
      lane_of = list(range(2 * nb)) + [2 * (k // 2) + e for j in range(2)
                                       for k in range(len(pos)) for e in range(2)]
      lo, hi, step = (arith.index_cast(index, v) for v in (c(0), n_parts, c(MERGE_UNROLL)))
      loop = scf.ForOp(lo, hi, step, [neg] * (2 * nb) + [zero] * (2 * nb + n_o))
      with ir.InsertionPoint(loop.body):
        s0 = arith.index_cast(i32, loop.induction_variable)
        carried = list(loop.inner_iter_args)
        big_m, acc = carried[:2 * nb], carried[2 * nb:]
        group = []
        for u in range(MERGE_UNROLL):
          s = add(s0, c(u))
          valid = arith.cmpi(arith.CmpIPredicate.slt, s, n_parts)
          s = arith.minsi(s, arith.subi(n_parts, c(1)))
          ms, ls = [], []
          for cb in range(nb):
            ms += load2(addr(ml_base, ml_elem(s, 0, cb), 4))
            ls += load2(addr(ml_base, ml_elem(s, 1, cb), 4))
          os_ = [load2(addr(o_base, o_elem(s, j, k), 4))
                 for j in range(2) for k in range(len(pos))]
          group.append((valid, [arith.select(valid, x, neg) for x in ms], ls, os_))
        new_m = list(big_m)
        for _, ms, _, _ in group:
          new_m = [arith.maximumf(a, x) for a, x in zip(new_m, ms)]
        scale = [ex2(arith.subf(a, x)) for a, x in zip(big_m, new_m)]  # per lane
        acc = [arith.mulf(a, scale[lane_of[i]]) for i, a in enumerate(acc)]
        for valid, ms, ls, os_ in group:
          w = [arith.select(valid, ex2(arith.subf(x, mm)), zero) for x, mm in zip(ms, new_m)]
          vals = ls + [x for pair in os_ for x in pair]  # acc's order
          acc = [arith.addf(a, arith.mulf(w[lane_of[i]], x))
                 for i, (a, x) in enumerate(zip(acc, vals, strict=True))]
        scf.yield_(new_m + acc)
      res = list(loop.results)[2 * nb:]
      l_vals = [res[2 * cb:2 * cb + 2] for cb in range(nb)]
      o_flat = res[2 * nb:]
      o_vals = [[o_flat[(j * len(pos) + k) * 2:(j * len(pos) + k) * 2 + 2]
                 for k in range(len(pos))] for j in range(2)]
      write_out(o_vals, l_vals)

    multi = arith.cmpi(arith.CmpIPredicate.sgt, n_parts, c(1))
    branch = scf.IfOp(multi, [], has_else=True)
    with ir.InsertionPoint(branch.then_block):
      for j in range(2):
        for k, reg in enumerate(regs[j]):
          store2(addr(o_base, o_elem(part, j, k), 4), split(reg), c(1))
      first_row = arith.extui(i32, arith.cmpi(arith.CmpIPredicate.eq, pos[0][0], c(0)))
      for cb in range(nb):  # the lanes' max and sum: once, by the threads holding row 0
        store2(addr(ml_base, ml_elem(part, 0, cb), 4), split(mreg[cb]), first_row)
        store2(addr(ml_base, ml_elem(part, 1, cb), 4), split(lreg[cb]), first_row)
      count_addr = addr(cnt_base, add(mul(bi, c(KV_HEADS)), wg), 4)
      last = counted_in_last(t, count_addr, arith.subi(n_parts, c(1)))
      is_last = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ne, last, c(0)))
      with ir.InsertionPoint(is_last.then_block):
        merge_from_memory()
        # every part has counted in: the count back to 0 leaves the counters as they came
        asm(llvm.StructType.get_literal([]), [count_addr, arith.extui(
            i32, arith.cmpi(arith.CmpIPredicate.eq, t, c(0)))],
            "{\n.reg .pred p;\nsetp.ne.u32 p, $1, 0;\n@p st.global.u32 [$0], 0;\n}", "l,r")
        scf.yield_([])
      scf.yield_([])
    with ir.InsertionPoint(branch.else_block):
      write_out([[split(r) for r in regs[j]] for j in range(2)], [split(r) for r in lreg])
      scf.yield_([])

  return merge


# --------------------------------------------------------------------------- the kernel

def _bf16_smem(shape, swizzle: int):
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return plgpu.SMEM(shape, jnp.bfloat16, transforms=(
      plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)))


def _tile_step(gp: int, k_factor: float, v_factor: float, lazy_tau: float | None,
               overlap: bool, placed: bool = False, v_halves: bool = False,
               prefetch_v: bool = False):
  """The kernels' work on one 64-token tile, shared by both schedules: (wg, q [gp, 128] SMEM
  ref of this warpgroup's queries, the pipeline slot's tile refs, scratch refs, state) ->
  state (m [gp] running max in log2 units, l [64, gp] per-thread partial sums, o0 / o1
  [64, gp] unnormalized O^T halves). v_halves: V goes through SMEM one head_dim half at a
  time (`V_HALVES`); prefetch_v: with v_halves, V's words and scales loaded with K's
  (`PREFETCH_V`)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax import lax

  wgmma_layout = plgpu.Layout.WGMMA
  decode, decode_stacked = _tile_decoder(placed=placed), _tile_decoder(True, placed)
  col_max = _column_reducer("max", gp)
  raise_vote = _raise_vote()

  def step(wg, q, kc_s, vc_s, ks_s, vs_s, kg_s, vg_s, vf_s, v_smem, p_smem, red_smem,
           vote_smem, carry):
    m, l, o0, o1 = carry
    valid = plgpu.load(vf_s, (), layout=wgmma_layout.reduce(1))
    k0, k1 = decode(plgpu.load(kc_s.at[:, pl.ds(16 * wg, 16)], (), layout=wgmma_layout),
                    plgpu.load(ks_s, (), layout=wgmma_layout))

    def v_operands():
      return (plgpu.load(vc_s.at[:, pl.ds(16 * wg, 16)], (), layout=wgmma_layout),
              plgpu.load(vs_s, (), layout=wgmma_layout))

    if prefetch_v and v_halves:  # loaded now, decoded after the softmax
      early = v_operands()
      v_operands = lambda: early  # noqa: E731

    def decode_v():  # V to SMEM (the last tile's PV wgmma, its reader, has completed)
      v_smem[wg] = decode_stacked(*v_operands())

    def s_scope(acc):
      plgpu.wgmma(acc, k0, q.at[:, pl.ds(0, 64)].T)
      plgpu.wgmma(acc, k1, q.at[:, pl.ds(64, 64)].T)
      if overlap:
        decode_v()
      plgpu.wgmma_wait(0)
      return acc[...]

    s = pl.run_scoped(s_scope, plgpu.ACC((64, gp), jnp.float32))
    s = _row_scaler(k_factor, gp)(s, kg_s)
    s = s + ((valid - 1.0) * 1e30)[:, None]

    def raise_max(args):  # the online softmax's step: the exact running max, state rescaled
      m, l, o0, o1 = args
      m_new = jnp.maximum(m, col_max(s, red_smem.at[wg]))
      corr = jnp.exp2(m - m_new)
      return m_new, l * corr[None, :], o0 * corr[None, :], o1 * corr[None, :]

    if lazy_tau is None:
      m, l, o0, o1 = raise_max((m, l, o0, o1))
    else:  # only when a score passes the running max by more than lazy_tau (see docstring)
      raise_vote(s - (m + lazy_tau)[None, :], vote_smem)
      m, l, o0, o1 = lax.cond(vote_smem[wg] != 0, raise_max, lambda a: a, (m, l, o0, o1))
    # scores in log2 units. Hidden slots carry -1e30, so their p is 0 once a visible slot has
    # set m; before that (m still -1e30: hidden tiles first) s - m is 0 there and p 1, and
    # that start is wiped by the first visible tile's corr = exp2(-1e30 - m) = 0 (or, in a
    # part that sees none, its m of -1e30 drops it from the combine)
    p = jnp.exp2(s - m[None, :])
    l = l + p
    p_smem.at[wg].T[...] = _row_scaler(v_factor, gp)(p, vg_s).astype(jnp.bfloat16)
    if v_halves:  # half 0 to SMEM; half 1 waits in registers for the first product's end
      v0, v1 = decode(*v_operands())
      v_smem[wg] = v0
    elif not overlap:
      decode_v()
    plgpu.commit_smem()

    def o_scope(accs):
      if v_halves:
        plgpu.wgmma(accs[0], v_smem.at[wg].T, p_smem.at[wg].T)
        plgpu.wgmma_wait(0)  # its reader done: every warp of the warpgroup waited
        v_smem[wg] = v1
        plgpu.commit_smem()
        plgpu.wgmma(accs[1], v_smem.at[wg].T, p_smem.at[wg].T)
        return
      plgpu.wgmma(accs[0], v_smem.at[wg, pl.ds(0, 64)].T, p_smem.at[wg].T)
      plgpu.wgmma(accs[1], v_smem.at[wg, pl.ds(64, 64)].T, p_smem.at[wg].T)

    # the wgmmas accumulate onto the (rescaled) output in place (a zeroed accumulator and an
    # add after it cost 16 more instructions a tile)
    o0, o1 = pl.run_state(o_scope)((plgpu.ACC.init(o0), plgpu.ACC.init(o1)))
    return m, l, o0, o1

  return step


def _initial_state(gp: int):
  import jax.experimental.pallas.mosaic_gpu as plgpu
  wgmma_layout = plgpu.Layout.WGMMA
  zeros = plgpu.layout_cast(jnp.zeros((64, gp), jnp.float32), wgmma_layout)
  return (plgpu.layout_cast(jnp.full((gp,), R.NEG, jnp.float32), wgmma_layout.reduce(0)),
          zeros, zeros, zeros)


def _scratch(gp: int, v_halves: bool = False):
  """SMEM beside the pipeline's buffers: queries and their TMA barriers, decoded V (both
  head_dim halves, or one: `V_HALVES`), P^T, reduction rows, vote flags."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return dict(
      q_smem=_bf16_smem((KV_HEADS, gp, HEAD_DIM), 128),
      q_bar=plgpu.Barrier(num_arrivals=1, num_barriers=KV_HEADS),
      # [head_dim half x 64 tokens, 64]
      v_smem=_bf16_smem((KV_HEADS, 64 if v_halves else 128, 64), 128),
      p_smem=_bf16_smem((KV_HEADS, gp, 64), 128),  # P^T: V's swizzle, which wgmma needs
      red_smem=plgpu.SMEM((KV_HEADS, red_elems(gp)), jnp.float32),  # per warpgroup
      vote_smem=plgpu.SMEM((KV_HEADS,), jnp.int32))  # `_raise_vote`'s flags


def _compiler_params(auto_barriers: bool):
  import jax.experimental.pallas.mosaic_gpu as plgpu
  # approx_math: exp2 as one `ex2.approx.ftz` (relative error ~2**-22; the probabilities are
  # rounded to bf16 next) instead of the ~8-instruction accurate exp
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                              approx_math=True, unsafe_no_auto_barriers=not auto_barriers)


@functools.partial(jax.jit, static_argnames=("split_tiles", "n_splits", "stages", "k_factor",
                                             "v_factor", "overlap", "lazy_tau", "heads",
                                             "out_dtype", "placed", "v_halves",
                                             "prefetch_v"))
def mgpu_decode_kernel(kt, qp, kc, vc, ks, vs, kg, vg, vf, *, split_tiles: int, n_splits: int,
                       k_factor: float, v_factor: float, stages: int = 2,
                       overlap: bool = False, lazy_tau: float | None = LAZY_TAU,
                       heads: int | None = None, out_dtype=jnp.bfloat16, placed: bool = False,
                       v_halves: bool = False, prefetch_v: bool = False):
  """The raw kernel, split schedule: CTA (row, split) runs tiles [split * split_tiles, ...) of
  its row. kt int32 [B]: 64-token tiles each row needs (through its last visible slot; later
  tiles are neither computed nor loaded: the pipeline's grid is dynamic). qp bf16
  [B, 4, gp, 128] (head_dim physical; gp the wgmma N side, 8 or 16: `query_lanes`); kc/vc
  uint32 [B, S, 64] (codes of the 4 heads; `placed`: "kv_words"); ks/vs uint32 [B, S, 8]
  (scale bytes); kg/vg float32 [B, S, 4] (the cache's own row scales g, read in place), times
  k_factor / v_factor in the kernel (2**8, K's also times the softmax scale and log2(e): the
  softmax is `exp2` of scores in log2 units, and the returned maxima are in those units); vf
  float32 [B, S_pad] (1: slot visible, 0 not).
  The softmax denominator stays a per-thread [64, gp] partial (rescaled with the output) and is
  reduced across warps once per split, so a tile has one cross-warp reduction (the max), not
  two: 5-7% faster on the H200 than a reduction per tile (B 16/64 x S 8k/32k, 2026-11-30).
  overlap: decode V and store it to SMEM while the S wgmma runs (between its issue and its
  wait) instead of after the softmax. ptxas keeps an in-flight wgmma's register operands
  intact (it serializes the wgmmas where it cannot). No faster on the H200 (session 12: 54.8 vs
  54.6 us at B 16 x 8k), so off; kept as a tested variant.
  lazy_tau: the running max's slack in log2 units (module docstring), None: exact every tile.
  Returns (o float32 [B, n_splits, 4, 2, 64, gp]: unnormalized O^T per head_dim half,
  ml float32 [B, n_splits, 4, 2, gp]: running max (log2 units) and sum). A split s > 0 with
  s * split_tiles >= kt is neither run nor written: its partials are undefined (see
  `live_splits`). heads (query heads per KV head, <= gp): merge the splits in the kernel
  (`_split_merger`) and return a third output, the attention `[B, 4 * heads, 128]` in
  out_dtype (bfloat16 or float32), logical head_dim order; the partials are then its scratch
  (written only where a row has more than one live split). v_halves: decoded V through SMEM
  one head_dim half at a time (`V_HALVES`; not with overlap)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax import lax
  from trace_jax.kernels.fp4_mgpu import _patch_register_pool
  _patch_register_pool()

  b = qp.shape[0]
  gp = qp.shape[2]  # the N side: query heads per KV head, padded (`query_lanes`)
  col_sum = _column_reducer("add", gp)
  if v_halves and overlap:
    raise ValueError("V through SMEM in halves takes no overlap")
  step = _tile_step(gp, k_factor, v_factor, lazy_tau, overlap, placed, v_halves, prefetch_v)
  if heads is not None:
    merger = _split_merger(gp, heads, jnp.dtype(out_dtype))

  def decode_attention_mosaic(kt_gmem, q_gmem, kc_gmem, vc_gmem, ks_gmem, vs_gmem, kg_gmem,
                              vg_gmem, vf_gmem, o_gmem, ml_gmem, *merged, q_smem, v_smem,
                              p_smem, red_smem, vote_smem, q_bar, o_smem=None, ml_smem=None):
    # (the function's name is the kernel's name in profiles)
    out_gmem = merged[0] if merged else None
    counts = None if heads is None else pl.get_global(
        plgpu.SemaphoreType.REGULAR((b * KV_HEADS,)))  # zeroed for each call
    bi = lax.axis_index("b")
    si = lax.axis_index("s")
    t0 = si * split_tiles
    need = kt_gmem[bi]  # tiles this row needs
    # splits that start before the row's last needed tile, and split 0 (`live_splits`)
    n_live = jnp.maximum((need + split_tiles - 1) // split_tiles, 1)

    # the warpgroup index, taken once before the pipeline's loop: read inside each step (a
    # warp shuffle) it kept every wgmma descriptor's arithmetic in the loop (~70 uniform-datapath
    # instructions a tile in the SASS)
    hoisted = {}

    def compute_context(eval_pipeline):
      wg = hoisted["wg"] = lax.axis_index("wg")
      plgpu.copy_gmem_to_smem(q_gmem.at[bi, wg], q_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      m, l, o0, o1 = eval_pipeline(_initial_state(gp))
      l = col_sum(l, red_smem.at[wg])  # the per-thread partial sums, once
      if heads is not None:
        merger(o0, o1, m, l, bi, si, n_live, bi * n_splits, o_gmem, ml_gmem, counts, out_gmem)
        return
      ml_smem[wg, 0] = m
      ml_smem[wg, 1] = l
      for j, o in enumerate((o0, o1)):  # one [64, gp] buffer per warpgroup: SMEM for stages
        o_smem[wg] = o
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_gmem.at[bi, si, wg, j])
        if j == 0:
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      plgpu.copy_smem_to_gmem(ml_smem.at[wg], ml_gmem.at[bi, si, wg])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def body(idx, kc_s, vc_s, ks_s, vs_s, kg_s, vg_s, vf_s, carry):
      del idx
      wg = hoisted["wg"]
      return step(wg, q_smem.at[wg], kc_s, vc_s, ks_s, vs_s, kg_s, vg_s, vf_s, v_smem, p_smem,
                  red_smem, vote_smem, carry)

    row = lambda i: (t0 + i, 0)  # noqa: E731
    # the split's needed tiles only: a dynamic grid (a static one over split_tiles made the
    # row's last live split wait for an (L2) load of each tile past the row's end)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(jnp.clip(need - t0, 0, split_tiles),), memory_registers=40,
        in_specs=[plgpu.BlockSpec((TILE, 64), row), plgpu.BlockSpec((TILE, 64), row),
                  plgpu.BlockSpec((TILE, 8), row), plgpu.BlockSpec((TILE, 8), row),
                  plgpu.BlockSpec((TILE, KV_HEADS), row), plgpu.BlockSpec((TILE, KV_HEADS), row),
                  plgpu.BlockSpec((TILE,), lambda i: (t0 + i,))],
        wg_axis="wg", num_compute_wgs=KV_HEADS, max_concurrent_steps=stages,
        compute_context=compute_context)

    # A split that starts at or past the row's last needed tile runs nothing and writes
    # nothing (the wrapper masks its partials): at rollout shapes the cache is sized for the
    # longest context while the live one is short. Split 0 always runs: a row without visible
    # slots gets its zero state from it.
    @pl.when(si < n_live)
    def _():
      pipeline(kc_gmem.at[bi], vc_gmem.at[bi], ks_gmem.at[bi], vs_gmem.at[bi], kg_gmem.at[bi],
               vg_gmem.at[bi], vf_gmem.at[bi])

  out_type = (jax.ShapeDtypeStruct((b, n_splits, KV_HEADS, 2, 64, gp), jnp.float32),
              jax.ShapeDtypeStruct((b, n_splits, KV_HEADS, 2, gp), jnp.float32))
  if heads is not None:
    out_type += (jax.ShapeDtypeStruct((b, KV_HEADS * heads, HEAD_DIM), out_dtype),)
  scratch = _scratch(gp, v_halves)
  if heads is None:  # the partials' staging for TMA stores, only where XLA merges them (the
    # in-kernel merge stores from registers): 8 KB at gp 8
    scratch.update(o_smem=plgpu.SMEM((KV_HEADS, 64, gp), jnp.float32),
                   ml_smem=plgpu.SMEM((KV_HEADS, 2, gp), jnp.float32))
  return mosaic_kernel(
      decode_attention_mosaic, out_type=out_type, grid=(b, n_splits), grid_names=("b", "s"),
      num_threads=KV_HEADS + 1, thread_name="wg",
      compiler_params=_compiler_params(AUTO_BARRIERS or heads is None), scratch_types=scratch,
  )(kt, qp, kc, vc, ks, vs, kg, vg, vf)


# Stream schedule: unit entries pack (row, tile, flags) into an int32
_UNIT_ROW_SHIFT, _UNIT_TILE_SHIFT, _UNIT_TILE_MASK = 13, 2, (1 << 11) - 1
_UNIT_LAST, _UNIT_EMPTY = 2, 1
MAX_STREAM_TILES = _UNIT_TILE_MASK + 1  # 131,072 slots


def _unit_row_tile(e):
  """A unit entry's (row, tile), for the kernel's scalars and the model's arrays alike."""
  return e >> _UNIT_ROW_SHIFT, (e >> _UNIT_TILE_SHIFT) & _UNIT_TILE_MASK


def stream_tables(kt, s_tiles: int, n_ctas: int):
  """The stream schedule's work tables (XLA, a few small fusions a call, the same for every
  layer): each row's needed tiles (`kt`; a row without visible slots one empty unit) laid end
  to end, row after row, and cut into n_ctas runs of q = ceil(units / n_ctas) (the last runs
  shorter or empty), so every CTA streams about the same number of tiles whatever the rows'
  lengths. Returns (units int32 [n_ctas, W]: column 0 the CTA's unit count, then its units,
  `(row << 13) | (tile << 2) | (last tile of the row << 1) | (empty)`; rows int32 [B]:
  `first CTA of the row << 8 | CTAs that hold part of it`). A row's parts are consecutive
  CTAs; part (row r, CTA c) has partials slot r + c (unique: rows and CTAs both advance)."""
  b = kt.shape[0]
  # the packings' ranges: a part count and first CTA in 8 bits, rows in the entry's 18
  assert n_ctas < 256 and b < 1 << (31 - _UNIT_ROW_SHIFT), (n_ctas, b)
  assert s_tiles <= MAX_STREAM_TILES, s_tiles
  units = jnp.maximum(kt, 1)
  # sums and counts as masked reductions, not cumsum and searchsorted: 5 small XLA kernels
  # where those made 8 (launches dominate at these sizes); cumsum and a binary search where
  # the compares (rows x rows, units x rows) would pass 2**24
  ar = jnp.arange(b)
  end = (jnp.sum(jnp.where(ar[None, :] <= ar[:, None], units[None, :], 0), axis=1)
         if b * b <= 1 << 24 else jnp.cumsum(units))
  total = end[-1]
  start = end - units
  q = (total + n_ctas - 1) // n_ctas
  lo = jnp.minimum(jnp.arange(n_ctas) * q, total)
  count = jnp.minimum(lo + q, total) - lo
  max_u = -(-b * max(s_tiles, 1) // n_ctas)  # >= q
  width = -(-(max_u + 1) // 4) * 4  # 16-byte rows
  u = jnp.minimum(lo[:, None] + jnp.arange(width - 1)[None, :], total - 1)
  if n_ctas * (width - 1) * b <= 1 << 24:
    r = jnp.sum(end[None, None, :] <= u[:, :, None], axis=-1, dtype=jnp.int32)  # rows ending <= u
  else:
    r = jnp.searchsorted(end, u, side="right", method="scan_unrolled").astype(jnp.int32)
  t = u - start[r]
  entry = ((r << _UNIT_ROW_SHIFT) | (t << _UNIT_TILE_SHIFT)
           | jnp.where(t == units[r] - 1, _UNIT_LAST, 0) | jnp.where(kt[r] == 0, _UNIT_EMPTY, 0))
  table = jnp.concatenate([count[:, None], entry], axis=1).astype(jnp.int32)
  first, last = start // q, (end - 1) // q
  return table, ((first << 8) | (last - first + 1)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("stages", "k_factor", "v_factor", "lazy_tau",
                                             "heads", "out_dtype", "placed", "v_halves",
                                             "prefetch_v"))
def mgpu_stream_kernel(units, rows, qp, kc, vc, ks, vs, kg, vg, vf, counts=None, *,
                       k_factor: float, v_factor: float, heads: int, stages: int = 2,
                       lazy_tau: float | None = LAZY_TAU, out_dtype=jnp.bfloat16,
                       placed: bool = False, v_halves: bool = False, prefetch_v: bool = False):
  """The raw kernel, stream schedule: one CTA per SM (`units.shape[0]`), each streaming its run
  of (row, tile) units from `stream_tables` through one pipeline (a dynamic grid of the run's
  length), crossing rows: at a row's last tile or the run's end the warpgroups finish the
  part (`_split_merger`: written out, or counted in and merged by the row's last part) and
  start the next row's state, its queries fetched (TMA) while the part is merged. No CTA is
  launched for splits past a row's live tiles, and the tiles spread evenly over the SMs
  whatever the rows' lengths. Operands as `mgpu_decode_kernel`, and counts (int32 [B x 4]
  zeros, `PhysicalQuery.counts`: the merges' counters, zeros again after the call; None: a
  semaphore array of the kernel's own, which XLA zero-fills for each call); returns (o float32
  [B + n_ctas, 4, 2, 64, gp], ml float32 [B + n_ctas, 4, 2, gp]: the parts' partials,
  scratch; the attention [B, 4 * heads, 128] in out_dtype, logical head_dim order)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax import lax
  from trace_jax.kernels.fp4_mgpu import _patch_register_pool
  _patch_register_pool()

  b, n_ctas = rows.shape[0], units.shape[0]
  gp = qp.shape[2]
  col_sum = _column_reducer("add", gp)
  step = _tile_step(gp, k_factor, v_factor, lazy_tau, False, placed, v_halves, prefetch_v)
  merger = _split_merger(gp, heads, jnp.dtype(out_dtype))

  given = () if counts is None else (counts,)

  def decode_attention_stream(units_gmem, rows_gmem, q_gmem, kc_gmem, vc_gmem, ks_gmem,
                              vs_gmem, kg_gmem, vg_gmem, vf_gmem, *refs, q_smem, v_smem, p_smem,
                              red_smem, vote_smem, q_bar):
    if given:  # an input the merges count into in place (zeros in, zeros out)
      counts, o_gmem, ml_gmem, out_gmem = refs
    else:  # zeroed each call
      counts = pl.get_global(plgpu.SemaphoreType.REGULAR((b * KV_HEADS,)))
      o_gmem, ml_gmem, out_gmem = refs
    ci = lax.axis_index("c")
    n = units_gmem[ci, 0]
    entry = lambda i: units_gmem[ci, 1 + i]  # noqa: E731  (an L1 hit but once a 128 B line)
    hoisted = {}

    def fetch_q(r):
      wg = hoisted["wg"]
      plgpu.copy_gmem_to_smem(q_gmem.at[r, wg], q_smem.at[wg], q_bar.at[wg])

    def compute_context(eval_pipeline):
      hoisted["wg"] = wg = lax.axis_index("wg")

      @pl.when(n > 0)
      def _():
        fetch_q(_unit_row_tile(entry(0))[0])
        plgpu.barrier_wait(q_bar.at[wg])

      eval_pipeline(_initial_state(gp))

    def body(idx, kc_s, vc_s, ks_s, vs_s, kg_s, vg_s, vf_s, carry):
      wg = hoisted["wg"]
      e = entry(idx[0])
      carry = lax.cond(
          (e & _UNIT_EMPTY) == 0,
          lambda c: step(wg, q_smem.at[wg], kc_s, vc_s, ks_s, vs_s, kg_s, vg_s, vf_s, v_smem,
                         p_smem, red_smem, vote_smem, c),
          lambda c: c, carry)

      def finish(state):  # the part ends: out or into the row's merge; the next row starts
        m, l, o0, o1 = state
        r = _unit_row_tile(e)[0]
        more = idx[0] < n - 1
        # the next row's queries (this part's last S wgmma, their reader, has completed)
        pl.when(more)(lambda: fetch_q(r + 1))
        l = col_sum(l, red_smem.at[wg])
        info = rows_gmem[r]
        first = info >> 8
        merger(o0, o1, m, l, r, ci - first, info & 255, r + first, o_gmem, ml_gmem, counts,
               out_gmem)
        pl.when(more)(lambda: plgpu.barrier_wait(q_bar.at[wg]))
        return _initial_state(gp)

      return lax.cond(((e & _UNIT_LAST) != 0) | (idx[0] == n - 1), finish, lambda c: c, carry)

    # one load of the unit a step for all the specs' index maps (each map is called with the
    # step's same index tracer; the loads are not merged otherwise)
    memo = {}

    def tile_of(i):
      if id(i) not in memo:
        memo[id(i)] = (i, _unit_row_tile(entry(i)))
      return memo[id(i)][1]

    spec = lambda cols: plgpu.BlockSpec(  # noqa: E731
        (None, TILE, cols), lambda i: (*tile_of(i), 0))
    pipeline = plgpu.emit_pipeline_warp_specialized(
        body, grid=(n,), memory_registers=40,
        in_specs=[spec(64), spec(64), spec(8), spec(8), spec(KV_HEADS), spec(KV_HEADS),
                  plgpu.BlockSpec((None, TILE), tile_of)],
        wg_axis="wg", num_compute_wgs=KV_HEADS, max_concurrent_steps=stages,
        compute_context=compute_context)
    pipeline(kc_gmem, vc_gmem, ks_gmem, vs_gmem, kg_gmem, vg_gmem, vf_gmem)

  slots = b + n_ctas
  out_type = (jax.ShapeDtypeStruct((slots, KV_HEADS, 2, 64, gp), jnp.float32),
              jax.ShapeDtypeStruct((slots, KV_HEADS, 2, gp), jnp.float32),
              jax.ShapeDtypeStruct((b, KV_HEADS * heads, HEAD_DIM), out_dtype))
  return mosaic_kernel(
      decode_attention_stream, out_type=out_type, grid=(n_ctas,), grid_names=("c",),
      num_threads=KV_HEADS + 1, thread_name="wg",
      compiler_params=_compiler_params(AUTO_BARRIERS), scratch_types=_scratch(gp, v_halves),
  )(units, rows, qp, kc, vc, ks, vs, kg, vg, vf, *given)


def _emulated_operands(kc, vc, ks, vs, kg, vg, vf, s_pad: int, k_factor: float,
                       v_factor: float, placed: bool):
  """The emulations' view of the cache: K / V decoded (`code * s * 2**-8`, float32) in the
  kernel's physical head_dim order [B, S_pad, 4, 128]; the row factors as the kernel forms them
  (g times the factor, rounded to float32) [B, 4, S_pad]; the validity row [B, S_pad]."""
  b, s = kc.shape[:2]

  def decode(codes, scales):
    c8 = jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape(b, s, KV_HEADS, 64)
    if placed:
      c8 = e2m1.unplace_kv_words(c8)
    vals = e2m1.decode(e2m1.unpack_nibbles(c8)).astype(jnp.float32)  # [B, S, 4, 128]
    sb = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(b, s, KV_HEADS, 8)
    sv = jax.lax.bitcast_convert_type(sb, jnp.float8_e4m3fn).astype(jnp.float32)
    x = vals * jnp.repeat(sv, 16, axis=-1) * 2.0 ** -ROW_SHIFT
    return to_physical(jnp.pad(x, ((0, 0), (0, s_pad - s), (0, 0), (0, 0))))

  pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, s_pad - a.shape[-1])])  # noqa: E731
  kg = pad(jnp.swapaxes(kg * jnp.float32(k_factor), 1, 2))
  vg = pad(jnp.swapaxes(vg * jnp.float32(v_factor), 1, 2))
  return decode(kc, ks), decode(vc, vs), kg, vg, pad(vf)


def _emulated_tile(qf, kt, vt, kgt, vgt, val, carry, lazy_tau):
  """One 64-token tile of the kernels' online softmax, batched: qf [N, 4, gp, 128], kt / vt
  [N, 64, 4, 128], kgt / vgt [N, 4, 64], val [N, 64]; state (m, l [N, 4, gp], o [N, 4, gp,
  128]). The running max of a KV head rises only where one of its scores passes it by more
  than `lazy_tau` (the kernel's vote is per warpgroup: a KV head's queries and tokens)."""
  m, l, o = carry
  hp = jax.lax.Precision.HIGHEST
  sc = jnp.einsum("bhgd,bthd->bhgt", qf, kt.astype(jnp.bfloat16).astype(jnp.float32),
                  precision=hp)
  sc = sc * kgt[:, :, None, :] + ((val - 1.0) * 1e30)[:, None, None, :]
  m_new = jnp.maximum(m, sc.max(-1))
  if lazy_tau is not None:
    rise = (sc > (m + lazy_tau)[..., None]).any(axis=(2, 3), keepdims=True)[..., 0]
    m_new = jnp.where(rise, m_new, m)
  p = jnp.exp2(sc - m_new[..., None])  # as the kernel: hidden slots via the -1e30 only
  corr = jnp.exp2(m - m_new)
  pb = (p * vgt[:, :, None, :]).astype(jnp.bfloat16).astype(jnp.float32)
  pv = jnp.einsum("bhgt,bthd->bhgd", pb, vt.astype(jnp.bfloat16).astype(jnp.float32),
                  precision=hp)
  return m_new, l * corr + p.sum(-1), o * corr[..., None] + pv


def _where_rows(mask, a, b):
  """Per row (axis 0) of every array of the pytrees a and b: a where mask, else b."""
  return jax.tree.map(
      lambda x, y: jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, y), a, b)


def _initial_emulated(n: int, gp: int):
  return (jnp.full((n, KV_HEADS, gp), R.NEG, jnp.float32), jnp.zeros((n, KV_HEADS, gp)),
          jnp.zeros((n, KV_HEADS, gp, HEAD_DIM)))


def _to_kernel_layout(m, l, o):
  """Emulated state -> the kernels' partials: o [..., 4, 2, 64, gp], ml [..., 4, 2, gp]."""
  gp = o.shape[-2]
  o = jnp.moveaxis(o.reshape(*o.shape[:-2], gp, 2, 64), -3, -1)
  return o, jnp.stack([m, l], -2)


def emulate_kernel(kt, qp, kc, vc, ks, vs, kg, vg, vf, *, split_tiles: int, n_splits: int,
                   k_factor: float, v_factor: float, stages: int = 2, overlap: bool = False,
                   lazy_tau: float | None = LAZY_TAU, heads: int | None = None,
                   out_dtype=jnp.bfloat16, placed: bool = False, v_halves: bool = False,
                   prefetch_v: bool = False):
  """A `jnp` model of `mgpu_decode_kernel` (same inputs and outputs): decodes the codes in
  their natural order (un-placing "kv_words"), multiplies in the kernel's physical head_dim
  order, runs the same online softmax per 64-token tile (tiles at or past `kt` leave the state
  as it is), and with `heads` the merged output (`merge_partials`, the combine the in-kernel
  merge equals). Lets CPU tests cover the plumbing around the kernel."""
  # (the order of the softmax sum, and of the kernel's work, not modelled)
  del stages, overlap, v_halves, prefetch_v
  b = kc.shape[0]
  kp, vp, kg, vg, vf = _emulated_operands(kc, vc, ks, vs, kg, vg, vf,
                                          n_splits * split_tiles * TILE, k_factor, v_factor,
                                          placed)
  qf = qp.astype(jnp.float32)  # [B, 4, gp, 128]
  sl = lambda a, i, ax: jax.lax.dynamic_slice_in_dim(a, i * TILE, TILE, ax)  # noqa: E731
  os_, mls = [], []
  for sp in range(n_splits):  # each split restarts the online softmax
    carry = _initial_emulated(b, qp.shape[2])
    for i in range(sp * split_tiles, (sp + 1) * split_tiles):
      new = _emulated_tile(qf, sl(kp, i, 1), sl(vp, i, 1), sl(kg, i, 2), sl(vg, i, 2),
                           sl(vf, i, 1), carry, lazy_tau)
      carry = _where_rows(i < kt, new, carry)
    # a split past the row's last needed tile is not written by the kernel: undefined, NaN here
    dead = ~live_splits(kt, split_tiles, n_splits)[:, sp]
    part = _to_kernel_layout(*carry)
    o, ml = _where_rows(dead, jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), part), part)
    os_.append(o), mls.append(ml)
  o, ml = jnp.stack(os_, 1), jnp.stack(mls, 1)  # [B, n, 4, 2, 64, gp], [B, n, 4, 2, gp]
  if heads is None:
    return o, ml
  return o, ml, merge_partials(kt, o, ml, split_tiles, n_splits, heads).astype(out_dtype)


def emulate_stream_kernel(units, rows, qp, kc, vc, ks, vs, kg, vg, vf, counts=None, *,
                          k_factor: float, v_factor: float, heads: int, stages: int = 2,
                          lazy_tau: float | None = LAZY_TAU, out_dtype=jnp.bfloat16,
                          placed: bool = False, v_halves: bool = False,
                          prefetch_v: bool = False):
  """A `jnp` model of `mgpu_stream_kernel` (same inputs and outputs) that follows its tables:
  every CTA steps through its units (all CTAs at once, a scan over steps), skips empty ones,
  and at a part's end writes the part's partials to slot row + CTA and starts afresh; then each
  row combines its parts (`rows`: first CTA, count) in order (`_combine_parts`). Slots no part
  writes hold NaN, so a table that points a row at a slot nobody wrote poisons its output."""
  del stages, v_halves, prefetch_v, counts  # (the order of the work, its counters: not modelled)
  b, n_ctas, gp = rows.shape[0], units.shape[0], qp.shape[2]
  s_tiles = -(-kc.shape[1] // TILE)
  kp, vp, kg, vg, vf = _emulated_operands(kc, vc, ks, vs, kg, vg, vf, s_tiles * TILE,
                                          k_factor, v_factor, placed)
  qf = qp.astype(jnp.float32)
  ctas = jnp.arange(n_ctas)
  slots = b + n_ctas

  def step(carry, i):
    state, o_buf, ml_buf = carry
    e = units[:, 1 + i]
    r, t = _unit_row_tile(e)
    on = i < units[:, 0]
    tl = lambda a, ax: jax.vmap(  # noqa: E731  (each CTA's tile of its row)
        lambda x, tt: jax.lax.dynamic_slice_in_dim(x, tt * TILE, TILE, ax - 1))(a[r], t)
    new = _emulated_tile(qf[r], tl(kp, 1), tl(vp, 1), tl(kg, 2), tl(vg, 2), tl(vf, 1), state,
                         lazy_tau)
    work = on & ((e & _UNIT_EMPTY) == 0)
    state = _where_rows(work, new, state)
    done = on & (((e & _UNIT_LAST) != 0) | (i == units[:, 0] - 1))
    o, ml = _to_kernel_layout(*state)
    dest = jnp.where(done, r + ctas, slots)  # slot `slots`: dropped
    o_buf = o_buf.at[dest].set(o, mode="drop")
    ml_buf = ml_buf.at[dest].set(ml, mode="drop")
    state = _where_rows(done, _initial_emulated(n_ctas, gp), state)
    return (state, o_buf, ml_buf), None

  o_buf = jnp.full((slots, KV_HEADS, 2, 64, gp), jnp.nan, jnp.float32)
  ml_buf = jnp.full((slots, KV_HEADS, 2, gp), jnp.nan, jnp.float32)
  (_, o_buf, ml_buf), _ = jax.lax.scan(
      step, (_initial_emulated(n_ctas, gp), o_buf, ml_buf), jnp.arange(units.shape[1] - 1))
  first, n_parts = rows >> 8, rows & 255
  part = jnp.arange(n_ctas)
  live = part[None, :] < n_parts[:, None]  # [B, parts]
  idx = jnp.where(live, jnp.arange(b)[:, None] + first[:, None] + part[None, :], 0)
  out = _combine_parts(live, o_buf[idx], ml_buf[idx], heads)
  return o_buf, ml_buf, out.astype(out_dtype)


def merge_partials(kt, o, ml, split_tiles: int, n_splits: int, g: int) -> jax.Array:
  """The split combine of `mgpu_decode_kernel`'s partials as XLA ops (the result the kernel's
  in-kernel merge gives up to float32 rounding): float32 `[B, 4 x g, 128]`, logical order.

  It reduces over the splits in the kernel's own layout, [B, n, 4, 2, 64 physical, gp]: the
  splits axis is major, so the reduction reads o once in order; only its result, n times
  smaller, is transposed to logical head_dim order. (Reducing after the transposition: a loop
  reduce fusion of 37 us a layer appeared in the H200 profile at B = 276 with 16 splits,
  session 13.) Splits the kernel did not write drop out (selected away, never multiplied: their
  memory may hold NaN). Only the g real query-head lanes of the kernel's gp are read (GQA 8 at
  gp 16: half the partials' bytes; the slice fuses into the reduction)."""
  return _combine_parts(live_splits(kt, split_tiles, n_splits), o, ml, g)


def _combine_parts(live, o, ml, g: int) -> jax.Array:
  """Partials [B, n, 4, 2, 64, gp] / [B, n, 4, 2, gp] of the parts marked live [B, n] ->
  float32 `[B, 4 x g, 128]`, logical order (`merge_partials`)."""
  live = live[:, :, None, None, None, None]  # [B, n, 1 x 4]
  # the kernel's maxima are in log2 units (its scores carry log2(e)): back to natural ones
  m = jnp.where(live, ml[:, :, :, None, None, 0, :g] * LN2, R.NEG)  # [B, n, 4, 1, 1, g]
  l = jnp.where(live, ml[:, :, :, None, None, 1, :g], 0.0)
  out = combine_splits(jnp.where(live, o[..., :g], 0.0), m, l, axis=1)  # [B, 4, 2, 64, g]
  return _to_logical(out)


def _to_logical(out):
  """[B, 4, 2, 64 physical, g] -> [B, 4 x g, 128 logical]."""
  b, kvh, g = out.shape[0], out.shape[1], out.shape[-1]
  out = out.reshape(b, kvh, 2, *_HALF_AXES, g)
  out = out.transpose(0, 1, 7, 2, *(3 + a for a in _HALF_TO_LOGICAL))
  return out.reshape(b, kvh * g, HEAD_DIM)


# --------------------------------------------------------------------------- the wrapper

def live_splits(kt, split_tiles: int, n_splits: int) -> jax.Array:
  """bool [B, n_splits]: the splits the kernel runs and writes, those that start before the
  row's last needed tile (`kt` [B] tiles), and split 0."""
  first = jnp.arange(n_splits) * split_tiles
  return (first[None, :] < kt[:, None]) | (jnp.arange(n_splits) == 0)[None, :]


# 1024 slots: see default_splits. TRACE_JAX_ATTN_MAX_SPLIT_TILES: another bound (A/B runs)
MAX_SPLIT_TILES = int_setting("TRACE_JAX_ATTN_MAX_SPLIT_TILES", 16, minimum=1,
                              doc="most 64-token tiles a split of the attention's split schedule")


def default_splits(b: int, s: int) -> int:
  """The split schedule's splits: for one full wave of CTAs (one CTA fits an SM: ~160 KB of SMEM),
  the most with b x splits <= NUM_SMS, and at least enough that no split spans more than
  MAX_SPLIT_TILES tiles. A CTA's tile rate, not HBM, bounds this kernel, so splits over many CTAs
  win, and a wave that is barely started costs a whole one; but a rollout's cache is sized for its
  longest context and the live one is shorter (splits past it exit at once), so long splits leave
  the live tiles to a few CTAs. H200 sweeps, kernel us (bench_attention): all slots live, B=16 x 8k
  51.2 with 8 splits (128 CTAs), 54.6 with 16, 63.0 with 32; B=64 x 1k 28.8 with 2, 33.6 with 4
  (session 12). Cache 8k, L slots live (`--live`, session 13): B=276, L=1536: 380 with 1 split (the
  one-wave rule), 197 with 8, 196 with 16, 239 with 32; B=64, L=1536: 91 with 2 (rule), 57 with 16;
  B=16, L=2048: 48 with 8 (rule), 28 with 16, 24 with 32; B=64 x 1k, L=768: 28 with 2, 32 with 4.
  The combine reads every split's partials, live or not (16 KB a row and split at GQA 8): at the
  8k-capacity shape (B 276, live context <= 768, 12 layers) splits of <= 16 tiles (8 splits) made
  the whole decode step 7.20 -> 6.19 ms against <= 8 (16 splits; session 15). (Since session 20 the
  kernel merges the live splits itself; the sweep of split counts at the capacity shape still
  favours 8: call 165.1 us, 170.6 with 16, 216.5 with 32.)"""
  tiles = -(-s // TILE)
  return max(1, min(tiles, max(NUM_SMS // b, -(-tiles // MAX_SPLIT_TILES))))


def decode_attention(q, k, v, valid, *, scale: float | None = None, out_dtype=None,
                     splits: int | None = None, stages: int | None = None, overlap: bool = False,
                     lazy_tau: float | None = LAZY_TAU, merge: bool = MERGE_IN_KERNEL,
                     schedule: str | None = None, v_halves: bool | None = None,
                     prefetch_v: bool = PREFETCH_V,
                     kernel_fn=None) -> jax.Array:
  """The Mosaic kernel path of `decode_attention_ref` for NVFP4 K/V `[B, S, 4, 128]`: q
  `[B, H, 128]` bf16 (H <= 64; or a `PhysicalQuery`), valid `[B, S]` or lengths `[B]`. The
  kernel reads the cache (codes, scales, row scales) in place. schedule: "stream" or "splits"
  (default `SCHEDULE`; splits, overlap, or XLA's merge ask for the split kernel). overlap: see
  `mgpu_decode_kernel`. merge: the split combine in the kernel (else XLA's, after it).
  v_halves: decoded V through SMEM in halves (None: `V_HALVES`, whole with overlap or XLA's
  merge). prefetch_v: with V in halves, V's loads with K's (`PREFETCH_V`).
  kernel_fn replaces the kernel (tests pass `emulate_kernel` / `emulate_stream_kernel`)."""
  b, h, hd, s, kvh = R.check_decode_args(q, k, v, valid)
  why = kernel_supported(q, k, v)
  if why:
    raise ValueError(f"Mosaic decode attention kernel: {why}")
  out_dtype = out_dtype or q.dtype
  scale = hd ** -0.5 if scale is None else scale
  g = h // kvh
  if schedule is None:
    schedule = "splits" if splits or overlap or not merge else SCHEDULE
  if schedule not in ("stream", "splits"):
    raise ValueError(f"Mosaic decode attention kernel: unknown schedule {schedule!r}")
  stream = schedule == "stream"
  if stream and (splits or overlap or not merge):
    raise ValueError("Mosaic decode attention kernel: the stream schedule merges in the kernel "
                     "and takes no splits or overlap")
  if stream and (-(-s // TILE) > MAX_STREAM_TILES or b >= 1 << (31 - _UNIT_ROW_SHIFT)):
    raise ValueError(f"Mosaic decode attention kernel: the stream schedule takes caches of up "
                     f"to {MAX_STREAM_TILES * TILE} slots and fewer than "
                     f"{1 << (31 - _UNIT_ROW_SHIFT)} rows, not {s} x {b}")
  if v_halves is None:
    v_halves = default_v_halves(overlap, merge)
  fit = max_stages(query_lanes(g), merge, v_halves)
  if stages is None:
    stages = min(STAGES, fit)
  if not 1 <= stages <= fit:
    raise ValueError(f"Mosaic decode attention kernel: {stages} pipeline stages, 1 to {fit} fit "
                     f"in shared memory here ({g} query heads per KV head, merge={merge})")
  allowed = R.allowed_slots(valid, s)
  tiles = -(-s // TILE)
  split_tiles = -(-tiles // (splits or default_splits(b, s)))
  n_splits = -(-tiles // split_tiles)

  counts = None
  if isinstance(q, PhysicalQuery):
    if query_lanes(g) != g:
      raise ValueError(f"Mosaic decode attention kernel: physical queries of {g} heads per KV "
                       f"head, the kernel reads {query_lanes(g)} lanes")
    qp = q.qp.reshape(b, kvh, g, hd)
    if q.counts is not None and stream:
      counts = q.counts
      if counts.shape != (b * kvh,) or counts.dtype != jnp.int32:
        raise ValueError(f"Mosaic decode attention kernel: counters {counts.dtype}"
                         f"{list(counts.shape)}, not int32[{b * kvh}] (a row and KV head)")
  else:
    qp = to_physical(q.astype(jnp.bfloat16).reshape(b, kvh, g, hd))
    qp = jnp.pad(qp, ((0, 0), (0, 0), (0, query_lanes(g) - g), (0, 0)))
  u32 = lambda a, n: jax.lax.bitcast_convert_type(  # noqa: E731  (bytes -> words, a view)
      jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(b, s, n, 4), jnp.uint32)
  kc, vc = u32(k.codes, 64), u32(v.codes, 64)
  placed = k.packing == "kv_words"
  ks, vs = u32(k.scales, 8), u32(v.scales, 8)
  kg, vg = (x.global_scale[..., 0].astype(jnp.float32) for x in (k, v))  # views of the cache
  # the per-call validity row is padded to whole tiles: TMA needs 16-byte row strides (S = 1
  # gave 4), and the padding slots are invisible (vf 0)
  vf = jnp.pad(allowed.astype(jnp.float32), ((0, 0), (0, tiles * TILE - s)))
  last = s - jnp.argmax(allowed[:, ::-1], axis=1)  # one past the last visible slot
  kt = jnp.where(jnp.any(allowed, axis=1), (last + TILE - 1) // TILE, 0).astype(jnp.int32)
  kernel_dtype = jnp.float32 if jnp.dtype(out_dtype) == jnp.float32 else jnp.bfloat16
  if stream:
    units, rows = stream_tables(kt, tiles, min(NUM_SMS, b * tiles))
    res = (kernel_fn or mgpu_stream_kernel)(
        units, rows, qp, kc, vc, ks, vs, kg, vg, vf, counts,
        stages=stages, lazy_tau=lazy_tau, k_factor=float(2 ** ROW_SHIFT * scale * LOG2E),
        v_factor=float(2 ** ROW_SHIFT), heads=g, out_dtype=kernel_dtype, placed=placed,
        v_halves=v_halves, prefetch_v=prefetch_v)
    return res[2].astype(out_dtype)
  res = (kernel_fn or mgpu_decode_kernel)(
      kt, qp, kc, vc, ks, vs, kg, vg, vf, split_tiles=split_tiles, n_splits=n_splits,
      stages=stages, overlap=overlap, lazy_tau=lazy_tau,
      k_factor=float(2 ** ROW_SHIFT * scale * LOG2E), v_factor=float(2 ** ROW_SHIFT),
      heads=g if merge else None, out_dtype=kernel_dtype, placed=placed, v_halves=v_halves,
      prefetch_v=prefetch_v)
  if merge:
    return res[2].astype(out_dtype)
  o, ml = res
  return merge_partials(kt, o, ml, split_tiles, n_splits, g).astype(out_dtype)
