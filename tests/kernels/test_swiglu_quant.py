"""The expert down input's kernel (`kernels/swiglu_quant.py`): SwiGLU of the gate/up kernel's
chunk rows, the site's NVFP4 row quantization and the down kernel's operand, against its
reference (row gather, `nn.silu(g) * u`, `quantize_with_value`, `permute_k_rows`) bit for bit;
the grouped wrappers' ungathered rows (`ChunkRows`) and laid-out operands (`OperandRows`) with
the FP4 kernel emulated; interpret mode on CPU, the CUDA lowering where the plugin is
installed, the compiled kernel against XLA:GPU's own SwiGLU on a GPU (marked)."""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import quant as tq
from trace_jax.kernels import fp4_mgpu, layout, swiglu_quant


def chunk_rows_case(src, n_pad, f, m, seed):
  """Gate/up rows over many magnitudes (zeros, huge and tiny rows), slots with repeats, one
  past the rows (reads as zeros) and one negative (counts back, as `jnp.take`)."""
  rng = np.random.default_rng(seed)
  rows = rng.standard_normal((src, n_pad)) * np.exp(rng.uniform(-5, 5, (src, 1)))
  rows[1] = 0.0
  rows[2, :f] = 40.0 * rng.standard_normal(f)  # exp(-g) overflows bf16 for g < -88.7
  slot = rng.integers(0, src, m)
  slot[[0, 1, 2]] = [1, 2, 2]
  slot[3], slot[m - 1] = src + 5, -1
  return layout.ChunkRows(jnp.asarray(rows, jnp.bfloat16), jnp.asarray(slot, jnp.int32), 2 * f)


def _same(got, want):
  (qg, og), (qw, ow) = got, want
  assert qg.shape == qw.shape and qg.axis == qw.axis and qg.fmt == qw.fmt and og.m == ow.m
  for a, b in zip((qg.codes, qg.scales, qg.global_scale, og.data),
                  (qw.codes, qw.scales, qw.global_scale, ow.data)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("f,k_pad,n_rows,tile,split",
                         [(128, 128, 48, 2048, False), (192, 256, 40, 256, False),
                          (192, 192, 40, 1024, True), (768, 768, 40, 2048, True)],
                         ids=["f128", "f192_kpad256_row_a_program", "f192_split_3x4",
                              "f768_split_3x16"])
def test_equals_reference(f, k_pad, n_rows, tile, split):
  """F = 128; F = 192 (12 blocks, padded to 16 in the kernel) into a 256-column operand (zero
  columns past F); rows split in tiles with no idle blocks (F 192: 3 of 4 blocks, F 768: 3 of
  16), their row scales over all tiles; 37 rows padded to n_rows with zero rows."""
  gu = chunk_rows_case(64, 2 * f + 128, f, 37, f)
  run = functools.partial(swiglu_quant.swiglu_quantize_rows, f=f, fmt="nvfp4", n_rows=n_rows,
                          k_pad=k_pad)
  got = jax.jit(lambda g: run(g, interpret=True, tile_elems=tile, split=split))(gu)
  want = jax.jit(lambda g: swiglu_quant.swiglu_quantize_rows_ref(
      g, f, "nvfp4", n_rows=n_rows, k_pad=k_pad))(gu)
  _same(got, want)
  # the reference itself: rows by the slot table, zeros past it, the operand's layout
  x = np.asarray(gu.rows, np.float32)[np.clip(np.asarray(gu.slot), -1, 63)]
  x[3] = 0.0
  np.testing.assert_array_equal(np.asarray(gu.gather(), np.float32), x[:, :2 * f])
  value = np.asarray(tq.dequantize(want[0], jnp.bfloat16), np.float32)
  op = np.asarray(want[1].data, np.float32)
  phys = layout.permute_k(jnp.asarray(np.pad(value, ((0, 0), (0, k_pad - f)))))
  np.testing.assert_array_equal(op[:37], np.asarray(phys))
  assert not op[37:].any()


def test_swiglu_rounds_each_op():
  """`swiglu` equals `nn.silu(g) * u` evaluated op by op (each bf16 op rounded by itself), over
  every finite bf16 g, and u of many magnitudes."""
  bits = np.arange(1 << 16, dtype=np.uint16)
  g = bits.view(ml_dtypes.bfloat16)
  g = g[np.isfinite(g.astype(np.float32))]
  u = np.random.default_rng(0).standard_normal(g.shape) * np.exp(
      np.random.default_rng(1).uniform(-8, 8, g.shape))
  g, u = jnp.asarray(g), jnp.asarray(u, jnp.bfloat16)
  with jax.disable_jit():
    want = jax.nn.silu(g) * u
  got = jax.jit(swiglu_quant.swiglu)(g, u)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16),
                                np.asarray(want).view(np.uint16))


def test_supported():
  gu = layout.ChunkRows(jnp.zeros((64, 1792), jnp.bfloat16), jnp.zeros(8, jnp.int32), 1536)
  assert swiglu_quant.kernel_supported(gu, 768, "nvfp4", 768) is None
  assert "mxfp4" in swiglu_quant.kernel_supported(gu, 768, "mxfp4", 768)
  assert "multiples of 64" in swiglu_quant.kernel_supported(gu, 760, "nvfp4", 768)
  assert "n = 1536" in swiglu_quant.kernel_supported(gu, 512, "nvfp4", 512)
  assert "1280 columns" in swiglu_quant.kernel_supported(gu, 768, "nvfp4", 1280)
  with pytest.raises(ValueError, match="operand of 4 rows"):
    swiglu_quant.swiglu_quantize_rows(gu, 768, "nvfp4", n_rows=4, k_pad=768, interpret=True)


