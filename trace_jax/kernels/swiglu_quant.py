"""The expert down-projection's input in the rollout as one Pallas kernel: the SwiGLU of the
gate/up kernel's rows, read where that kernel left them (its chunk rows, through the slot
table), the site's NVFP4 row quantization, and the dequantized value written straight into the
down kernel's operand (`layout.permute_k_rows`: K pair-permuted, rows padded with zeros).

Owns the kernel, its support check, its reference and the SwiGLU's rounding on the GPU. The
result is defined by `swiglu_quantize_rows_ref`, the XLA ops the model runs without it: a row
gather (`fp4_mgpu.gather_rows`), `nn.silu(g) * u`, `quant.quantize_with_value(second_level=
"row")` and `layout.permute_k_rows`. In the 8k-capacity decode step (B 256) those are four
kernels a layer, ~14 us of kernel time on the H200; this is one of 9.0 us (session 37,
`benchmarks/results/session37_h200_2026-12-04`; 8.6 against 19.9 us a call alone). Nsight
Compute had it bound by instructions (ALU 60%, DRAM 12.6% of peak): the encoding's integer
work, the SwiGLU's roundings and the 16 idle blocks of 64 a row of F 768 held in one tile.
Since session 38 a row is held in tiles with no idle blocks (`SPLIT_ROWS`) and the E2M1 index
takes fewer instructions (`e2m1.magnitude_index_rtne`): 8.6 -> 7.4 us a call at B 256.

The SwiGLU rounds as XLA:GPU computes `nn.silu(g) * u` in bf16 (its optimized HLO: `exp(-g)`
and `+ 1` in bf16, `1 / d` in float32 rounded to bf16, then two bf16 products): each of those
ops rounded to bf16 here too, the exponential by libdevice's `__nv_expf` (the Triton
lowering's) and the reciprocal by the PTX `rcp.rn.f32`. In interpret mode the body runs
`nn.silu(g) * u` itself, the reference's own ops.

Lowering: a portable Pallas body, `interpret=True` on CPU, the Triton lowering on the GPU (as
`row_quant`, whose encoding it shares).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import layout as L
from trace_jax.kernels.attention_pallas import _pow2_at_least
from trace_jax.kernels import row_quant as RQ
from trace_jax.kernels.row_quant import (decoded_value, encode_tile, operand_order, reciprocal,
                                         store_fields)
from trace_jax.models import transformer as T
from trace_jax.settings import choice_setting, int_setting
from trace_jax.quant import formats as F
from trace_jax.quant import qarray as Q

# Elements of h a program takes (whole rows, at least one; a row of F 768 is held as 1,024) and
# its warps (`TRACE_JAX_SWIGLU_TILE`, `TRACE_JAX_SWIGLU_WARPS` for A/B runs). H200, B 256, us a
# call: 2,048 x 4 warps 8.61, x 8 8.77; 1,024 x 4 9.82; 4,096 x 8 9.04 (session 37)
TILE_ELEMS = int_setting("TRACE_JAX_SWIGLU_TILE", 2048, minimum=16,
                         doc="elements a tile of the SwiGLU kernel")
NUM_WARPS = int_setting("TRACE_JAX_SWIGLU_WARPS", 4, minimum=1,
                        doc="warps a program of the SwiGLU kernel")
MAX_ROW_ELEMS = 4096  # the longest h row (F) a program holds
# "on": rows in tiles of the largest power of two of blocks that divides them (F 768: three
# tiles of 16 blocks), no idle lanes; "off": one tile of the blocks rounded up to a power of
# two (64 for 48: a quarter of the lanes idle in a kernel that Nsight Compute has bound by
# instructions, session 37). H200 (session 38), us a call, off -> on: B 256 8.64 -> 8.03, B 64
# 4.77 -> 4.83 (4 warps); the 4-layer decode step's SwiGLU kernels 37.4 -> 35.7 us, its
# prefill's 12.0 -> 10.6 ms; bit for bit the same. `TRACE_JAX_SWIGLU_SPLIT=off`: the other
SPLIT_ROWS = choice_setting(
    "TRACE_JAX_SWIGLU_SPLIT", "on", ("off", "on"),
    doc="a row of the SwiGLU kernel in tiles with no idle blocks, or one tile")


def swiglu(g, u, *, to_bf16=None, recip=None):
  """`nn.silu(g) * u` for bf16 g and u, rounded as XLA:GPU rounds it (module docstring): exp(-g),
  + 1, the reciprocal, g * s and * u, each rounded to bf16, in float32 arithmetic. to_bf16: the
  rounding (`transformer.round_to`; a kernel body casts, `row_quant.rounding`); recip: 1 / d (a
  kernel body: the PTX division)."""
  rnd = to_bf16 or functools.partial(T.round_to, dtype=jnp.bfloat16)
  recip = recip or (lambda d: 1.0 / d)
  g = g.astype(jnp.float32)
  e = rnd(jnp.exp(-g))
  s = rnd(recip(rnd(e + 1.0)))
  return (rnd(g * s) * u.astype(jnp.float32)).astype(jnp.bfloat16)


def _rcp(d):
  """`1 / d` correctly rounded, by the PTX reciprocal (`rcp.rn.f32`: fewer instructions than
  the division `row_quant` uses, the same value; elementwise, float32)."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - GPU lowering only
  return plt.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[d], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])[0]


