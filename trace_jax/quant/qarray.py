"""The quantized-array pytree and `quantize` / `dequantize`.

`QArray` holds what a block-scaled tensor really is in memory: packed codes (FP4: two per
`uint8`, even index in the low nibble, pairs along the block axis), one scale per block
(`float8_e8m0fnu` or `float8_e4m3fn`), and for NVFP4 the float32 second-level scale. Blocks
run along `axis`, the contraction axis of the matmul that consumes the tensor.

Shapes that are not a multiple of the block are **padded** with zeros along the block axis
(always, for every format; zeros change no scale) and the logical shape is kept, so
`dequantize` returns the original shape. Non-finite input raises in eager mode; inside `jit` the
block's (NVFP4: the second-level scope's) scale becomes NaN so it decodes to NaN, never to 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import e2m1
from trace_jax.quant import formats as F

SecondLevel = str | Sequence[int]


# --------------------------------------------------------------------------- blocked layout

def normalize_axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"block axis {axis} is out of range for a {ndim}-d array")
  return axis % ndim


def to_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """Move `axis` last, zero-pad it to a multiple of `block`, split it: (..., nb, block)."""
  x = jnp.moveaxis(x, axis, -1)
  k = x.shape[-1]
  pad = (-k) % block
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  return x.reshape(*x.shape[:-1], (k + pad) // block, block)


def from_blocks(xb: jax.Array, axis: int, k: int) -> jax.Array:
  """Inverse of `to_blocks`: merge blocks, drop padding, move the axis back."""
  x = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])[..., :k]
  return jnp.moveaxis(x, -1, axis)


def _second_level_reduce_axes(second_level: SecondLevel, ndim: int, axis: int) -> tuple[int, ...]:
  """Axes of the blocked layout (lead..., nb, block) that `g` reduces over."""
  lead = [a for a in range(ndim) if a != axis]  # original axes, in blocked order
  if second_level == "tensor":
    keep = ()
  elif second_level == "row":
    keep = tuple(lead)
  elif isinstance(second_level, str):
    raise ValueError(
        f"unknown second_level {second_level!r}: use 'tensor', 'row' or a tuple of the axes "
        "that index separate tensors (e.g. (0,) for stacked experts)")
  else:
    keep = tuple(normalize_axis(a, ndim) for a in second_level)
    if axis in keep:
      raise ValueError(f"second_level axes {tuple(second_level)} include the block axis {axis}")
  reduce = [i for i, a in enumerate(lead) if a not in keep]
  return tuple(reduce) + (len(lead), len(lead) + 1)


def check_finite(x, what: str = "input") -> None:
  """Eager validation: raise a clear error for NaN/Inf. A no-op on tracers (inside jit)."""
  if isinstance(x, jax.core.Tracer):
    return
  arr = np.asarray(x)
  if arr.dtype.kind not in "fc" and not jnp.issubdtype(arr.dtype, jnp.floating):
    return
  bad = ~np.isfinite(arr.astype(np.float32))
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{what} has {int(bad.sum())} non-finite value(s) (NaN/Inf), first at index {idx} "
        f"= {arr[idx]!r}; refusing to quantize (inside jit such blocks decode to NaN)")


# --------------------------------------------------------------------------- block encode

@dataclasses.dataclass
class Blocked:
  """Result of encoding in the blocked layout (lead..., nb, block)."""

  codes: jax.Array  # uint8 E2M1 codes or float8_e4m3fn elements
  scales: jax.Array  # (lead..., nb) float8_e8m0fnu / float8_e4m3fn
  g: jax.Array | None  # broadcastable to scales, float32 (NVFP4 only)


def block_divisor(scales: jax.Array, g: jax.Array | None, fmt: F.Format) -> jax.Array:
  """float32 per-block scale value that elements are divided by (NaN for NaN scales)."""
  if fmt.scale == "e8m0":
    return F.e8m0_from_bits(jax.lax.bitcast_convert_type(scales, jnp.uint8))
  return F.nvfp4_divisor(scales, g)


def scaled_blocks(xb: jax.Array, scales: jax.Array, g: jax.Array | None, fmt: F.Format,
                  recip=F.reciprocal) -> jax.Array:
  """`x / scale` per element in the blocked layout, exactly as the formats define it:
  an exact power-of-two multiply for E8M0, `x * (1 / (s * g))` in float32 for NVFP4 (recip:
  as in `encode_blocks`)."""
  xb = xb.astype(jnp.float32)
  if fmt.scale == "e8m0":
    e, is_nan = F.e8m0_exponent_of(scales)
    z = xb * F.pow2(-e)[..., None]
    return jnp.where(is_nan[..., None], jnp.float32(jnp.nan), z)
  return xb * recip(F.nvfp4_divisor(scales, g))[..., None]


def decode_blocks(codes: jax.Array, scales: jax.Array, g: jax.Array | None, fmt: F.Format) -> jax.Array:
  """float32 values `q * scale` in the blocked layout (the one decode rule)."""
  q = e2m1.decode(codes) if fmt.is_fp4 else F.e4m3_value(codes)
  return q * block_divisor(scales, g, fmt)[..., None]  # a NaN scale makes the block NaN


def _encode_elements(z: jax.Array, fmt: F.Format, key: jax.Array | None) -> jax.Array:
  if fmt.is_fp4:
    return e2m1.encode(z) if key is None else e2m1.encode_stochastic(z, key)
  if key is not None:
    raise ValueError(f"stochastic rounding is implemented for FP4 formats, not {fmt.name}")
  return jnp.clip(z, -F.E4M3_MAX, F.E4M3_MAX).astype(jnp.float8_e4m3fn)


def block_amax(xb: jax.Array) -> jax.Array:
  """Each block's maximum magnitude, +inf where it holds a non-finite element (float32)."""
  xb = xb.astype(jnp.float32)
  return jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), jnp.float32(jnp.inf)), axis=-1)


