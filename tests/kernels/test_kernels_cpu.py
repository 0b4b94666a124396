"""CPU tests of the matmul references, the kernel weight layout and everything around the
Mosaic GPU kernel (its in-register decode emulated bit for bit in numpy, its chunk tables and
output gather through a `jnp` model of the kernel). The Mosaic GPU kernel itself does not run
in Pallas interpret mode (its decode is inline PTX); `test_lowers_for_cuda` lowers it where
`jax-cuda13-plugin` is installed, and tests/kernels/test_kernels_gpu.py runs it on a GPU."""

import dataclasses
import functools
import os

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.kernels import dispatch, fp4_mgpu, layout, reference
from trace_jax.quant import quantize

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def np_dequant(q) -> np.ndarray:
  """Independent numpy decode of a QArray with blocks along axis -2: [.., K, N] float64."""
  codes = np.asarray(q.codes)
  lo, hi = codes & 15, codes >> 4
  ax = q.axis
  c = np.stack([lo, hi], axis=ax + 1)
  c = c.reshape(*codes.shape[:ax], 2 * codes.shape[ax], *codes.shape[ax + 1:])
  v = E2M1[c]
  if q.fmt.scale == "e8m0":
    b = np.asarray(q.scales).view(np.uint8).astype(np.float64)
    s = np.where(b == 255, np.nan, 2.0 ** (b - 127))
  else:
    s = np.asarray(q.scales).astype(np.float32).astype(np.float64)
    s = (s * np.asarray(q.global_scale, np.float64)).astype(np.float32).astype(np.float64)
  v = v * np.repeat(s, q.fmt.block, axis=ax)
  return np.take(v, np.arange(q.shape[ax]), axis=ax)


def rand_w(shape, seed):
  rng = np.random.default_rng(seed)
  col = np.exp(rng.normal(size=(1,) * (len(shape) - 1) + (shape[-1],)))  # spread of scales
  return jnp.asarray((rng.standard_normal(shape) * col).astype(np.float32))


# One dense and one expert shape (K, N not multiples of the tile) and one kb per format, shared
# by the tests so that the jitted prepare/decode functions compile once per combination.
DENSE = (200, 300)
EXPERTS = (6, 96, 256)
KB = {"nvfp4": 4, "mxfp4": 2}


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


# ------------------------------------------------------------------ references vs numpy

@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_matmul_ref_vs_numpy(fmt):
  w = rand_w((100, 48), 0)
  q = quantize(w, fmt, axis=0)
  x = jax.random.normal(jax.random.key(1), (3, 100), jnp.float32).astype(jnp.bfloat16)
  got = reference.matmul_ref(x, q, jnp.float32)
  want = np.asarray(x, np.float64) @ np_dequant(q)
  assert relerr(got, want) < 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_grouped_ref_vs_numpy(fmt):
  e, k, n = 5, 64, 40
  w = rand_w((e, k, n), 2)
  q = quantize(w, fmt, axis=1, second_level=(0,))
  gs = np.array([3, 0, 1, 6, 0], np.int32)  # empty groups, a one-row group
  m = 12  # two rows past sum(group_sizes): zeros
  x = jax.random.normal(jax.random.key(3), (m, k), jnp.float32).astype(jnp.bfloat16)
  got = np.asarray(reference.grouped_matmul_ref(x, q, jnp.asarray(gs), jnp.float32))
  wd, xn = np_dequant(q), np.asarray(x, np.float64)
  want = np.zeros((m, n))
  r = 0
  for g, size in enumerate(gs):
    want[r:r + size] = xn[r:r + size] @ wd[g]
    r += size
  assert relerr(got, want) < 1e-6
  assert np.all(got[gs.sum():] == 0)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "bf16"])
def test_xla_path_vs_numpy(fmt):
  """The GPU XLA path (bf16 `q * scale` operand, float32 second-level factor after the product),
  run here on CPU, against the numpy dequantized product: dense, and grouped with per-expert g,
  empty groups and a one-row group."""
  from trace_jax.kernels import dispatch
  e, k, n = 5, 64, 40
  w = rand_w((e, k, n), 4)
  q = w.astype(jnp.bfloat16) if fmt == "bf16" else quantize(w, fmt, axis=1, second_level=(0,))
  if fmt == "bf16":
    wd = np.asarray(q, np.float64)
  else:  # the E2M1 formats decoded independently; MXFP8 by the library's dequantize
    wd = np_dequant(q) if fmt != "mxfp8" else np.asarray(reference._operand(q), np.float64)
  parts = dispatch._bf16_parts(q)
  a, factor = parts
  assert a.dtype == jnp.bfloat16
  gs = np.array([3, 0, 1, 6, 0], np.int32)
  x = jax.random.normal(jax.random.key(5), (10, k), jnp.float32).astype(jnp.bfloat16)
  got = np.asarray(dispatch.xla_grouped_matmul(x, parts, jnp.asarray(gs), jnp.float32))
  xn, want, r = np.asarray(x, np.float64), np.zeros_like(got, np.float64), 0
  for g, size in enumerate(gs):
    want[r:r + size] = xn[r:r + size] @ wd[g]
    r += size
  assert relerr(got, want) < 1e-6  # float32 accumulation order and (q*s)*g vs q*(s*g)
  dense = jax.tree_util.tree_map(lambda t: t[3] if t is not None else None, parts)
  assert relerr(dispatch.xla_matmul(x, dense, jnp.float32), xn @ wd[3]) < 1e-6


def test_one_row_products_are_two_row_products_where_xla_gpu_needs_it(monkeypatch):
  """A single row goes through `_two_row_dot` (a zero second row) in the bf16 XLA path always,
  and in `float32_dot` (the router) on the GPU only (faked here): the lowered program then has
  the concatenate and a 2-row dot; several rows, the CPU and the `xla` setting keep the plain
  dot. Values agree with float64 numpy either way."""
  k, n = 64, 24
  w = jax.random.normal(jax.random.key(7), (k, n), jnp.float32)
  wn = np.asarray(w, np.float64)

  def fresh(x, w):  # a new function each time: the choice is made at trace time
    return dispatch.float32_dot(x, w)

  for rows, on_gpu in ((1, False), (1, True), (3, True)):
    monkeypatch.setattr(dispatch, "on_gpu", lambda on_gpu=on_gpu: on_gpu)
    monkeypatch.setattr(dispatch, "kernels_on", lambda on_gpu=on_gpu: on_gpu)
    x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.float32)
    text = jax.jit(functools.partial(fresh)).lower(x, w).as_text()
    padded = rows == 1 and on_gpu
    assert ("stablehlo.concatenate" in text) == padded, (rows, on_gpu)
    assert (f"tensor<2x{k}xf32>" in text) == padded
    got = np.asarray(jax.jit(functools.partial(fresh))(x, w), np.float64)
    assert got.shape == (rows, n)
    assert relerr(got, np.asarray(x, np.float64) @ wn) < 1e-6
  x = jax.random.normal(jax.random.key(1), (1, k), jnp.float32)  # the opt-out, on "GPU"
  monkeypatch.setattr(dispatch, "_SINGLE_ROW", "xla")
  text = jax.jit(functools.partial(fresh)).lower(x, w).as_text()
  assert "stablehlo.concatenate" not in text and f"tensor<2x{k}xf32>" not in text
  monkeypatch.setattr(dispatch, "_SINGLE_ROW", "pad")
  xb = jnp.ones((1, 1, k), jnp.bfloat16)  # [B, T, K] with one row: padded on any backend
  assert "stablehlo.concatenate" in jax.jit(
      lambda x, w: dispatch.xla_matmul(x, (w.astype(jnp.bfloat16), None), jnp.float32)
  ).lower(xb, w).as_text()


