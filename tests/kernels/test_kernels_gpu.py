"""GPU tests: the Mosaic GPU FP4 kernel against the reference (float32 output, so only the
accumulation order differs: relative error < 1e-5), across dense and grouped shapes and ragged
edge cases. Run on the GPU machine:

  JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python -m pytest -q -m gpu tests/kernels
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax.kernels import fp4_mgpu, reference
from trace_jax.quant import dequantize, quantize

pytestmark = pytest.mark.gpu

TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")


def rand_w(shape, seed):
  rng = np.random.default_rng(seed)
  col = np.exp(rng.normal(size=(1,) * (len(shape) - 1) + (shape[-1],)))
  return jnp.asarray((rng.standard_normal(shape) * col).astype(np.float32))


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite kernel output"
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _dense(x, pw, out_dtype):
  return kernels.matmul(x, pw, out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "bm", "n_inner"))
def _grouped(x, pw, g, out_dtype, bm=None, n_inner=None):
  return kernels.grouped_matmul(x, pw, g, out_dtype, bm=bm,
                                config=None if n_inner is None else dict(n_inner=n_inner))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("k,n,kb", [(512, 512, 4), (200, 300, 2), (1000, 768, 8)])
@pytest.mark.parametrize("b", [1, 20, 64, 100])  # chunk 16, 32, 64 rows; 100: prefill path
def test_dense(fmt, k, n, kb, b):
  q = quantize(rand_w((k, n), k + n), fmt, axis=0)
  pw = jax.jit(functools.partial(kernels.prepare_weight, kb=kb))(q)
  x = jax.random.normal(jax.random.key(b), (b, k), jnp.float32).astype(jnp.bfloat16)
  ref = reference.matmul_ref(x, q, jnp.float32)
  assert relerr(_dense(x, pw, jnp.float32), ref) < TOL
  assert relerr(_dense(x, pw, jnp.bfloat16), ref) < 1e-2


@functools.partial(jax.jit, static_argnames=("out_dtype", "steps"))
def _dense_stream_k(x, pw, out_dtype, steps):
  return kernels.matmul(x, pw, out_dtype, config=dict(stream_k=steps))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("k,n,kb,steps", [
    (520, 700, 4, 2),  # 3 tiles x 3 steps: CTAs end a tile and start the next; last holds 1
    (520, 700, 4, 4),  # a whole tile and the next one's first step
    (520, 700, 4, 5),  # more than a tile
    (1000, 768, 8, 3),  # kb 8: 3 tiles x 2 steps
])
def test_dense_stream_k(fmt, k, n, kb, steps):
  """Stream-K schedules against the reference, at 16/32/64-row chunks."""
  q = quantize(rand_w((k, n), k + n + 1), fmt, axis=0)
  pw = jax.jit(functools.partial(kernels.prepare_weight, kb=kb))(q)
  for b in (1, 20, 64):
    x = jax.random.normal(jax.random.key(b), (b, k), jnp.float32).astype(jnp.bfloat16)
    ref = reference.matmul_ref(x, q, jnp.float32)
    assert relerr(_dense_stream_k(x, pw, jnp.float32, steps), ref) < TOL, b
    assert relerr(_dense_stream_k(x, pw, jnp.bfloat16, steps), ref) < 1e-2, b


def test_dense_stream_k_gemv_shape():
  """The plan's own schedule at 8192 x 28672 (112 tiles: 28 of 32 steps a CTA at kb 4, 14 of
  16 at kb 8) against the reference; one weight made on the device."""
  k, n = 8192, 28672
  col = jnp.exp(jax.random.normal(jax.random.key(1), (1, n)))
  w = jax.random.normal(jax.random.key(2), (k, n), jnp.float32) * col
  q = quantize(w, "nvfp4", axis=0)
  for kb, steps in ((4, 28), (8, 14)):
    assert fp4_mgpu.stream_k_plan(n // 256, k // 64 // kb, 1) == steps
    pw = jax.jit(functools.partial(kernels.prepare_weight, kb=kb))(q)
    for b in (1, 16, 32):
      x = jax.random.normal(jax.random.key(b), (b, k), jnp.float32).astype(jnp.bfloat16)
      assert relerr(_dense(x, pw, jnp.float32), reference.matmul_ref(x, q, jnp.float32)) < TOL


def test_single_row_bf16_is_a_matrix_product():
  """A one-row bf16 product (batch-1 decode of the attention projections) stays a matrix
  product: XLA:GPU's multiply + reduce form wrote the float32 product [N, K] (32 MB for the
  30B-A3B q projection); the result equals the float32 reference to bf16 rounding."""
  w = (jax.random.normal(jax.random.key(1), (2048, 4096), jnp.float32) * 0.02).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(2), (1, 1, 2048), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(lambda x, w: kernels.matmul(x, w, jnp.float32))
  text = f.lower(x, w).compile().as_text()
  assert "f32[4096,2048]" not in text and "f32[2048,4096]" not in text, text[:3000]
  ref = reference.matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32))
  assert relerr(f(x, w), ref) < 1e-5


@pytest.mark.parametrize("rows", [1, 256])
def test_router_product_of_bf16_operands(rows):
  """`dispatch.bf16_operands_dot` (TRACE_JAX_ROUTER_DOT=bf16) at the 30B-A3B router shape: one
  bf16 product with float32 accumulation on the tensor cores, against float64 numpy and the
  float32 dot (the products are exact either way; the accumulations differ)."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  w = (jax.random.normal(jax.random.key(5), (2048, 128), jnp.float32) * 0.02).astype(jnp.bfloat16)
  x = jax.random.normal(jax.random.key(rows), (rows, 2048), jnp.float32).astype(jnp.bfloat16)
  ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  got = jax.jit(dispatch.bf16_operands_dot)(x, w)
  assert got.dtype == jnp.float32
  assert relerr(got, ref) < 1e-6
  assert relerr(got, jax.jit(lambda x, w: jnp.dot(
      x.astype(jnp.float32), w.astype(jnp.float32), precision="highest"))(x, w)) < 1e-6


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("bm,n_inner", [(None, 1), (16, 1), (64, 1), (16, 2), (None, 2)])
def test_grouped_ragged(fmt, bm, n_inner):
  """n_inner 2: a CTA chains the pipelines of both column tiles of N 512; n_inner 1: the 3 K
  steps split over 3 CTAs (few groups: `fp4_mgpu.grouped_parallelism`)."""
  e, k, n = 8, 704, 512  # K not a multiple of 256
  q = quantize(rand_w((e, k, n), 3), fmt, axis=1, second_level=(0,))
  pw = jax.jit(kernels.prepare_weight)(q)
  cases = [[0, 0, 0, 1, 0, 0, 0, 0],  # one token
           [0, 70, 0, 0, 2, 0, 0, 9],  # empty groups, a group over several chunks
           [3, 1, 4, 1, 5, 9, 2, 6]]
  for gs in cases:
    m = sum(gs) + 5  # rows past sum(group_sizes): zeros
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    ref = reference.grouped_matmul_ref(x, q, g, jnp.float32)
    got = _grouped(x, pw, g, jnp.float32, bm, n_inner)
    assert relerr(got, ref) < TOL, gs
    assert np.all(np.asarray(got)[sum(gs):] == 0)