def _swiglu_in_kernel(g, u, interpret: bool):
  """`swiglu` in a kernel body: compiled, casts round and the PTX reciprocal divides."""
  if interpret:
    return swiglu(g, u)
  return swiglu(g, u, to_bf16=RQ.rounding(jnp.bfloat16, interpret=False), recip=_rcp)


def kernel_supported(gu: L.ChunkRows, f: int, fmt, k_pad: int) -> str | None:
  """None if the kernel takes the down input of h = silu(gate) * up, `f` columns each, from
  `gu` (gate columns [0, f), up [f, 2f)) in `fmt` for an operand of `k_pad` columns."""
  fmt = F.get_format(fmt)
  if fmt.name != "nvfp4":
    return f"format {fmt.name}, the kernel writes nvfp4"
  if f % 64 or not 0 < f <= MAX_ROW_ELEMS:
    return f"rows of {f} elements: the kernel takes multiples of 64 up to {MAX_ROW_ELEMS}"
  if (gu.rows.dtype != jnp.bfloat16 or gu.rows.shape[1] < 2 * f or gu.rows.shape[1] % 16
      or gu.n != 2 * f):
    return f"gate/up rows {gu.rows.dtype}{list(gu.rows.shape)} for n = {gu.n} of 2 x {f}"
  if k_pad % 64 or k_pad < f or k_pad > _pow2_at_least(f // 16, 1) * 16:
    return f"an operand of {k_pad} columns for {f}"
  return None


def _kernel(slot_ref, gu_ref, codes_ref, scales_ref, g_ref, op_ref, *, fmt, recip, interpret,
            m: int, src: int, nb: int, sub: int, parts: int, chunks: int, rows: int,
            n_rows: int):
  """Rows of h in `parts` tiles of `sub` blocks (powers of two; one tile of nb rounded up, or
  tiles that hold nb exactly, no idle blocks), their row maxima taken over all tiles."""
  plt = RQ.triton_primitives()
  r0 = pl.program_id(0) * rows
  r = r0 + jnp.arange(rows)
  row_ok = r < m
  slot = plt.load(slot_ref.at[pl.ds(r0, rows)], mask=row_ok, other=0)
  slot, src_ok = L.chunk_row_index(slot, src, row_ok)
  tiles = []
  for t in range(parts):
    blk = t * sub + jnp.arange(sub)
    blk_ok = blk < nb
    ok = (src_ok[:, None] & blk_ok[None, :])[:, :, None]
    # gathers as integer indices in every axis (what interpret mode's discharge takes,
    # clamping the masked blocks past the row); plain ranges in the block and element axes,
    # so that Triton sees contiguous, aligned rows and loads them in vectors
    at = (slot[:, None, None], blk[None, :, None], jnp.arange(16)[None, None, :])
    gate = plt.load(gu_ref.at[at], mask=ok, other=0)
    up = plt.load(gu_ref.at[at[0], at[1] + nb, at[2]], mask=ok, other=0)
    # [R, sub, 16]; zeros past the row
    tiles.append((t, blk_ok, _swiglu_in_kernel(gate, up, interpret).astype(jnp.float32)))
  g_amax = None
  if parts > 1:
    g_amax = functools.reduce(jnp.maximum, [jnp.max(Q.block_amax(h), axis=1)
                                            for _, _, h in tiles])[:, None]
  for t, blk_ok, h in tiles:
    blk, packed = encode_tile(h, fmt, recip, g_amax)
    at = lambda ref: ref.at[pl.ds(r0, rows), pl.ds(t * sub, sub)]  # noqa: E731,B023
    store_fields(at, codes_ref, scales_ref, g_ref, blk, packed, r0, rows,
                 row_ok[:, None] & blk_ok[None, :], row_ok)
    # rows m.. of the operand's padding get zeros (value is zero there: nothing was loaded)
    value = operand_order(decoded_value(blk).astype(op_ref.dtype))
    c = t * sub // 4 + jnp.arange(sub // 4)
    op_ok = ((r < n_rows)[:, None] & (c < chunks)[None, :])[:, :, None]
    plt.store(op_ref.at[pl.ds(r0, rows), pl.ds(t * sub // 4, sub // 4)], value, mask=op_ok)


def _tiles(nb: int, k_pad: int, split: bool) -> tuple[int, int]:
  """(sub, parts): one tile of nb (or the operand's k_pad / 16) blocks rounded up to a power of
  two; split: tiles of the largest power of two dividing nb, where they cover the operand."""
  if split and k_pad == nb * 16:
    sub = nb & -nb
    if sub >= 4:
      return sub, nb // sub
  return _pow2_at_least(max(nb, k_pad // 16), 4), 1


def swiglu_quantize_rows(gu: L.ChunkRows, f: int, fmt, *, n_rows: int, k_pad: int,
                         interpret: bool = False, tile_elems: int = TILE_ELEMS,
                         num_warps: int = NUM_WARPS, split: bool | None = None):
  """`(q, operand)`: h = silu(gate) * up of gu's rows (`[M, f]`), q its `QArray` (blocked along
  the last axis, one row scale a row) and operand `L.OperandRows` of its dequantized value, as
  `swiglu_quantize_rows_ref` gives them; n_rows (>= M) and k_pad (>= f, multiple of 64) the
  operand's rows and columns. split: a row in tiles with no idle blocks (F 768: three of 16
  blocks, where one tile holds 64 for 48; None: `SPLIT_ROWS`)."""
  fmt = F.get_format(fmt)
  why = kernel_supported(gu, f, fmt, k_pad)
  if why:
    raise ValueError(f"SwiGLU row quantization kernel: {why}")
  m = gu.slot.shape[0]
  if n_rows < m:
    raise ValueError(f"an operand of {n_rows} rows for {m}")
  src, n_pad = gu.rows.shape
  nb = f // fmt.block
  sub, parts = _tiles(nb, k_pad, SPLIT_ROWS == "on" if split is None else split)
  rows = 1 << (max(1, tile_elems // (sub * parts * fmt.block)).bit_length() - 1)
  gu_b = gu.rows.reshape(src, n_pad // fmt.block, fmt.block)  # columns past 2f: never read
  out_shape = RQ.field_shapes(m, nb, fmt,
                              jax.ShapeDtypeStruct((n_rows, k_pad // 64, 64), jnp.bfloat16))
  slot = gu.slot.astype(jnp.int32)
  codes, scales, g, op = RQ.launch(
      functools.partial(_kernel, fmt=fmt, recip=reciprocal(interpret), interpret=interpret,
                        m=m, src=src, nb=nb, sub=sub, parts=parts, chunks=k_pad // 64,
                        rows=rows, n_rows=n_rows),
      slot, gu_b, programs=-(-n_rows // rows), out_shape=out_shape, interpret=interpret,
      num_warps=num_warps, name="swiglu_row_quant_nvfp4")
  q = Q.QArray(codes.reshape(m, f // 2), scales, g, fmt, 1, (m, f))
  return q, L.OperandRows(op.reshape(n_rows, k_pad), m)


def swiglu_quantize_rows_ref(gu: L.ChunkRows, f: int, fmt, *, n_rows: int, k_pad: int):
  """The kernel's definition in XLA ops: the rows, `swiglu` (`nn.silu(g) * u` as XLA:GPU
  rounds it), the site's row quantization and the operand layout, its padding rows zeros."""
  x = gu.gather()
  h = swiglu(x[:, :f], x[:, f:])
  q, value = Q.quantize_with_value(h, fmt, second_level="row", validate=False)
  m = gu.slot.shape[0]
  value = jnp.pad(value, ((0, n_rows - m), (0, 0)))  # padding rows: zeros
  return q, L.OperandRows(L.permute_k_rows(value, None, n_rows, k_pad), m)
