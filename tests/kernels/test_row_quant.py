"""The rollout's activation quantization kernel (`kernels/row_quant.py`) against
`quant.quantize_with_value(..., second_level="row")`, codes, scales, row scales and value bit for
bit; interpret mode on CPU, the CUDA lowering where the plugin is installed, the compiled kernel
on a GPU (marked)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import quant as tq
from trace_jax.kernels import row_quant


def rows_case(shape, dtype, seed):
  """Rows over many magnitudes, a zero row, a row with one huge element (block scales at both
  clip bounds), values on E2M1 midpoints."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape[:-1] + (1,)))
  flat = x.reshape(-1, shape[-1])
  flat[0] = 0.0
  flat[1] = 1e-6
  flat[1, 5] = 3e4
  flat[2, :16] = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)
  return jnp.asarray(x, jnp.float32).astype(dtype)


def _same(got, want):
  (qg, vg), (qw, vw) = got, want
  assert qg.shape == qw.shape and qg.axis == qw.axis and qg.fmt == qw.fmt
  for a, b in zip((qg.codes, qg.scales, qg.global_scale, vg),
                  (qw.codes, qw.scales, qw.global_scale, vw)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("shape,dtype", [((2, 5, 128), jnp.bfloat16), ((7, 96), jnp.float32)],
                         ids=["bf16_3d", "f32_nb6"])
def test_equals_quantize_with_value(shape, dtype):
  """K = 128 (8 blocks) and K = 96 (6 blocks: padded to 8 in the kernel), rows not a multiple of
  the kernel's rows per program."""
  x = rows_case(shape, dtype, 0)
  got = jax.jit(lambda a: row_quant.quantize_rows(a, "nvfp4", interpret=True))(x)
  want = tq.quantize_with_value(x, "nvfp4", second_level="row", validate=False)
  _same(got, want)


@pytest.mark.parametrize("shape,tile_elems", [((37, 96), 512), ((5, 256), 64)],
                         ids=["4_rows_a_program", "tile_under_a_row"])
def test_launch_shapes_give_the_same_bits(shape, tile_elems):
  """Programs of several rows with a partial last one (37 rows, 4 a program), and a tile
  smaller than a row (one row a program): the launch shape changes no bit."""
  x = rows_case(shape, jnp.bfloat16, 3)
  got = jax.jit(lambda a: row_quant.quantize_rows(a, "nvfp4", interpret=True,
                                                  tile_elems=tile_elems))(x)
  _same(got, tq.quantize_with_value(x, "nvfp4", second_level="row", validate=False))


def test_supported():
  assert row_quant.kernel_supported(jnp.zeros((4, 2048), jnp.bfloat16), "nvfp4") is None
  # rows longer than a program's tile (the o_proj input, 4096): one row a program
  assert row_quant.kernel_supported(jnp.zeros((4, 4096), jnp.bfloat16), "nvfp4") is None
  assert "up to 4096" in row_quant.kernel_supported(jnp.zeros((4, 4112), jnp.bfloat16), "nvfp4")
  assert "mxfp4" in row_quant.kernel_supported(jnp.zeros((4, 64)), "mxfp4")
  assert "multiples of 16" in row_quant.kernel_supported(jnp.zeros((4, 40)), "nvfp4")
  with pytest.raises(ValueError, match="multiples of 16"):
    row_quant.quantize_rows(jnp.zeros((4, 40)), "nvfp4", interpret=True)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernel at the 30B-A3B expert sites (K 2048 and 768), for an
  H200 (the lowering asks the device's compute capability: a CPU machine has none)."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  for shape in ((64, 1, 2048), (512, 768)):
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    text = jax.jit(lambda a: row_quant.quantize_rows(a, "nvfp4")).trace(x).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "row_quant_nvfp4" in text


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(64, 1, 2048), (512, 768)])
def test_kernel_on_gpu_equals_reference(shape):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  x = rows_case(shape, jnp.bfloat16, 1)
  got = jax.jit(lambda a: row_quant.quantize_rows(a, "nvfp4"))(x)
  want = jax.jit(lambda a: tq.quantize_with_value(a, "nvfp4", second_level="row",
                                                  validate=False))(x)
  _same(got, want)