def expert_case(k, n, m, seed):
  """A 30B-A3B-shaped expert matmul (128 experts, NVFP4, top-8 routing of m // 8 random
  tokens): (packed weight, group sizes, rows, float32 reference)."""
  e = 128
  q = quantize(rand_w((e, k, n), 5 + seed // 2) * 0.02, "nvfp4", axis=1, second_level=(0,))
  pw = jax.jit(kernels.prepare_weight)(q)
  top = jax.lax.top_k(jax.random.normal(jax.random.key(seed), (m // 8, e)), 8)[1].reshape(-1)
  g = jnp.bincount(top, length=e).astype(jnp.int32)
  x = jax.random.normal(jax.random.key(seed + 1), (m, k), jnp.float32).astype(jnp.bfloat16)
  return pw, g, x, reference.grouped_matmul_ref(x, q, g, jnp.float32)


@pytest.mark.parametrize("k,n,m,seed,n_inners", [
    (2048, 1536, 256, 0, (None, 1, 6)),  # gate+up; n_inner 6: one CTA per chunk
    (768, 2048, 512, 2, (1, 4, 8)),  # down at 512 decode rows: 3 K steps per tile, 8 chained
    (2048, 1536, 8, 4, (None, 6)),  # batch 1: 8 experts, K split 2 ways (the rule) / chained
    (768, 2048, 8, 6, (None,)),  # batch 1, down: one column tile per CTA
])
def test_grouped_expert_shapes(k, n, m, seed, n_inners):
  """The 30B-A3B expert matmuls (128 experts, top-8 routing) for each column-tile chaining."""
  pw, g, x, ref = expert_case(k, n, m, seed)
  for n_inner in n_inners:
    assert relerr(_grouped(x, pw, g, jnp.float32, n_inner=n_inner), ref) < TOL, n_inner


@functools.partial(jax.jit, static_argnames=("out_dtype", "n_ctas", "merge"))
def _grouped_stream_k(x, pw, g, out_dtype, n_ctas=None, merge="xla"):
  cfg = dict(stream_k=True, merge=merge) | ({} if n_ctas is None else dict(n_ctas=n_ctas))
  return kernels.grouped_matmul(x, pw, g, out_dtype, config=cfg)


@pytest.mark.parametrize("fmt,merge", [("nvfp4", "xla"), ("mxfp4", "xla"),
                                       ("nvfp4", "kernel")])
def test_grouped_stream_k_ragged(fmt, merge):
  """The grouped stream-K schedule over 3 / 7 / all CTAs (runs that cut tiles and cross chunks:
  2 column tiles x 3 K steps a chunk, K not a multiple of 256), empty groups, one token, rows
  past the sum; float32 and bf16 out; the cut tiles' parts added by XLA or in the kernel."""
  e, k, n = 8, 704, 512
  q = quantize(rand_w((e, k, n), 3), fmt, axis=1, second_level=(0,))
  pw = jax.jit(kernels.prepare_weight)(q)
  for gs in ([0, 0, 0, 1, 0, 0, 0, 0], [0, 70, 0, 0, 2, 0, 0, 9], [3, 1, 4, 1, 5, 9, 2, 6]):
    m = 90  # rows past sum(group_sizes): zeros
    x = jax.random.normal(jax.random.key(sum(gs)), (m, k), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    ref = reference.grouped_matmul_ref(x, q, g, jnp.float32)
    for n_ctas in (3, 7, None):
      got = _grouped_stream_k(x, pw, g, jnp.float32, n_ctas, merge)
      assert relerr(got, ref) < TOL, (gs, n_ctas)
      assert np.all(np.asarray(got)[sum(gs):] == 0)
    assert relerr(_grouped_stream_k(x, pw, g, jnp.bfloat16, 7, merge), ref) < 1e-2, gs


@pytest.mark.parametrize("k,n,m,seed", [(2048, 1536, 64, 8), (2048, 1536, 256, 0),
                                        (2048, 1536, 2208, 10), (768, 2048, 512, 2)])
def test_grouped_stream_k_expert_shapes(k, n, m, seed):
  """The 30B-A3B expert matmuls (128 experts, top-8 routing) under the stream-K schedule (the
  default from 32 to 256 rows) against the reference, the cut tiles' parts added by XLA or in
  the kernel (bit for bit the same: each is one float32 addition of the same two parts)."""
  pw, g, x, ref = expert_case(k, n, m, seed)
  got = _grouped_stream_k(x, pw, g, jnp.float32)
  assert relerr(got, ref) < TOL
  assert relerr(_grouped_stream_k(x, pw, g, jnp.bfloat16), ref) < 1e-2
  np.testing.assert_array_equal(np.asarray(_grouped_stream_k(x, pw, g, jnp.float32,
                                                             merge="kernel")), np.asarray(got))


@pytest.mark.parametrize("k,n,rows", [(2048, 5120, 256), (4096, 2048, 100), (704, 512, 65)])
def test_dense_as_one_group(k, n, rows):
  """Dense products past the GEMV kernel's 64 rows through the grouped kernel with the rows as
  one group (`fp4_mgpu.matmul_as_group`, its default launch): the 8k-capacity batch through
  the fused q/k/v projection, o at 100 rows (K split 8 ways), K not a multiple of the tile."""
  q = quantize(rand_w((k, n), 24) * 0.02, "nvfp4", axis=0)
  pw = jax.jit(kernels.prepare_weight)(q)
  x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
  got = jax.jit(lambda x, w: fp4_mgpu.matmul_as_group(x, w, out_dtype=jnp.float32))(x, pw)
  assert relerr(got, reference.matmul_ref(x, q, jnp.float32)) < TOL


def test_grouped_capacity_batch_bf16_out():
  """The 8k-capacity rollout's gate+up as the engine runs it: 2,208 rows of top-8 routing over
  128 experts, bf16 out (bm 32, 6 chained column tiles, 4 pipeline stages: only bf16 out fits
  them). Each element within bf16 rounding (2**-8 relative) of the float32 reference, plus
  the accumulation order's share."""
  e, k, n, m = 128, 2048, 1536, 2208
  q = quantize(rand_w((e, k, n), 21) * 0.02, "nvfp4", axis=1, second_level=(0,))
  pw = jax.jit(kernels.prepare_weight)(q)
  top = jax.lax.top_k(jax.random.normal(jax.random.key(22), (m // 8, e)), 8)[1].reshape(-1)
  g = jnp.bincount(top, length=e).astype(jnp.int32)
  x = jax.random.normal(jax.random.key(23), (m, k), jnp.float32).astype(jnp.bfloat16)
  ref = np.asarray(reference.grouped_matmul_ref(x, q, g, jnp.float32), np.float64)
  got = np.asarray(_grouped(x, pw, g, jnp.bfloat16).astype(jnp.float32), np.float64)
  bound = 2.0 ** -8 * np.abs(ref) + 1e-5 * np.max(np.abs(ref))
  assert np.all(np.abs(got - ref) <= bound), np.max(np.abs(got - ref) / bound)


@functools.partial(jax.jit, static_argnames=("n_inner", "splits"))
def _bf16_kernel(x, w, g, n_inner=None, splits=None):
  from trace_jax.kernels import bf16_mgpu
  over = {k: v for k, v in (("n_inner", n_inner), ("splits", splits)) if v is not None}
  return bf16_mgpu.grouped_matmul(x, w, g, out_dtype=jnp.float32, config_override=over)


@pytest.mark.parametrize("k,n,m,seed,configs", [
    (2048, 1536, 8, 0, ((None, None), (6, 1), (1, 4))),  # batch 1, gate+up: the rule, chained
    (768, 2048, 8, 2, ((None, None), (1, 1))),  # batch 1, down
    (2048, 1536, 64, 4, ((None, None),)),  # batch 8
    (768, 2048, 512, 6, ((None, None), (8, 1))),  # batch 64, down
])
def test_bf16_grouped_expert_shapes(k, n, m, seed, configs):
  """The bf16 grouped kernel (`bf16_mgpu`) at the 30B-A3B expert shapes: bf16 products are
  exact in float32, so only the summation order differs from the reference."""
  e = 128
  w = (rand_w((e, k, n), 7 + seed) * 0.02).astype(jnp.bfloat16)
  top = jax.lax.top_k(jax.random.normal(jax.random.key(seed), (m // 8, e)), 8)[1].reshape(-1)
  g = jnp.bincount(top, length=e).astype(jnp.int32)
  x = jax.random.normal(jax.random.key(seed + 1), (m, k), jnp.float32).astype(jnp.bfloat16)
  ref = reference.grouped_matmul_ref(x, w, g, jnp.float32)
  for n_inner, splits in configs:
    got = _bf16_kernel(x, w, g, n_inner, splits)
    assert relerr(got, ref) < TOL, (n_inner, splits)


def test_bf16_grouped_ragged():
  """Empty groups, one row, a group over several chunks, rows past the groups (zeros)."""
  e, k, n = 8, 512, 512
  w = (rand_w((e, k, n), 11) * 0.05).astype(jnp.bfloat16)
  for gs in ([0, 0, 0, 1, 0, 0, 0, 0], [0, 70, 0, 0, 2, 0, 0, 9], [3, 1, 4, 1, 5, 9, 2, 6]):
    m = sum(gs) + 5
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    g = jnp.asarray(gs, jnp.int32)
    got = _bf16_kernel(x, w, g)
    assert relerr(got, reference.grouped_matmul_ref(x, w, g, jnp.float32)) < TOL, gs
    assert np.all(np.asarray(got)[sum(gs):] == 0)


@pytest.mark.parametrize("mode,rows", [("chunks", 200), ("exact", 200), ("exact", 255)])
@pytest.mark.parametrize("bm,wgs,kb,splits", [(256, 2, 1, 1), (128, 1, 1, 2), (128, 2, 2, 1),
                                               (128, 2, 1, 4)])  # the last: `ksplit_launch`'s
def test_bf16_dense_rows_chunks(bm, wgs, kb, splits, mode, rows):
  """The bf16 kernel with 128 / 256 rows a chunk (`bf16_mgpu.dense_matmul`), K 512, N 640,
  against the float32 reference: 200 rows, a partial chunk (`DENSE_ROWS` "chunks": padded to
  whole chunks and sliced back; "exact": read past the operand's end as zeros), and 255, the
  rollout's capacity batch ("exact": padded to 256, the output written for 255 rows only)."""
  from trace_jax.kernels import bf16_mgpu
  x = jax.random.normal(jax.random.key(bm + splits), (rows, 512), jnp.float32
                        ).astype(jnp.bfloat16)
  w = (rand_w((512, 640), 13) * 0.05).astype(jnp.bfloat16)
  got = jax.jit(functools.partial(bf16_mgpu.dense_matmul, bm=bm, wgs=wgs, kb=kb,
                                  splits=splits, out_dtype=jnp.float32,
                                  exact_rows=mode == "exact"))(x, w)
  ref = reference.matmul_ref(x.astype(jnp.float32), w.astype(jnp.float32))
  assert relerr(got, ref) < TOL


@pytest.mark.parametrize("order,alias", [("rotate", True), ("fixed", True), ("rotate", False)])
@pytest.mark.parametrize("rows,k,n,splits,wgs,kb,bm", [
    (256, 4096, 2048, 8, 2, 1, 256),  # the o projection's shape, a cluster of 8
    (255, 4096, 2048, 4, 2, 1, 128),  # the o projection at 255 rows in two 128-row chunks
    (255, 4096, 2048, 2, 2, 1, 128),  # the same in clusters of 2 (`CLUSTER_LAUNCH`, session 47)
    (255, 1024, 640, 4, 1, 2, 256),  # the rollout's 255 rows (operand padded to 256), 10 tiles
    (200, 512, 256, 2, 2, 1, 128),  # a partial second chunk, a cluster of 2
    (128, 1024, 384, 8, 1, 1, 128),  # 128 rows: wgmma N 128, 16-row slices
])
def test_bf16_cluster_matmul(rows, k, n, splits, wgs, kb, bm, order, alias):
  """`bf16_mgpu.cluster_matmul` (K split in a cluster, the parts added in distributed shared
  memory) against a float64 product, bf16 out within one rounding plus float32 sums; two calls
  give the same bits (the parts are added in split order whatever the sends' order); the output
  holds exactly `rows` rows. alias: the received parts in the pipeline's SMEM (default) or in
  their own."""
  from trace_jax.kernels import bf16_mgpu
  x = jax.random.normal(jax.random.key(rows + splits), (rows, k), jnp.float32)
  x = x.astype(jnp.bfloat16)
  w = (rand_w((k, n), 17) * 0.05).astype(jnp.bfloat16)
  xp = jnp.pad(x, ((0, -rows % 8), (0, 0)))
  fn = jax.jit(functools.partial(bf16_mgpu.cluster_matmul, splits=splits, wgs=wgs, kb=kb,
                                 rows=rows, bm=bm, order=order, alias=alias))
  got = fn(xp, w)
  assert got.shape == (rows, n) and got.dtype == jnp.bfloat16
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  g = np.asarray(got, np.float64)
  assert np.all(np.abs(g - want) <= 2 ** -8 * np.abs(want) + 1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(np.asarray(fn(xp, w)).view(np.uint16),
                                np.asarray(got).view(np.uint16))
  f32 = jax.jit(functools.partial(bf16_mgpu.cluster_matmul, splits=splits, wgs=wgs, kb=kb,
                                  out_dtype=jnp.float32, bm=bm, order=order, alias=alias))(xp, w)
  assert relerr(f32[:rows], want) < 1e-5


@pytest.mark.parametrize("tokens,k,n", [(1, 2048, 1536), (1, 768, 2048), (2, 2048, 1536)])
def test_row_chunk_routing_through_both_kernels(monkeypatch, tokens, k, n):
  """`route` on the GPU for one token's top-8 (and, with the limit raised, two tokens, whose
  experts may repeat): row chunks in token order; the FP4 and bf16 grouped kernels with those
  tables equal the reference on the rows in token order (the reference sorts nothing: one
  product per (token, slot) row)."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  e, top = 128, 8
  q = quantize(rand_w((e, k, n), 21) * 0.02, "nvfp4", axis=1, second_level=(0,))
  pw = jax.jit(kernels.prepare_weight)(q)
  wb = (rand_w((e, k, n), 22) * 0.02).astype(jnp.bfloat16)
  logits = jax.random.normal(jax.random.key(tokens), (tokens, e))
  if tokens == 2:
    logits = logits.at[1].set(logits[0])  # the same experts twice: each chunk reads its own
  ids = jax.lax.top_k(logits, top)[1].reshape(-1).astype(jnp.int32)
  x = jax.random.normal(jax.random.key(3), (tokens, k), jnp.float32).astype(jnp.bfloat16)
  xr = np.asarray(x, np.float32)[np.arange(tokens * top) // top]
  monkeypatch.setattr(dispatch, "ROW_CHUNK_ROWS", tokens * top)
  for w, dense in ((pw, dequantize(q, jnp.float32)[ids]), (wb, wb[ids])):
    order, inverse, gs, tables = dispatch.route(ids, e, w)
    assert tables[4:] == (dispatch.ROW_CHUNKS,)
    got = kernels.grouped_matmul(x, w, gs, jnp.float32, rows=order // top, out_rows=inverse,
                                 tables=tables)
    want = np.einsum("mk,mkn->mn", xr, np.asarray(dense, np.float32))
    assert relerr(got, want) < TOL, type(w).__name__