def encode_blocks(xb: jax.Array, fmt: F.Format, g_reduce_axes: tuple[int, ...],
                  key: jax.Array | None = None, recip=F.reciprocal,
                  g_amax: jax.Array | None = None) -> Blocked:
  """Choose scales and encode elements for blocked `xb` (lead..., nb, block). recip: the
  correctly rounded float32 `1 / d` (`formats.reciprocal`; a Pallas kernel passes the
  hardware's IEEE division, which its compiler's `/` need not be). g_amax: the maximum the
  second-level scale takes, given where xb is a part of what it covers (a kernel holding a row
  in parts): `block_amax` of all of it reduced as g_reduce_axes would, keepdims."""
  xb = xb.astype(jnp.float32)
  # NaN must reach the scale, but XLA:CPU's vectorized max can drop NaN (seen on a [200, 300]
  # weight): non-finite elements enter the maximum as +inf, which every max keeps, and an
  # infinite block maximum becomes NaN. One reduction per block (a separate any(non-finite)
  # was one more GPU kernel at every quantization site of the decode step), and g reduces the
  # block maxima instead of the elements again.
  amax_inf = block_amax(xb)
  nan_if_inf = lambda a: jnp.where(a == jnp.inf, jnp.float32(jnp.nan), a)  # noqa: E731
  amax_b = nan_if_inf(amax_inf)
  if fmt.scale == "e8m0":
    e = F.e8m0_exponent(amax_b, fmt)
    scales = F.e8m0_to_bytes(e, jnp.isfinite(amax_b))
    z = scaled_blocks(xb, scales, None, fmt, recip)
    return Blocked(_encode_elements(z, fmt, key), scales, None)

  # g_reduce_axes end with (nb, block): the same maximum over the block maxima
  if g_amax is None:
    g_amax = jnp.max(amax_inf, axis=g_reduce_axes[:-1], keepdims=True)
  amax_g = nan_if_inf(g_amax)
  g = F.nvfp4_second_level(amax_g, fmt)
  s6 = F.e4m3_block_scale(amax_b, g, 6.0, recip)
  codes6 = _encode_elements(scaled_blocks(xb, s6, g, fmt, recip), fmt, key)
  if not fmt.four_over_six:
    return Blocked(codes6, s6, g)
  # 4/6: also try the block scaled to 4 (1.5x the unrounded scale); keep the lower block MSE,
  # the standard scale on ties. The same key is reused so SR stays a function of the input.
  s4 = F.e4m3_block_scale(amax_b, g, 4.0, recip)
  codes4 = _encode_elements(scaled_blocks(xb, s4, g, fmt, recip), fmt, key)
  err6 = jnp.sum(jnp.square(decode_blocks(codes6, s6, g, fmt) - xb), axis=-1)
  err4 = jnp.sum(jnp.square(decode_blocks(codes4, s4, g, fmt) - xb), axis=-1)
  use4 = err4 < err6
  return Blocked(jnp.where(use4[..., None], codes4, codes6), jnp.where(use4, s4, s6), g)


