"""Fake quantization for QAT: forward `dequantize(quantize(x))` bit for bit, straight-through
backward (zero where the value saturated: |x / scale| > `Format.saturation_bound`), and
stochastic-rounding quantization of gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax.quant import formats as F
from trace_jax.quant import qarray as Q


def _fake_quant_fwd_value(x, fmt: F.Format, axis: int, second_level, key):
  ax = Q.normalize_axis(axis, x.ndim)
  xb = Q.to_blocks(x, ax, fmt.block)
  blk = Q.encode_blocks(xb, fmt, Q._second_level_reduce_axes(second_level, x.ndim, ax), key)
  v = Q.decode_blocks(blk.codes, blk.scales, blk.g, fmt)
  # STE mask: pass the gradient unless x/scale saturated (see Format.saturation_bound).
  z = Q.scaled_blocks(xb, blk.scales, blk.g, fmt)
  inside = jnp.abs(z) <= fmt.saturation_bound
  k = x.shape[ax]
  return (Q.from_blocks(v, ax, k).astype(x.dtype), Q.from_blocks(inside, ax, k))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _fake_quant(x, fmt, axis, second_level):
  return _fake_quant_fwd_value(x, fmt, axis, second_level, None)[0]


def _fq_fwd(x, fmt, axis, second_level):
  y, inside = _fake_quant_fwd_value(x, fmt, axis, second_level, None)
  return y, inside


def _fq_bwd(fmt, axis, second_level, inside, ct):
  return (jnp.where(inside, ct, jnp.zeros_like(ct)),)


_fake_quant.defvjp(_fq_fwd, _fq_bwd)


def fake_quant(x: jax.Array, fmt: str | F.Format, *, axis: int = -1,
               second_level: Q.SecondLevel = "tensor", validate: bool = True) -> jax.Array:
  """Straight-through fake quantization: value `dequantize(quantize(x), x.dtype)` exactly."""
  fmt = F.get_format(fmt)
  if validate:
    Q.check_finite(x, "fake_quant input")
  sl = second_level if isinstance(second_level, str) else tuple(second_level)
  return _fake_quant(x, fmt, axis, sl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _grad_quant(x, key, fmt, axis, second_level):
  return x


def _gq_fwd(x, key, fmt, axis, second_level):
  return x, key


def _gq_bwd(fmt, axis, second_level, key, ct):
  y, _ = _fake_quant_fwd_value(ct, fmt, axis, second_level, key)
  return y, None


_grad_quant.defvjp(_gq_fwd, _gq_bwd)


def quantize_grad(x: jax.Array, key: jax.Array, fmt: str | F.Format, *, axis: int = -1,
                  second_level: Q.SecondLevel = "row") -> jax.Array:
  """Identity forward; the backward pass fake-quantizes the incoming gradient with
  stochastic rounding (unbiased), blocks along `axis`."""
  fmt = F.get_format(fmt)
  sl = second_level if isinstance(second_level, str) else tuple(second_level)
  return _grad_quant(x, key, fmt, axis, sl)


def stochastic_fake_quant(x: jax.Array, key: jax.Array, fmt: str | F.Format, *, axis: int = -1,
                          second_level: Q.SecondLevel = "row") -> jax.Array:
  """Value of quantize-with-stochastic-rounding then dequantize (no gradient rule)."""
  fmt = F.get_format(fmt)
  return _fake_quant_fwd_value(x, fmt, axis, second_level, key)[0]