def test_router_product_of_bf16_operands(monkeypatch):
  """`TRACE_JAX_ROUTER_DOT=bf16` on the GPU (faked here): bf16 router operands go through one
  bf16 product with float32 accumulation (no float32 converts in the program), whose products
  are exact, so it agrees with float64 numpy to float32 accumulation; float32 operands, and the
  default setting, keep the float32 dot."""
  k, n = 256, 128
  x = jax.random.normal(jax.random.key(3), (5, k), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(4), (k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)

  def fresh(x, w):  # a new function each time: the choice is made at trace time
    return dispatch.float32_dot(x, w)

  for setting, operands, bf16_dot in (("bf16", (x, w), True), ("float32", (x, w), False),
                                      ("bf16", (x.astype(jnp.float32), w), False)):
    monkeypatch.setattr(dispatch, "_ROUTER_DOT", setting)
    text = jax.jit(functools.partial(fresh)).lower(*operands).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 1 and ("xbf16>, tensor" in dots[0]) == bf16_dot, (setting, dots)
    got = jax.jit(functools.partial(fresh))(*operands)
    assert got.dtype == jnp.float32
    assert relerr(np.asarray(got, np.float64), want) < 1e-6
  monkeypatch.setattr(dispatch, "_ROUTER_DOT", "bf16")  # one row: the zero second row too
  text = jax.jit(functools.partial(fresh)).lower(x[:1], w).as_text()
  assert "stablehlo.concatenate" in text and f"tensor<2x{k}xbf16>" in text


def _all_eqns(jaxpr):
  """A jaxpr's equations and those of the jaxprs in their parameters, depth first."""
  for e in jaxpr.eqns:
    yield e
    for v in e.params.values():
      for sub in (v if isinstance(v, (list, tuple)) else [v]):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from _all_eqns(inner)


def test_router_product_default_and_derivative(monkeypatch):
  """The bf16 product is the GPU default, and its derivative is the float32 dot's, bit for bit
  (float32 cotangent products rounded to the operands' bf16): a trainer with bf16 weights on
  the GPU learns as with the float32 dot; against float64 numpy too."""
  assert dispatch._ROUTER_DOT == ("bf16" if os.environ.get("TRACE_JAX_ROUTER_DOT") in (
      None, "bf16") else "float32")
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.normal(size=(2, 3, 96)), jnp.bfloat16)  # [B, T, K]
  w = jnp.asarray(rng.normal(size=(96, 24)) * 0.1, jnp.bfloat16)
  ct = rng.normal(size=(2, 3, 24)).astype(np.float32)
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  grads = {}
  for setting in ("bf16", "float32"):
    monkeypatch.setattr(dispatch, "_ROUTER_DOT", setting)
    loss = lambda x, w: jnp.sum(dispatch.float32_dot(x, w) * ct)  # noqa: E731 - traced anew
    grad = jax.grad(loss, argnums=(0, 1))
    grads[setting] = jax.jit(grad)(x, w)
    # the cotangent's two products at HIGHEST precision either way (the GPU's default would
    # be TF32; on CPU both are exact, so the values below cannot tell)
    dots = [e for e in _all_eqns(jax.make_jaxpr(grad)(x, w).jaxpr)
            if e.primitive.name == "dot_general"]
    highest = [d for d in dots if "HIGHEST" in str(d.params.get("precision"))]
    assert len(dots) == 3 and len(highest) >= 2, (setting, [d.params for d in dots])
  for got, want in zip(grads["bf16"], grads["float32"]):
    assert got.dtype == jnp.bfloat16 and np.array_equal(np.asarray(got), np.asarray(want))
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  dx = np.asarray(grads["bf16"][0], np.float64)
  assert relerr(dx, np.einsum("btn,kn->btk", ct, wf)) < 1e-2  # bf16 rounding of the result
  dw = np.asarray(grads["bf16"][1], np.float64)
  assert relerr(dw, np.einsum("btk,btn->kn", xf, ct)) < 1e-2


# ------------------------------------------------------------------ layout

@pytest.mark.parametrize("fmt,kb", KB.items())
def test_layout_roundtrip(fmt, kb):
  """decode_packed(prepare_weight(q)) == dequantize(q): dense and experts, K and N not
  multiples of the tile (padding)."""
  for shape, axis, sl in [(DENSE, 0, "tensor"), (EXPERTS, 1, (0,))]:
    q = quantize(rand_w(shape, 4), fmt, axis=axis, second_level=sl)
    pw = kernels.prepare_weight(q, kb=kb)
    assert pw.shape == shape and pw.k_pad % (64 * kb) == 0 and pw.n_pad % 256 == 0
    got = np.asarray(kernels.decode_packed(pw), np.float64)
    want = np_dequant(q)
    if fmt == "mxfp4":
      np.testing.assert_array_equal(got, want)  # powers of two: exact
    else:
      np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)  # fp32 rounding of s*g


def test_layout_nan_scale_poisons_column():
  # a NaN block scale set by hand: quantize's own NaN path depends on XLA CPU's max reduction,
  # which dropped the NaN for some shapes (seen at [200, 300]; reported, not ours to fix)
  q = quantize(rand_w(DENSE, 5), "mxfp4", axis=0)
  sb = np.asarray(q.scales).view(np.uint8).copy()
  sb[0, 7] = 0xFF
  q = dataclasses.replace(q, scales=jnp.asarray(sb).view(jnp.float8_e8m0fnu))
  d = np.asarray(kernels.decode_packed(kernels.prepare_weight(q, kb=KB["mxfp4"])))
  assert np.all(np.isnan(d[:, 7])) and np.all(np.isfinite(np.delete(d, 7, axis=1)))


def _prmt(a, b, sel):
  pool = [(a >> np.uint32(8 * i)) & np.uint32(255) for i in range(4)]
  pool += [(b >> np.uint32(8 * i)) & np.uint32(255) for i in range(4)]
  out = np.zeros_like(a)
  for i in range(4):
    byte = pool[(sel >> (4 * i)) & 7]
    if (sel >> (4 * i)) & 8:  # sign-replicate mode: the byte's bit 7 in all 8 bits
      byte = np.where(byte & np.uint32(0x80), np.uint32(0xFF), np.uint32(0))
    out |= byte << np.uint32(8 * i)
  return out


def _decode_word(x, mult):
  """fp4_mgpu.DECODE_ASM on uint32 code words x with bf16x2 multipliers: the four registers
  (nibbles (0, 2), (1, 3), (4, 6), (5, 7)), each prmt (sign-replicating), shl 2, and, mul."""
  w4 = x << np.uint32(4)
  return [_bf16x2_mul((_prmt(src, src, sel) << np.uint32(2)) & np.uint32(0x81C081C0), mult)
          for sel, src in ((0x9180, w4), (0x9180, x), (0xB3A2, w4), (0xB3A2, x))]


