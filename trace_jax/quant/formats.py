"""Block-scaled formats (MXFP4, NVFP4, NVFP4 4/6, MXFP8) and their scale rules.

A `Format` is static metadata: element type, block size, scale type and scale rule. Every scale
rule of NUMERICS.md is defined once here, as exact integer/float32 operations:

* E8M0 (MX) exponents come from the float32 exponent and mantissa bits (`frexp`), never from a
  rounded `log2`: "ceil" picks the smallest `e` with `amax <= elem_max * 2**e`, "floor" the OCP
  reference `floor(log2(amax)) - emax_elem`.
* NVFP4: `g = amax / (6 * 448)` (256 with 4/6), `s = E4M3_rtne(clip(amax_block / (6 g), 2**-9,
  448))`, the block scale `d = s * g` formed in float32; encode `z = x / d`, decode `q * d`.

Every NVFP4 division `a / b` is computed as `a * (1 / b)`: the float32 reciprocal (correctly
rounded) times `a`. XLA itself rewrites `x / broadcast(d)` into exactly that (measured on CPU:
4088 of 16000 quotients differ from IEEE division in the last bit), so the literal formula would
round differently depending on whether the divisor happened to be broadcast; this spelling is the
one every path (jnp reference, fake-quant, guided rounding, kernels) computes identically.

Two rules are spelled in integers because XLA on the GPU does not keep the float ones (measured
on the H200, jax 0.11.2, `benchmarks/probe_glue.py`):

* `reciprocal`: XLA:GPU lowers float32 `/` to PTX `div.full.f32`, off by one ulp for 13% of
  divisors (openxla/xla#37181), so off the CPU `1 / d` is a long division of the integer
  mantissas (`reciprocal_long_division`).
* `e4m3_value`: with `xla_allow_excess_precision` (XLA's default) the GPU pipeline deletes a
  `f32 -> float8 -> f32` convert pair (simplify-fp-conversions), so the codes were encoded with
  the unrounded block scale while decode used the stored one (9% of code bytes off). The value
  of an E4M3 byte is built from its bits, which no pass folds away.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
E8M0_NAN_BYTE = 0xFF


@dataclasses.dataclass(frozen=True)
class Format:
  """A block-scaled number format (hashable: it travels as static pytree metadata)."""

  name: str
  element: Literal["e2m1", "e4m3"]
  block: int
  scale: Literal["e8m0", "e4m3"]
  scale_rule: Literal["ceil", "floor"] = "ceil"  # E8M0 formats only
  four_over_six: bool = False  # NVFP4 only

  @property
  def elem_max(self) -> float:
    return 6.0 if self.element == "e2m1" else E4M3_MAX

  @property
  def saturation_bound(self) -> float:
    """|x / scale| beyond which a value counts as clipped for the straight-through gradient:
    elem_max plus half the last grid step (E2M1 7, E4M3 464), the range that would round to
    elem_max anyway. Values just above 6 only because the E4M3 block scale rounded down keep
    their gradient; a literal `> 6` test would freeze the largest weight of about half of all
    NVFP4 blocks under QAT."""
    return 7.0 if self.element == "e2m1" else 464.0

  @property
  def is_fp4(self) -> bool:
    return self.element == "e2m1"

  @property
  def two_level(self) -> bool:
    """Whether the format has the fp32 second-level scale `g` (NVFP4)."""
    return self.scale == "e4m3"

  @property
  def element_bits(self) -> int:
    return 4 if self.element == "e2m1" else 8

  @property
  def bits_per_element(self) -> float:
    """Payload plus block scales, excluding the second-level scale (NUMERICS.md Sizes)."""
    return self.element_bits + 8 / self.block

  @property
  def g_denominator(self) -> float:
    """`g = amax / (6 * this)`: 448, or 256 with 4/6 (headroom for the 1.5x block scale)."""
    return 256.0 if self.four_over_six else E4M3_MAX

  def __str__(self) -> str:
    return self.name


FORMATS: dict[str, Format] = {
    "mxfp4": Format("mxfp4", "e2m1", 32, "e8m0", "ceil"),
    "mxfp4_floor": Format("mxfp4_floor", "e2m1", 32, "e8m0", "floor"),
    "nvfp4": Format("nvfp4", "e2m1", 16, "e4m3"),
    "nvfp4_4o6": Format("nvfp4_4o6", "e2m1", 16, "e4m3", four_over_six=True),
    "mxfp8": Format("mxfp8", "e4m3", 32, "e8m0", "ceil"),
}


def get_format(fmt: str | Format) -> Format:
  """Resolve a format name (or pass a `Format` through); unknown names get a clear error."""
  if isinstance(fmt, Format):
    return fmt
  if not isinstance(fmt, str) or fmt not in FORMATS:
    raise ValueError(f"unknown quantization format {fmt!r}; known formats: {sorted(FORMATS)}")
  return FORMATS[fmt]


# --------------------------------------------------------------------------- E8M0 (MX) scales

def _elem_max_frexp(elem_max: float) -> tuple[float, int]:
  m, k = np.frexp(np.float32(elem_max))
  return float(m), int(k)


def e8m0_exponent(amax: jax.Array, fmt: Format) -> jax.Array:
  """Integer block exponent `e` (int32, clamped to [-127, 127]) for block maxima `amax`.

  With amax = m * 2**E (frexp, m in [0.5, 1)) and elem_max = M * 2**k: `amax <= M 2**(e+k)`
  first holds at e = E - k when m <= M, else at e = E - k + 1 ("ceil"). "floor" is
  floor(log2 amax) - emax_elem = (E - 1) - (k - 1) = E - k.
  """
  amax = amax.astype(jnp.float32)
  m, big_e = jnp.frexp(amax)
  big_m, k = _elem_max_frexp(fmt.elem_max)
  e = big_e.astype(jnp.int32) - k
  if fmt.scale_rule == "ceil":
    e = e + (m > big_m).astype(jnp.int32)
  elif fmt.scale_rule != "floor":
    raise ValueError(f"unknown E8M0 scale rule {fmt.scale_rule!r}; use 'ceil' or 'floor'")
  e = jnp.where(amax == 0, E8M0_MIN_EXP, e)
  return jnp.clip(e, E8M0_MIN_EXP, E8M0_MAX_EXP)


def pow2(e: jax.Array) -> jax.Array:
  """Exact float32 2**e for integer e in [-127, 127] built from bits (2**-127 is subnormal:
  built as 2**-126 / 2, exact where subnormals are kept)."""
  e = e.astype(jnp.int32)
  biased = jnp.clip(e + 127, 1, 254).astype(jnp.uint32)
  v = jax.lax.bitcast_convert_type(biased << 23, jnp.float32)
  return jnp.where(e < -126, v * 0.5, v)


def e8m0_to_bytes(e: jax.Array, finite: jax.Array) -> jax.Array:
  """Store exponents as `float8_e8m0fnu`; non-finite blocks get the NaN byte 0xFF."""
  b = jnp.where(finite, e + 127, E8M0_NAN_BYTE).astype(jnp.uint8)
  return jax.lax.bitcast_convert_type(b, jnp.float8_e8m0fnu)


def e8m0_exponent_of(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(exponent int32, is_nan bool) of stored `float8_e8m0fnu` scales."""
  b = jax.lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
  return b - 127, b == E8M0_NAN_BYTE


