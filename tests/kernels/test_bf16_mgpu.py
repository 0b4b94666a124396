"""The bf16 grouped kernel's wrapper (`kernels/bf16_mgpu.py`) on CPU: chunk tables, K split,
row and output gathers around `emulate_chunked_matmul` against the reference grouped matmul;
the dispatch that chooses it; its Mosaic GPU lowering where `jax-cuda13-plugin` is installed.
The kernel itself runs against the reference in tests/kernels/test_kernels_gpu.py."""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.kernels import bf16_mgpu, dispatch, reference

E, K, N = 6, 256, 512  # K: 2 pipeline steps (a K split of 2 is possible); N: 2 column tiles


def _weights(seed):
  w = jax.random.normal(jax.random.key(seed), (E, K, N), jnp.float32) * 0.05
  return w.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("n_inner", "splits"))
def _emulated(x, w, g, rows, out_rows, n_inner=None, splits=None):
  over = {k: v for k, v in (("n_inner", n_inner), ("splits", splits)) if v is not None}
  return bf16_mgpu.grouped_matmul(x, w, g, out_dtype=jnp.float32, config_override=over,
                                  kernel_fn=bf16_mgpu.emulate_chunked_matmul, rows=rows,
                                  out_rows=out_rows)


@pytest.mark.parametrize("sizes", [
    [0, 0, 1, 0, 0, 0],  # one row
    [0, 40, 0, 0, 3, 0],  # empty groups, a group over several 16-row chunks
    [3, 1, 4, 1, 5, 9],
])
@pytest.mark.parametrize("n_inner,splits", [(None, None), (1, 2), (2, 1)])
def test_wrapper_equals_reference(sizes, n_inner, splits):
  """Every row of every group equals the reference's (bf16 products, float32 sums: only the
  summation order differs); rows past sum(sizes) are zeros; rows / out_rows gathers equal
  gathering around the reference; n_inner 2 chains both column tiles, splits 2 adds two
  float32 K halves (a wrapper that kept only one half fails)."""
  w = _weights(1)
  g = jnp.asarray(sizes, jnp.int32)
  m = sum(sizes) + 3
  x = jax.random.normal(jax.random.key(m), (m, K), jnp.float32).astype(jnp.bfloat16)
  rows = jnp.asarray(np.random.default_rng(m).permutation(m), jnp.int32)
  out_rows = jnp.asarray(np.random.default_rng(m + 1).permutation(m), jnp.int32)
  want = reference.grouped_matmul_ref(x[rows], w, g, jnp.float32)[out_rows]
  got = _emulated(x, w, g, rows, out_rows, n_inner, splits)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
  past = np.asarray(out_rows) >= sum(sizes)
  assert np.all(np.asarray(got)[past] == 0)


def test_kernel_supported_names_the_problem():
  x, w, g = jnp.zeros((8, K), jnp.bfloat16), _weights(2), jnp.zeros((E,), jnp.int32)
  assert bf16_mgpu.kernel_supported(x, w, g) is None
  assert "not bf16" in bf16_mgpu.kernel_supported(x, w.astype(jnp.float32), g)
  assert "K=200" in bf16_mgpu.kernel_supported(x[:, :200], w[:, :200], g)
  assert "rows" in bf16_mgpu.kernel_supported(jnp.zeros((2048, K), jnp.bfloat16), w, g)
  assert "group sizes" in bf16_mgpu.kernel_supported(x, w, g[:3])