def _decode_weight_word(x, mult):
  """fp4_mgpu.WEIGHT_DECODE_ASM on uint32 code words x with bf16x2 multipliers: register 0 the
  word masked, 1 shifted left by 4, 2 rotated left by 10, 3 shifted left by 6 with its e1 bits
  from the word shifted right by 2; each masked to bf16 bits 15, 8, 7, 6 of each half, then
  multiplied."""
  u = np.uint32
  mag = u(0x81C081C0)
  r3 = ((x << u(6)) & u(0x80C080C0)) | ((x >> u(2)) & u(0x01000100))
  return [_bf16x2_mul(r, mult) for r in
          (x & mag, (x << u(4)) & mag, ((x << u(10)) | (x >> u(22))) & mag, r3)]


def _bf16x2_mul(a, b):
  """mul.rn.bf16x2 of uint32 pairs (exact products here, so f32 multiply then round)."""
  out = np.zeros_like(a)
  for h in range(2):
    av = ((a >> np.uint32(16 * h)) & np.uint32(0xFFFF)).astype(np.uint16).view(ml_dtypes.bfloat16)
    bv = ((b >> np.uint32(16 * h)) & np.uint32(0xFFFF)).astype(np.uint16).view(ml_dtypes.bfloat16)
    p = (av.astype(np.float32) * bv.astype(np.float32)).astype(ml_dtypes.bfloat16)
    out |= p.view(np.uint16).astype(np.uint32) << np.uint32(16 * h)
  return out