def e8m0_from_bits(b: jax.Array) -> jax.Array:
  """float32 value of E8M0 scale bytes given as integers (`2**(b - 127)`, NaN for 0xFF): the one
  E8M0 value rule (`qarray.block_divisor` bitcasts stored scales to bytes and calls this; the
  decode kernels get `uint8` bytes directly)."""
  b = b.astype(jnp.int32)
  return jnp.where(b == E8M0_NAN_BYTE, jnp.float32(jnp.nan), pow2(b - 127))


# --------------------------------------------------------------------------- NVFP4 scales

def reciprocal(d: jax.Array) -> jax.Array:
  """Correctly rounded float32 `1 / d` (divisions are multiplies by this; see module doc). On CPU
  XLA's own division, which is IEEE (57x faster there than the long division: integer division
  does not vectorize); elsewhere `reciprocal_long_division`. XLA:CPU flushes subnormals, so the
  two differ only where d or 1/d is subnormal (|d| < 2**-126 or > 2**126): block divisors meet
  that only for blocks whose maximum is below ~7e-38."""
  return jax.lax.platform_dependent(d.astype(jnp.float32), cpu=lambda v: jnp.float32(1.0) / v,
                                    default=reciprocal_long_division)


def reciprocal_long_division(d: jax.Array) -> jax.Array:
  """Correctly rounded float32 `1 / d` from integer ops only (XLA:GPU's float division is not
  correctly rounded): IEEE round-to-nearest-even, subnormal inputs and results, +-0 -> +-inf,
  +-inf -> +-0, NaN -> NaN. With d's mantissa D in [2**23, 2**24), `2**47 // D` by long division
  in 8-bit steps (every partial remainder times 256 fits 32 bits) gives the quotient's bits and
  the remainder the sticky part; no ties arise (2**48 = (2Q + 1) D has no solution with
  Q >= 2**23)."""
  u32, i32 = jnp.uint32, jnp.int32
  bits = jax.lax.bitcast_convert_type(d.astype(jnp.float32), u32)
  sign = bits & u32(0x80000000)
  mag = bits & u32(0x7FFFFFFF)
  exp = (mag >> 23).astype(i32)
  man = mag & u32(0x7FFFFF)
  # normalize: d = D * 2**(e - 23), D in [2**23, 2**24) (subnormals shifted up)
  lead = jnp.maximum(jax.lax.clz(man).astype(i32) - 8, 0)
  sub = exp == 0
  big_d = jnp.where(sub, man << lead.astype(u32), man | u32(0x800000))
  big_d = jnp.maximum(big_d, u32(1))  # d == 0 is settled below; avoid dividing by zero
  e = jnp.where(sub, -126 - lead, exp - 127)
  q = u32(1 << 23) // big_d
  r = u32(1 << 23) % big_d
  for _ in range(3):
    t = r << 8
    q = (q << 8) | (t // big_d)
    r = t % big_d
  # 1/d = (q + r/D) * 2**(-24 - e), q in (2**23, 2**24]; q == 2**24 only for D == 2**23 (r == 0)
  top = q >> 24
  q = q >> top
  biased = 126 - e + top.astype(i32)  # the exponent field of a normal result
  # normal result: round the fraction r/D; subnormal: drop `shift` more bits of q, r sticky
  shift = jnp.clip(1 - biased, 0, 25).astype(u32)
  kept = q >> shift
  low = q & ((u32(1) << shift) - u32(1))
  half = u32(1) << (jnp.maximum(shift, u32(1)) - u32(1))  # of the dropped bits (shift > 0)
  up_sub = (low > half) | ((low == half) & ((r > 0) | ((kept & u32(1)) == 1)))
  up = jnp.where(shift == 0, r + r > big_d, up_sub)
  mant = kept + up.astype(u32)  # a carry into bit 23 (24) moves the exponent: bits add up
  out = jnp.where(biased > 0, (biased.astype(u32) << 23) + (mant - u32(1 << 23)), mant)
  out = jnp.where(biased >= 255, u32(0x7F800000), out)  # overflow (|d| < 2**-128)
  out = jnp.where(mag == 0, u32(0x7F800000), out)
  out = jnp.where(mag == u32(0x7F800000), u32(0), out)
  out = jnp.where(mag > u32(0x7F800000), mag | u32(0x400000), out)  # NaN stays NaN (quiet)
  return jax.lax.bitcast_convert_type(out | sign, jnp.float32)


def e4m3_value(s: jax.Array) -> jax.Array:
  """float32 value of `float8_e4m3fn` numbers, built from their bits (see module doc): exponent
  field e, mantissa m -> `2**(e-7) (1 + m/8)`, or `m 2**-9` for e = 0; S.1111.111 is NaN."""
  b = jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.uint32)
  e, m = (b >> 3) & 15, b & 7
  normal = jax.lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
  mag = jnp.where(e == 0, m.astype(jnp.float32) * jnp.float32(2.0**-9), normal)
  mag = jnp.where((b & 0x7F) == 0x7F, jnp.float32(jnp.nan), mag)
  return jnp.where((b & 0x80) != 0, -mag, mag)


