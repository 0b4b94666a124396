"""The routing-tables kernel (`kernels/routing.py`) in Pallas interpret mode against the XLA
path it replaces (`sort_by_group`, `count_by_group`, `fp4_mgpu.chunk_tables`), every table bit
for bit: decode sizes, row counts that are not powers of two, a single row, skewed routing with
empty groups; its CUDA lowering; on the GPU the compiled kernel (marked)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.kernels import fp4_mgpu, routing


def _xla_tables(ids, e, bm, c):
  order, inverse = kernels.sort_by_group(ids)
  gs = kernels.count_by_group(ids, e)
  ce, row0, slot, total = fp4_mgpu.chunk_tables(gs, ids.shape[0], bm, with_total=True)
  return order, inverse, gs, ce, row0, slot, total[:1]


_NAMES = ("order", "inverse", "group_sizes", "chunk_expert", "chunk_row", "slot", "total")


def _ids(m, e, seed, skew=False):
  rng = np.random.default_rng(seed)
  p = np.ones(e) / e
  if skew:  # a few hot experts, many empty groups
    p = rng.dirichlet(np.full(e, 0.05))
  return jnp.asarray(rng.choice(e, size=m, p=p), jnp.int32)


# (interpret mode runs a program at a time: ~1.5 s a case on 2 cores)
@pytest.mark.parametrize("m,e,skew", [
    (512, 128, False), (600, 128, True), (1, 128, False), (37, 9, True), (2048, 128, False),
    pytest.param(4096, 64, True, marks=pytest.mark.slow)],
    ids=["decode_b64", "non_pow2_skewed", "one_row", "small", "decode_b256", "max_rows"])
def test_kernel_equals_xla_tables(m, e, skew):
  ids = _ids(m, e, m + e, skew)
  bm = fp4_mgpu.grouped_bm(m, e)
  c = fp4_mgpu.chunk_count(m, e, bm)
  got = routing.routing_tables(ids, num_groups=e, bm=bm, n_chunks=c, interpret=True)
  want = jax.jit(_xla_tables, static_argnums=(1, 2, 3))(ids, e, bm, c)
  for name, a, b in zip(_NAMES, got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


# slow (~15-20 s of emulated kernels run op by op on 2 cores); CI runs it. The default suite
# keeps the tables' own tests (test_kernel_equals_xla_tables, test_limits)
@pytest.mark.slow
def test_route_feeds_the_grouped_kernel_its_tables(monkeypatch):
  """`dispatch.route` with the kernel on (the GPU's branch, the kernel in interpret mode here):
  the same order, inverse and group sizes as without it, and tables that the FP4 grouped
  wrapper (emulated kernel) takes in place of its own with the same result, bit for bit; off
  the GPU `route` is `sort_by_group` + `count_by_group` and no tables."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  from trace_jax.quant import quantize  # noqa: PLC0415
  e, k, n, tokens, top = 6, 96, 256, 20, 2
  w = jax.random.normal(jax.random.key(1), (e, k, n), jnp.float32)
  pw = kernels.prepare_weight(quantize(w, "nvfp4", axis=1, second_level=(0,)), kb=4)
  idx = _ids(tokens * top, e, 5, skew=True)
  x = jax.random.normal(jax.random.key(2), (tokens, k), jnp.float32).astype(jnp.bfloat16)
  off = kernels.route(idx, e, pw)
  # the XLA path's tables (group ends counted from the ids) equal those from the sizes alone
  bm = fp4_mgpu.grouped_bm(tokens * top, e)
  assert off[3][0] == bm
  apart = fp4_mgpu.chunk_tables(off[2], tokens * top, bm, with_total=True)
  for a, b in zip(off[3][1:4], apart[:3], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (np.asarray(off[3][4]) == np.asarray(apart[3])[0]).all()
  monkeypatch.setattr(dispatch, "_ROUTING", "kernel")
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(routing, "routing_tables",
                      functools.partial(routing.routing_tables, interpret=True))
  on = kernels.route(idx, e, pw)
  for a, b in zip(on[:3], off[:3], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert on[3][0] == bm
  for a, b in zip(on[3][1:4], off[3][1:4], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (np.asarray(on[3][4]) == np.asarray(off[3][4])[0]).all()

  def run(tables):
    order, inverse, gs = off[:3]
    return np.asarray(fp4_mgpu.grouped_matmul(
        x, pw, gs, out_dtype=jnp.float32, kernel_fn=fp4_mgpu.emulate_chunked_matmul,
        rows=order // top, out_rows=inverse, tables=tables))

  np.testing.assert_array_equal(run(on[3]), run(None))
  np.testing.assert_array_equal(run(off[3]), run(None))


def test_limits():
  assert routing.kernel_supported(jnp.zeros((routing.MAX_ROWS + 1,), jnp.int32), 128)
  assert routing.kernel_supported(jnp.zeros((4, 2), jnp.int32), 128)
  assert routing.kernel_supported(jnp.zeros((8,), jnp.float32), 128)
  assert routing.kernel_supported(jnp.zeros((8,), jnp.int32), 128) is None
  with pytest.raises(ValueError, match="routing kernel"):
    routing.routing_tables(jnp.zeros((0,), jnp.int32), num_groups=4, bm=16, n_chunks=4,
                           interpret=True)


def test_lowers_for_cuda(monkeypatch):
  """The Triton lowering accepts the kernels (register tiles, masked loads and stores, the
  order's scatter), at 128 groups and at 9 (tiles of groups past the tables' ends)."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  for e in (128, 9):
    fn = functools.partial(routing.routing_tables, num_groups=e, bm=16,
                           n_chunks=fp4_mgpu.chunk_count(600, e, 16))
    text = jax.jit(fn).trace(jax.ShapeDtypeStruct((600,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "moe_routing_rows" in text and "moe_routing_chunks" in text


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,skew", [(512, 128, False), (600, 128, True), (1, 128, False),
                                      (2048, 128, False), (2040, 128, True), (4096, 128, False)])
def test_kernel_on_gpu_equals_xla_tables(m, e, skew):
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  ids = _ids(m, e, 7 * m + e, skew)
  bm = fp4_mgpu.grouped_bm(m, e)
  c = fp4_mgpu.chunk_count(m, e, bm)
  got = routing.routing_tables(ids, num_groups=e, bm=bm, n_chunks=c)
  want = jax.jit(_xla_tables, static_argnums=(1, 2, 3))(ids, e, bm, c)
  for name, a, b in zip(_NAMES, got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.slow  # (~18-22 s, as the test above; a GPU-only choice of `route`)
def test_row_chunks_need_no_order(monkeypatch):
  """`dispatch.row_chunks` (`route` on the GPU up to ROW_CHUNK_ROWS rows): identity order, a
  chunk per row. The FP4 and bf16 grouped wrappers (emulated kernels) give with them what they
  give with the sorted tables, bit for bit, also where rows share an expert (2 tokens of top-4
  here: a batch-1 step is 1 token of top-8, distinct experts); the paths that need sorted rows
  (the reference here) sort them first; `route` picks them only up to the limit and only on
  the GPU, before the routing kernels (the default there) as before XLA's tables."""
  from trace_jax.kernels import bf16_mgpu, dispatch  # noqa: PLC0415
  from trace_jax.quant import quantize  # noqa: PLC0415
  e, k, n, tokens, top = 12, 256, 256, 2, 4
  m = tokens * top
  ids = jnp.asarray([5, 2, 9, 11, 9, 5, 0, 2], jnp.int32)
  w = jax.random.normal(jax.random.key(1), (e, k, n), jnp.float32)
  x = jax.random.normal(jax.random.key(2), (tokens, k), jnp.float32).astype(jnp.bfloat16)
  pw = kernels.prepare_weight(quantize(w, "nvfp4", axis=1, second_level=(0,)), kb=4)
  wb = (w * 0.05).astype(jnp.bfloat16)
  sorted_route = kernels.route(ids, e, pw)  # CPU: sorted rows and their tables
  by_rows = dispatch.row_chunks(ids, e)
  np.testing.assert_array_equal(np.asarray(by_rows[0]), np.arange(m))
  np.testing.assert_array_equal(np.asarray(by_rows[2]), np.asarray(sorted_route[2]))
  assert by_rows[3][4] == dispatch.ROW_CHUNKS

  def fp4(r):
    order, inverse, gs, tables = r
    return np.asarray(fp4_mgpu.grouped_matmul(
        x, pw, gs, out_dtype=jnp.float32, kernel_fn=fp4_mgpu.emulate_chunked_matmul,
        rows=order // top, out_rows=inverse, tables=tables))

  def bf16(r):
    order, inverse, gs, tables = r
    return np.asarray(bf16_mgpu.grouped_matmul(
        x, wb, gs, out_dtype=jnp.float32, kernel_fn=bf16_mgpu.emulate_chunked_matmul,
        rows=order // top, out_rows=inverse, tables=tables))

  np.testing.assert_array_equal(fp4(by_rows), fp4(sorted_route))
  np.testing.assert_array_equal(bf16(by_rows), bf16(sorted_route))
  # the reference path (CPU) with row-chunk tables sorts the rows itself
  token = np.arange(m) // top
  want = np.stack([np.asarray(x, np.float32)[token[i]] @ np.asarray(wb, np.float32)[ids[i]]
                   for i in range(m)])
  got = dispatch.grouped_matmul(x, wb, by_rows[2], jnp.float32, rows=by_rows[0] // top,
                                out_rows=by_rows[1], tables=by_rows[3])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # route: row chunks on the GPU up to the limit (here the bf16 weight's kernel), sorted above
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "_BF16_GROUPED", "auto")
  assert dispatch.route(ids, e, wb)[3][4:] == (dispatch.ROW_CHUNKS,)
  assert dispatch.route(ids, e, pw)[3][4:] == (dispatch.ROW_CHUNKS,)
  monkeypatch.setattr(dispatch, "ROW_CHUNK_ROWS", m - 1)
  monkeypatch.setattr(routing, "routing_tables",  # (above the limit the routing kernels' tables)
                      functools.partial(routing.routing_tables, interpret=True))
  for setting in ("kernel", "xla"):
    monkeypatch.setattr(dispatch, "_ROUTING", setting)
    assert not fp4_mgpu.by_rows(dispatch.route(ids, e, pw)[3])