def emulate_kernel_decode(pw, e=0):
  """Numpy re-enactment of the kernel's PTX (fp4_mgpu._SCALE_ASM / WEIGHT_DECODE_ASM) on the
  packed words: returns A [N_pad, K_pad] bf16 values in the kernel's PHYSICAL K order."""
  words = np.asarray(pw.codes[e]).astype(np.uint32)
  sw = np.asarray(pw.scales[e]).astype(np.uint32)
  nt, kt = words.shape[0], words.shape[1] // 16
  w = words.reshape(nt, kt, 128, 4)
  s = sw.reshape(nt, kt // pw.kb, 128, pw.kb // 2)
  a = np.zeros((nt, kt, 64, 64), np.float32)
  t = np.arange(128)
  wp, g, q = t // 32, (t % 32) // 4, t % 4
  for j in range(kt):
    step, jj = divmod(j, pw.kb)
    word = s[:, step, :, jj // 2]
    cs = []
    for r in range(2):
      b = 2 * (jj % 2) + r
      c = _prmt(word, np.zeros_like(word), 0x4040 | b | (b << 8))
      c = (c << np.uint32(4)) + np.uint32(0x76007600) if pw.fmt == "nvfp4" else c << np.uint32(7)
      cs.append(c)
    for jw in range(4):  # word jw: 8 codes of row jw // 2
      x = w[:, j, :, jw]
      for o, val in enumerate(_decode_weight_word(x, cs[jw // 2])):
        ci, ri = 4 * (jw % 2) + o, jw // 2
        for v in range(2):
          h = ((val >> np.uint32(16 * v)) & np.uint32(0xFFFF)).astype(np.uint16)
          a[:, j, wp * 16 + ri * 8 + g, 8 * ci + 2 * q + v] = (
              h.view(ml_dtypes.bfloat16).astype(np.float32))
  return a.transpose(0, 2, 1, 3).reshape(nt * 64, kt * 64)


@pytest.mark.parametrize("fmt,kb", KB.items())
def test_kernel_decode_emulation_exact(fmt, kb):
  """The PTX decode of the packed layout, times the column factor, against the permuted
  activations equals x @ dequantize(q) (the layout, the bit placement and the scale bytes)."""
  k, n = DENSE
  q = quantize(rand_w(DENSE, 6), fmt, axis=0)
  pw = kernels.prepare_weight(q, kb=kb)
  a_phys = emulate_kernel_decode(pw)  # [N_pad, K_pad]
  a_ref, _ = layout.decode_parts(pw)  # [1, K, N] logical
  a_pad = jnp.pad(jnp.asarray(a_ref[0]).T.astype(jnp.float32), ((0, 0), (0, pw.k_pad - k)))
  np.testing.assert_array_equal(a_phys[:n], np.asarray(layout.permute_k(a_pad)))
  x = jax.random.normal(jax.random.key(7), (5, k), jnp.float32).astype(jnp.bfloat16)
  xp = np.asarray(layout.permute_k(jnp.pad(x, ((0, 0), (0, pw.k_pad - k)))), np.float64)
  y = (xp @ a_phys.T.astype(np.float64)) * np.asarray(pw.factor[0], np.float64)
  assert relerr(y[:, :n], np.asarray(x, np.float64) @ np_dequant(q)) < 1e-6


# ------------------------------------------------------------------ wrappers around the kernel

@jax.jit
def _dense_emulated(x, pw):
  return fp4_mgpu.matmul(x, pw, out_dtype=jnp.float32, kernel_fn=fp4_mgpu.emulate_chunked_matmul)


@functools.partial(jax.jit, static_argnames=("bm", "stream_k"))
def _grouped_emulated(x, pw, g, bm, stream_k=None):
  return fp4_mgpu.grouped_matmul(x, pw, g, out_dtype=jnp.float32, bm=bm,
                                 kernel_fn=fp4_mgpu.emulate_chunked_matmul,
                                 config=dict(stream_k=stream_k))


@pytest.mark.parametrize("fmt,leads", [("nvfp4", [(1,), (64,)]), ("mxfp4", [(2, 5)])])
def test_dense_wrapper_emulated(fmt, leads):
  q = quantize(rand_w(DENSE, 8), fmt, axis=0)  # K, N not multiples of the tile
  pw = kernels.prepare_weight(q, kb=KB[fmt])
  for lead in leads:  # n_pad 512 -> 2 CTAs: K split over CTAs
    x = jax.random.normal(jax.random.key(9), (*lead, DENSE[0]), jnp.float32).astype(jnp.bfloat16)
    got = _dense_emulated(x, pw)
    assert got.shape == (*lead, DENSE[1])
    assert relerr(got, reference.matmul_ref(x, q, jnp.float32)) < 1e-6


def test_dense_as_one_group_emulated():
  """Dense products past the GEMV kernel's rows through the grouped kernel, every row in one
  group: 3 lead rows x 50 = 150 rows in chunks of 64 (the last one partly past the rows), K
  not a multiple of the tile, its 4 steps split 4 ways (`dense_group_config`: 2 column tiles x
  3 chunks x 4 CTAs; float32 partial sums)."""
  k, n = 1000, 300
  q = quantize(rand_w((k, n), 31), "nvfp4", axis=0)
  pw = kernels.prepare_weight(q, kb=KB["nvfp4"])
  x = jax.random.normal(jax.random.key(32), (3, 50, k), jnp.float32).astype(jnp.bfloat16)
  got = jax.jit(lambda x, pw: fp4_mgpu.matmul_as_group(
      x, pw, out_dtype=jnp.float32, kernel_fn=fp4_mgpu.emulate_chunked_matmul))(x, pw)
  assert fp4_mgpu.dense_group_config(150, 2, 4) == dict(n_inner=1, splits=4)
  assert got.shape == (3, 50, n)
  assert relerr(got, reference.matmul_ref(x, q, jnp.float32)) < 1e-6
  with pytest.raises(ValueError, match="dense weight"):
    qe = quantize(rand_w((2, *DENSE), 33), "nvfp4", axis=1, second_level=(0,))
    fp4_mgpu.matmul_as_group(x, kernels.prepare_weight(qe, kb=4))


def test_dense_rows_choose_gemv_grouped_or_decode_and_dot(monkeypatch):
  """The dense FP4 product's path by row count on the kernel path: the GEMV kernel up to
  MAX_DECODE_ROWS, the grouped kernel as one group up to DENSE_GROUP_ROWS (5.7x faster than
  the decode + dot at 256 rows on the H200), the bf16 decode and XLA's dot past it (traced
  only, the kernel wrappers stubbed: which path each row count reaches; the kernels' own
  results are tested above and on the GPU)."""
  q = quantize(rand_w(DENSE, 34), "nvfp4", axis=0)
  pw = kernels.prepare_weight(q, kb=KB["nvfp4"])
  seen = []
  for name in ("matmul", "matmul_as_group"):  # the kernels' wrappers, recorded, not run
    monkeypatch.setattr(fp4_mgpu, name, lambda x, w, *a, name=name, **k: (
        seen.append((name, x.size // x.shape[-1])), jnp.zeros((*x.shape[:-1], w.n)))[1])
  monkeypatch.setattr(dispatch, "decode_parts", lambda w, real=dispatch.decode_parts: (
      seen.append(("decode", None)), real(w))[1])
  for rows in (fp4_mgpu.MAX_DECODE_ROWS, fp4_mgpu.MAX_DECODE_ROWS + 1, dispatch.DENSE_GROUP_ROWS,
               dispatch.DENSE_GROUP_ROWS + 1):
    x = jax.ShapeDtypeStruct((rows, DENSE[0]), jnp.bfloat16)
    jax.eval_shape(lambda x: dispatch.matmul(x, pw, use_kernel=True), x)
  assert dispatch.DENSE_GROUP_ROWS >= 256
  assert seen == [("matmul", 64), ("matmul_as_group", 65),
                  ("matmul_as_group", dispatch.DENSE_GROUP_ROWS), ("decode", None)], seen


@functools.partial(jax.jit, static_argnames=("steps",))
def _stream_k_emulated(x, pw, steps):
  return fp4_mgpu.matmul(x, pw, out_dtype=jnp.float32, config=dict(stream_k=steps),
                         kernel_fn=fp4_mgpu.emulate_chunked_matmul)


@pytest.mark.parametrize("steps", [2, 4, 5])
def test_dense_stream_k_emulated(steps):
  """Stream-K: 3 column tiles x 3 K steps over CTAs of 2 (a CTA ends one tile and starts the
  next; the last CTA holds one unit), 4 (a whole tile and the next one's first step) and 5 (more
  than a tile) units; the wrapper adds only the written slots (the model leaves NaN in the
  others) and applies the column factor after."""
  q = quantize(rand_w((520, 700), 16), "nvfp4", axis=0)
  pw = kernels.prepare_weight(q, kb=4)
  assert (pw.n_pad // 256, pw.k_pad // 256) == (3, 3)
  for b in (1, 20):  # chunks of 16 and 32 rows
    x = jax.random.normal(jax.random.key(b), (b, 520), jnp.float32).astype(jnp.bfloat16)
    got = _stream_k_emulated(x, pw, steps)
    assert relerr(got, reference.matmul_ref(x, q, jnp.float32)) < 1e-6


def test_stream_k_slots_and_plan():
  """Every (tile, K step) unit is in exactly one slot; the CTA that holds a unit (unit //
  steps) is the slot's (the tile's first CTA + slot); a slot's steps are consecutive. The plan
  takes stream-K where it shortens the busiest SM's run of steps: the 8192 x 28672 GEMV (112
  tiles x 32 steps: 28 a CTA), not the 30B-A3B q/k/v (20 x 8, 4 splits) or o_proj (8 x 16,
  16 splits) calls, whose splits already fill the SMs as evenly."""
  for tiles, k_steps, steps in [(3, 3, 2), (3, 3, 4), (3, 3, 5), (112, 32, 28), (7, 5, 3)]:
    held = fp4_mgpu.stream_k_slots(tiles, k_steps, steps)
    assert np.all(held.sum(axis=0) == 1)
    for p, t, k in zip(*np.nonzero(held)):
      assert (t * k_steps + k) // steps == (t * k_steps) // steps + p
    for p in range(held.shape[0]):
      for t in range(tiles):
        ks = np.nonzero(held[p, t])[0]
        assert len(ks) == 0 or ks[-1] - ks[0] == len(ks) - 1
  assert fp4_mgpu.stream_k_plan(112, 32, 1) == 28
  assert fp4_mgpu.stream_k_plan(20, 8, 4) == 0
  assert fp4_mgpu.stream_k_plan(8, 16, 16) == 0
  assert fp4_mgpu.stream_k_plan(200, 32, 1) == 49  # 2 waves of 32 steps against 49
  assert fp4_mgpu.stream_k_plan(112, 32, 1, bm=32) == 28
  assert fp4_mgpu.stream_k_plan(112, 32, 1, bm=64) == 0  # the slots' sum costs the gain
  # the dense wrapper's default, against the K splits it would use otherwise
  assert fp4_mgpu.dense_stream_k(112, 32, 16) == 28
  assert fp4_mgpu.dense_stream_k(16, 8, 16) == 0  # q projection: 8 splits fill 128 SMs


def test_concat_columns_and_fuse_projections():
  """Dense PackedWeights side by side decode to the parts side by side, bit for bit (each part's
  scales ride on its own columns), and multiply as the parts do; `fuse_projections` fuses a
  dict's q/k/v kernels (k's and v's become None) only where the parts fit unpadded."""
  qs = [quantize(rand_w((200, n), 20 + n), "nvfp4", axis=0) for n in (512, 256, 256)]
  pws = [kernels.prepare_weight(q, kb=4) for q in qs]
  fused = layout.concat_columns(pws)
  assert fused.shape == (200, 1024) and fused.n_pad == 1024
  whole, parts = layout.decode_parts(fused), [layout.decode_parts(pw) for pw in pws]
  for got, want in zip(whole, (jnp.concatenate([p[i] for p in parts], axis=-1) for i in (0, 1))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  x = jax.random.normal(jax.random.key(3), (3, 200), jnp.float32).astype(jnp.bfloat16)
  want = jnp.concatenate([reference.matmul_ref(x, q, jnp.float32) for q in qs], axis=-1)
  assert relerr(_dense_emulated(x, fused), want) < 1e-6
  odd = kernels.prepare_weight(quantize(rand_w((200, 300), 23), "nvfp4", axis=0), kb=4)
  with pytest.raises(ValueError, match="multiple of 256"):
    layout.concat_columns([pws[0], odd])
  with pytest.raises(ValueError, match="one format, kb and K"):
    layout.concat_columns([pws[0], kernels.prepare_weight(qs[1], kb=2)])
  attn = {"q_proj": {"kernel": pws[0]}, "k_proj": {"kernel": pws[1]},
          "v_proj": {"kernel": pws[2]}, "o_proj": {"kernel": pws[1]}}
  tree = kernels.fuse_projections({"layers_0": {"attn": attn}, "embed": jnp.ones(3)})
  got = tree["layers_0"]["attn"]
  assert got["q_proj"]["kernel"].shape == (200, 1024)
  assert got["k_proj"]["kernel"] is None and got["v_proj"]["kernel"] is None
  assert got["o_proj"]["kernel"] is pws[1]
  same = lambda a, b: all(x is y for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))  # noqa
  for bad in ({**attn, "v_proj": {"kernel": odd}},  # padded columns
              {**attn, "q_proj": {"kernel": pws[0], "bias": jnp.zeros(512)}},  # a bias
              {**attn, "k_proj": {"kernel": qs[1]}}):  # not in the kernel layout
    out = kernels.fuse_projections({"attn": bad})["attn"]
    assert out.keys() == bad.keys() and same(out, bad)
  # bf16 parts (the `paper` policy's attention weights): fused only when asked, side by side
  wb = [jnp.asarray(rand_w((200, n), 30 + n), jnp.bfloat16) for n in (512, 128, 128)]
  attn_b = {p: {"kernel": w} for p, w in zip(("q_proj", "k_proj", "v_proj"), wb)}
  assert same(kernels.fuse_projections({"attn": attn_b})["attn"], attn_b)
  got = kernels.fuse_projections({"attn": attn_b}, bf16=True)["attn"]
  np.testing.assert_array_equal(np.asarray(got["q_proj"]["kernel"]),
                                np.concatenate([np.asarray(w) for w in wb], axis=1))
  assert got["k_proj"]["kernel"] is None and got["v_proj"]["kernel"] is None
  mixed = {**attn_b, "v_proj": {"kernel": wb[2].astype(jnp.float32)}}  # not all bf16
  assert same(kernels.fuse_projections({"attn": mixed}, bf16=True)["attn"], mixed)


def test_grouped_n_inner_and_stages(monkeypatch):
  """n_inner: the setting, cut to the largest divisor of the column tiles; chained pipelines
  get a stage count that divides the steps per tile (enumerated against a brute-force rule)."""
  assert fp4_mgpu.grouped_n_inner(6, "all") == 6
  assert fp4_mgpu.grouped_n_inner(8, "all") == 8
  assert fp4_mgpu.grouped_n_inner(6, "4") == 3  # 4 does not divide 6
  assert fp4_mgpu.grouped_n_inner(7, "2") == 1
  monkeypatch.setattr(fp4_mgpu, "GROUPED_N_INNER", "2")
  assert fp4_mgpu.grouped_n_inner(8) == 2
  with pytest.raises(ValueError, match="n_inner"):
    fp4_mgpu.grouped_n_inner(6, "0")
  for bm in fp4_mgpu.BM_CHOICES:
    for k_steps in range(1, 13):
      for n_inner in (1, 2, 8):
        cfg = fp4_mgpu.default_config(bm, 4, jnp.bfloat16, k_steps=k_steps, n_ctas=0,
                                      split=False, n_inner=n_inner)
        cap = fp4_mgpu.default_config(bm, 4, jnp.bfloat16, k_steps=k_steps, n_ctas=0,
                                      split=False)["stages"]
        want = max(d for d in range(1, cap + 1) if n_inner == 1 or k_steps % d == 0)
        assert cfg["stages"] == want and cfg["n_inner"] == n_inner, (bm, k_steps, n_inner)


def test_grouped_parallelism_rule():
  """Column tiles per CTA and K splits of a grouped call against the rule enumerated: n_inner the
  largest divisor of the tiles (up to the setting) that leaves >= NUM_SMS/2 CTAs with rows, else
  1; then the most K splits (divisors of the steps) with <= NUM_SMS CTAs; given values kept."""
  sms = fp4_mgpu.NUM_SMS
  for active in (1, 3, 8, 16, 40, 64, 128):
    for tiles in (1, 2, 6, 8):
      for steps in (1, 2, 3, 8):
        ni, sp = fp4_mgpu.grouped_parallelism(active, tiles, steps)
        divs = [d for d in range(1, tiles + 1) if tiles % d == 0]
        want_ni = max([d for d in divs if active * tiles // d >= sms // 2] or [1])
        assert ni == want_ni, (active, tiles, steps)
        if ni == 1 and active * tiles < sms // 2:
          want_sp = max(s for s in range(1, steps + 1)
                        if steps % s == 0 and active * tiles * s <= sms)
        else:
          want_sp = 1
        assert sp == want_sp, (active, tiles, steps)
        assert fp4_mgpu.grouped_parallelism(active, tiles, steps, 1, 1) == (1, 1)
  # the 30B-A3B experts (gate+up: 6 tiles, 8 steps; down: 8 tiles, 3 steps) at batch 1, 8, 64
  assert fp4_mgpu.grouped_parallelism(8, 6, 8) == (1, 2)
  assert fp4_mgpu.grouped_parallelism(8, 8, 3) == (1, 1)
  assert fp4_mgpu.grouped_parallelism(64, 6, 8) == (3, 1)
  assert fp4_mgpu.grouped_parallelism(128, 6, 8) == (6, 1)
  with pytest.raises(ValueError, match="splits"):
    fp4_mgpu.default_config(16, 4, jnp.bfloat16, k_steps=3, n_ctas=0, split=False, splits=2)


@functools.partial(jax.jit, static_argnames=("splits",))
def _grouped_split_emulated(x, pw, g, splits):
  return fp4_mgpu.grouped_matmul(x, pw, g, out_dtype=jnp.float32, config=dict(splits=splits),
                                 kernel_fn=fp4_mgpu.emulate_chunked_matmul)


@pytest.mark.parametrize("splits", [None, 1])
def test_grouped_wrapper_split_k_emulated(splits):
  """K split across CTAs (3 steps: few groups split 3 ways by the rule) sums the partial
  products of the wanted rows; empty groups and rows past the sum stay zero."""
  q = quantize(rand_w((3, 520, 64), 12), "nvfp4", axis=1, second_level=(0,))
  pw = kernels.prepare_weight(q, kb=4)
  assert fp4_mgpu.grouped_parallelism(3, 1, pw.k_pad // 256) == (1, 3)
  for gs in ([0, 7, 0], [5, 1, 9]):
    x = jax.random.normal(jax.random.key(sum(gs)), (20, 520), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    got = _grouped_split_emulated(x, pw, g, splits)
    want = reference.grouped_matmul_ref(x, q, g, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(got)[sum(gs):] == 0)


@pytest.mark.parametrize("bm,stream_k", [(16, False), (32, False), (16, True)])
def test_grouped_wrapper_emulated(bm, stream_k):
  e, k, n = EXPERTS
  q = quantize(rand_w(EXPERTS, 10), "nvfp4", axis=1, second_level=(0,))
  pw = kernels.prepare_weight(q, kb=KB["nvfp4"])
  cases = [[0, 1, 0, 0, 0, 0],  # one token
           [40, 0, 3, 0, 17, 0],  # empty groups, a group over several chunks
           [0, 0, 0, 0, 0, 0],  # nothing routed
           [5, 5, 5, 5, 5, 5]]
  m = 67  # one compile; rows past the sum give zeros
  for gs in cases:
    x = jax.random.normal(jax.random.key(sum(gs)), (m, k), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    got = _grouped_emulated(x, pw, g, bm, stream_k)
    want = reference.grouped_matmul_ref(x, q, g, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("merge", ["xla", "kernel"])
def test_grouped_stream_k_emulated(merge):
  """The grouped stream-K schedule (emulated kernel: its out and parts, unwritten tiles NaN;
  merge "kernel": the cut tiles' parts added in the kernel): 3 column tiles x 3 K steps a
  chunk over 4 / 7 / 132 CTAs, so runs cut tiles and cross chunks; empty groups, one token,
  nothing routed, rows past the sum; the tables built from the sizes and `route`'s (with rows
  / out_rows), as float32 and bf16."""
  e, k, n = 6, 520, 600  # K 768 and N 768 padded: 3 steps, 3 tiles
  q = quantize(rand_w((e, k, n), 14), "nvfp4", axis=1, second_level=(0,))
  pw = kernels.prepare_weight(q, kb=4)
  m = 50

  @functools.partial(jax.jit, static_argnames=("n_ctas", "out_dtype"))
  def run(x, g, n_ctas, out_dtype=jnp.float32):
    return fp4_mgpu.grouped_matmul(x, pw, g, out_dtype=out_dtype,
                                   config=dict(stream_k=True, n_ctas=n_ctas, merge=merge),
                                   kernel_fn=fp4_mgpu.emulate_chunked_matmul)

  cuts = 0
  for gs in ([0, 7, 0, 3, 30, 1], [0, 1, 0, 0, 0, 0], [0] * 6):
    x = jax.random.normal(jax.random.key(sum(gs)), (m, k), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    want = np.asarray(reference.grouped_matmul_ref(x, q, g, jnp.float32))
    bm = fp4_mgpu.grouped_bm(m, e)
    chunks = int(fp4_mgpu.chunk_tables(g, m, bm, with_total=True)[3][0])
    for n_ctas in (4, 7, 132):
      steps = max(-(-chunks * 9 // n_ctas), 3)
      tiles = np.arange(chunks * 3)
      cuts += (tiles * 3 // steps != (tiles * 3 + 2) // steps).sum()
      got = np.asarray(run(x, g, n_ctas))
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"{gs} {n_ctas}")
      assert np.all(got[sum(gs):] == 0)
    got16 = np.asarray(run(x, g, 7, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(got16, want, rtol=1e-2, atol=1e-2 * np.abs(want).max())
  assert cuts > 0  # runs ended inside tiles: their parts were added
  # route's tables (their total) and the caller's row order
  tokens, top = 25, 2
  idx = jnp.asarray(np.random.default_rng(6).integers(0, e, (tokens, top)), jnp.int32)
  order, inverse, gs, tables = dispatch._routed_by_counts(idx.reshape(-1), e)
  xt = jax.random.normal(jax.random.key(7), (tokens, k), jnp.float32).astype(jnp.bfloat16)
  got = fp4_mgpu.grouped_matmul(xt, pw, gs, out_dtype=jnp.float32, rows=order // top,
                                out_rows=inverse, tables=tables,
                                config=dict(stream_k=True, n_ctas=5, merge=merge),
                                kernel_fn=fp4_mgpu.emulate_chunked_matmul)
  want = reference.grouped_matmul_ref(xt[order // top], q, gs, jnp.float32)[inverse]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_grouped_stream_k_rule(monkeypatch):
  """Decode-sized calls (32-256 rows) take the grouped stream-K schedule by default; row
  chunks, asked-for K splits or chained tiles, 64-row chunks and the "off" setting do not."""
  rule = fp4_mgpu.grouped_stream_k
  min_rows = fp4_mgpu.GROUPED_STREAM_K_MIN_ROWS
  assert rule(256, 16, False, {}) and rule(min_rows, 16, False, {})
  assert not rule(min_rows - 1, 16, False, {})
  assert not rule(fp4_mgpu.GROUPED_STREAM_K_MAX_ROWS + 1, 16, False, {})
  assert not rule(256, 16, True, {}) and not rule(256, 64, False, {})
  assert not rule(256, 16, False, dict(splits=2)) and not rule(256, 16, False, dict(n_inner=6))
  monkeypatch.setattr(fp4_mgpu, "GROUPED_STREAM_K", "off")
  assert not rule(256, 16, False, {})
  monkeypatch.setattr(fp4_mgpu, "GROUPED_STREAM_K", "on")
  assert rule(8, 16, False, {})


def test_dispatch_cpu_falls_back():
  q = quantize(rand_w(DENSE, 11), "mxfp4", axis=0)
  pw = kernels.prepare_weight(q, kb=KB["mxfp4"])
  x = jax.random.normal(jax.random.key(0), (4, DENSE[0]), jnp.float32).astype(jnp.bfloat16)
  assert not kernels.on_gpu()
  np.testing.assert_array_equal(np.asarray(kernels.matmul(x, pw)),
                                np.asarray(kernels.matmul(x, q)))
  qe = quantize(rand_w(EXPERTS, 12), "mxfp4", axis=1, second_level=(0,))
  g = jnp.asarray([2, 0, 1, 0, 0, 1], jnp.int32)
  xe = jax.random.normal(jax.random.key(1), (4, EXPERTS[1]), jnp.float32).astype(jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(kernels.grouped_matmul(xe, kernels.prepare_weight(qe, kb=KB["mxfp4"]), g)),
      np.asarray(kernels.grouped_matmul(xe, qe, g)))


def test_lowers_for_cuda():
  """Mosaic GPU lowering (layouts, inline PTX, SMEM budget) runs on CPU with the plugin."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  for fmt in ("nvfp4", "mxfp4"):
    k, n = 1024, 512
    pw = layout.PackedWeight(sds((1, n // 64, k // 4, 32), jnp.uint32),
                             sds((1, n // 64, k // 32, 32), jnp.uint32),
                             sds((1, n), jnp.float32), fmt, (k, n), 4)
    for b in (1, 64):  # bm 16 (K split: float32 partial sums) and 64
      jax.jit(lambda x, p: fp4_mgpu.matmul(x, p)).trace(
          sds((b, k), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",))
      for steps in (2, 3):  # stream-K: 2 tiles x 4 steps, the last CTA's length dynamic at 3
        jax.jit(lambda x, p: fp4_mgpu.matmul(x, p, config=dict(stream_k=steps))).trace(
            sds((b, k), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",))
    jax.jit(lambda x, p: fp4_mgpu.matmul_as_group(x, p)).trace(  # 100 rows: one group
        sds((100, k), jnp.bfloat16), pw).lower(lowering_platforms=("cuda",))
    pe = layout.PackedWeight(sds((8, n // 64, k // 4, 32), jnp.uint32),
                             sds((8, n // 64, k // 32, 32), jnp.uint32),
                             sds((8, n), jnp.float32), fmt, (8, k, n), 4)
    # grouped: bm 16 (the stream-K schedule by default, with the cut tiles' parts added in
    # the kernel, and the chunk schedule) and 64
    for m, cfg in ((40, {}), (40, dict(stream_k=True, merge="kernel")),
                   (40, dict(stream_k=False)), (512, {})):
      jax.jit(lambda x, p, g: fp4_mgpu.grouped_matmul(x, p, g, config=cfg)).trace(
          sds((m, k), jnp.bfloat16), pe, sds((8,), jnp.int32)).lower(
              lowering_platforms=("cuda",))


def test_capacity_gate_up_stages_fit_smem():
  """The 8k-capacity batch's gate+up (2,208 rows of 128 experts, bm 32, 6 chained column
  tiles of 8 K steps) gets 4 pipeline stages, and Mosaic's lowering, which checks the CTA's
  shared memory (232,448 bytes), accepts them; with bm 64 (16 KiB more a stage) it
  refuses 4."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  e, k, n, m = 128, 2048, 1536, 2208
  bm = fp4_mgpu.grouped_bm(m, e)
  n_inner, splits = fp4_mgpu.grouped_parallelism(e, n // 256, k // 256)
  cfg = fp4_mgpu.default_config(bm, 4, jnp.bfloat16, k_steps=k // 256, n_ctas=0, split=False,
                                n_inner=n_inner, splits=splits)
  assert (bm, n_inner, splits, cfg["stages"]) == (32, 6, 1, 4)
  pe = layout.PackedWeight(sds((e, n // 64, k // 4, 32), jnp.uint32),
                           sds((e, n // 64, k // 32, 32), jnp.uint32),
                           sds((e, n), jnp.float32), "nvfp4", (e, k, n), 4)
  args = (sds((m, k), jnp.bfloat16), pe, sds((e,), jnp.int32))
  jax.jit(lambda x, p, g: fp4_mgpu.grouped_matmul(x, p, g)).trace(*args).lower(
      lowering_platforms=("cuda",))
  with pytest.raises(Exception, match="shared memory"):  # bm 64: 16 KiB more a stage
    jax.jit(lambda x, p, g: fp4_mgpu.grouped_matmul(x, p, g, config=dict(bm=64, stages=4))
            ).trace(*args).lower(lowering_platforms=("cuda",))


def test_prepare_tree():
  q = quantize(rand_w(DENSE, 13), "nvfp4", axis=0)
  qe = quantize(rand_w(EXPERTS, 14), "nvfp4", axis=1, second_level=(0,))
  kv = quantize(rand_w((4, 64), 15), "nvfp4", axis=-1, second_level="row")  # not a weight
  tree = {"dense": q, "experts": qe, "kv": kv, "norm": jnp.ones(3)}
  out = kernels.prepare_tree(tree, kb=KB["nvfp4"])
  assert isinstance(out["dense"], kernels.PackedWeight) and out["dense"].shape == DENSE
  assert isinstance(out["experts"], kernels.PackedWeight) and out["experts"].experts
  assert out["kv"] is kv and out["norm"] is tree["norm"]


@pytest.mark.parametrize("small_sort", [4096, 0], ids=["compare", "sort"])
def test_sort_and_count_by_group_vs_numpy(monkeypatch, small_sort):
  """Stable order by group (ties keep row order), its inverse and the group sizes, against
  numpy, by comparisons (the decode-size path) and by XLA's sort and scatters."""
  monkeypatch.setattr(dispatch, "SMALL_SORT", small_sort)
  ids = np.random.default_rng(7).integers(0, 5, size=37).astype(np.int32)
  ids[ids == 3] = 4  # an empty group
  order, inverse = jax.jit(kernels.sort_by_group)(jnp.asarray(ids))
  np.testing.assert_array_equal(np.asarray(order), np.argsort(ids, kind="stable"))
  np.testing.assert_array_equal(np.asarray(inverse), np.argsort(np.argsort(ids, kind="stable")))
  np.testing.assert_array_equal(ids[np.asarray(order)][np.asarray(inverse)], ids)
  sizes = jax.jit(kernels.count_by_group, static_argnums=1)(jnp.asarray(ids), 6)
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids, minlength=6))


@pytest.mark.parametrize("m,e,ids_up_to,alpha", [(37, 9, 11, 0.3), (16, 128, 128, 5.0),
                                                   (600, 128, 128, 0.05)],
                         ids=["past_groups", "fewer_rows_than_groups", "skewed_empty_groups"])
def test_route_tables_equal_the_separate_reductions(m, e, ids_up_to, alpha):
  """`route`'s fused tables (three reductions and a look-up) equal `sort_by_group`,
  `count_by_group` and `chunk_tables` computed apart, bit for bit: ids past the groups (rows
  no group holds: the expert-parallel path's), fewer rows than groups, skewed routing with
  empty groups."""
  rng = np.random.default_rng(m)
  ids = jnp.asarray(rng.choice(ids_up_to, size=m, p=rng.dirichlet(np.full(ids_up_to, alpha))),
                    jnp.int32)

  def apart(ids):
    order, inverse = kernels.sort_by_group(ids)
    sizes = kernels.count_by_group(ids, e)
    tables = fp4_mgpu.chunk_tables(sizes, m, fp4_mgpu.grouped_bm(m, e), with_total=True)
    return (order, inverse, sizes) + tables

  def fused(ids):
    order, inverse, sizes, (bm, *tables) = dispatch._routed_by_counts(ids, e)
    assert bm == fp4_mgpu.grouped_bm(m, e)
    return (order, inverse, sizes, *tables)

  names = ("order", "inverse", "sizes", "chunk_expert", "chunk_row", "slot")
  *got, got_total = jax.jit(fused)(ids)
  *want, want_total = jax.jit(apart)(ids)
  for name, a, b in zip(names, got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  # the reserved chunks, in every element of both
  assert (np.asarray(got_total) == np.asarray(want_total)[0]).all()
  assert (np.asarray(want_total) == np.asarray(want_total)[0]).all()


@pytest.mark.parametrize("e,m,total", [(9, 70, 61), (4, 600, 597)],
                         ids=["owners_beside_slots", "owners_then_slots"])
def test_chunk_tables_vs_loop(e, m, total):
  """The grouped kernel's chunk tables against a plain loop over groups: ceil((size + 7) / bm)
  windows reserved per group, of bm rows from the group's first row rounded down to 8, those
  that start past the group's last row unused (-1, 0); each row's (chunk, row-in-window) slot,
  rows past the sum at C * bm. Both forms: the owners and slots in one reduction (M rows a
  little past the chunks needed: C = M), and apart (M far past C)."""
  rng = np.random.default_rng(3)
  bm = 16
  gs = rng.multinomial(total, np.ones(e) / e)
  gs[[2, e - 1]] = 0, 0
  gs[0] += total - gs.sum()
  ce, row0, slot, total = jax.jit(fp4_mgpu.chunk_tables, static_argnums=(1, 2, 4))(
      jnp.asarray(gs, jnp.int32), m, bm, None, True)
  ce, row0, slot, total = map(np.asarray, (ce, row0, slot, total))
  n_chunks = fp4_mgpu.chunk_count(m, e, bm)
  assert ce.shape == row0.shape == (n_chunks,)
  assert (m <= n_chunks) == (m == 70)  # one reduction for owners and slots, or two
  # with the group ends given (as `route` counts them) the same tables
  given = jax.jit(fp4_mgpu.chunk_tables, static_argnums=(1, 2))(
      jnp.asarray(gs, jnp.int32), m, bm, jnp.asarray(np.cumsum(gs), jnp.int32))
  for a, b in zip(given, (ce, row0, slot), strict=True):
    np.testing.assert_array_equal(np.asarray(a), b)
  want_ce, want_row0, want_slot = [], [], np.full(m, ce.shape[0] * bm)
  start = 0
  for g, size in enumerate(gs):
    for j in range(-(-(size + 7) // bm) if size else 0):
      r = start // 8 * 8 + j * bm
      used = r < start + size
      for row in range(max(r, start), min(r + bm, start + size)):
        want_slot[row] = len(want_ce) * bm + row - r
      want_ce.append(g if used else -1)
      want_row0.append(r if used else 0)
    start += size
  n = len(want_ce)
  assert (total == n).all()  # the reserved chunks, used or not
  assert (-1 in want_ce) == (m == 70)  # there, a reserved window starts past its group's end
  np.testing.assert_array_equal(ce[:n], want_ce)
  np.testing.assert_array_equal(row0[:n], want_row0)
  assert (ce[n:] == -1).all() and (row0[n:] == 0).all()
  np.testing.assert_array_equal(slot, want_slot)


def test_permute_k_rows_is_gather_pad_permute():
  """The fused operand gather equals row gather, padding rows (copies of row 0), K pad and
  `permute_k` done apart, bit for bit (K = 96: not a multiple of the 64 tile; rows repeat and
  leave some out)."""
  x = jax.random.normal(jax.random.key(4), (9, 96), jnp.float32).astype(jnp.bfloat16)
  rows = np.asarray([3, 3, 0, 8, 5, 1], np.int32)
  fn = jax.jit(layout.permute_k_rows, static_argnums=(2, 3))
  for src, got in ((rows, fn(x, jnp.asarray(rows), 16, 128)), (np.arange(9), fn(x, None, 16, 128))):
    padded = np.concatenate([src, np.zeros(16 - src.shape[0], np.int32)])
    want = layout.permute_k(jnp.pad(x[padded], ((0, 0), (0, 128 - 96))))
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                  np.asarray(want).view(np.uint16))


def test_grouped_wrapper_rows_and_out_rows_emulated():
  """rows / out_rows on the kernel path (emulated kernel) give the reference of the gathered
  operand, gathered back: x holds one row per token, each routed to 2 experts."""
  e, k, n = EXPERTS
  q = quantize(rand_w(EXPERTS, 12), "nvfp4", axis=1, second_level=(0,))
  pw = kernels.prepare_weight(q, kb=KB["nvfp4"])
  tokens, top = 20, 2
  idx = jnp.asarray(np.random.default_rng(5).integers(0, e, (tokens, top)), jnp.int32).reshape(-1)
  order, inverse = kernels.sort_by_group(idx)
  gs = jnp.bincount(idx, length=e).astype(jnp.int32)
  x = jax.random.normal(jax.random.key(13), (tokens, k), jnp.float32).astype(jnp.bfloat16)
  got = jax.jit(lambda x, g, o, i: fp4_mgpu.grouped_matmul(
      x, pw, g, out_dtype=jnp.float32, kernel_fn=fp4_mgpu.emulate_chunked_matmul, rows=o // top,
      out_rows=i))(x, gs, order, inverse)
  want = reference.grouped_matmul_ref(x[order // top], q, gs, jnp.float32)[inverse]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)
  # the dispatch's reference path applies the same gathers (its products by row tiles)
  ref = jax.jit(lambda x, g, o, i: kernels.grouped_matmul(x, q, g, jnp.float32, rows=o // top,
                                                          out_rows=i))(x, gs, order, inverse)
  tiled = reference.grouped_matmul_ref(x[order // top], q, gs, jnp.float32,
                                       tile=dispatch.GROUPED_TILE,
                                       per_step=dispatch.GROUPED_TILES_PER_STEP)[inverse]
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(tiled))
  np.testing.assert_allclose(np.asarray(ref), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_gpu_libraries_are_imported_before_programs_compile(monkeypatch):
  """Why `import_gpu_libraries` exists: a JAX user context created after a program compiled (as
  importing tokamax creates them) makes the program's next call compile again. Off the GPU it
  imports nothing; on the GPU it loads tokamax (a stand-in that counts here). (Last in this
  file: the new context is part of every later jit's cache key in this process.)"""
  f = jax.jit(lambda x: x * 2)
  f(1.0)
  f(2.0)
  assert f._cache_size() == 1
  jax.make_user_context(None)
  f(3.0)
  assert f._cache_size() == 2
  calls = []
  monkeypatch.setattr(dispatch, "_tokamax_ragged_dot", lambda: calls.append(1))
  dispatch.import_gpu_libraries()
  assert calls == []
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  dispatch.import_gpu_libraries()
  assert calls == [1]


@pytest.mark.parametrize("pdl", ["off", "wait", "early"])
def test_pdl_prologue_comes_first(monkeypatch, tmp_path, request, pdl):
  """`TRACE_JAX_PDL` (`fp4_mgpu.mosaic_kernel`): the Mosaic module Pallas hands to Mosaic (its
  dump, lowered on CPU) carries `griddepcontrol.wait` (and, "early", `launch_dependents` before
  it) ahead of the kernel's first TMA load, and the `uses_pdl` attribute that launches it with
  programmatic stream serialization; "off" carries neither. A grouped call: its CTAs read the
  chunk tables, written by the kernels before it, at their start."""
  pytest.importorskip("jax_cuda13_plugin")
  monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path))
  monkeypatch.setenv("MOSAIC_GPU_DUMP_MLIR_PASSES", "1")
  monkeypatch.setattr(fp4_mgpu, "PDL", pdl)
  # (the setting is read when the kernel is traced: traces cached under another are dropped,
  # before and after)
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)
  sds = jax.ShapeDtypeStruct
  k, n = 1024, 512
  pe = layout.PackedWeight(sds((8, n // 64, k // 4, 32), jnp.uint32),
                           sds((8, n // 64, k // 32, 32), jnp.uint32),
                           sds((8, n), jnp.float32), "nvfp4", (8, k, n), 4)
  jax.jit(lambda x, p, g: fp4_mgpu.grouped_matmul(x, p, g, config=dict(stream_k=False))).trace(
      sds((512, k), jnp.bfloat16), pe, sds((8,), jnp.int32)).lower(lowering_platforms=("cuda",))
  dumps = sorted(tmp_path.glob("*.before_layout_inference.txt"))
  assert dumps, "Mosaic wrote no module dump"
  lines = dumps[-1].read_text().splitlines()

  def first(text):
    return next((i for i, line in enumerate(lines) if text in line), None)

  wait, early = first("griddepcontrol.wait;"), first("griddepcontrol.launch_dependents;")
  attr = "mosaic_gpu.uses_pdl" in lines[0]
  if pdl == "off":
    assert (wait, early, attr) == (None, None, False)
    return
  load = first("mosaic_gpu.async_load")
  assert attr and wait is not None and load is not None and wait < load
  assert (early is not None and early < wait) == (pdl == "early")


def test_pdl_mode_is_checked():
  """An unknown PDL mode is refused by name before any kernel is built."""
  with pytest.raises(ValueError, match="pdl must be one of"):
    fp4_mgpu.mosaic_kernel(lambda: None, pdl="on")
