"""A decoder layer's residual add and the RMS norm of its sum as one Pallas kernel: `s = x + h`
and `rms_norm(s, scale, eps)` (the attention's output added to the residual stream, then the
MoE's input norm).

Owns the kernel, its support check, its wrapper and its reference (`add_rms_norm_ref`: the
model's own ops, `x + h` and `transformer.rms_norm`). The kernel body traces the same rules: in
interpret mode on CPU both outputs equal the reference bit for bit. Compiled, the sum `s` is
still exact (one correctly rounded add), while the norm's float32 sum of squares runs in
Triton's order, so the normalized row may differ from XLA's by a rounding (the GPU test states
the tolerance).

In the decode step XLA makes the add one kernel (~2.6 us at B 256) and the norm another (an
XLA Triton normalization fusion, ~1.9 us; session 38's 4-layer profile on the H200): the norm
fusion takes one output only, so the add is not fused into it. The GPU default since session
40 (`dispatch.add_rms_norm`; `TRACE_JAX_ADD_NORM=xla` opts out): on the H200 2.2 us a call, both
outputs bit for bit with XLA's, the 4-layer step's kernels 1.630 -> 1.625 ms.

h may be the o projection's float32 K parts (`layout.KParts`, opt-in
`TRACE_JAX_BF16_DENSE_KSPLIT=on`): the kernel adds them in `layout.sum_parts`' order and rounds
once, as `KParts.value` does, bit for bit in interpret mode.

Lowering: a portable Pallas body, whole rows a program, `interpret=True` on CPU and the Triton
lowering on the GPU (as `row_quant`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.kernels import layout as L
from trace_jax.kernels import row_quant as RQ
from trace_jax.settings import int_setting
from trace_jax.models import transformer as T

# Elements a program takes (whole rows: one 2,048-wide row at the 30B-A3B shape) and its warps;
# TRACE_JAX_ADD_NORM_WARPS for the GPU's A/B (others not yet timed)
TILE_ELEMS = 2048
NUM_WARPS = int_setting("TRACE_JAX_ADD_NORM_WARPS", 4, minimum=1,
                        doc="warps a program of the add + norm kernel")
MAX_ROW_ELEMS = 8192


def kernel_supported(x, h, scale) -> str | None:
  """None if the kernel adds and normalizes these rows: x, h of one shape `[..., D]` and one
  floating dtype (or h float32 `KParts` of x's shape, added and rounded to x's dtype first),
  D a power of two up to `MAX_ROW_ELEMS` (no padded lanes in the norm's mean), scale `[D]`;
  else the reason it does not."""
  if isinstance(h, L.KParts):
    if tuple(x.shape) != h.shape or h.parts.dtype != jnp.float32:
      return f"x {x.dtype}{list(x.shape)} and parts {h.parts.dtype}{list(h.shape)} differ"
  elif tuple(x.shape) != tuple(h.shape) or x.dtype != h.dtype:
    return f"x {x.dtype}{list(x.shape)} and h {h.dtype}{list(h.shape)} differ"
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return f"dtype {x.dtype}"
  return norm_rows_supported(x.shape[-1] if x.ndim else 0, scale)


def norm_rows_supported(d: int, scale) -> str | None:
  """None if a kernel body normalizes whole rows of d elements with `scale` (`add_and_norm`): d
  a power of two up to `MAX_ROW_ELEMS` (no padded lanes in the norm's mean), scale `[d]`; else
  the reason it does not."""
  if not (0 < d <= MAX_ROW_ELEMS and d & (d - 1) == 0):
    return f"rows of {d} elements: the kernel takes powers of two up to {MAX_ROW_ELEMS}"
  if tuple(scale.shape) != (d,):
    return f"scale of shape {tuple(scale.shape)}, not ({d},)"
  return None


def add_and_norm(at, ok, x_ref, h, scale_ref, s_ref, y_ref, *, eps: float, rnd) -> None:
  """Inside a kernel body: s = the rows `at(x_ref)` + h stored to `at(s_ref)`, its
  `transformer.rms_norm` (roundings `rnd`, `row_quant.rounding`) to `at(y_ref)`; rows where
  `ok` [R, 1]."""
  plt = RQ.triton_primitives()
  s = plt.load(at(x_ref), mask=ok, other=0) + h
  plt.store(at(s_ref), s, mask=ok)
  plt.store(at(y_ref), T.rms_norm(s, scale_ref[...], eps, rnd), mask=ok)


def _kernel(x_ref, h_ref, scale_ref, s_ref, y_ref, *, n: int, rows: int, eps: float,
            interpret: bool, parts: int):
  plt = RQ.triton_primitives()
  r0 = pl.program_id(0) * rows
  ok = ((r0 + jnp.arange(rows)) < n)[:, None]
  at = lambda ref: ref.at[pl.ds(r0, rows)]  # noqa: E731
  if parts:  # h's float32 K parts [parts * n, d]: added part 0 first (`layout.sum_parts`)
    h = L.sum_parts([plt.load(h_ref.at[pl.ds(i * n + r0, rows)], mask=ok, other=0)
                     for i in range(parts)]).astype(x_ref.dtype)
  else:
    h = plt.load(at(h_ref), mask=ok, other=0)
  add_and_norm(at, ok, x_ref, h, scale_ref, s_ref, y_ref, eps=eps,
               rnd=RQ.rounding(x_ref.dtype, interpret))


def add_rms_norm(x: jax.Array, h: jax.Array | L.KParts, scale: jax.Array, eps: float, *,
                 interpret: bool = False, num_warps: int | None = None):
  """`(x + h, rms_norm(x + h, scale, eps))` from one kernel, both in x's dtype and shape; h
  may be `KParts` (`h.value(x.dtype)`: the kernel adds the parts in that order)."""
  why = kernel_supported(x, h, scale)
  if why:
    raise ValueError(f"add + RMS norm kernel: {why}")
  d = x.shape[-1]
  n = math.prod(x.shape[:-1])
  rows = max(1, TILE_ELEMS // d)
  parts = h.parts.shape[0] if isinstance(h, L.KParts) else 0
  hs = h.parts.reshape(parts * n, d) if parts else h.reshape(n, d)
  out = [jax.ShapeDtypeStruct((n, d), x.dtype)] * 2
  s, y = RQ.launch(functools.partial(_kernel, n=n, rows=rows, eps=eps, interpret=interpret,
                                     parts=parts),
                   x.reshape(n, d), hs, scale, programs=-(-n // rows),
                   out_shape=out, interpret=interpret, num_warps=num_warps or NUM_WARPS,
                   name="add_rms_norm")
  return s.reshape(x.shape), y.reshape(x.shape)


def add_rms_norm_ref(x: jax.Array, h: jax.Array | L.KParts, scale: jax.Array, eps: float):
  """The model's ops: the residual add (`KParts` h: its value in x's dtype first), then
  `transformer.rms_norm` of the sum."""
  s = x + (h.value(x.dtype) if isinstance(h, L.KParts) else h)
  return s, T.rms_norm(s, scale, eps)
