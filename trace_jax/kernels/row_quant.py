"""An activation site's NVFP4 quantization in the rollout as one Pallas kernel: rows (blocks of 16
along the last axis, one second-level scale per row) to codes, block scales, row scales and the
dequantized value, which the next matmul takes.

Owns the kernel, its support check and its wrapper, and the same kernel writing the value as an
FP4 matmul's operand rows (`quantize_rows_to_operand`: the experts' input, each token's row at
its (token, slot) pairs' sorted rows of the gate/up kernel's operand; its reference
`quantize_rows_to_operand_ref`), with the body parts `swiglu_quant` shares (`decoded_value`,
`operand_order`, `store_fields`). The result is defined by
`quant.quantize_with_value(x, fmt, second_level="row")`: the same bits in every field and in
the value. That is four XLA kernels per site in a decode step on the H200 (block maxima, row
maxima, scales, codes and value; session-7 profile), one of them fused with the site's
producer; this is one.

The encoding is `quant.qarray.encode_blocks` traced inside the kernel, with the correctly
rounded reciprocal it needs computed by the PTX `div.rn.f32` instruction on the GPU and by the
ordinary division in interpret mode (`reciprocal`; `encode_tile` is the in-kernel encoding
`kv_append` shares). The value is
`E2M1(code) * (s * g)` as `decode_blocks` forms it, the E2M1 magnitude from the code's e4m3 bit
pattern (`e2m1.as_e4m3_bits`, exact) instead of a table.

Lowering: a portable Pallas body, `interpret=True` on CPU, the Triton lowering on the GPU (as
`attention_pallas`). On the H200 (session 8) every field equals the XLA path bit for bit, and
the decode step with both glue kernels runs 49 fewer kernels, 3.7% less kernel time; the GPU
default in `dispatch` (`TRACE_JAX_ROW_QUANT=xla` opts out).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels.attention_pallas import _pow2_at_least
from trace_jax.settings import int_setting
from trace_jax.quant import e2m1
from trace_jax.quant import formats as F
from trace_jax.quant import qarray as Q

# Elements of x a program takes (whole rows: at least one) and its warps. H200, us a call at
# (2,048 x 768) / (256 x 2048) / (256 x 768) / (32 x 2048), 2048 elements: 5.06 / 2.62 / 1.89 /
# 1.89, 4096 (before): 5.31 / 2.50 / 2.59 / 2.24; XLA's four kernels 13.1 / 9.4 / 8.5 / 7.6
# (benchmarks/results/session32_h200_2026-12-04, `bench_row_quant.py`: 1-8 warps, 1,024-8,192
# elements; one warp and 8,192 elements were 2-30x slower)
TILE_ELEMS = 2048
NUM_WARPS = 4
# The longest row the kernel takes (a program holds at least one whole row, padded to a power
# of two): the limit TILE_ELEMS set before session 32 made tiles smaller; the 30B-A3B o_proj's
# input rows (32 heads x 128) are this long.
MAX_ROW_ELEMS = 4096
# Warps of `quantize_rows_to_operand`'s programs (one 2,048-element row each at the experts'
# input: few programs, so more warps shorten each one's serial work; TRACE_JAX_OPERAND_WARPS).
# H200, B 256, ncu: 6.2 us at 8, 6.5 at 4 (7.1 before the destinations were loaded first)
OPERAND_WARPS = int_setting("TRACE_JAX_OPERAND_WARPS", 8, minimum=1,
                            doc="warps a program of the experts' input quantization kernel")


def _ieee_reciprocal(d):
  """`1 / d` correctly rounded, by the PTX instruction (elementwise, float32)."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - GPU lowering only
  return plt.elementwise_inline_asm(
      "div.rn.f32 $0, $1, $2;", args=[jnp.ones_like(d), d], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(d.shape, jnp.float32)])[0]


def reciprocal(interpret: bool):
  """The reciprocal a kernel body passes to `encode_blocks`: the PTX division when compiled,
  `formats.reciprocal` in interpret mode (the same correctly rounded values)."""
  return F.reciprocal if interpret else _ieee_reciprocal


def rounding(dtype, interpret: bool):
  """The rounding to dtype a kernel body passes to the model's functions (`transformer.rms_norm`,
  `combine_experts`): theirs (`round_to`, `lax.reduce_precision`) in interpret mode, two casts
  when compiled (Triton has no reduce_precision); the same values."""
  if interpret:
    return None
  return lambda v: v.astype(dtype).astype(jnp.float32)