def test_dispatch_chooses_it_on_gpu(monkeypatch):
  """On a GPU (the default setting) bf16 expert weights go through the kernel (here its jnp
  model) up to BF16_KERNEL_ROWS rows, with the MoE layer's row and output gathers folded in;
  above, and with `TRACE_JAX_BF16_GROUPED=tokamax`, not."""
  monkeypatch.setattr(dispatch, "_BF16_GROUPED", "auto")
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  calls = []

  def model(*args, **kw):
    calls.append(kw["bm"])
    return bf16_mgpu.emulate_chunked_matmul(*args, **kw)

  monkeypatch.setattr(bf16_mgpu, "bf16_chunked_matmul", model)
  w, g = _weights(3), jnp.asarray([2, 0, 3, 1, 0, 2], jnp.int32)
  x = jax.random.normal(jax.random.key(4), (8, K), jnp.float32).astype(jnp.bfloat16)
  rows = jnp.asarray([7, 6, 5, 4, 3, 2, 1, 0], jnp.int32)
  got = dispatch.grouped_matmul(x, w, g, jnp.float32, rows=rows, out_rows=rows)
  want = reference.grouped_matmul_ref(x[rows], w, g, jnp.float32)[rows]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=2e-6)
  assert calls == [16]
  # route builds the chunk tables once for both of a layer's calls; with them, the same
  ids = jnp.repeat(jnp.arange(E, dtype=jnp.int32), np.asarray(g))
  order, inverse, sizes, tables = dispatch.route(ids, E, w)
  np.testing.assert_array_equal(np.asarray(sizes), np.asarray(g))
  assert tables is not None and tables[0] == 16
  again = dispatch.grouped_matmul(x, w, sizes, jnp.float32, rows=rows, out_rows=rows,
                                  tables=tables)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
  assert dispatch._bf16_kernel_weight(w, dispatch.BF16_KERNEL_ROWS)
  assert not dispatch._bf16_kernel_weight(w, dispatch.BF16_KERNEL_ROWS + 1)
  monkeypatch.setattr(dispatch, "_BF16_GROUPED", "kernel")
  assert dispatch._bf16_kernel_weight(w, bf16_mgpu.MAX_ROWS)
  monkeypatch.setattr(dispatch, "_BF16_GROUPED", "tokamax")
  assert not dispatch._bf16_kernel_weight(w, 8)
  assert dispatch.route(ids, E, w)[3] is None


