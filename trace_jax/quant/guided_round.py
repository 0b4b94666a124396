"""TRACE rollout-guided rounding: the `Guidance` pytree and `guided_fake_quant`.

The rollout records, at a guided site, its block scales and either one mantissa bit per element
(compact) or the whole 4-bit code (full). The trainer then computes
`z = clip(x / scale_rollout, -6, 6)`; if `z` is on the E2M1 grid it takes it, otherwise it takes
whichever of the two bracketing neighbours the rollout chose: adjacent magnitudes alternate
their mantissa bit (0, .5, 1, 1.5, 2, 3, 4, 6 -> 0 1 0 1 0 1 0 1), so one bit identifies it. With
full codes it takes the neighbour closest to the rollout's value (ties: round to nearest even).
The forward value is `scale * q`; the gradient is straight through to `x`, zero where `x`
saturated (|x / scale| > 7, the same rule as `fake_quant`, see `Format.saturation_bound`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import e2m1
from trace_jax.quant import formats as F
from trace_jax.quant import qarray as Q


@dataclasses.dataclass(frozen=True)
class Guidance:
  """What the rollout recorded at one quantized site (registered pytree).

  payload: compact: uint8, 8 mantissa bits per byte along `axis` (element i in bit i % 8);
           full: uint8, two 4-bit codes per byte along `axis` (as in `QArray.codes`).
  scales, global_scale: the rollout's block scales and NVFP4 second-level scale.
  """

  payload: jax.Array
  scales: jax.Array
  global_scale: jax.Array | None
  fmt: F.Format = dataclasses.field(metadata=dict(static=True))
  axis: int = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  compact: bool = dataclasses.field(metadata=dict(static=True))

  @property
  def nbytes(self) -> int:
    n = self.payload.size + self.scales.size * self.scales.dtype.itemsize
    if self.global_scale is not None:
      n += self.global_scale.size * self.global_scale.dtype.itemsize
    return int(n)

  @property
  def bits_per_element(self) -> float:
    """Measured guidance bits per logical element (payload + scales + second-level scales)."""
    return 8.0 * self.nbytes / int(np.prod(self.shape))

  def blocked_payload(self) -> jax.Array:
    """Per-element bits (compact) or codes (full) in the blocked layout (lead..., nb, block)."""
    p = jnp.moveaxis(self.payload, self.axis, -1)
    p = e2m1.unpack_bits(p) if self.compact else e2m1.unpack_nibbles(p)
    return p.reshape(*p.shape[:-1], p.shape[-1] // self.fmt.block, self.fmt.block)


jax.tree_util.register_dataclass(
    Guidance, data_fields=["payload", "scales", "global_scale"],
    meta_fields=["fmt", "axis", "shape", "compact"])


def guidance_bits_per_element(fmt: str | F.Format, compact: bool = True) -> float:
  """Nominal guidance bits per element: 1 (or 4) + block scale bits (NUMERICS.md Sizes)."""
  fmt = F.get_format(fmt)
  return (1.0 if compact else 4.0) + 8.0 / fmt.block


def make_guidance(q: Q.QArray, compact: bool = True, payload: jax.Array | None = None
                  ) -> Guidance:
  """The guidance the rollout keeps for a quantized FP4 site. payload: its compact bits where a
  kernel that made q wrote them (`e2m1.nibble_mantissa_bits` of q's nibble-packed codes, the
  blocked axis 8 elements a byte), else None: made here."""
  if not isinstance(q, Q.QArray):
    raise TypeError(f"make_guidance expects a QArray, got {type(q).__name__}")
  if not q.fmt.is_fp4:
    raise ValueError(f"guided rounding is defined for FP4 formats, not {q.fmt.name}")
  q = Q.with_packing(q, "nibbles")  # the trainer reads nibble-packed codes
  if payload is not None:
    want = q.shape[:q.axis] + (q.shape[q.axis] // 8,) + q.shape[q.axis + 1:]
    if not compact or tuple(payload.shape) != want or payload.dtype != jnp.uint8:
      raise ValueError(f"a given guidance payload is compact uint8{list(want)} for codes of "
                       f"shape {list(q.shape)}, got {'compact ' if compact else ''}"
                       f"{payload.dtype}{list(payload.shape)}")
  elif compact:  # (blocks are whole bytes of bits: the element order is the codes')
    codes = jnp.moveaxis(q.codes, q.axis, -1)
    payload = jnp.moveaxis(e2m1.nibble_mantissa_bits(codes), -1, q.axis)
  else:
    payload = q.codes
  return Guidance(payload, q.scales, q.global_scale, q.fmt, q.axis, q.shape, compact)


def guided_codes_blocked(xb: jax.Array, g: Guidance) -> tuple[jax.Array, jax.Array]:
  """Guided E2M1 codes and the STE mask (|x/scale| <= 6) for blocked `xb`."""
  s, gs = g.scales, g.global_scale
  s = jnp.moveaxis(s, g.axis, -1)
  gs = None if gs is None else jnp.moveaxis(gs, g.axis, -1)
  z = Q.scaled_blocks(xb, s, gs, g.fmt)
  inside = jnp.abs(z) <= g.fmt.saturation_bound
  a = jnp.minimum(jnp.abs(z), e2m1.E2M1_MAX)
  lo_idx = e2m1.floor_index(a)
  hi_idx = jnp.minimum(lo_idx + 1, 7).astype(jnp.uint8)
  on_grid = a == e2m1.grid_value(lo_idx)
  payload = g.blocked_payload()
  if g.compact:
    pick_lo = (lo_idx & 1) == payload
  else:
    target = jnp.abs(e2m1.decode(payload))
    d_lo = jnp.abs(e2m1.grid_value(lo_idx) - target)
    d_hi = jnp.abs(e2m1.grid_value(hi_idx) - target)
    rtne = e2m1.magnitude_index_rtne(a)
    pick_lo = jnp.where(d_lo == d_hi, rtne == lo_idx, d_lo < d_hi)
  idx = jnp.where(on_grid | pick_lo, lo_idx, hi_idx)
  codes = idx | (e2m1._sign_bit(z) << 3)
  return codes, inside


def _guided_value(x, g: Guidance):
  ax = g.axis
  xb = Q.to_blocks(x, ax, g.fmt.block)
  codes, inside = guided_codes_blocked(xb, g)
  s = jnp.moveaxis(g.scales, ax, -1)
  gs = None if g.global_scale is None else jnp.moveaxis(g.global_scale, ax, -1)
  v = Q.decode_blocks(codes, s, gs, g.fmt)
  k = x.shape[ax]
  return Q.from_blocks(v, ax, k).astype(x.dtype), Q.from_blocks(inside, ax, k)


@jax.custom_vjp
def _guided(x, g):
  return _guided_value(x, g)[0]


def _guided_fwd(x, g):
  y, inside = _guided_value(x, g)
  return y, (inside, g)


def _guided_bwd(res, ct):
  inside, g = res
  zero_g = jax.tree_util.tree_map(
      lambda a: np.zeros(a.shape, jax.dtypes.float0)
      if not jnp.issubdtype(a.dtype, jnp.inexact) else jnp.zeros_like(a), g)
  return jnp.where(inside, ct, jnp.zeros_like(ct)), zero_g


_guided.defvjp(_guided_fwd, _guided_bwd)


def guided_fake_quant(x: jax.Array, guidance: Guidance, *, axis: int = -1) -> jax.Array:
  """TRACE guided fake quantization of the trainer's `x` with the rollout's `guidance`."""
  if not isinstance(guidance, Guidance):
    raise TypeError(f"guided_fake_quant expects a Guidance, got {type(guidance).__name__}")
  ax = Q.normalize_axis(axis, x.ndim)
  if tuple(x.shape) != tuple(guidance.shape) or ax != guidance.axis:
    raise ValueError(
        f"guidance recorded for shape {guidance.shape} (block axis {guidance.axis}) cannot "
        f"guide an array of shape {tuple(x.shape)} (block axis {ax})")
  return _guided(x, guidance)


def guided_quantize(x: jax.Array, guidance: Guidance) -> Q.QArray:
  """The trainer's guided codes as a `QArray` with the rollout's scales (for metrics)."""
  xb = Q.to_blocks(x, guidance.axis, guidance.fmt.block)
  codes, _ = guided_codes_blocked(xb, guidance)
  s = jnp.moveaxis(guidance.scales, guidance.axis, -1)
  gs = None if guidance.global_scale is None else jnp.moveaxis(guidance.global_scale,
                                                               guidance.axis, -1)
  return Q.pack_blocked(Q.Blocked(codes, s, gs), guidance.fmt, guidance.axis, guidance.shape)


def map_blocked(obj, fn, shape: tuple[int, ...], **meta):
  """A `QArray`/`Guidance` whose every data leaf is `fn(leaf)` (None stays None) and whose
  logical shape is `shape`: the one way to reshape, gather, repeat or split these pytrees, whose
  static shape must follow what is done to their leaves."""
  data = {f: None if getattr(obj, f) is None else fn(getattr(obj, f)) for f in _data_fields(obj)}
  return dataclasses.replace(obj, **data, shape=tuple(int(d) for d in shape), **meta)


def take_rows(obj, idx: jax.Array):
  """Rows `idx` of a 2-D `QArray`/`Guidance` whose blocks run along the last axis (rows are
  independent under row-local scales, so gathering rows of every leaf is exact)."""
  if obj.axis != 1 or len(obj.shape) != 2:
    raise ValueError(f"take_rows needs a 2-D array blocked along its last axis, got shape "
                     f"{obj.shape} blocked along axis {obj.axis}")
  return map_blocked(obj, lambda a: a[idx], (idx.shape[0], obj.shape[1]))


def reshape_rows(obj, lead: tuple[int, ...]):
  """Reshape the row dimensions of a `QArray`/`Guidance` blocked along its last axis."""
  if obj.axis != len(obj.shape) - 1:
    raise ValueError(f"reshape_rows needs blocks along the last axis, got axis {obj.axis}")
  return map_blocked(obj, lambda a: a.reshape(*lead, a.shape[-1]), tuple(lead) + obj.shape[-1:],
                     axis=len(lead))


def _data_fields(obj):
  if isinstance(obj, Guidance):
    return ("payload", "scales", "global_scale")
  if isinstance(obj, Q.QArray):
    return ("codes", "scales", "global_scale")
  raise TypeError(f"expected a QArray or Guidance, got {type(obj).__name__}")


def concatenate(objs, axis: int, xp=jnp):
  """Concatenate `QArray`s or `Guidance`s of one format along a non-block `axis` (e.g. decode
  steps along time); `xp=numpy` for host-resident ones."""
  first = objs[0]
  ax = Q.normalize_axis(axis, len(first.shape))
  if ax == first.axis:
    raise ValueError(f"cannot concatenate along the block axis {ax}")
  fields = _data_fields(first)
  data = {}
  for f in fields:
    parts = [getattr(o, f) for o in objs]
    data[f] = None if parts[0] is None else xp.concatenate(parts, axis=ax)
  shape = list(first.shape)
  shape[ax] = sum(o.shape[ax] for o in objs)
  return dataclasses.replace(first, **data, shape=tuple(shape))