def nvfp4_second_level(amax: jax.Array, fmt: Format) -> jax.Array:
  """`g = amax * (1 / (6 * 448))` (or 256 for 4/6); 1 where amax is 0; NaN where amax is not
  finite."""
  amax = amax.astype(jnp.float32)
  g = amax * (np.float32(1.0) / np.float32(6.0 * fmt.g_denominator))
  g = jnp.where(amax == 0, jnp.float32(1.0), g)
  return jnp.where(jnp.isfinite(amax), g, jnp.float32(jnp.nan))


def e4m3_block_scale(amax_block: jax.Array, g: jax.Array, target: float = 6.0,
                     recip=reciprocal) -> jax.Array:
  """`E4M3_rtne(clip(amax_block * (1 / (target * g)), 2**-9, 448))` as `float8_e4m3fn` (NaN
  stays NaN). target = 6 is the standard rule; 4/6 also tries target = 4 (1.5x the unrounded
  scale). recip: `reciprocal` as a kernel computes it (the same correctly rounded value)."""
  ratio = amax_block.astype(jnp.float32) * recip(jnp.float32(target) * g)
  return jnp.clip(ratio, E4M3_MIN_SUBNORMAL, E4M3_MAX).astype(jnp.float8_e4m3fn)


def nvfp4_divisor(s: jax.Array, g: jax.Array) -> jax.Array:
  """The float32 block scale `d = s * g`: decode multiplies by it, encode by `reciprocal(d)`."""
  return e4m3_value(s) * g.astype(jnp.float32)