def test_lowers_for_cuda():
  """Mosaic GPU lowering (TMA tiling and swizzle of the bf16 weight tile, wgmma with A
  transposed from SMEM, SMEM budget) at the 30B-A3B expert shapes, batch 1 and 8."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  for k, n in ((2048, 1536), (768, 2048)):
    for m in (8, 64):
      jax.jit(lambda x, w, g: bf16_mgpu.grouped_matmul(x, w, g)).trace(
          sds((m, k), jnp.bfloat16), sds((128, k, n), jnp.bfloat16),
          sds((128,), jnp.int32)).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("bm,splits", [(128, 1), (256, 2)])
def test_dense_wrapper_equals_a_product(bm, splits):
  """`dense_matmul` (rows padded to chunks of bm, K parts added) around the kernel's jnp model
  against a float64 product: 200 rows (a partial chunk), K 256 (2 steps of 128), N 512."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((200, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.bfloat16)
  got = jax.jit(functools.partial(
      bf16_mgpu.dense_matmul, bm=bm, wgs=2, kb=1, splits=splits, out_dtype=jnp.float32,
      kernel_fn=bf16_mgpu.emulate_chunked_matmul))(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_dense_lowers_for_cuda():
  """128- and 256-row chunks (wgmma N 128 / 256, 2 warpgroups, one 64-wide K tile a step), K
  in 1, 2 or 4 parts, at the 30B-A3B q/k/v and o shapes, 256 rows."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  for k, n in ((2048, 5120), (4096, 2048)):
    for bm, splits in ((256, 1), (128, 2), (128, 4)):  # (128, 4): `ksplit_launch` at o
      jax.jit(functools.partial(bf16_mgpu.dense_matmul, bm=bm, wgs=2, kb=1, splits=splits)
              ).trace(sds((256, k), jnp.bfloat16), sds((k, n), jnp.bfloat16)).lower(
                  lowering_platforms=("cuda",))



def test_cluster_lowers_for_cuda():
  """The K split in a cluster (`cluster_matmul`: its barriers' init, the partials' exchange
  through distributed shared memory in either order of sends, in SMEM of their own or in the
  pipeline's, the bf16 epilogue of a row slice) at the o projection's shape with clusters of 8
  and 4, and at 128 rows (16-row slices); a launch that does not fit SMEM or splits K unevenly
  is refused by name."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  for rows, splits, wgs, kb, order, alias in ((256, 8, 2, 1, "rotate", True),
                                              (256, 4, 1, 2, "fixed", False),
                                              (128, 8, 1, 1, "rotate", True)):
    jax.jit(functools.partial(bf16_mgpu.cluster_matmul, splits=splits, wgs=wgs, kb=kb,
                              order=order, alias=alias)).trace(
        sds((rows, 4096), jnp.bfloat16), sds((4096, 2048), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",))
  for kw, why in ((dict(splits=8, wgs=2, kb=4, alias=False), "does not fit SMEM"),
                  (dict(splits=3, wgs=2, kb=1), "splits 3"),
                  (dict(splits=8, wgs=3, kb=1), "do not split")):
    with pytest.raises(ValueError, match=why):
      bf16_mgpu.cluster_matmul(jnp.zeros((256, 4096), jnp.bfloat16),
                               jnp.zeros((4096, 2048), jnp.bfloat16), **kw)

def test_dense_dispatch(monkeypatch):
  """With TRACE_JAX_BF16_DENSE=kernel (the default), a bf16 dense product of 129-256 rows on the
  GPU goes through `dense_matmul` (here around the kernel's jnp model) where `dense_launch`
  gives enough CTAs; fewer rows, narrower outputs and the "xla" setting keep XLA's dot. The
  kernel gets rows padded to whole chunks (`DENSE_ROWS` "chunks"), or with "exact" (the
  default) the rows as they are where they are a multiple of 8 (200), else padded to one (255
  -> 256) and told the count, so no slice follows it."""
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(bf16_mgpu, "DENSE_ROWS", "chunks")
  jax.clear_caches()  # (read when the call is traced)
  calls = []

  def model(*args, **kw):
    calls.append((args[0].shape, kw["bm"], kw["wgs"], kw["kb"], kw["rows"]))
    return bf16_mgpu.emulate_chunked_matmul(*args, **kw)

  monkeypatch.setattr(bf16_mgpu, "bf16_chunked_matmul", model)
  rng = np.random.default_rng(6)
  w = jnp.asarray(rng.standard_normal((K, 4096)) * 0.05, jnp.bfloat16)  # 32 x 2 = 64 CTAs
  x = jnp.asarray(rng.standard_normal((2, 100, K)), jnp.bfloat16)  # 200 rows
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for setting, n_calls in (("xla", 0), ("kernel", 1)):
    monkeypatch.setattr(dispatch, "BF16_DENSE", setting)
    got = dispatch.matmul(x, w, jnp.float32)
    assert got.shape == (2, 100, 4096) and len(calls) == n_calls, setting
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  assert calls == [((256, K), 128, 2, 2, None)]
  x255 = jnp.asarray(rng.standard_normal((3, 85, K)), jnp.bfloat16)  # the rollout's 255 rows
  want255 = np.asarray(x255, np.float64) @ np.asarray(w, np.float64)
  monkeypatch.setattr(bf16_mgpu, "DENSE_ROWS", "exact")
  jax.clear_caches()  # (read when the call is traced)
  for xs, want_xs, operand in ((x, want, (200, K, 200)), (x255, want255, (256, K, 255))):
    got = dispatch.matmul(xs, w, jnp.float32)
    np.testing.assert_allclose(np.asarray(got), want_xs, rtol=1e-5, atol=1e-5)
    shape, *launch, rows = calls.pop()
    assert (*shape, rows) == operand and launch == [128, 2, 2]
  monkeypatch.setattr(bf16_mgpu, "DENSE_ROWS", "chunks")
  jax.clear_caches()
  dispatch.matmul(x[:, :60], w, jnp.float32)  # 120 rows: XLA
  dispatch.matmul(x, w[:, :512], jnp.float32)  # 8 CTAs: XLA
  wide = jnp.zeros((K, bf16_mgpu.DENSE_MAX_N + 128), jnp.bfloat16)  # an lm_head: untimed, XLA
  dispatch.matmul(x, wide, jnp.float32)
  assert len(calls) == 1


def test_ksplit_dispatch(monkeypatch):
  """With TRACE_JAX_BF16_DENSE_KSPLIT=on, a product with too few CTAs for the default launch
  (255 rows x N 1024: 8 column tiles x 2 chunks) goes through `dense_matmul` (around the
  kernel's jnp model) with K in the most parts that fit one wave (8: 128 CTAs) and equals the
  product; off (the default), XLA's dot. At the o projection's shape the rule takes 4 parts
  (32 CTAs: 8 parts would be 256), and none where no part count reaches DENSE_MIN_CTAS."""
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "BF16_DENSE", "kernel")
  monkeypatch.setattr(bf16_mgpu, "DENSE_CLUSTER", "off")
  calls = []

  def model(*args, **kw):
    calls.append((args[0].shape, kw["bm"], kw["wgs"], kw["kb"], kw["splits"], kw["rows"]))
    return bf16_mgpu.emulate_chunked_matmul(*args, **kw)

  monkeypatch.setattr(bf16_mgpu, "bf16_chunked_matmul", model)
  rng = np.random.default_rng(9)
  w = jnp.asarray(rng.standard_normal((512, 1024)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((255, 1, 512)), jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for setting, n_calls in (("off", 0), ("on", 1)):
    monkeypatch.setattr(bf16_mgpu, "DENSE_KSPLIT", setting)
    jax.clear_caches()  # (read when the call is traced)
    got = dispatch.matmul(x, w, jnp.bfloat16)
    assert got.shape == (255, 1, 1024) and len(calls) == n_calls, setting
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2 ** -7, atol=1e-3)
  assert calls == [((256, 512), 128, 2, 1, 8, 255)]
  # keep_parts (the o projection's): the 8 float32 parts unadded, their value the output above
  parts = dispatch.matmul(x, w, jnp.bfloat16, keep_parts=True)
  assert isinstance(parts, kernels.KParts) and parts.parts.shape == (8, 255, 1, 1024)
  np.testing.assert_array_equal(np.asarray(parts.value(jnp.bfloat16)).view(np.uint16),
                                np.asarray(got).view(np.uint16))
  assert bf16_mgpu.ksplit_launch(255, 4096, 2048) == dict(bm=128, wgs=2, kb=1, splits=4)
  assert bf16_mgpu.ksplit_launch(255, 512, 256) is None  # 4 CTAs: 32 at most
  monkeypatch.setattr(bf16_mgpu, "DENSE_KSPLIT", "off")
  jax.clear_caches()
  assert not isinstance(dispatch.matmul(x, w, jnp.bfloat16, keep_parts=True), kernels.KParts)


def test_cluster_dispatch(monkeypatch):
  """With TRACE_JAX_BF16_CLUSTER=on, a product `dense_launch` leaves to XLA for want of CTAs
  (here K 512, N 256 at 255 rows: 4 CTAs) goes through `cluster_matmul` (here a jnp model of
  it) with its rows padded to a multiple of 8 and their count, as the o projection would on
  the GPU; off (the default), or at 120 rows, XLA's dot."""
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "BF16_DENSE", "kernel")
  calls = []

  def model(x, w, *, splits, wgs, kb, bm, rows, out_dtype):
    calls.append((x.shape, rows, splits, wgs, kb, bm))
    y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST)
    return y[:rows].astype(out_dtype)

  monkeypatch.setattr(bf16_mgpu, "cluster_matmul", model)
  rng = np.random.default_rng(8)
  w = jnp.asarray(rng.standard_normal((512, 256)) * 0.05, jnp.bfloat16)
  x = jnp.asarray(rng.standard_normal((255, 1, 512)), jnp.bfloat16)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  for setting, n_calls in (("off", 0), ("on", 1)):
    monkeypatch.setattr(bf16_mgpu, "DENSE_CLUSTER", setting)
    jax.clear_caches()  # (read when the call is traced)
    got = dispatch.matmul(x, w, jnp.float32)
    assert got.shape == (255, 1, 256) and len(calls) == n_calls, setting
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  c = bf16_mgpu.CLUSTER_LAUNCH  # the launch passed on as it stands
  assert calls == [((256, 512), 255, c["splits"], c["wgs"], c["kb"], c["bm"])]
  dispatch.matmul(x[:120], w, jnp.float32)  # 120 rows: XLA
  assert len(calls) == 1

def test_padded_rows_dispatch(monkeypatch):
  """A `PaddedRows` operand (the attention's input norm, `TRACE_JAX_NORM_ROWS=padded`): 255 rows
  held in 256 go to the dense kernel (its jnp model) as they are, told the 255, no pad and no
  slice; where the kernel does not apply (`TRACE_JAX_BF16_DENSE=xla`, or off the GPU) the
  product of their value. Both against float64; `norm_rows_padded` only with the opt-in, on
  the GPU, with the kernel's exact rows."""
  from trace_jax.kernels import layout  # noqa: PLC0415
  calls = []

  def model(*args, **kw):
    calls.append((args[0].shape, kw["rows"]))
    return bf16_mgpu.emulate_chunked_matmul(*args, **kw)

  monkeypatch.setattr(bf16_mgpu, "bf16_chunked_matmul", model)
  monkeypatch.setattr(bf16_mgpu, "DENSE_ROWS", "exact")
  rng = np.random.default_rng(7)
  w = jnp.asarray(rng.standard_normal((K, 4096)) * 0.05, jnp.bfloat16)  # 32 x 2 = 64 CTAs
  rows = jnp.asarray(rng.standard_normal((256, K)), jnp.bfloat16).at[255:].set(0)
  x = layout.PaddedRows(rows, (255, 1, K))
  want = np.asarray(rows[:255], np.float64) @ np.asarray(w, np.float64)
  for setting, on_gpu, taken in (("kernel", True, True), ("xla", True, False),
                                 ("kernel", False, False)):
    monkeypatch.setattr(dispatch, "BF16_DENSE", setting)
    monkeypatch.setattr(dispatch, "on_gpu", lambda on_gpu=on_gpu: on_gpu)
    monkeypatch.setattr(dispatch, "kernels_on", lambda on_gpu=on_gpu: on_gpu)
    jax.clear_caches()
    got = dispatch.matmul(x, w, jnp.float32)
    assert got.shape == (255, 1, 4096)
    np.testing.assert_allclose(np.asarray(got)[:, 0], want, rtol=1e-5, atol=1e-5)
    assert calls == ([((256, K), 255)] if taken else []), setting
    calls.clear()
  for setting, bf16_dense, rows_mode, on_gpu, padded in (
      ("padded", "kernel", "exact", True, True), ("exact", "kernel", "exact", True, False),
      ("padded", "xla", "exact", True, False), ("padded", "kernel", "chunks", True, False),
      ("padded", "kernel", "exact", False, False)):
    monkeypatch.setattr(dispatch, "_NORM_ROWS", setting)
    monkeypatch.setattr(dispatch, "BF16_DENSE", bf16_dense)
    monkeypatch.setattr(bf16_mgpu, "DENSE_ROWS", rows_mode)
    monkeypatch.setattr(dispatch, "on_gpu", lambda on_gpu=on_gpu: on_gpu)
    monkeypatch.setattr(dispatch, "kernels_on", lambda on_gpu=on_gpu: on_gpu)
    assert dispatch.norm_rows_padded() == padded
  with pytest.raises(ValueError, match="rows 257"):
    bf16_mgpu.dense_matmul(rows, w, bm=128, wgs=2, kb=2, rows=257,
                           kernel_fn=bf16_mgpu.emulate_chunked_matmul)