# --------------------------------------------------------------------------- QArray

@dataclasses.dataclass(frozen=True)
class QArray:
  """A block-scaled quantized array (registered pytree; format, axis, shape are static).

  codes:  FP4: uint8, two codes per byte along `axis` (length ceil(K/block)*block/2);
          MXFP8: float8_e4m3fn, one per element (padded length).
  scales: one per block, the block axis at `axis` (length ceil(K/block)).
  global_scale: NVFP4 float32 second-level scale, keepdims (broadcastable to `scales`);
          None for MX formats.
  packing: FP4 codes' byte order: "nibbles" (`e2m1.pack_nibbles`, everywhere but the KV
          cache), or "kv_words" (each 4 bytes along `axis` bit-placed as the decode attention
          kernel reads them, `e2m1.place_kv_words`; see `with_packing`).
  """

  codes: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  fmt: F.Format = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  packing: str = dataclasses.field(default="nibbles", metadata=dict(static=True))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def dtype(self):
    """Element type the codes represent (`float4_e2m1fn` or `float8_e4m3fn`)."""
    return jnp.float4_e2m1fn if self.fmt.is_fp4 else jnp.float8_e4m3fn

  @property
  def block_size(self) -> int:
    return self.fmt.block

  @property
  def nbytes(self) -> int:
    """True bytes held: packed codes + block scales + second-level scales."""
    n = self.codes.size * self.codes.dtype.itemsize + self.scales.size * self.scales.dtype.itemsize
    if self.global_scale is not None:
      n += self.global_scale.size * self.global_scale.dtype.itemsize
    return int(n)

  @property
  def bits_per_element(self) -> float:
    return 8.0 * self.nbytes / self.size

  def blocked_codes(self) -> jax.Array:
    """Codes unpacked into the blocked layout (lead..., nb, block)."""
    c = jnp.moveaxis(self.codes, self.axis, -1)
    if self.packing == "kv_words":
      c = e2m1.unplace_kv_words(c)
    if self.fmt.is_fp4:
      c = e2m1.unpack_nibbles(c)
    return c.reshape(*c.shape[:-1], c.shape[-1] // self.fmt.block, self.fmt.block)

  def blocked_scales(self) -> tuple[jax.Array, jax.Array | None]:
    s = jnp.moveaxis(self.scales, self.axis, -1)
    g = None if self.global_scale is None else jnp.moveaxis(self.global_scale, self.axis, -1)
    return s, g

  def unpacked_codes(self) -> jax.Array:
    """One code per logical element, in the logical shape (for code-agreement metrics)."""
    return from_blocks(self.blocked_codes(), self.axis, self.shape[self.axis])

  def __repr__(self) -> str:
    return (f"QArray({self.fmt.name}, shape={self.shape}, axis={self.axis}, "
            f"nbytes={self.nbytes})")


jax.tree_util.register_dataclass(
    QArray, data_fields=["codes", "scales", "global_scale"],
    meta_fields=["fmt", "axis", "shape", "packing"])

PACKINGS = ("nibbles", "kv_words")


def with_packing(q: QArray, packing: str) -> QArray:
  """`q` with its FP4 codes in `packing` (the same values; only the codes' bytes move)."""
  if packing not in PACKINGS:
    raise ValueError(f"unknown FP4 code packing {packing!r}; expected one of {PACKINGS}")
  if packing == q.packing:
    return q
  if not q.fmt.is_fp4:
    raise ValueError(f"{packing} packing is defined for FP4 codes, not {q.fmt.name}")
  c = jnp.moveaxis(q.codes, q.axis, -1)
  c = e2m1.place_kv_words(c) if packing == "kv_words" else e2m1.unplace_kv_words(c)
  return dataclasses.replace(q, codes=jnp.moveaxis(c, -1, q.axis), packing=packing)


def pack_blocked(blk: Blocked, fmt: F.Format, axis: int, shape: tuple[int, ...]) -> QArray:
  """Store a `Blocked` encoding as a `QArray` with the block axis at `axis`."""
  c = blk.codes.reshape(*blk.codes.shape[:-2], -1)
  if fmt.is_fp4:
    c = e2m1.pack_nibbles(c)
  g = None if blk.g is None else jnp.moveaxis(blk.g, -1, axis)
  return QArray(jnp.moveaxis(c, -1, axis), jnp.moveaxis(blk.scales, -1, axis), g, fmt, axis,
                tuple(shape))


def _encode(x, fmt: F.Format, axis: int, second_level: SecondLevel, key, validate: bool):
  """The blocked encoding of `x` along `axis` (the one quantization rule) and that axis."""
  x = jnp.asarray(x)
  if x.ndim == 0:
    raise ValueError("quantize needs an array with at least one axis, got a scalar")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a floating-point array, got dtype {x.dtype}")
  ax = normalize_axis(axis, x.ndim)
  if validate:
    check_finite(x, "quantize input")
  reduce_axes = _second_level_reduce_axes(second_level, x.ndim, ax)
  return encode_blocks(to_blocks(x, ax, fmt.block), fmt, reduce_axes, key), ax


def _value(codes, scales, g, fmt: F.Format, axis: int, k: int, dtype) -> jax.Array:
  """Blocked codes and their scales (block axis last) -> values in the logical layout."""
  return from_blocks(decode_blocks(codes, scales, g, fmt), axis, k).astype(dtype)


def quantize(x: jax.Array, fmt: str | F.Format, *, axis: int = -1,
             second_level: SecondLevel = "tensor", key: jax.Array | None = None,
             validate: bool = True) -> QArray:
  """Quantize `x` into a `QArray` with blocks along `axis`.

  second_level (NVFP4 only): the scope of the fp32 scale `g` — "tensor" (weights), "row"
  (activations and K/V: a token depends only on its own values), or a tuple of axes that index
  separate tensors (e.g. `(0,)` for stacked experts `[E, K, N]`).
  key: stochastic rounding of the elements (for gradients only); None = round to nearest even.
  validate: raise on NaN/Inf when called eagerly (ignored inside jit).
  """
  fmt = F.get_format(fmt)
  if not any(isinstance(a, jax.core.Tracer) for a in (x, key)):
    # An eager call runs as one compiled program (per shape, dtype, format and axis) rather
    # than op by op: eager quantization of a test's KV cache took ~4 s a call that way.
    x = jnp.asarray(x)
    if validate:
      check_finite(x, "quantize input")
    if x.ndim:  # (a scalar gets its error from `_encode` below)
      level = tuple(second_level) if isinstance(second_level, list) else second_level
      return _quantize_compiled(x, key, fmt=fmt, axis=normalize_axis(axis, x.ndim),
                                second_level=level)
  blk, ax = _encode(x, fmt, axis, second_level, key, validate)
  return pack_blocked(blk, fmt, ax, jnp.shape(x))


@functools.partial(jax.jit, static_argnames=("fmt", "axis", "second_level"))
def _quantize_compiled(x, key, *, fmt: F.Format, axis: int, second_level) -> QArray:
  blk, ax = _encode(x, fmt, axis, second_level, key, validate=False)
  return pack_blocked(blk, fmt, ax, x.shape)


def quantize_with_value(x: jax.Array, fmt: str | F.Format, *, axis: int = -1,
                        second_level: SecondLevel = "tensor", dtype=None,
                        validate: bool = True) -> tuple[QArray, jax.Array]:
  """`(q, dequantize(q, dtype))` for `q = quantize(x, ...)`, from one encoding (dtype default
  x's). The value is decoded from the codes before they are packed: a caller that uses only
  the value (an activation site that records nothing) never packs and unpacks nibbles, and XLA
  drops the unused QArray."""
  fmt = F.get_format(fmt)
  blk, ax = _encode(x, fmt, axis, second_level, None, validate)
  v = _value(blk.codes, blk.scales, blk.g, fmt, ax, jnp.shape(x)[ax], dtype or x.dtype)
  return pack_blocked(blk, fmt, ax, jnp.shape(x)), v


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """Decode a `QArray` to `dtype` in its logical shape (computed in float32, then cast)."""
  if not isinstance(q, QArray):
    raise TypeError(f"dequantize expects a QArray, got {type(q).__name__}")
  s, g = q.blocked_scales()
  return _value(q.blocked_codes(), s, g, q.fmt, q.axis, q.shape[q.axis], dtype)
