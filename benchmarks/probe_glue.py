"""Where the Triton-compiled glue kernels (`kernels/row_quant.py`, `kernels/kv_append.py`) part
from their XLA definitions on the GPU: each output field's mismatch count with the first
mismatches in context, the same kernel with the compiler's own division instead of the PTX one,
and the kernel's primitives alone (the PTX reciprocal, the f32 -> e4m3 conversion, the e4m3 bit
pattern -> f32 decode) against XLA over sweeps of values. Writes the arrays to an npz for study
on a CPU.

  python3 benchmarks/probe_glue.py --out $OUT/probe_glue.npz   (from the repo root: the cases
  are the GPU tests' own, `tests/kernels/test_row_quant.py` and `test_kv_append.py`)
"""

from __future__ import annotations

import argparse
import functools
import traceback

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tests.kernels.test_kv_append import decode_case
from tests.kernels.test_row_quant import rows_case
from trace_jax import quant as tq
from trace_jax.kernels import kv_append, row_quant
from trace_jax.quant import e2m1
from trace_jax.quant import formats as F

SAVED: dict[str, np.ndarray] = {}


def _u8(a):
  return np.asarray(a).view(np.uint8).reshape(np.asarray(a).shape + (-1,))


def _report(name, got, want, context=None):
  """Mismatches of one field (compared as bytes) with the first few positions."""
  g, w = np.asarray(got), np.asarray(want)
  bad = np.any(_u8(g) != _u8(w), axis=-1)
  SAVED[f"{name}_got"], SAVED[f"{name}_want"] = g, w
  print(f"{name}: {int(bad.sum())} of {bad.size} differ", flush=True)
  for pos in list(zip(*np.nonzero(bad)))[:4]:
    extra = "" if context is None else f" | {context(pos)}"
    print(f"   at {tuple(int(p) for p in pos)}: got {g[pos]!r} want {w[pos]!r}{extra}")


def row_quant_fields(tag, fn):
  x = rows_case((512, 768), jnp.bfloat16, 1)  # the GPU test's [512, 768] case
  SAVED[f"{tag}_x"] = np.asarray(x.astype(jnp.float32))
  (qg, vg) = jax.jit(fn)(x)
  (qw, vw) = jax.jit(lambda a: tq.quantize_with_value(a, "nvfp4", second_level="row",
                                                      validate=False))(x)
  xf = np.asarray(x.astype(jnp.float32)).reshape(512, 48, 16)
  ctx_b = lambda p: f"block amax {np.abs(xf[p[0], p[1]]).max():.6g}"  # noqa: E731
  _report(f"{tag}_g", qg.global_scale, qw.global_scale)
  _report(f"{tag}_scales", qg.scales, qw.scales, ctx_b)
  _report(f"{tag}_codes", qg.codes, qw.codes,
          lambda p: f"x pair {xf[p[0], p[1] // 8, 2 * (p[1] % 8):2 * (p[1] % 8) + 2]}")
  _report(f"{tag}_value", vg, vw)


def primitives():
  """The kernel's primitives, one elementwise Pallas kernel each, against XLA."""
  from jax.experimental.pallas import triton as plt  # noqa: PLC0415
  rng = np.random.default_rng(0)
  d = np.concatenate([np.float32(2.0) ** rng.uniform(-40, 40, 4096),
                      rng.uniform(1e-3, 1e3, 4096)]).astype(np.float32)
  sweep = np.concatenate([rng.uniform(0, 460, 4096),
                          np.float32(2.0) ** rng.uniform(-12, 9, 4096)]).astype(np.float32)
  bits = np.arange(256, dtype=np.uint8)

  def elementwise(body, x, out_dtype):
    def kernel(x_ref, o_ref):
      o_ref[...] = body(x_ref[...])
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, out_dtype),
                          compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))(x)

  got = jax.jit(lambda a: elementwise(row_quant._ieee_reciprocal, a, jnp.float32))(d)
  _report("prim_recip_ptx", got, jax.jit(F.reciprocal)(d))
  got = jax.jit(lambda a: elementwise(lambda v: 1.0 / v, a, jnp.float32))(d)
  _report("prim_recip_slash", got, jax.jit(F.reciprocal)(d))
  clip = lambda v: jnp.clip(v, F.E4M3_MIN_SUBNORMAL, F.E4M3_MAX).astype(jnp.float8_e4m3fn)  # noqa: E731
  got = jax.jit(lambda a: elementwise(clip, a, jnp.float8_e4m3fn))(sweep)
  _report("prim_to_e4m3", got, jax.jit(clip)(sweep))
  dec = lambda b: jax.lax.bitcast_convert_type(b, jnp.float8_e4m3fn).astype(jnp.float32)  # noqa: E731
  got = jax.jit(lambda a: elementwise(dec, a, jnp.float32))(bits)
  _report("prim_e4m3_decode", got, jax.jit(dec)(bits))
  z = (sweep / 64).astype(np.float32)
  got = jax.jit(lambda a: elementwise(e2m1.encode, a, jnp.uint8))(z)
  _report("prim_e2m1_encode", got, jax.jit(e2m1.encode)(z))


def kv_fields():
  kc, vc, k, v, idx = decode_case(100)  # the GPU test's shared-index case
  got = jax.jit(kv_append.append)(kc, vc, k, v, idx)
  kq = jax.jit(lambda a: tq.quantize(a, "nvfp4", second_level="row", validate=False))(k)
  for name, a, w in (("kv_new_codes", got[2].codes, kq.codes),
                     ("kv_new_scales", got[2].scales, kq.scales),
                     ("kv_new_g", got[2].global_scale, kq.global_scale),
                     ("kv_cache_codes_at", got[0].codes[:, 100], kq.codes[:, 0]),
                     ("kv_cache_untouched", got[0].codes[:, :100], kc.codes[:, :100])):
    _report(name, a, w)


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe_glue.npz")
  args = p.parse_args()
  print("jax", jax.__version__, jax.devices()[0])
  steps = [("primitives", primitives),
           ("row_quant (PTX division)",
            functools.partial(row_quant_fields, "rq",
                              lambda a: row_quant.quantize_rows(a, "nvfp4"))),
           ("kv_append", kv_fields)]
  slash = lambda d: jnp.float32(1.0) / d  # noqa: E731

  def with_slash(a):
    orig = row_quant._ieee_reciprocal
    row_quant._ieee_reciprocal = slash
    try:
      return row_quant.quantize_rows(a, "nvfp4")
    finally:
      row_quant._ieee_reciprocal = orig
  steps.append(("row_quant (compiler's division)",
                functools.partial(row_quant_fields, "rq_slash", with_slash)))
  for name, fn in steps:
    print(f"== {name}", flush=True)
    try:
      fn()
    except Exception:  # noqa: BLE001 - a probe reports every step
      traceback.print_exc(limit=3)
  np.savez_compressed(args.out, **SAVED)


if __name__ == "__main__":
  main()