def encode_tile(xb, fmt, recip, g_amax=None):
  """Inside a kernel body: the row encoding of blocks `xb [R, NB, 16]` (float32; one second-level
  scale per row) -> (the `Blocked` encoding, codes packed two per byte `[R, NB, 8]` uint8, the
  even element in the low nibble as `e2m1.pack_nibbles` has it). The packing is a sum over the
  pair axis: the Triton lowering slices no register arrays. g_amax `[R, 1]`: the rows'
  maxima where xb holds a part of them (`encode_blocks`)."""
  r, nb, block = xb.shape
  blk = Q.encode_blocks(xb, fmt, (1, 2), recip=recip, g_amax=g_amax)
  weight = 1 + 15 * jax.lax.broadcasted_iota(jnp.int32, (1, 1, 1, 2), 3)
  pairs = (blk.codes.astype(jnp.int32) & 15).reshape(r, nb, block // 2, 2)
  return blk, jnp.sum(pairs * weight, axis=-1).astype(jnp.uint8)


def kernel_supported(x, fmt) -> str | None:
  """None if the kernel quantizes `x` (`[..., K]`, K a multiple of 16 up to 4096) in `fmt`."""
  fmt = F.get_format(fmt)
  if fmt.name != "nvfp4":
    return f"format {fmt.name}, the kernel writes nvfp4"
  if x.ndim < 1 or x.shape[-1] % fmt.block or not 0 < x.shape[-1] <= MAX_ROW_ELEMS:
    return (f"rows of {x.shape[-1:]} elements: the kernel takes multiples of 16 up to "
            f"{MAX_ROW_ELEMS}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return f"dtype {x.dtype}"
  return None


def decoded_value(blk):
  """Inside a kernel body: the dequantized value of a row encoding `blk` (float32 [R, NB, 16]),
  `E2M1(code) * (s * g)` as `decode_blocks` forms it."""
  q = jax.lax.bitcast_convert_type(e2m1.as_e4m3_bits(blk.codes, False),
                                   jnp.float8_e4m3fn).astype(jnp.float32)
  q = q * jnp.float32(e2m1.E4M3_OF_E2M1_SCALE)  # E2M1(code), exact
  return q * F.nvfp4_divisor(blk.scales, blk.g)[..., None]


def operand_order(value):
  """Inside a kernel body: rows of blocks `[R, NB, 16]` (NB a multiple of 4) in an FP4 matmul
  kernel's operand order (`layout.permute_k`), as `[R, NB / 4, 64]`: block 4c + q, element
  2ci + v to physical 64c + 8ci + 2q + v."""
  r, nb, _ = value.shape
  return jnp.swapaxes(value.reshape(r, nb // 4, 4, 8, 2), 2, 3).reshape(r, nb // 4, 64)


def store_fields(at, codes_ref, scales_ref, g_ref, blk, packed, r0, rows, ok, row_ok):
  """Inside a kernel body: a row encoding's codes, block scales and row scales stored at the
  programs' rows (`at`: their blocks of a ref), masked by `ok` [R, NB] and `row_ok` [R]."""
  plt = triton_primitives()
  plt.store(at(codes_ref), packed, mask=ok[:, :, None])
  plt.store(at(scales_ref), blk.scales, mask=ok)
  plt.store(g_ref.at[pl.ds(r0, rows)], blk.g, mask=row_ok[:, None])


def triton_primitives():
  """Pallas' Triton primitives (masked loads and stores), imported where a kernel traces."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415 - masked loads/stores
  return plt


def field_shapes(n: int, nb: int, fmt, *more) -> list:
  """The outputs of a row-quantizing kernel: codes (two a byte), block scales and row scales of
  n rows of nb blocks, then `more`."""
  return [jax.ShapeDtypeStruct((n, nb, fmt.block // 2), jnp.uint8),
          jax.ShapeDtypeStruct((n, nb), jnp.float8_e4m3fn),
          jax.ShapeDtypeStruct((n, 1), jnp.float32), *more]


def whole(s):
  """The BlockSpec of a whole array (the kernels index their refs themselves)."""
  return pl.BlockSpec(s.shape, lambda i: (0,) * len(s.shape))


def launch_params(interpret: bool, num_warps: int):
  """The Triton launch of a kernel body: its warps, one stage; None in interpret mode."""
  if interpret:
    return None
  return triton_primitives().CompilerParams(num_warps=num_warps, num_stages=1)


def launch(body, *args, programs: int, out_shape, interpret: bool, num_warps: int, name: str):
  """A glue kernel's call: `programs` programs of `body`, each indexing whole-array refs of
  `args` and of the outputs `out_shape` itself."""
  return pl.pallas_call(
      body,
      grid=(programs,),
      in_specs=[whole(a) for a in args],
      out_specs=[whole(s) for s in out_shape],
      out_shape=out_shape,
      compiler_params=launch_params(interpret, num_warps),
      interpret=interpret,
      name=name,
  )(*args)


def _encode_rows(x_ref, codes_ref, scales_ref, g_ref, *, fmt, recip, n: int, nb: int,
                 rows: int, nb_pad: int, bits_ref=None):
  """Inside a kernel body: the program's rows of x loaded, encoded and their codes, block
  scales and row scales stored, and their compact guidance bits where `bits_ref` is given
  ([N, NB, block / 8], `e2m1.nibble_mantissa_bits`) -> (the encoding, `at` (the rows' blocks
  of a ref), the [R, NB] mask)."""
  r0 = pl.program_id(0) * rows
  row_ok = (r0 + jnp.arange(rows)) < n
  ok = row_ok[:, None] & (jnp.arange(nb_pad) < nb)[None, :]
  at = lambda ref: ref.at[pl.ds(r0, rows), pl.ds(0, nb_pad)]  # noqa: E731
  x = triton_primitives().load(at(x_ref), mask=ok[:, :, None], other=0).astype(jnp.float32)
  blk, packed = encode_tile(x, fmt, recip)  # codes [R, NB, 16], scales [R, NB]
  store_fields(at, codes_ref, scales_ref, g_ref, blk, packed, r0, rows, ok, row_ok)
  if bits_ref is not None:
    triton_primitives().store(at(bits_ref), e2m1.nibble_mantissa_bits(packed, in_kernel=True),
                              mask=ok[:, :, None])
  return blk, at, ok


def _kernel(x_ref, codes_ref, scales_ref, g_ref, val_ref, **kw):
  blk, at, ok = _encode_rows(x_ref, codes_ref, scales_ref, g_ref, **kw)
  triton_primitives().store(at(val_ref), decoded_value(blk).astype(val_ref.dtype),
                            mask=ok[:, :, None])


def _operand_kernel(x_ref, dest_ref, codes_ref, scales_ref, g_ref, op_ref, *bits_ref,
                    copies: int, n_rows: int, **kw):
  """`_kernel` with the value written as an operand's rows: row i to rows dest[i, :]; the
  operand's rows past n * copies get zeros, `rows` of them a program; the rows' guidance bits
  where a `bits_ref` output follows."""
  plt = triton_primitives()
  n, rows, nb_pad = kw["n"], kw["rows"], kw["nb_pad"]
  r0 = pl.program_id(0) * rows
  r = r0 + jnp.arange(rows)
  row_ok = r < n
  # the destinations first: loaded after the encoding, their latency stood exposed (the
  # kernel's main stall on the H200, session 37's ncu); masked rows aim past the operand
  # (interpret mode drops those updates)
  dests = [plt.load(dest_ref.at[pl.ds(r0, rows), jnp.int32(j)], mask=row_ok, other=n_rows)
           for j in range(copies)]
  blk = _encode_rows(x_ref, codes_ref, scales_ref, g_ref, bits_ref=(bits_ref or [None])[0],
                     **kw)[0]
  value = operand_order(decoded_value(blk).astype(op_ref.dtype))  # [R, C, 64]
  c = jnp.arange(nb_pad // 4)
  cols = (c[None, :, None], jnp.arange(64)[None, None, :])
  c_ok = (c < op_ref.shape[1])[None, :, None]
  for d in dests:
    plt.store(op_ref.at[(d[:, None, None],) + cols], value, mask=row_ok[:, None, None] & c_ok)
  pad = n * copies + r
  plt.store(op_ref.at[(pad[:, None, None],) + cols], jnp.zeros_like(value),
            mask=(pad < n_rows)[:, None, None] & c_ok)


def _row_qarray(codes, scales, g, shape, fmt) -> Q.QArray:
  """The kernels' fields of `[N, ...]` rows as the `QArray` of x's shape (blocked along its
  last axis, one row scale a row)."""
  *lead, k = shape
  return Q.QArray(codes.reshape(*lead, k // 2), scales.reshape(*lead, k // fmt.block),
                  g.reshape(*lead, 1), fmt, len(lead), tuple(shape))


def quantize_rows(x: jax.Array, fmt, *, interpret: bool = False, tile_elems: int = TILE_ELEMS,
                  num_warps: int = NUM_WARPS):
  """`(q, value)` as `quant.quantize_with_value(x, fmt, second_level="row")` gives them, from
  one kernel: q a `QArray` blocked along the last axis, value in x's dtype. tile_elems: elements
  of x a program takes (whole rows, at least one), num_warps: its warps."""
  fmt = F.get_format(fmt)
  why = kernel_supported(x, fmt)
  if why:
    raise ValueError(f"row quantization kernel: {why}")
  *lead, k = x.shape
  n = math.prod(lead)
  nb = k // fmt.block
  nb_pad = _pow2_at_least(nb, 1)
  rows = max(1, tile_elems // (nb_pad * fmt.block))
  xb = x.reshape(n, nb, fmt.block)
  out_shape = field_shapes(n, nb, fmt, jax.ShapeDtypeStruct((n, nb, fmt.block), x.dtype))
  codes, scales, g, value = launch(
      functools.partial(_kernel, fmt=fmt, n=n, nb=nb, rows=rows, nb_pad=nb_pad,
                        recip=reciprocal(interpret)),
      xb, programs=-(-n // rows), out_shape=out_shape, interpret=interpret,
      num_warps=num_warps, name="row_quant_nvfp4")
  q = _row_qarray(codes, scales, g, x.shape, fmt)
  return q, value.reshape(x.shape)


def quantize_rows_to_operand(x: jax.Array, fmt, dest: jax.Array, *, n_rows: int, k_pad: int,
                             guidance_bits: bool = False, interpret: bool = False,
                             tile_elems: int = TILE_ELEMS, num_warps: int | None = None):
  """`(q, operand, bits)`: q as `quantize_rows` gives it, bits (with guidance_bits, else None)
  its compact guidance payload (`make_guidance(q).payload`, uint8 `[..., K / 8]`), and
  `layout.OperandRows` of the dequantized
  value laid out for an FP4 matmul kernel (`layout.permute_k_rows`), x's row i (its leading
  axes flattened) at the operand's rows dest[i, :], rows past N * copies zeros. dest: int
  [N, copies] holding each of range(N * copies) once (a MoE layer's `inverse`, reshaped: the
  sorted position of each (token, slot) pair); n_rows >= N * copies, k_pad a multiple of 64,
  >= K. One kernel where `quantize_rows` and the operand's gather are two. num_warps: None for
  `OPERAND_WARPS`."""
  from trace_jax.kernels import layout  # noqa: PLC0415 - layout imports quant, not kernels
  fmt = F.get_format(fmt)
  why = kernel_supported(x, fmt)
  if why:
    raise ValueError(f"row quantization kernel: {why}")
  *lead, k = x.shape
  n = math.prod(lead)
  copies = dest.shape[-1]
  if dest.shape != (n, copies) or n_rows < n * copies or k_pad % 64 or k_pad < k:
    raise ValueError(f"an operand of [{n_rows}, {k_pad}] from {n} rows of {k} to destinations "
                     f"{list(dest.shape)}")
  nb = k // fmt.block
  nb_pad = _pow2_at_least(max(nb, k_pad // fmt.block), 4)
  rows = max(1, tile_elems // (nb_pad * fmt.block))
  out_shape = field_shapes(n, nb, fmt,
                           jax.ShapeDtypeStruct((n_rows, k_pad // 64, 64), jnp.bfloat16))
  if guidance_bits:
    out_shape.append(jax.ShapeDtypeStruct((n, nb, fmt.block // 8), jnp.uint8))
  xb = x.reshape(n, nb, fmt.block)
  dest = dest.astype(jnp.int32)
  programs = max(-(-n // rows), -(-(n_rows - n * copies) // rows))
  codes, scales, g, op, *bits = launch(
      functools.partial(_operand_kernel, fmt=fmt, n=n, nb=nb, rows=rows, nb_pad=nb_pad,
                        copies=copies, n_rows=n_rows, recip=reciprocal(interpret)),
      xb, dest, programs=programs, out_shape=out_shape, interpret=interpret,
      num_warps=num_warps or OPERAND_WARPS, name="row_quant_operand_nvfp4")
  q = _row_qarray(codes, scales, g, x.shape, fmt)
  bits = bits[0].reshape(*lead, k // 8) if guidance_bits else None
  return q, layout.OperandRows(op.reshape(n_rows, k_pad), n * copies), bits


def quantize_rows_to_operand_ref(x: jax.Array, fmt, dest: jax.Array, *, n_rows: int,
                                 k_pad: int):
  """`quantize_rows_to_operand` in XLA ops: the site's quantization, the value's rows gathered
  into destination order (`order // copies`, order the inverse of dest) and laid out."""
  from trace_jax.kernels import layout  # noqa: PLC0415
  q, value = Q.quantize_with_value(x, fmt, second_level="row", validate=False)
  n, copies = dest.shape
  flat = dest.reshape(-1).astype(jnp.int32)
  order = jnp.zeros_like(flat).at[flat].set(jnp.arange(n * copies, dtype=jnp.int32))
  rows = value.reshape(n, -1)[order // copies]
  rows = jnp.pad(rows, ((0, n_rows - n * copies), (0, 0)))  # padding rows: zeros
  return q, layout.OperandRows(layout.permute_k_rows(rows, None, n_rows, k_pad), n * copies)