@functools.partial(jax.jit, static_argnames=("keep_chunks",))
def _gate_up(x, pw, g, keep_chunks):
  return fp4_mgpu.grouped_matmul(x, pw, g, out_dtype=jnp.bfloat16, keep_chunks=keep_chunks,
                                 kernel_fn=fp4_mgpu.emulate_chunked_matmul)


@jax.jit
def _down(x, pw, g):
  return fp4_mgpu.grouped_matmul(x, pw, g, out_dtype=jnp.float32,
                                 kernel_fn=fp4_mgpu.emulate_chunked_matmul)


def test_grouped_calls_chain_through_the_kernel():
  """gate/up (N = 2 x 192) left in its chunks, the kernel's operand into the down call (K = 192,
  padded to 256), FP4 kernels emulated: the rows equal the gathered result, the down product
  equals the one from the reference's values laid out by the wrapper itself; empty groups."""
  rng = np.random.default_rng(0)
  e, d, f = 4, 256, 192
  w_gu = kernels.prepare_weight(tq.quantize(jnp.asarray(rng.standard_normal((e, d, 2 * f)),
                                                        jnp.float32), "nvfp4", axis=1), kb=4)
  w_dn = kernels.prepare_weight(tq.quantize(jnp.asarray(rng.standard_normal((e, f, d)),
                                                        jnp.float32), "nvfp4", axis=1), kb=4)
  gs = jnp.asarray([9, 0, 14, 1], jnp.int32)
  x = jnp.asarray(rng.standard_normal((24, d)), jnp.bfloat16)
  rows = _gate_up(x, w_gu, gs, True)
  assert isinstance(rows, layout.ChunkRows)
  np.testing.assert_array_equal(np.asarray(rows.gather(), np.float32),
                                np.asarray(_gate_up(x, w_gu, gs, False), np.float32))
  n_rows, k_pad = fp4_mgpu.operand_shape(24, w_dn)
  assert k_pad == 256
  q, op = jax.jit(lambda r: swiglu_quant.swiglu_quantize_rows(
      r, f, "nvfp4", n_rows=n_rows, k_pad=k_pad, interpret=True))(rows)
  q_ref, _ = swiglu_quant.swiglu_quantize_rows_ref(rows, f, "nvfp4", n_rows=n_rows, k_pad=k_pad)
  np.testing.assert_array_equal(np.asarray(q.codes), np.asarray(q_ref.codes))
  got = _down(op, w_dn, gs)
  want = _down(tq.dequantize(q_ref, jnp.bfloat16), w_dn, gs)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match=rf"laid out as \[{n_rows - 8}, 256\]"):
    _down(layout.OperandRows(op.data[:-8], 24), w_dn, gs)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel at the 30B-A3B expert shape (F 768, 2,048 rows from
  220 chunks of 32), rows in one tile and split in three, for an H200."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  args = (jax.ShapeDtypeStruct((7040, 1536), jnp.bfloat16),
          jax.ShapeDtypeStruct((2048,), jnp.int32))
  for split in (False, True):
    text = jax.jit(lambda r, s: swiglu_quant.swiglu_quantize_rows(  # noqa: B023
        layout.ChunkRows(r, s, 1536), 768, "nvfp4", n_rows=2080, k_pad=768, split=split)).trace(
            *args).lower(lowering_platforms=("cuda",)).as_text()
    assert "swiglu_row_quant_nvfp4" in text


@pytest.mark.gpu
@pytest.mark.parametrize("src,m,split", [(7040, 2048, False), (64, 8, False), (7040, 2048, True)],
                         ids=["b256_decode", "one_token", "b256_split"])
def test_kernel_on_gpu_equals_reference_and_xla(src, m, split):
  """The compiled kernel (rows in one tile, and split in three) against its reference, and its
  SwiGLU against XLA:GPU's own `nn.silu(g) * u` (the model's path without the kernel), bit for
  bit."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  gu = chunk_rows_case(src, 1536, 768, m, 2)
  n_rows = fp4_mgpu.operand_rows(m, 32)
  got = jax.jit(lambda g: swiglu_quant.swiglu_quantize_rows(
      g, 768, "nvfp4", n_rows=n_rows, k_pad=768, split=split))(gu)
  want = jax.jit(lambda g: swiglu_quant.swiglu_quantize_rows_ref(
      g, 768, "nvfp4", n_rows=n_rows, k_pad=768))(gu)
  _same(got, want)
  xla = jax.jit(lambda g: tq.quantize_with_value(
      jax.nn.silu(g.gather()[:, :768]) * g.gather()[:, 768:], "nvfp4", second_level="row",
      validate=False)[0])(gu)
  np.testing.assert_array_equal(np.asarray(got[0].codes), np.asarray(xla.codes))
  np.testing.assert_array_equal(np.asarray(got[0].global_scale), np.asarray(xla.global_scale))
