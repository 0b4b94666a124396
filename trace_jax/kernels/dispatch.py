"""Choose a GPU kernel or the `jnp` reference for each matmul and decode attention call.

Kernel path (GPU backend, an FP4 `PackedWeight` from `prepare_weight`, bf16/f32 array
activations): the Mosaic GPU kernel of `fp4_mgpu.py` for decode shapes (dense: <= 64 rows) and
for grouped expert matmuls of any size; dense prefill (> 64 rows) decodes the weight once to
bf16 (`q * scale`, exact) and uses XLA's dot, then applies the fp32 column factor (up to
`DENSE_GROUP_ROWS` rows, 256 by default, the grouped kernel with the rows as one group instead).

XLA path (GPU backend, bf16 activations, bf16 or block-scaled `QArray` weights that are not in
the kernel layout): the weight is decoded to bf16 `q * scale` (exact: an E2M1/E4M3 element times
an E4M3/E8M0 scale has at most 8 significant bits) and multiplied in bf16 with float32
accumulation, the NVFP4 second-level scale applied to the float32 result. It equals the
reference up to float32 rounding (`(q*s)*g` instead of `q*(s*g)`) and the accumulation order.
Grouped matmuls use tokamax's Mosaic GPU `ragged_dot` when tokamax is installed (an optional GPU
dependency), XLA's `ragged_dot` otherwise; `TRACE_JAX_GROUPED=xla` forces XLA's.

A one-row bf16 product (batch-1 decode), and the router's one-row float32 product
(`float32_dot`), get a zero second row (`TRACE_JAX_SINGLE_ROW=xla`: not), so that XLA:GPU keeps
them matrix products (see `_two_row_dot`).

Everything else (CPU, float32 activations, FP4 activations) runs the reference in
`reference.py`. `use_kernel=False` forces the reference on CPU and the XLA path on GPU;
`use_kernel=True` forces the kernel (errors off-GPU).

Decode attention: on GPU the Mosaic GPU NVFP4 kernel of `attention_mgpu.py` where it applies
(NVFP4 K/V, 4 KV heads x head_dim 128, cache length a multiple of 8; on the H200 198 us per
call at B=64 x 8k against 281 us for the Pallas kernel on a bf16 cache, and 365 us for the
Pallas kernel on the same NVFP4 cache in its earlier launch configuration, 2026-11-30) and the
cache is not short; else the Pallas kernel of `attention_pallas.py` for the operands
`attention_pallas.kernel_supported` accepts (it reads an FP4 cache in place; the reference
dequantizes the whole cache to bf16 every step: on the H200 that was 31 us per layer and call at
384 slots, B=64), the reference `attention_ref` elsewhere. Short: batch x cache slots <=
`SHORT_CACHE_SLOTS` (4096), where the Mosaic kernel's fixed cost per call loses. H200 us per
call, Pallas / Mosaic on NVFP4 (bf16 KV beside): B 1 x 256 slots 5.6 / 8.1 (4.8), B 1 x 1024
8.5 / 12.6 (6.2), B 16 x 256 9.4 / 10.7 (7.3), B 16 x 1024 20.0 / 17.4 (16.9) (session 17).
The environment variable `TRACE_JAX_DECODE_ATTENTION` (read at import) picks otherwise:
`=kernel` the Pallas kernel for every format, `=reference` the reference on GPU too.

Prefill attention (T query tokens over a cache that holds them, the rollout's prefill): on GPU
the flash-style Pallas kernel `attention_pallas.prefill_attention` (it reads the cache in
place; the reference materializes float32 scores `[B, H, T, S]`, 38 GB at B=64, prompt 2048;
on the H200 3.75x the reference's speed in bf16 and 2.9x in NVFP4 at B=16, prompt 2048),
`attention_ref.prefill_attention_ref` elsewhere or with `TRACE_JAX_PREFILL_ATTENTION=reference`.
The trainer's attention (no cache, differentiated) stays the reference formula.

Decode routing tables: `sort_by_group` and `count_by_group` order and count (token, slot) rows
by comparisons up to `SMALL_SORT` rows (one reduction kernel each, no sort or scatter), by
XLA's sort and scatters above it. `route` gives them with the FP4 grouped kernel's chunk tables
(all of them from three reductions and a look-up, `_routed_by_counts`);
on the GPU two Pallas kernels compute all of them (`routing.py`; `TRACE_JAX_ROUTING=xla` opts
out). Since the router's top-k is a kernel of its own XLA no longer splits it when they run:
4-layer decode step at B 255 on an H100 (session 45) 116 -> 103 kernels a step, 1.774 -> 1.765
ms of kernels. Up to `ROW_CHUNK_ROWS` rows on the GPU (one token's
top-k: a batch-1 decode step) `route` orders nothing: every row is a chunk of its own in the
caller's order, its expert the row's id, so the tables are the ids and two constants
(`row_chunks`).

Pallas kernels for the rollout's glue on the GPU (`append_kv`, `quantize_rows`,
`quantize_rows_to_operand`, `swiglu_quantize_rows`; opt out with `TRACE_JAX_KV_APPEND=xla`,
`TRACE_JAX_ROW_QUANT=xla`, `TRACE_JAX_ROW_QUANT_OPERAND=xla`, `TRACE_JAX_SWIGLU_QUANT=xla`):
None off the GPU and for operands they do not take; the caller then runs its XLA path, which
gives the same bits.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import quant as tq
# fp4_mgpu imports no Pallas at module level (its kernels import Mosaic when they trace)
from trace_jax.kernels import attention_ref, fp4_mgpu, reference
from trace_jax.kernels.fp4_mgpu import ROW_CHUNKS
from trace_jax.kernels.repeatable_gather import take_copies, take_rows
from trace_jax.kernels.layout import (ChunkRows, KParts, OperandRows, PackedWeight, PaddedRows,
                                      decode_parts, prepare_weight)
from trace_jax.settings import choice_setting as _setting, declare, int_setting
from trace_jax.quant import QArray
from trace_jax.quant.qarray import decode_blocks, from_blocks

__all__ = ["add_rms_norm", "append_kv", "combine_add_rms_norm",
           "combine_in_kernel", "count_by_group", "decode_attention", "decode_qkv", "float32_dot",
           "grouped_backend",
           "grouped_matmul", "kernels_on", "kv_packing", "matmul", "norm_rows_padded", "on_gpu",
           "prefill_attention", "prepare_weight", "quantize_rows", "quantize_rows_to_operand",
           "route", "router_gates", "sort_by_group", "swiglu_quantize_rows", "topk_gates"]

_ATTENTION = _setting(
    "TRACE_JAX_DECODE_ATTENTION", "mosaic", ("kernel", "reference", "mosaic"),
    doc="decode attention: Mosaic for NVFP4 caches, Pallas for all, or the reference")
_ATTENTION_KERNEL = _ATTENTION != "reference"
_ATTENTION_MOSAIC = _ATTENTION == "mosaic"
_KV_APPEND = _setting("TRACE_JAX_KV_APPEND", "kernel", ("xla", "kernel"),
                      doc="the decode step's NVFP4 K/V cache write as a kernel, or XLA's ops")
# Three decode-step kernels, the GPU defaults since session 40 ("xla" opts out of each). H200,
# kernel time of the 4-layer 8k-capacity decode step at B 256, command buffers off: all XLA
# 1.630 ms; q/k/v kernel 1.600; add + norm 1.625; add + norm and combine 1.622; all three
# 1.592 (combine at 4 warps), 1.573 (16); GPU tests: q, K and V bit for bit with XLA's, the
# norm bit for bit, the combine's sum bit for bit with the model's rule
# (benchmarks/results/session40_h200_2026-12-05).
# q/k norms, rotary embedding and K/V append as one kernel (`decode_qkv`), or XLA's ops and
# the K/V append kernel ("xla")
_DECODE_QKV = _setting(
    "TRACE_JAX_DECODE_QKV", "kernel", ("xla", "kernel"),
    doc="q/k norms, rotary embedding and K/V cache write in one kernel, or XLA's ops")
# a guided layer's compact guidance bits of K, V (`decode_qkv`) and the experts' input
# (`quantize_rows_to_operand`) written by the kernels that quantize them ("kernel"; 3
# element-wise XLA kernels a guided layer fewer; the GPU default since their H200 tests passed,
# stage s42b, session 43) or made by XLA from their codes ("xla")
_GUIDANCE_BITS = _setting(
    "TRACE_JAX_GUIDANCE_BITS", "kernel", ("xla", "kernel"),
    doc="guidance bits written by the quantizing kernels, or made by XLA from codes")
# a residual add and the RMS norm after it as one kernel (`add_rms_norm`), or XLA's two
_ADD_NORM = _setting(
    "TRACE_JAX_ADD_NORM", "kernel", ("xla", "kernel"),
    doc="a residual add and the RMS norm after it in one kernel (decode step), or XLA's ops")
# the MoE's output (its gates' weighted sum of the down kernel's rows), the residual add and
# the next RMS norm as one kernel (`combine_add_rms_norm`), or XLA's ops ("xla")
_MOE_COMBINE = _setting(
    "TRACE_JAX_MOE_COMBINE", "kernel", ("xla", "kernel"),
    doc="the MoE's gated sum, residual add and next norm in one kernel, or XLA's ops")
_ROW_QUANT = _setting("TRACE_JAX_ROW_QUANT", "kernel", ("xla", "kernel"),
                      doc="activation-site NVFP4 quantization as a kernel, or XLA's ops")
_SWIGLU_QUANT = _setting(
    "TRACE_JAX_SWIGLU_QUANT", "kernel", ("xla", "kernel"),
    doc="the down input's SwiGLU, quantization and operand in one kernel, or XLA's")
_ROW_QUANT_OPERAND = _setting(
    "TRACE_JAX_ROW_QUANT_OPERAND", "kernel", ("xla", "kernel"),
    doc="experts' input quantized into the gate/up kernel's operand, or XLA's")
# The router's gates: "kernel" (softmax, top-k and weights in one kernel, `topk_gates`) or "xla"
# (XLA's ops)
_ROUTER_TOPK = _setting("TRACE_JAX_ROUTER_TOPK", "kernel", ("xla", "kernel"),
                        doc="the router's softmax, top-k and weights in one kernel, or XLA's ops")
# The rollout router's split-K parts: summed by XLA's reduction kernel after its product
# ("xla"), or by the gates kernel ("kernel", opt-in: `router_gates`, decode batches only). H100,
# 4-layer decode step at B 255 (session 45): 103 -> 99 kernels a step, 1.734 -> 1.732 ms of
# kernels (the router's 9.6 us a layer 9.5): one kernel and its gap fewer a layer, no faster
_ROUTER_SUM = _setting(
    "TRACE_JAX_ROUTER_SUM", "xla", ("xla", "kernel"),
    doc="the router's split-K parts summed by XLA, or by the gates kernel (opt-in)")
# The router's float32 product of bf16 operands (the rollout's activations and weights) on the
# GPU: "bf16" (the default) one bf16 product with float32 accumulation (`bf16_operands_dot`;
# its derivative the float32 dot's); "float32" converts them and runs XLA's float32 dot at
# HIGHEST precision. H200, the 4-layer 8k-capacity decode step at B 256 (session 41, one A/B,
# each side its own process): the router product's two kernels 39.2 -> 19.7 us a step, all
# kernels 1.589 -> 1.569 ms
_ROUTER_DOT = _setting(
    "TRACE_JAX_ROUTER_DOT", "bf16", ("float32", "bf16"),
    doc="the router's bf16-operand product as a bf16 product, or converted to float32")
_PREFILL_KERNEL = _setting(
    "TRACE_JAX_PREFILL_ATTENTION", "kernel", ("kernel", "reference"),
    doc="prefill attention by the flash-style Pallas kernel, or the reference") == "kernel"
# FP4 KV caches the Mosaic decode attention kernel reads hold bit-placed code words ("kv_words":
# its decode 13 instructions a word instead of 17); TRACE_JAX_KV_WORDS=nibbles keeps the nibble
# packing (A/B runs)
_KV_WORDS = _setting(
    "TRACE_JAX_KV_WORDS", "placed", ("placed", "nibbles"),
    doc="FP4 KV caches of bit-placed code words for the attention's decode, or nibbles")
# decode attention over at most this many cache slots (batch x slots) takes the Pallas kernel
# where the Mosaic one also applies (see the module docstring); 0: the Mosaic kernel always
SHORT_CACHE_SLOTS = int_setting(
    "TRACE_JAX_ATTN_SHORT_SLOTS", 4096, minimum=0,
    doc="decode attention over at most this many batch x cache slots by Pallas")
# Dense FP4 products of more rows than the GEMV kernel takes, up to this many, through the
# grouped kernel with the rows as one group (`fp4_mgpu.matmul_as_group`); past it (prefill) the
# weight is decoded to bf16 once and XLA's dot runs (0: always). Policies with FP4 dense
# weights only (w4a16, w4a4, all_linear); `paper` keeps the attention projections bf16. H200,
# 256 rows, us per call (session 26, benchmarks/results/session26_h200_2026-12-02): attention o
# 4096x2048 kernel 15.4 against decode + dot 88.1 (XLA bf16 17.5); fused q/k/v 2048x5120 19.3
# against 100.9 (XLA bf16 17.3). Not timed past 256 rows.
DENSE_GROUP_ROWS = int_setting("TRACE_JAX_DENSE_GROUP_ROWS", 256, minimum=0,
                               doc="dense FP4 products up to this many rows by the grouped kernel")
_SINGLE_ROW = _setting("TRACE_JAX_SINGLE_ROW", "pad", ("pad", "xla"),
                       doc="one-row products (batch-1 decode) padded to two rows, or XLA's")
_ROUTING = _setting(
    "TRACE_JAX_ROUTING", "kernel", ("kernel", "xla"),
    doc="MoE routing tables (FP4 experts, GPU) from two Pallas kernels, or XLA's ops")
# bf16 expert weights: the Mosaic kernel of `bf16_mgpu.py` up to BF16_KERNEL_ROWS rows (auto,
# the default), up to its MAX_ROWS (kernel), or never (tokamax); tokamax's ragged_dot above
_BF16_GROUPED = _setting(
    "TRACE_JAX_BF16_GROUPED", "auto", ("auto", "tokamax", "kernel"),
    doc="bf16 expert products: Mosaic up to 256 rows (auto), to its maximum, or tokamax")
# Grouped matmuls on the reference path (float32 experts: the trainer's; on the CPU every
# grouped matmul): "tiles" (the default, `tiled_grouped`: a loop over row tiles of up to
# GROUPED_TILE rows, GROUPED_TILES_PER_STEP tiles a loop step, ragged_dot below 16 rows a
# group) or "ragged_dot" (`reference.grouped_matmul_ref`'s definition), which XLA expands into
# a product E times as large. H100 (session 52): the mid train step 0.729 s with ragged_dot,
# 0.241 with tiles of 128 one a step, 0.090 with 16 a step; one 30B-A3B expert product's
# forward + gradient at 16,384 rows 786 ms (ragged_dot), 29.3 (tiles), 21.7 (16 a step), 20.7
# (32); at the mid shape (1,536 rows a group) tiles of 256 were 14-19% faster than of 128, at
# 30B-A3B's (96 rows a group, so `tile_for` keeps 128) 20-23% slower. The 4-layer 30B-A3B train
# step, out of memory with ragged_dot, 0.262 s. The defaults (256, 32) as a pair are not yet
# timed in a train step. On 2 CPU cores (session 51) the tiny train step 0.28-0.32 s against
# 0.40-0.46 s, and 16 a step no different
_GROUPED_REF = _setting(
    "TRACE_JAX_GROUPED_REF", "tiles", ("tiles", "ragged_dot"),
    doc="grouped products off the kernels (trainer, CPU): row tiles, or XLA's ragged_dot")
GROUPED_TILE = int_setting("TRACE_JAX_GROUPED_TILE", 256, minimum=1,
                           doc="most rows a tile of the grouped products' row-tile loop")
# tiles a loop step of the tiles path (one batched product of that many tiles)
GROUPED_TILES_PER_STEP = int_setting(
    "TRACE_JAX_GROUPED_TILES_PER_STEP", 32, minimum=1,
    doc="tiles a step of the row-tile loop multiplies in one batched product")
# H200, 30B-A3B experts, kernel us, bf16_mgpu / tokamax (session 13, bench_kernels): gate+up
# 14.1 / 22.2 at 8 rows, 83.0 / 103.1 at 64, 184.0 / 186.9 at 256; down 7.0 / 11.8 at 8, 45.7 /
# 46.6 at 64. Not measured above 256 rows.
BF16_KERNEL_ROWS = 256
# bf16 dense products (the `paper` policy's attention projections, the BF16 engine's): "kernel"
# (the default): the rollout's weight sync puts q, k and v side by side
# (`layout.fuse_projections`: a new array beside the master's three, 1 GB at 48 layers of the
# 30B-A3B shape, which the capacity planner counts) and products of rows
# `bf16_mgpu.dense_launch` takes run the bf16 Mosaic kernel with 128-row chunks; "xla": XLA's
# dot. H200: q/k/v at 256 rows 14.9 against XLA's 19.7 us alone (session 32); the 4-layer FP4
# decode step at the 8k-capacity shape, B 256, 2.004 -> 1.929 ms (kernels 1.694 -> 1.643,
# session 33). Its summation order is not XLA's: the engine smoke at 160 sequences (1 layer,
# kernels against the jnp reference path) had 12 of 160 rows take another token at a near-tie
# (0 with "xla", whose products are the reference's own).
BF16_DENSE = _setting("TRACE_JAX_BF16_DENSE", "kernel", ("xla", "kernel"),
                      doc="bf16 dense products (q/k/v, o) by the bf16 Mosaic kernel, or XLA's dot")
# A decode step's input norm (the MoE combine kernel's) writing its rows padded to a multiple of
# 8 for the bf16 q/k/v kernel ("padded", opt-in: `norm_rows_padded`; XLA's pad of [255, 2048]
# to 256 rows before that kernel, 1.5 us a layer in the 48-layer step, should go), or as they
# are ("exact")
_NORM_ROWS = _setting(
    "TRACE_JAX_NORM_ROWS", "exact", ("exact", "padded"),
    doc="the combine kernel's norm rows padded to a multiple of 8 (opt-in), or exact")


def on_gpu() -> bool:
  """Whether the default backend is a GPU (for XLA-path choices, which hold on any GPU)."""
  return jax.default_backend() == "gpu"


# The kernels (the Mosaic GPU ones, the Triton-lowered Pallas ones, tokamax's): "auto" on NVIDIA
# Hopper GPUs (compute capability 9.0) only, the one architecture they were built and checked
# for (wgmma, TMA and setmaxnreg are sm_90a instructions; the Pallas kernels' inline PTX was
# only ever run on the H100 and H200); "on" on any GPU (to try them elsewhere); "off" never.
# Elsewhere every call takes the XLA path, which is what the kernels are checked against.
_KERNELS = _setting(
    "TRACE_JAX_KERNELS", "auto", ("auto", "on", "off"),
    doc="the GPU kernels on Hopper (sm_90) GPUs only (auto), on any GPU, or never")
KERNEL_CAPABILITY = (9, 0)


def kernels_allowed(setting: str, backend: str, platform_version: str,
                    capability: str | None) -> bool:
  """Whether the kernels run on a device of this backend, PJRT platform version ("... cuda
  ..." for NVIDIA's) and compute capability ("9.0"), under TRACE_JAX_KERNELS `setting`."""
  if setting == "off" or backend != "gpu":
    return False
  if setting == "on":
    return True
  if "cuda" not in platform_version.lower() or not capability:
    return False
  try:
    major_minor = tuple(int(x) for x in capability.split(".")[:2])
  except ValueError:
    return False
  return major_minor == KERNEL_CAPABILITY


@functools.cache
def kernels_on() -> bool:
  """Whether this process's calls take the kernels: its first device is an NVIDIA Hopper GPU
  (or TRACE_JAX_KERNELS says otherwise). Read once. (A multi-process job whose hosts answer
  differently stops at `parallel.initialize`: its processes would compile different programs.)"""
  device = jax.local_devices()[0]
  version = getattr(getattr(device, "client", None), "platform_version", "") or ""
  return kernels_allowed(_KERNELS, jax.default_backend(), version,
                         getattr(device, "compute_capability", None))


def _lowered_once(*static_argnames: str):
  """`jax.jit` around a kernel call made in every layer: JAX traces and lowers it once per
  program and argument shapes (its lowering cache), so every layer calls one identical kernel
  and XLA compiles it once. The Mosaic FP4 kernels were jitted from the start; unwrapped, the
  BF16 program's kernels (tokamax's grouped matmul, the Pallas attention) made its compile grow
  3.3 s per layer on the H200 where the FP4 program's stayed flat (session 10)."""
  return functools.partial(jax.jit, static_argnames=static_argnames)


def _frozen(config: dict | None):
  """A kernel config dict as a static (hashable) argument."""
  return None if not config else tuple(sorted(config.items()))


def _thawed(config) -> dict | None:
  """The config dict back from `_frozen`."""
  return dict(config) if config else None


_NO_TOKAMAX = declare("TRACE_JAX_GROUPED", "", "xla",
                      "xla: bf16 grouped products on the XLA path never take tokamax's ragged_dot")


@functools.cache
def _tokamax_ragged_dot():
  if os.environ.get(_NO_TOKAMAX, "") == "xla":
    return None
  try:
    import tokamax  # optional GPU dependency (Python >= 3.12, jax >= 0.11.1)
  except Exception:  # noqa: BLE001 - absent or broken: fall back to XLA's ragged_dot
    return None
  return tokamax.ragged_dot


def import_gpu_libraries() -> None:
  """On the GPU, import the optional libraries the kernels call (tokamax) now, before programs
  are compiled. Importing tokamax creates JAX user contexts (`jax.make_user_context`, for its
  config options), which are part of every jit's cache key: a program compiled before the
  import compiles again at its next call. Imported inside the first rollout's trace, it made the
  BF16 engine's second call trace and compile its program again (H200, 12 layers, B 1: a 12.5 s
  call where the third took 0.01 s; session 16). `RolloutEngine` and `make_train_step` call
  this before they compile anything."""
  if kernels_on():
    _tokamax_ragged_dot()


def grouped_backend() -> str:
  """Which bf16 grouped matmul the XLA path uses here: 'tokamax' or 'xla'; on a GPU (unless
  `TRACE_JAX_BF16_GROUPED=tokamax`) 'bf16_mgpu+tokamax' / 'bf16_mgpu+xla': the kernel up to
  `_bf16_kernel_rows()` rows, the other above."""
  base = "tokamax" if kernels_on() and _tokamax_ragged_dot() is not None else "xla"
  return f"bf16_mgpu+{base}" if kernels_on() and _bf16_kernel_rows() else base


def _ragged_bf16(x, a, group_sizes) -> jax.Array:
  """bf16 grouped matmul with float32 accumulation and output."""
  group_sizes = group_sizes.astype(jnp.int32)
  if kernels_on() and _tokamax_ragged_dot() is not None:
    return _tokamax_grouped(x, a, group_sizes)
  return jax.lax.ragged_dot(x, a, group_sizes, preferred_element_type=jnp.float32)


@_lowered_once()
def _tokamax_grouped(x, a, group_sizes):
  return _tokamax_ragged_dot()(x, a, group_sizes, preferred_element_type=jnp.float32,
                               implementation=("mosaic", "xla"))


def _bf16_parts(w):
  """(a, factor) with `w == a * factor`: a bf16 (exact `q * scale` for a `QArray` whose blocks run
  along K), factor the float32 second-level scale squeezed over K (or None); None if w has no
  such form."""
  if not isinstance(w, QArray):
    return (w, None) if w.dtype == jnp.bfloat16 else None
  if w.axis != w.ndim - 2:
    return None
  s, g = w.blocked_scales()
  if g is not None and w.global_scale.shape[w.axis] != 1:
    return None
  a = from_blocks(decode_blocks(w.blocked_codes(), s, None if g is None else jnp.float32(1),
                                w.fmt), w.axis, w.shape[w.axis]).astype(jnp.bfloat16)
  return a, None if g is None else jnp.squeeze(w.global_scale, w.axis).astype(jnp.float32)


def _one_row(x) -> bool:
  """Whether `x [..., K]` is a single row that `_two_row_dot` should take."""
  return x.size == x.shape[-1] and _SINGLE_ROW != "xla"


def _two_row_dot(x, a, **dot_kwargs) -> jax.Array:
  """A single row `x [..., K]` times `a [K, N]` as a two-row product whose second row is zero.

  Why: XLA:GPU rewrites a one-row dot with a weight under 10M elements (every 30B-A3B attention
  projection, the MoE router) as multiply + reduce; with [K, N] weights it writes the float32
  product transposed, then reads it back. H200, batch-1 decode: bf16 o_proj 26.2 -> 5.8 us,
  q/k/v 9.7 -> 6.8 us; the float32 router 4.1 -> 2.8 us alone (two kernels, 6.4 us a layer, in
  the decode loop). The zero row costs a concatenate kernel (~1.4 us); the row broadcast to two
  instead left no such kernel but XLA moved the work into others: the BF16 batch-1 step's
  kernels 1.095 -> 1.100 ms (benchmarks/results/session17_h200_2026-12-01)."""
  row = x.reshape(1, -1)
  x2 = jnp.concatenate([row, jnp.zeros_like(row)])
  return jnp.dot(x2, a, **dot_kwargs)[:1].reshape(*x.shape[:-1], -1)


def xla_matmul(x, parts, out_dtype) -> jax.Array:
  """The XLA path's dense matmul: bf16 `x @ a` with float32 accumulation, times the factor."""
  a, factor = parts
  x = x.astype(jnp.bfloat16)
  if _one_row(x):
    y = _two_row_dot(x, a, preferred_element_type=jnp.float32)
  else:
    y = jnp.einsum("...k,kn->...n", x, a, preferred_element_type=jnp.float32)
  return (y if factor is None else y * factor).astype(out_dtype)


def _bf16_dense(x, w, out_dtype, rows: int | None = None, keep_parts: bool = False):
  """`x [R, K] @ w` (bf16 [K, N]) through `bf16_mgpu.dense_matmul` where its launch rule
  (`bf16_mgpu.dense_launch`) takes the shape, else `bf16_mgpu.cluster_matmul` where
  `bf16_mgpu.cluster_launch` does, else None: `[rows, N]` (rows: the product's
  rows where x holds more, `PaddedRows`; None: all R), or `KParts` (keep_parts, a K split)."""
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  launch = bf16_mgpu.dense_launch(rows or x.shape[0], *w.shape)
  if launch is not None:
    return _dense_bf16_call(x, w, out_dtype=out_dtype, rows=rows,
                            keep_parts=keep_parts and launch["splits"] > 1, **launch)
  launch = bf16_mgpu.cluster_launch(rows or x.shape[0], *w.shape)
  if launch is None:
    return None
  return _cluster_bf16_call(x, w, out_dtype=out_dtype, rows=rows, **launch)


@_lowered_once("out_dtype", "splits", "wgs", "kb", "bm", "rows")
def _cluster_bf16_call(x, w, *, out_dtype, splits, wgs, kb, bm, rows):
  """`bf16_mgpu.cluster_matmul` of x's rows (padded to a multiple of 8, as TMA tiles them;
  rows: the product's rows where x holds more)."""
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  m = rows or x.shape[0]
  xc = jnp.pad(x.astype(jnp.bfloat16), ((0, -x.shape[0] % 8), (0, 0)))
  return bf16_mgpu.cluster_matmul(xc, w, splits=splits, wgs=wgs, kb=kb, bm=bm, rows=m,
                                  out_dtype=out_dtype)


@_lowered_once("out_dtype", "bm", "wgs", "kb", "splits", "rows", "keep_parts")
def _dense_bf16_call(x, w, *, out_dtype, bm, wgs, kb, splits, rows, keep_parts):
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  return bf16_mgpu.dense_matmul(x, w, bm=bm, wgs=wgs, kb=kb, splits=splits,
                                out_dtype=out_dtype, rows=rows, keep_parts=keep_parts)


def float32_dot(x, w) -> jax.Array:
  """float32 `x [..., K] @ w [K, N]` at HIGHEST precision (XLA's default rounds float32 dot
  operands to TF32 on Hopper GPUs): the MoE router's logits. On the GPU a single row goes
  through `_two_row_dot`; elsewhere, and for more rows, the plain dot. bf16 x and w on the GPU
  go through `bf16_operands_dot` (`TRACE_JAX_ROUTER_DOT=float32`: not)."""
  if (_ROUTER_DOT == "bf16" and on_gpu() and x.dtype == jnp.bfloat16
      and w.dtype == jnp.bfloat16):
    return bf16_operands_dot(x, w)
  if on_gpu() and _one_row(x):
    return _two_row_dot(x.astype(jnp.float32), w.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
  return _float32_product(x, w)


def _float32_product(x, w) -> jax.Array:
  """`x @ w` of x and w converted to float32, at HIGHEST precision."""
  return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST)


def _bf16_product(x, w) -> jax.Array:
  if on_gpu() and _one_row(x):
    return _two_row_dot(x, w, preferred_element_type=jnp.float32)
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


@jax.custom_vjp
def bf16_operands_dot(x, w) -> jax.Array:
  """float32 `x [..., K] @ w [K, N]` of bf16 x and w as one bf16 product with float32
  accumulation (tensor cores on the GPU). Every product of two bf16 values is exact in float32,
  as in `float32_dot`; only the accumulation's order and rounding differ, which already differ
  between XLA's float32 dots of other row counts (the trainer's and the rollout's). Its
  derivative is the float32 dot's (`_float32_product`'s: products of the float32 cotangent at
  HIGHEST precision, rounded to x's and w's dtypes); autodiff of the bf16 product would give
  float32-by-bf16 products at the default precision, which XLA:GPU runs as TF32 on Hopper."""
  return _bf16_product(x, w)


def _float32_product_transposes(res, ct):
  """`_float32_product`'s derivative at (x, w): its transposes in x and in w (each linear in
  one operand), without its forward product, which `jax.vjp` would compute again."""
  x, w = res
  dx, = jax.linear_transpose(lambda a: _float32_product(a, w), x)(ct)
  dw, = jax.linear_transpose(lambda b: _float32_product(x, b), w)(ct)
  return dx, dw


bf16_operands_dot.defvjp(lambda x, w: (_bf16_product(x, w), (x, w)),
                         _float32_product_transposes)


def xla_grouped_matmul(x, parts, group_sizes, out_dtype) -> jax.Array:
  """The XLA path's grouped matmul; factor `[E, N]` or `[E, 1]` scales each row by its group's
  second-level scale."""
  a, factor = parts
  y = _ragged_bf16(x.astype(jnp.bfloat16), a, group_sizes)
  if factor is not None:
    gid = jnp.repeat(jnp.arange(a.shape[0]), group_sizes, total_repeat_length=x.shape[0])
    y = y * factor[gid]
  return y.astype(out_dtype)


def _xla_gpu_ok(x, w, use_kernel) -> bool:
  return (use_kernel is not True and on_gpu() and isinstance(x, jax.Array)
          and x.dtype == jnp.bfloat16 and not isinstance(w, PackedWeight))


def _kernel_ok(x, w, use_kernel) -> bool:
  if use_kernel is False or not isinstance(w, PackedWeight) or not isinstance(x, jax.Array):
    return False
  if use_kernel:
    return True
  return kernels_on() and x.dtype in (jnp.bfloat16, jnp.float32)


def _out_dtype(x, out_dtype):
  return out_dtype or (x.dtype if isinstance(x, jax.Array) else jnp.bfloat16)


def matmul(x, w, out_dtype=None, *, use_kernel: bool | None = None, config=None,
           keep_parts: bool = False) -> jax.Array | KParts:
  """`x @ w`; w `[K, N]` array, FP4 `QArray` (blocks along K) or `PackedWeight`; x may be
  `PaddedRows` (the bf16 dense kernel then reads its padded rows, others its value).
  keep_parts: where the bf16 dense kernel splits K (`bf16_mgpu.ksplit_launch`), its float32
  parts unadded (`KParts`, `[S, ..., N]`), for a reader that adds them itself."""
  padded = x if isinstance(x, PaddedRows) else None
  if padded is not None:
    x = padded.value()  # (a slice, dead where the dense kernel takes the padded rows)
  if _xla_gpu_ok(x, w, use_kernel) and (parts := _bf16_parts(w)) is not None:
    if BF16_DENSE == "kernel" and parts[1] is None and kernels_on():
      rows2d = x.reshape(-1, x.shape[-1]) if padded is None else padded.rows
      y = _bf16_dense(rows2d, parts[0], _out_dtype(x, out_dtype),
                      rows=None if padded is None else padded.n, keep_parts=keep_parts)
      if isinstance(y, KParts):
        return KParts(y.parts.reshape(y.parts.shape[0], *x.shape[:-1], y.parts.shape[-1]))
      if y is not None:
        return y.reshape(*x.shape[:-1], y.shape[-1])
    return xla_matmul(x, parts, _out_dtype(x, out_dtype))
  if not _kernel_ok(x, w, use_kernel) or w.experts:
    return reference.matmul_ref(x, w, out_dtype)
  out_dtype = _out_dtype(x, out_dtype)
  rows = x.size // x.shape[-1]
  if rows <= fp4_mgpu.MAX_DECODE_ROWS:
    return fp4_mgpu.matmul(x, w, out_dtype=out_dtype, config=config)
  if rows <= DENSE_GROUP_ROWS:  # decode batches past 64 rows (FP4 attention weights)
    return fp4_mgpu.matmul_as_group(x, w, out_dtype=out_dtype, config=config)
  a, factor = decode_parts(w)  # prefill: one bf16 decode, amortized over the rows
  return xla_matmul(x, (a[0], factor[0]), out_dtype)


def grouped_matmul(x, w, group_sizes, out_dtype=None, *, use_kernel: bool | None = None,
                   bm: int | None = None, config=None, rows=None, rows_inverse=None,
                   out_rows=None, tables=None,
                   keep_chunks: bool = False) -> jax.Array | ChunkRows:
  """Grouped (ragged) matmul of expert-sorted rows `x [M, K]` with `w [E, K, N]`.

  rows `[M]` ints: the sorted rows are `x[rows]` (x then holds e.g. one row per token, each
  routed to several experts); out_rows: return `result[out_rows]` (e.g. back to token order).
  On the reference and XLA paths both are gathers (rows' gradient added in a fixed order:
  `kernels.take_copies` with rows_inverse, else `kernels.take_rows`); the kernel paths fold them
  into the gathers that lay out their operand and read their output (no gradient).
  tables: the FP4 kernel's chunk tables from `route` (None: built from group_sizes);
  `row_chunks` tables come with rows in the caller's order, which paths other than the grouped
  kernels sort here first.
  rows_inverse `[M]` (only with rows): where each x row's copies lie when every x row is taken
  equally often (`rows[rows_inverse[t * c + j]] == t`: a MoE dispatch, rows = order // k and
  rows_inverse = order's inverse), for a gradient that gathers each row's copies and sums them
  (`kernels.take_copies`); without it the gradient sorts (`kernels.take_rows`)
  keep_chunks: the FP4 kernel path may return its rows ungathered (`ChunkRows`, for
  `swiglu_quantize_rows`); x may be `OperandRows` made for this call's FP4 kernel."""
  if rows_inverse is not None and rows is None:
    raise ValueError("grouped_matmul: rows_inverse says where x's rows repeat in rows; "
                     "it needs rows")
  if isinstance(x, OperandRows):
    if not (isinstance(w, PackedWeight) and w.experts and use_kernel is not False):
      raise ValueError("an operand laid out for the FP4 grouped kernel, for a weight it does "
                       f"not take ({type(w).__name__})")
    return fp4_mgpu.grouped_matmul(x, w, group_sizes, out_dtype=_out_dtype(x, out_dtype),
                                   bm=bm, config=config, out_rows=out_rows, tables=tables,
                                   keep_chunks=keep_chunks)
  if _kernel_ok(x, w, use_kernel) and w.experts:
    return fp4_mgpu.grouped_matmul(x, w, group_sizes, out_dtype=_out_dtype(x, out_dtype), bm=bm,
                                   config=config, rows=rows, out_rows=out_rows, tables=tables,
                                   keep_chunks=keep_chunks)
  lhs_rows = x if rows is None else rows  # what the kernel's row count and checks see
  if _bf16_kernel_weight(w, lhs_rows.shape[0]) and _xla_gpu_ok(x, w, use_kernel):
    from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
    if bf16_mgpu.kernel_supported(lhs_rows, w, group_sizes) is None:
      bm, arrays = (None, None) if tables is None else (tables[0], tables[1:4])
      return _bf16_grouped(x, w, group_sizes, rows, out_rows, arrays, bm=bm,
                           by_rows=fp4_mgpu.by_rows(tables), out_dtype=_out_dtype(x, out_dtype))
  if fp4_mgpu.by_rows(tables):  # rows in the caller's order: sorted by expert for the rest
    order, inverse = sort_by_group(tables[1])
    rows = order if rows is None else rows[order]
    rows_inverse = None if rows_inverse is None else inverse[rows_inverse]
    out_rows = inverse if out_rows is None else inverse[out_rows]
  if rows is not None:  # a token's row repeats once per chosen expert: its gradient adds them
    if not isinstance(x, jax.Array):
      x = x[rows]
    elif rows_inverse is None:
      x = take_rows(x, rows)
    else:
      x = take_copies(x, rows, rows_inverse)
  if _xla_gpu_ok(x, w, use_kernel) and (parts := _bf16_parts(w)) is not None:
    y = xla_grouped_matmul(x, parts, group_sizes, _out_dtype(x, out_dtype))
  else:
    y = reference.grouped_matmul_ref(x, w, group_sizes, out_dtype,
                                     tile=GROUPED_TILE if _GROUPED_REF == "tiles" else None,
                                     per_step=GROUPED_TILES_PER_STEP)
  return y if out_rows is None else y[out_rows]


def _bf16_kernel_rows() -> int:
  """The most rows a bf16 grouped matmul sends to `bf16_mgpu` under the setting (0: none)."""
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  return {"auto": BF16_KERNEL_ROWS, "kernel": bf16_mgpu.MAX_ROWS, "tokamax": 0}[_BF16_GROUPED]


def _bf16_kernel_weight(w, m: int) -> bool:
  """Whether bf16 expert weights `w` with `m` rows go to the Mosaic kernel of `bf16_mgpu.py`."""
  return (kernels_on() and isinstance(w, jax.Array) and w.dtype == jnp.bfloat16 and w.ndim == 3
          and m <= _bf16_kernel_rows())


@_lowered_once("bm", "by_rows", "out_dtype")
def _bf16_grouped(x, w, group_sizes, rows, out_rows, tables, *, bm, by_rows, out_dtype):
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415
  if tables is not None:
    tables = (bm, *tables) + ((ROW_CHUNKS,) if by_rows else ())
  return bf16_mgpu.grouped_matmul(x, w, group_sizes, out_dtype=out_dtype, rows=rows,
                                  out_rows=out_rows, tables=tables)


# Rows (e.g. (token, slot) pairs of a MoE layer) up to this many are ordered and counted by
# comparisons: a row's sorted position is the number of rows before it in (group, row) order,
# one [M, M] compare-and-sum; group sizes one [G, M] compare-and-sum. Above it XLA's sort, a
# scatter and a scatter-add, whose cost does not grow as M^2. A decode step has M = batch x
# top-k (512 at B=64, top-8). `TRACE_JAX_SMALL_SORT` sets it (0: always sort).
SMALL_SORT = int_setting(
    "TRACE_JAX_SMALL_SORT", 4096, minimum=0,
    doc="routing tables by comparisons up to this many rows, sorts above (0: always)")


def sort_by_group(group_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(order, inverse) for rows with int group ids `[M]`: `order` sorts them stably by group (the
  row order `grouped_matmul` takes), `inverse` undoes it (`sorted[inverse]` is the original
  order; it is each row's sorted position)."""
  m = group_ids.shape[0]
  i = jnp.arange(m, dtype=jnp.int32)
  if m <= SMALL_SORT:
    g = group_ids
    before = (g[None, :] < g[:, None]) | ((g[None, :] == g[:, None]) & (i[None, :] < i[:, None]))
    inverse = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(inverse[None, :] == i[:, None], i[None, :], 0), axis=1,
                    dtype=jnp.int32)
    return order, inverse
  order = jnp.argsort(group_ids, stable=True).astype(jnp.int32)
  inverse = jnp.zeros_like(order).at[order].set(i, unique_indices=True)
  return order, inverse


# Rows (one token's top-k) up to this many are routed as chunks of one row each, in the caller's
# order (`row_chunks`): no ordering or counting kernels. Every chunk reads its row's expert, so
# rows that share an expert read it once each: 8 = one token of top-8, whose experts differ.
# `TRACE_JAX_ROW_CHUNK_ROWS` sets it (0: never).
ROW_CHUNK_ROWS = int_setting(
    "TRACE_JAX_ROW_CHUNK_ROWS", 8, minimum=0,
    doc="up to this many routed rows as chunks of one row, no ordering kernels")


def row_chunks(group_ids: jax.Array, num_groups: int):
  """`route` without ordering: (order, inverse, group_sizes, tables) with order = inverse =
  identity and tables (bm, chunk_expert = the ids, chunk_row, slot, ROW_CHUNKS): row i is chunk
  i, a window of bm rows from row 8 * (i // 8) (the activation tile's TMA tiling) whose row
  i % 8 is gathered. Right for any ids; only the grouped kernels need no order, so
  `grouped_matmul` sorts such rows itself before any other path."""
  m = group_ids.shape[0]
  bm = fp4_mgpu.grouped_bm(m, num_groups)
  i = np.arange(m, dtype=np.int32)
  identity = jnp.asarray(i)
  tables = (bm, group_ids.astype(jnp.int32), jnp.asarray(i // 8 * 8),
            jnp.asarray(i * bm + i % 8), ROW_CHUNKS)
  return identity, identity, count_by_group(group_ids, num_groups), tables


def route(group_ids: jax.Array, num_groups: int, w=None):
  """A MoE layer's routing tables: (order, inverse, group_sizes, tables), as `sort_by_group`
  and `count_by_group` give them; tables: the FP4 grouped kernel's chunk tables
  (`fp4_mgpu.chunk_tables` with its rows per chunk and, 5th, the reserved-chunk count that
  the grouped stream-K schedule needs: (bm, chunk_expert, chunk_row, slot, total)) for a
  `grouped_matmul` of these rows with `w` (a packed expert weight up to `SMALL_SORT` rows,
  or bf16 experts for `bf16_mgpu` up to its `MAX_ROWS`), or None (the grouped matmul builds
  them if it needs them). With tables, up to `SMALL_SORT` rows: four small XLA kernels a layer
  (`_routed_by_counts`; nine before session 26). On the GPU, for a packed expert weight, above
  `ROW_CHUNK_ROWS` rows (`row_chunks`: none) and up to `routing.MAX_ROWS`, all of them come from
  two Pallas kernels (`routing.py`, the default since session 45; `TRACE_JAX_ROUTING=xla`: the
  XLA kernels)."""
  m = group_ids.shape[0]
  takes_tables = _kernel_takes_tables(w, group_ids, num_groups)
  if takes_tables and m <= ROW_CHUNK_ROWS and kernels_on():  # (before the kernels: no kernel)
    return row_chunks(group_ids, num_groups)
  if (_ROUTING == "kernel" and kernels_on() and isinstance(w, PackedWeight) and w.experts):
    from trace_jax.kernels import routing  # noqa: PLC0415 - Pallas imports stay lazy
    if routing.kernel_supported(group_ids, num_groups) is None:
      bm = fp4_mgpu.grouped_bm(m, w.codes.shape[0])
      order, inverse, gs, ce, row0, slot, total = routing.routing_tables(
          group_ids, num_groups=num_groups, bm=bm,
          n_chunks=fp4_mgpu.chunk_count(m, num_groups, bm))
      return order, inverse, gs, (bm, ce, row0, slot, total)
  if takes_tables and m <= SMALL_SORT:
    return _routed_by_counts(group_ids, num_groups)
  order, inverse = sort_by_group(group_ids)
  return order, inverse, count_by_group(group_ids, num_groups), None


def _routed_by_counts(group_ids: jax.Array, num_groups: int):
  """`route`'s tables with the grouped kernels' chunk tables in three dependent reductions
  (one XLA kernel each, where `sort_by_group`, `count_by_group` and `fp4_mgpu.chunk_tables`
  take about nine), the same values bit for bit:
    1. over M + E rows: a row's sorted position counts the rows before it in (group, row)
       order; group e's end counts the rows before (e, M) in that order (the ids <= e);
    2. over M + E rows: the order (the row at each sorted position), the groups' first
       and end chunks (prefix sums of the chunks each group takes) and their total;
    3. the chunk owners and window starts (`fp4_mgpu.chunk_owners`).
  A sorted row's slot is its position plus its group's offset: a look-up, one small elementwise
  kernel with the output gathers' bounds masks (`chunk_tables` has no group ids and searches
  for each row's group: a reduction over [M, E])."""
  m = group_ids.shape[0]
  g = group_ids.astype(jnp.int32)
  i = jnp.arange(m, dtype=jnp.int32)
  key_g = jnp.concatenate([g, jnp.arange(num_groups, dtype=jnp.int32)])[:, None]
  key_i = jnp.concatenate([i, jnp.full((num_groups,), m, jnp.int32)])[:, None]
  before = (g[None, :] < key_g) | ((g[None, :] == key_g) & (i[None, :] < key_i))
  counts = jnp.sum(before, axis=1, dtype=jnp.int32)
  inverse, ends = counts[:m], counts[m:]
  sizes = ends - jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  bm = fp4_mgpu.grouped_bm(m, num_groups)
  w = max(m, num_groups)  # columns: rows j for the order, groups e' for the chunk ends
  j = jnp.arange(w, dtype=jnp.int32)[None, :]
  inv_j = jnp.pad(inverse, (0, w - m), constant_values=-1)[None, :]
  nch_j = jnp.pad(fp4_mgpu.chunks_per_group(sizes, bm), (0, w - num_groups))[None, :]
  r = jnp.arange(m + num_groups, dtype=jnp.int32)[:, None]
  sums = jnp.sum(jnp.where(r < m, jnp.where(inv_j == r, j, 0),
                           jnp.where(j <= r - m, nch_j, 0)), axis=1, dtype=jnp.int32)
  # the exclusive sums beside (sibling terms: the chunk counts stay unmaterialized)
  ch_first = jnp.sum(jnp.where(j < r - m, nch_j, 0), axis=1, dtype=jnp.int32)[m:]
  # and the chunks reserved in all, in every element (the grouped stream-K kernel's count)
  total = jnp.sum(jnp.where(j < r + w, nch_j, 0), axis=1, dtype=jnp.int32)
  order, ch_end = sums[:m], sums[m:]
  ce, row0, off = fp4_mgpu.chunk_owners(sizes, ends, ch_first, ch_end, m, bm)
  g_sorted = g[order]
  owned = g_sorted < num_groups  # ids >= num_groups: rows no group holds, read as zeros
  slot = jnp.where(owned, i + off[jnp.minimum(g_sorted, num_groups - 1)], ce.shape[0] * bm)
  return order, inverse, sizes, (bm, ce, row0, slot, total)


def _kernel_takes_tables(w, group_ids, num_groups: int) -> bool:
  """Whether a grouped matmul of these rows with `w` runs a grouped kernel that takes chunk
  tables: the FP4 one for packed experts (also off the GPU, where tests drive its wrapper),
  `bf16_mgpu` on the GPU for bf16 experts it takes."""
  if isinstance(w, PackedWeight):
    return w.experts
  if not _bf16_kernel_weight(w, group_ids.shape[0]):
    return False
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  sizes = jax.ShapeDtypeStruct((num_groups,), jnp.int32)
  return bf16_mgpu.kernel_supported(group_ids, w, sizes) is None


def count_by_group(group_ids: jax.Array, num_groups: int) -> jax.Array:
  """Rows per group, `[num_groups]` int32 (`jnp.bincount` with `length`; by comparisons for up
  to `SMALL_SORT` rows, as `sort_by_group`). Ids must be >= 0; ids >= num_groups are not counted
  (the expert-parallel path marks the rows it does not own so)."""
  if group_ids.shape[0] <= SMALL_SORT:
    g = jnp.arange(num_groups, dtype=group_ids.dtype)
    return jnp.sum(group_ids[None, :] == g[:, None], axis=1, dtype=jnp.int32)
  return jnp.bincount(group_ids, length=num_groups).astype(jnp.int32)


def append_kv(k_cache, v_cache, k, v, index):
  """A decode step's K/V cache write by the Pallas kernel of `kv_append.py`: (k_cache,
  v_cache, kq, vq), or None where the caller's XLA path (quantize, then
  `kv_cache.write_layer`; the same bits) applies: off the GPU, caches the kernel does not
  write, and with `TRACE_JAX_KV_APPEND=xla`."""
  if _KV_APPEND != "kernel" or not kernels_on():
    return None
  from trace_jax.kernels import kv_append  # noqa: PLC0415 - Pallas imports stay lazy
  if kv_append.kernel_supported(k_cache, k) or kv_append.kernel_supported(v_cache, v):
    return None
  return _kv_append(k_cache, v_cache, k, v, index)


@_lowered_once()
def _kv_append(k_cache, v_cache, k, v, index):
  from trace_jax.kernels import kv_append  # noqa: PLC0415 - Pallas imports stay lazy
  return kv_append.append(k_cache, v_cache, k, v, index)


def decode_qkv(qkv, positions, k_cache, v_cache, index, *, num_heads: int, q_scale=None,
               k_scale=None, eps: float = 1e-6, theta: float = 10000.0,
               guidance_bits: bool = False):
  """A decode step's attention inputs by the Pallas kernel of `qkv_append.py`: from the fused
  q/k/v projection's rows qkv `[B, (H + 2 KVH) hd]`, the per-head RMS norms (q_scale, k_scale
  `[hd]`; None: none) and rotary embedding at `positions` `[B]`, K and V written into the NVFP4
  caches at `index`. Returns (q, k_cache, v_cache, kq, vq, bits), q as `decode_attention` will
  read it (an `attention_mgpu.PhysicalQuery` where that is the Mosaic kernel, else `[B, H,
  hd]`), bits the new rows' compact guidance payloads (kbits, vbits) where guidance_bits asks
  for them and `TRACE_JAX_GUIDANCE_BITS=kernel`, else None; or None where the caller's XLA path
  applies: with `TRACE_JAX_DECODE_QKV=xla`, off the GPU, with the K/V append kernel off, and
  for shapes it does not take."""
  if (_DECODE_QKV != "kernel" or _KV_APPEND != "kernel" or not kernels_on()
      or not isinstance(k_cache, QArray)):
    return None
  from trace_jax.kernels import qkv_append as DQ  # noqa: PLC0415 - Pallas imports stay lazy
  if DQ.kernel_supported(qkv, k_cache, v_cache, num_heads):
    return None
  b, _, _, hd = k_cache.shape
  q_like = jax.ShapeDtypeStruct((b, num_heads, hd), qkv.dtype)
  mosaic = (_decode_attention_path(q_like, k_cache, v_cache, None) == "mosaic"
            and DQ.mosaic_layout_supported(k_cache, num_heads) is None)
  layout = "mosaic" if mosaic else "logical"
  return _decode_qkv(qkv, positions, k_cache, v_cache, index, q_scale, k_scale,
                     num_heads=num_heads, eps=eps, theta=theta, layout=layout,
                     guidance_bits=guidance_bits and _GUIDANCE_BITS == "kernel")


@_lowered_once("num_heads", "eps", "theta", "layout", "guidance_bits")
def _decode_qkv(qkv, positions, k_cache, v_cache, index, q_scale, k_scale, *, num_heads, eps,
                theta, layout, guidance_bits):
  from trace_jax.kernels import qkv_append as DQ  # noqa: PLC0415 - Pallas imports stay lazy
  return DQ.decode_qkv(qkv, positions, k_cache, v_cache, index, num_heads=num_heads,
                       q_scale=q_scale, k_scale=k_scale, eps=eps, theta=theta, layout=layout,
                       guidance_bits=guidance_bits)


def add_rms_norm(x, h, scale, eps: float):
  """A decode step's residual add and RMS norm, `(x + h, rms_norm(x + h, scale, eps))`, by the
  Pallas kernel of `add_norm.py` (the sum exact, the norm to rounding), or None where the
  caller's ops apply: with `TRACE_JAX_ADD_NORM=xla`, off the GPU, and for shapes it does not
  take. Inference only (the kernel has no derivative)."""
  if _ADD_NORM != "kernel" or not kernels_on():
    return None
  from trace_jax.kernels import add_norm  # noqa: PLC0415 - Pallas imports stay lazy
  if add_norm.kernel_supported(x, h, scale):
    return None
  return _add_rms_norm(x, h, scale, eps=eps)


@_lowered_once("eps")
def _add_rms_norm(x, h, scale, *, eps):
  from trace_jax.kernels import add_norm  # noqa: PLC0415 - Pallas imports stay lazy
  return add_norm.add_rms_norm(x, h, scale, eps)


def combine_in_kernel() -> bool:
  """Whether a decode step's MoE may leave its output in the down kernel's rows for
  `combine_add_rms_norm` (on the GPU, unless `TRACE_JAX_MOE_COMBINE=xla`); where that
  kernel then declines the shapes, the caller's XLA ops read the rows."""
  return _MOE_COMBINE == "kernel" and kernels_on()


def norm_rows_padded() -> bool:
  """Whether a decode step's input norm may hand the attention its rows padded to a multiple of
  8 (`PaddedRows`, for the bf16 q/k/v kernel's exact rows): on the GPU with
  `TRACE_JAX_NORM_ROWS=padded` (opt-in), the bf16 dense kernel on and its rows exact."""
  if _NORM_ROWS != "padded" or BF16_DENSE != "kernel" or not kernels_on():
    return False
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  return bf16_mgpu.DENSE_ROWS == "exact"


def combine_add_rms_norm(x, rows: ChunkRows, inverse, weights, scale, eps: float,
                         pad_rows: bool = False):
  """A decode step's MoE output, residual add and RMS norm, `(s, rms_norm(s, scale, eps))` with
  s = x + the gates' weighted sum of each token's expert rows (`rows` left by the down kernel,
  pair (t, j) at `rows.slot[inverse[t * k + j]]`), by the Pallas kernel of `moe_combine.py`, or
  None where the caller's ops apply: as `combine_in_kernel`, and for shapes it does not take.
  pad_rows (the attention's input norm): the norm as `PaddedRows` where `norm_rows_padded` and
  the rows are not a multiple of 8. Inference only (the kernel has no derivative)."""
  if not combine_in_kernel():
    return None
  from trace_jax.kernels import moe_combine  # noqa: PLC0415 - Pallas imports stay lazy
  if moe_combine.kernel_supported(x, rows, inverse, weights, scale):
    return None
  n = x.size // x.shape[-1]
  y_rows = -(-n // 8) * 8 if pad_rows and n % 8 and norm_rows_padded() else None
  s, y = _combine_add_rms_norm(x, rows, inverse, weights, scale, eps=eps, y_rows=y_rows)
  return s, (y if y_rows is None else PaddedRows(y, tuple(x.shape)))


@_lowered_once("eps", "y_rows")
def _combine_add_rms_norm(x, rows, inverse, weights, scale, *, eps, y_rows):
  from trace_jax.kernels import moe_combine  # noqa: PLC0415 - Pallas imports stay lazy
  return moe_combine.combine_add_rms_norm(x, rows, inverse, weights, scale, eps, y_rows=y_rows)


def quantize_rows(x, fmt):
  """A rollout activation site's `(q, value)` (`quant.quantize_with_value(x, fmt,
  second_level="row")`, the same bits) from the Pallas kernel of `row_quant.py`, or None where
  the caller's XLA path applies: off the GPU, formats and shapes the kernel does not take, and
  with `TRACE_JAX_ROW_QUANT=xla`."""
  if _ROW_QUANT != "kernel" or not kernels_on():
    return None
  from trace_jax.kernels import row_quant  # noqa: PLC0415 - Pallas imports stay lazy
  if row_quant.kernel_supported(x, fmt):
    return None
  return _quantize_rows(x, fmt=fmt)


@_lowered_once("fmt")
def _quantize_rows(x, *, fmt):
  from trace_jax.kernels import row_quant  # noqa: PLC0415 - Pallas imports stay lazy
  return row_quant.quantize_rows(x, fmt)


def topk_gates(logits, k: int, normalize: bool):
  """A MoE router's (gate weights float32 [N, k], experts int32 [N, k]) from its float32 logits
  by one Pallas kernel (`router_topk.py`: softmax, top-k, renormalized where `normalize`), or
  None where the caller's XLA ops apply: off the GPU, shapes it does not take, and with
  `TRACE_JAX_ROUTER_TOPK=xla` (its weights agree with XLA's to rounding, its experts exactly;
  H200, session 38: the 4-layer decode step at B 256 1.629 -> 1.603 ms of kernels, 151 -> 147
  kernels)."""
  if _ROUTER_TOPK == "xla" or not kernels_on():
    return None
  from trace_jax.kernels import router_topk  # noqa: PLC0415 - Pallas imports stay lazy
  if router_topk.kernel_supported(logits, k):
    return None
  return _topk_gates(logits, k=k, normalize=normalize)


def router_gates(x, w, k: int, normalize: bool):
  """A MoE router's (gate weights, experts) from its bf16 input x `[N, D]` and weights w
  `[D, E]` as the rollout computes them with `TRACE_JAX_ROUTER_SUM=kernel` (opt-in): the
  product as D / 128 float32 parts in one XLA product (`router_topk.router_parts`), their sum,
  softmax, top-k and weights in the gates kernel (`router_topk.topk_gates_of_parts`). The
  products are exact in float32 as in `bf16_operands_dot`; the sums' order is fixed (128-term
  chunks, then the chunks in order), where XLA's own split-K product chooses its own. None where
  the caller's ops apply: off the GPU, `TRACE_JAX_ROUTER_TOPK=xla`, other dtypes and shapes,
  more rows than `router_topk.MAX_PARTS_ROWS` (prefills)."""
  if _ROUTER_SUM != "kernel" or _ROUTER_TOPK == "xla" or not kernels_on():
    return None
  from trace_jax.kernels import router_topk  # noqa: PLC0415 - Pallas imports stay lazy
  if router_topk.parts_supported(x, w, k):
    return None
  return _router_gates(x, w, k=k, normalize=normalize)


@_lowered_once("k", "normalize")
def _router_gates(x, w, *, k, normalize):
  from trace_jax.kernels import router_topk  # noqa: PLC0415 - Pallas imports stay lazy
  return router_topk.topk_gates_of_parts(router_topk.router_parts(x, w), k,
                                         normalize=normalize)


@_lowered_once("k", "normalize")
def _topk_gates(logits, *, k, normalize):
  from trace_jax.kernels import router_topk  # noqa: PLC0415 - Pallas imports stay lazy
  return router_topk.topk_gates(logits, k, normalize=normalize)


def quantize_rows_to_operand(x, fmt, inverse, copies: int, w, tables=None,
                             guidance_bits: bool = False):
  """An activation site quantized for a grouped matmul with `w` whose sorted row p is x's row
  order[p] // copies (a MoE layer's expert input: x one row a token, `inverse` [N * copies] the
  sorted position of each (token, slot) pair): `(q, OperandRows, bits)`, q as `quantize_rows`
  gives it, the dequantized value laid out for `grouped_matmul(..., w, tables=tables)` with no
  row gather, and q's compact guidance payload where guidance_bits asks for it and
  `TRACE_JAX_GUIDANCE_BITS=kernel` (else None), from the Pallas kernel of `row_quant.py`; or
  None where the caller's path applies (as `quantize_rows`, w not an FP4 expert weight,
  `TRACE_JAX_ROW_QUANT_OPERAND=xla`)."""
  if (_ROW_QUANT != "kernel" or _ROW_QUANT_OPERAND != "kernel" or not kernels_on()
      or not isinstance(w, PackedWeight) or not w.experts):
    return None
  from trace_jax.kernels import row_quant  # noqa: PLC0415 - Pallas imports stay lazy
  k = x.shape[-1]
  if row_quant.kernel_supported(x, fmt) or k > w.k_pad:
    return None
  n = x.size // k
  n_rows, k_pad = fp4_mgpu.operand_shape(n * copies, w, tables)
  return _quantize_rows_to_operand(x, inverse.reshape(n, copies), fmt=fmt, n_rows=n_rows,
                                   k_pad=k_pad,
                                   guidance_bits=guidance_bits and _GUIDANCE_BITS == "kernel")


@_lowered_once("fmt", "n_rows", "k_pad", "guidance_bits")
def _quantize_rows_to_operand(x, dest, *, fmt, n_rows, k_pad, guidance_bits):
  from trace_jax.kernels import row_quant  # noqa: PLC0415 - Pallas imports stay lazy
  return row_quant.quantize_rows_to_operand(x, fmt, dest, n_rows=n_rows, k_pad=k_pad,
                                            guidance_bits=guidance_bits)


def swiglu_quantize_rows(gu, f: int, fmt, w_down, tables=None):
  """The expert down-projection input site in the rollout, `(q, OperandRows)`, from the gate/up
  grouped call's rows left in its kernel's chunks (`ChunkRows`, `keep_chunks`): the SwiGLU, the
  site's NVFP4 row quantization (q as `quant.quantize_with_value(h, fmt, second_level="row")`
  gives it) and the dequantized value laid out for `grouped_matmul(..., w_down, tables=tables)`,
  from the Pallas kernel of `swiglu_quant.py`; or None where the caller's XLA path applies: off
  the GPU, gu an array, formats, weights and shapes the kernel does not take, and with
  `TRACE_JAX_SWIGLU_QUANT=xla`."""
  if (_SWIGLU_QUANT != "kernel" or not kernels_on() or not isinstance(gu, ChunkRows)
      or not isinstance(w_down, PackedWeight) or not w_down.experts):
    return None
  from trace_jax.kernels import swiglu_quant  # noqa: PLC0415 - Pallas imports stay lazy
  if swiglu_quant.kernel_supported(gu, f, fmt, w_down.k_pad):
    return None
  n_rows, k_pad = fp4_mgpu.operand_shape(gu.slot.shape[0], w_down, tables)
  return _swiglu_quantize_rows(gu, f=f, fmt=fmt, n_rows=n_rows, k_pad=k_pad)


@_lowered_once("f", "fmt", "n_rows", "k_pad")
def _swiglu_quantize_rows(gu, *, f, fmt, n_rows, k_pad):
  from trace_jax.kernels import swiglu_quant  # noqa: PLC0415 - Pallas imports stay lazy
  return swiglu_quant.swiglu_quantize_rows(gu, f, fmt, n_rows=n_rows, k_pad=k_pad)


def kv_packing(kv_heads: int, head_dim: int, kv_format) -> str:
  """The FP4 code packing (`QArray.packing`) of a new KV cache: "kv_words" where the Mosaic
  NVFP4 decode attention kernel reads it (on the GPU, its head shapes; the Pallas kernels and
  the references read either), else "nibbles"."""
  from trace_jax.kernels import attention_mgpu  # noqa: PLC0415 - Pallas imports stay lazy
  if (_KV_WORDS == "placed" and _ATTENTION_MOSAIC and kernels_on() and kv_format is not None
      and attention_mgpu.cache_supported(tq.get_format(kv_format).name, kv_heads,
                                         head_dim) is None):
    return "kv_words"
  return "nibbles"


def _decode_attention_path(q, k, v, use_kernel) -> str:
  """Which decode attention runs for these operands (q may be shapes only): "reference",
  "mosaic" or "pallas" (`decode_attention`)."""
  from trace_jax.kernels import attention_mgpu, attention_pallas
  if use_kernel is None:
    use_kernel = (_ATTENTION_KERNEL and kernels_on()
                  and attention_pallas.kernel_supported(q, k, v) is None)
  if not use_kernel:
    return "reference"
  short = q.shape[0] * k.shape[1] <= SHORT_CACHE_SLOTS
  if (use_kernel == "mosaic" or (use_kernel is True and _ATTENTION_MOSAIC and not short)) and (
      attention_mgpu.kernel_supported(q, k, v) is None):
    return "mosaic"
  return "pallas"


def decode_attention(q, k, v, valid, *, scale: float | None = None, out_dtype=None,
                     use_kernel: bool | str | None = None, config=None) -> jax.Array:
  """Attention of one query token per sequence over a KV cache (`[B, H, hd]`, or the Mosaic
  kernel's `PhysicalQuery` that `decode_qkv` makes), see `attention_ref.decode_attention_ref`;
  k/v bf16 arrays or FP4/FP8 `QArray`s. use_kernel: None (the default choice), False
  (reference), True (a kernel: Mosaic NVFP4 where it applies and the cache is not short, else
  Pallas), "mosaic" (the Mosaic NVFP4 kernel where it applies)."""
  from trace_jax.kernels import attention_mgpu
  path = _decode_attention_path(q, k, v, use_kernel)
  if path == "mosaic":
    return attention_mgpu.decode_attention(q, k, v, valid, scale=scale, out_dtype=out_dtype,
                                           **(config or {}))
  if isinstance(q, attention_mgpu.PhysicalQuery):
    q = q.logical()
  if path == "reference":
    return attention_ref.decode_attention_ref(q, k, v, valid, scale, out_dtype)
  return _pallas_decode(q, k, v, valid, scale=scale, out_dtype=out_dtype,
                        config=_frozen(config))


@_lowered_once("scale", "out_dtype", "config")
def _pallas_decode(q, k, v, valid, *, scale, out_dtype, config):
  from trace_jax.kernels import attention_pallas  # noqa: PLC0415 - Pallas imports stay lazy
  return attention_pallas.decode_attention(q, k, v, valid, scale=scale, out_dtype=out_dtype,
                                           config=_thawed(config))


def prefill_attention(q, k, v, key_mask, q_start, *, scale: float | None = None,
                      out_dtype=None, use_kernel: bool | None = None, config=None) -> jax.Array:
  """Attention of T query tokens per sequence (`[B, T, H, hd]`, query i at slot `q_start + i`)
  over a KV cache that already holds them, see `attention_ref.prefill_attention_ref`."""
  from trace_jax.kernels import attention_pallas
  if use_kernel is None:
    use_kernel = (_PREFILL_KERNEL and kernels_on() and q.ndim == 4
                  and attention_pallas.kernel_supported(q[:, 0], k, v) is None)
  if not use_kernel:
    return attention_ref.prefill_attention_ref(q, k, v, key_mask, q_start, scale, out_dtype)
  return _pallas_prefill(q, k, v, key_mask, q_start, scale=scale, out_dtype=out_dtype,
                         config=_frozen(config))


@_lowered_once("scale", "out_dtype", "config")
def _pallas_prefill(q, k, v, key_mask, q_start, *, scale, out_dtype, config):
  from trace_jax.kernels import attention_pallas  # noqa: PLC0415 - Pallas imports stay lazy
  return attention_pallas.prefill_attention(q, k, v, key_mask, q_start, scale=scale,
                                            out_dtype=out_dtype,
                                            config=_thawed(config))