def _operand_case(n, copies, seed):
  """dest: a random permutation of range(n * copies) as [n, copies] (a routing's inverse)."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.permutation(n * copies).reshape(n, copies), jnp.int32)


def _same_operand(got, want):
  _same((got[0], got[1].data), (want[0], want[1].data))
  assert got[1].m == want[1].m


@pytest.mark.parametrize("shape,k_pad,n_rows,tile", [((2, 5, 128), 128, 96, 512),
                                                     ((7, 192), 256, 64, 256)],
                         ids=["bf16_3d_pad_rows", "k192_kpad256_few_tokens"])
def test_operand_equals_reference(shape, k_pad, n_rows, tile):
  """The value written as an operand's rows (each row to its 8 destinations, zero rows past
  them, zero columns past K) and the codes' guidance bits: the kernel in interpret mode against
  its reference, and the reference against the layout rule itself (numpy)."""
  x = rows_case(shape, jnp.bfloat16, 5)
  n = int(np.prod(shape[:-1]))
  dest = _operand_case(n, 8, 6)
  got = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand(
      a, "nvfp4", d, n_rows=n_rows, k_pad=k_pad, guidance_bits=True, interpret=True,
      tile_elems=tile))(x, dest)
  want = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand_ref(
      a, "nvfp4", d, n_rows=n_rows, k_pad=k_pad))(x, dest)
  _same_operand(got, want)
  # the guidance bits the kernel wrote, as `make_guidance` makes them from the codes
  assert got[2].shape == shape[:-1] + (shape[-1] // 8,) and got[2].dtype == jnp.uint8
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(tq.make_guidance(want[0]).payload))
  _same((want[0], tq.quantize_with_value(x, "nvfp4", second_level="row", validate=False)[1]),
        tq.quantize_with_value(x, "nvfp4", second_level="row", validate=False))
  from trace_jax.kernels import layout  # noqa: PLC0415
  value = np.asarray(tq.dequantize(want[0], jnp.bfloat16), np.float32).reshape(n, -1)
  phys = np.asarray(layout.permute_k(jnp.asarray(np.pad(value, ((0, 0), (0, k_pad - shape[-1]))),
                                                 jnp.bfloat16)), np.float32)
  op = np.asarray(want[1].data, np.float32)
  d = np.asarray(dest)
  for j in range(8):
    np.testing.assert_array_equal(op[d[:, j]], phys)
  assert not op[n * 8:].any()
  with pytest.raises(ValueError, match="destinations"):
    row_quant.quantize_rows_to_operand(x, "nvfp4", dest[:-1], n_rows=n_rows, k_pad=k_pad,
                                       interpret=True)


def test_operand_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the operand kernel at the 30B-A3B experts' input (B 256 tokens,
  K 2048, 8 destinations each, 2,080 operand rows), for an H200."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  args = (jax.ShapeDtypeStruct((256, 1, 2048), jnp.bfloat16),
          jax.ShapeDtypeStruct((256, 8), jnp.int32))
  for bits in (False, True):  # with the guidance bits too
    text = jax.jit(lambda a, d, b=bits: row_quant.quantize_rows_to_operand(
        a, "nvfp4", d, n_rows=2080, k_pad=2048, guidance_bits=b)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "row_quant_operand_nvfp4" in text


@pytest.mark.gpu
@pytest.mark.parametrize("n,n_rows", [(256, 2080), (3, 48)], ids=["b256", "three_tokens"])
def test_operand_kernel_on_gpu_equals_reference(n, n_rows):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  x = rows_case((n, 1, 2048), jnp.bfloat16, 7)
  dest = _operand_case(n, 8, 8)
  got = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand(
      a, "nvfp4", d, n_rows=n_rows, k_pad=2048))(x, dest)
  want = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand_ref(
      a, "nvfp4", d, n_rows=n_rows, k_pad=2048))(x, dest)
  _same_operand(got, want)
