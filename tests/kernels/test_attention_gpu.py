"""GPU tests: the Pallas decode attention kernel against the reference (`decode_attention_ref`,
the definition) over bf16 / MXFP8 / NVFP4 / MXFP4 caches, cache lengths 1, 17, 1000 and 8192,
ragged batches, and the model's decode path on the GPU; the flash prefill kernel against
`prefill_attention_ref` (prompts of 1, 17, 300 and 2048 tokens, left padding, a later chunk) and
the model's prefill on the GPU; the Mosaic NVFP4 decode kernel (`attention_mgpu`) against the
reference. Both sides read K/V as the same bf16
values; they differ by float32 summation order and the kernel's bf16 rounding of
probabilities against its running max, so the bound is 2e-2 of max |ref| (bf16 outputs).
Run on the GPU machine:

  JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python -m pytest -q -m gpu tests/kernels
"""

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq

pytestmark = pytest.mark.gpu

FORMATS = [None, "mxfp8", "nvfp4", "mxfp4"]
TOL = 2e-2


@pytest.fixture(autouse=True, scope="module")
def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")


def make_kv(fmt, shape, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.normal(size=shape[:-1] + (1,)))
  x = jnp.asarray(x, jnp.float32)
  return x.astype(jnp.bfloat16) if fmt is None else tq.quantize(x, fmt, second_level="row")


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite kernel output"
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def _attn(q, k, v, valid, use_kernel):
  return kernels.decode_attention(q, k, v, valid, use_kernel=use_kernel)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("s", [1, 17, 1000, 8192])
def test_kernel_vs_reference(fmt, s):
  b, kvh, g, hd = 4, 4, 8, 128  # Qwen3-30B-A3B heads
  k, v = make_kv(fmt, (b, s, kvh, hd), s), make_kv(fmt, (b, s, kvh, hd), s + 1)
  q = jax.random.normal(jax.random.key(s), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = np.ones((b, s), bool)
  valid[1, : s // 3] = False  # left padding
  valid[2, max(1, s // 2):] = False  # shorter row: tiles past its last valid slot are skipped
  # (every row keeps a valid slot, as in decode: with none, the reference averages V and the
  # kernel gives 0, see `decode_attention_ref`)
  valid[3, 1:] = False  # one valid slot
  valid = jnp.asarray(valid)
  got = _attn(q, k, v, valid, True)
  want = _attn(q, k, v, valid, False)
  assert relerr(got, want) < TOL


@pytest.mark.parametrize("config", [dict(block_k=16, splits=7), dict(block_k=64, splits=1),
                                    dict(block_k=128, splits=64)])
def test_kernel_configs_ragged(config):
  b, s, kvh, g, hd = 3, 1000, 2, 5, 64  # 5 query heads per KV head (padded to 16)
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 1), make_kv("nvfp4", (b, s, kvh, hd), 2)
  q = jax.random.normal(jax.random.key(3), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray([1000, 17, 1])
  got = jax.jit(functools.partial(kernels.decode_attention, use_kernel=True, config=config))(
      q, k, v, lengths)
  want = jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)
  assert relerr(got, want) < TOL


MOSAIC_NAMES = ("decode_attention_stream", "decode_attention_mosaic")  # the two schedules


@pytest.mark.parametrize("heads,short,want", [((4, 2, 64), 4096, ("triton",)),
                                              ((8, 4, 128), 0, MOSAIC_NAMES),
                                              ((8, 4, 128), 4096, ("triton",))])
def test_model_decode_step_uses_the_kernel(monkeypatch, heads, short, want):
  """A decode step of a bf16 model with an NVFP4 cache goes through a kernel on the GPU (the
  default there; set explicitly so the test holds under any environment): the Pallas kernel at
  head_dim 64, at 4 KV heads x 128 the Mosaic kernel, or the Pallas one where the cache counts
  as short (`SHORT_CACHE_SLOTS`: 2 x 40 slots here); it agrees with the same token through the
  general attention path."""
  from trace_jax.kernels import dispatch
  monkeypatch.setattr(dispatch, "_ATTENTION_KERNEL", True)
  monkeypatch.setattr(dispatch, "_ATTENTION_MOSAIC", True)
  monkeypatch.setattr(dispatch, "SHORT_CACHE_SLOTS", short)
  jax.clear_caches()  # the flags are read at trace time
  h, kvh, hd = heads
  cfg = M.tiny(num_layers=2, num_heads=h, num_kv_heads=kvh, head_dim=hd, dtype="bfloat16")
  params = M.init_params(cfg, jax.random.key(0))
  apply = jax.jit(M.apply, static_argnums=(2, 3))
  policy = tq.make_policy("kv4", "nvfp4")
  ctx = M.QuantContext(policy, "rollout")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
  mask = jnp.asarray(np.arange(7)[None] >= np.array([[2], [0]]))
  out = apply(params, tokens[:, :6], cfg, ctx, token_mask=mask[:, :6],
              cache=M.init_cache(cfg, 2, 40, policy.kv))
  pos = M.default_positions(tokens, mask)[:, 6:]
  one = apply(params, tokens[:, 6:], cfg, ctx, positions=pos, cache=out.cache, cache_index=6)
  two = apply(params, jnp.pad(tokens[:, 6:], ((0, 0), (0, 1))), cfg, ctx,
              positions=jnp.pad(pos, ((0, 0), (0, 1))),
              token_mask=jnp.asarray([[True, False]] * 2), cache=out.cache, cache_index=6)
  lowered = jax.jit(M.apply, static_argnums=(2, 3)).lower(
      params, tokens[:, 6:], cfg, ctx, positions=pos, cache=out.cache, cache_index=6).as_text()
  assert any(name in lowered for name in want)  # the kernel is in the decode step
  a, b = np.asarray(one.logits[:, 0], np.float64), np.asarray(two.logits[:, 0], np.float64)
  assert np.max(np.abs(a - b)) < 0.05 * np.max(np.abs(b))


@functools.partial(jax.jit, static_argnames=("use_kernel",))
def _prefill(q, k, v, key_mask, q_start, use_kernel):
  return kernels.prefill_attention(q, k, v, key_mask, q_start, use_kernel=use_kernel)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("t", [1, 17, 300, 2048])
def test_prefill_kernel_vs_reference(fmt, t):
  """Rows: left padding of a third, a hole, a chunk starting at slot 40 (its cache holds 40
  earlier tokens). Compared on the queries that see a slot (the others: kernel 0, reference the
  mean of V)."""
  b, kvh, g, hd = 3, 4, 8, 128
  s = t + 40 + 7
  k, v = make_kv(fmt, (b, s, kvh, hd), t), make_kv(fmt, (b, s, kvh, hd), t + 1)
  q = jax.random.normal(jax.random.key(t), (b, t, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  key_mask = np.ones((b, s), bool)
  key_mask[0, : t // 3] = False
  key_mask[1, t // 2: t // 2 + 3] = False
  q_start = jnp.asarray([0, 0, 40], jnp.int32)
  got = np.asarray(_prefill(q, k, v, jnp.asarray(key_mask), q_start, True), np.float64)
  want = np.asarray(_prefill(q, k, v, jnp.asarray(key_mask), q_start, False), np.float64)
  slot = np.asarray(q_start)[:, None] + np.arange(t)  # [B, T]
  seen = np.array([[key_mask[r, : slot[r, i] + 1].any() for i in range(t)] for r in range(b)])
  assert relerr(got[seen], want[seen]) < TOL
  assert np.all(got[~seen] == 0)


def test_model_prefill_uses_the_kernel(monkeypatch):
  """A bf16 model's prefill into an NVFP4 cache goes through the flash kernel on the GPU and
  gives the logits of the reference path (set explicitly, so the test holds in any env)."""
  from trace_jax.kernels import dispatch
  cfg = M.tiny(num_layers=2, head_dim=64, dtype="bfloat16")
  params = M.init_params(cfg, jax.random.key(0))
  policy = tq.make_policy("kv4", "nvfp4")
  ctx = M.QuantContext(policy, "rollout")
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 50)), jnp.int32)
  mask = jnp.asarray(np.arange(50)[None] >= np.array([[9], [0]]))
  outs, texts = [], []
  for use in (True, False):
    monkeypatch.setattr(dispatch, "_PREFILL_KERNEL", use)
    jax.clear_caches()  # the flag is read at trace time: no cached trace of the other choice
    fn = jax.jit(M.apply, static_argnums=(2, 3))
    args = (params, tokens, cfg, ctx)
    kw = dict(token_mask=mask, cache=M.init_cache(cfg, 2, 64, policy.kv))
    texts.append(fn.lower(*args, **kw).as_text())
    outs.append(np.asarray(fn(*args, **kw).logits, np.float64))
  assert "triton" in texts[0] and "triton" not in texts[1]
  m = np.asarray(mask)
  assert np.max(np.abs(outs[0][m] - outs[1][m])) < 0.05 * np.max(np.abs(outs[1][m]))


# ------------------------------------------------------------------ Mosaic NVFP4 decode kernel

@functools.partial(jax.jit, static_argnames=("splits", "stages", "overlap", "lazy_tau",
                                             "merge", "out_dtype", "schedule", "emulate",
                                             "v_halves"))
def _mosaic(q, k, v, valid, splits=None, stages=None, overlap=False, lazy_tau=8.0, merge=True,
            out_dtype=None, schedule=None, emulate=False, v_halves=None):
  from trace_jax.kernels import attention_mgpu
  return attention_mgpu.decode_attention(
      q, k, v, valid, splits=splits, stages=stages, overlap=overlap, lazy_tau=lazy_tau,
      merge=merge, out_dtype=out_dtype, schedule=schedule, v_halves=v_halves,
      kernel_fn=attention_mgpu.emulate_stream_kernel if emulate else None)


MOSAIC_TOL = 3e-2  # K unrounded in the kernel, bf16 in the reference: see attention_mgpu


@pytest.mark.parametrize("s", [8, 24, 1000, 8192])
def test_mosaic_kernel_vs_reference(s):
  """The Mosaic GPU NVFP4 kernel (4 KV heads x 128, 8 query heads each: Qwen3-30B-A3B) against
  the reference, ragged rows as in test_kernel_vs_reference (lengths down to 1; cache lengths
  are multiples of 8, the kernel's requirement)."""
  b, kvh, g, hd = 4, 4, 8, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), s + 7), make_kv("nvfp4", (b, s, kvh, hd), s + 8)
  q = jax.random.normal(jax.random.key(s + 9), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = np.ones((b, s), bool)
  valid[1, : s // 3] = False
  valid[2, max(1, s // 2):] = False
  valid[3, 1:] = False
  valid = jnp.asarray(valid)
  got = _mosaic(q, k, v, valid)
  want = _attn(q, k, v, valid, False)
  assert relerr(got, want) < MOSAIC_TOL


@pytest.mark.parametrize("splits,stages,overlap,g,lazy", [
    (1, 2, False, 5, 8.0), (3, 1, False, 5, 8.0), (64, 2, False, 5, 8.0), (1, 2, True, 5, 8.0),
    (3, 1, True, 5, 8.0), (3, 2, False, 12, 8.0), (1, 1, True, 16, 8.0), (3, 2, False, 5, None),
    (1, 3, False, 5, 8.0), (3, 3, True, 16, 8.0), (64, 3, False, 8, None)])
def test_mosaic_kernel_splits_and_stages(splits, stages, overlap, g, lazy):
  """Launch variants; g query heads per KV head: 5 padded to the kernel's N of 8, 12 and 16 on
  its N of 16; lazy: the running max's slack (None: exact every tile)."""
  b, s, kvh, hd = 3, 1000, 4, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 1), make_kv("nvfp4", (b, s, kvh, hd), 2)
  q = jax.random.normal(jax.random.key(3), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray([1000, 17, 1])
  got = _mosaic(q, k, v, lengths, splits=splits, stages=stages, overlap=overlap, lazy_tau=lazy)
  want = jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)
  assert relerr(got, want) < MOSAIC_TOL


@pytest.mark.parametrize("g", [5, 8, 16])
def test_mosaic_in_kernel_merge_equals_xla_combine(g):
  """The split combine in the kernel (the last live split of a row merges the others' partials
  through L2, counted in with an atomic) against the XLA combine of the same partials, float32
  outputs: rows with 1 to 16 live splits of 16 and none, query lanes padded (g 5) or not; two
  calls in one program (each call's counters start at zero)."""
  b, s, kvh, hd = 5, 1024, 4, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 11), make_kv("nvfp4", (b, s, kvh, hd), 12)
  q = jax.random.normal(jax.random.key(13), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray([1024, 65, 64, 1, 0])
  f32 = jnp.float32

  @jax.jit
  def twice(q, k, v, lengths):
    a = _mosaic(q, k, v, lengths, splits=16, merge=True, out_dtype=f32)
    return a, _mosaic(q * 2, k, v, lengths, splits=16, merge=True, out_dtype=f32)

  got = twice(q, k, v, lengths)
  for x, qq in zip(got, (q, q * 2)):
    want = _mosaic(qq, k, v, lengths, splits=16, merge=False, out_dtype=f32)
    np.testing.assert_allclose(np.asarray(x), np.asarray(want), rtol=2e-5, atol=2e-6)
  assert not np.asarray(got[0][4]).any()  # no visible slot: zeros
  ref = jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)  # (its row 4: uniform)
  assert relerr(_mosaic(q, k, v, lengths, splits=16)[:4], ref[:4]) < MOSAIC_TOL  # bf16 output


@pytest.mark.parametrize("b,s,stages,g,lazy", [
    (4, 8, 2, 8, 8.0), (5, 1000, 2, 8, 8.0), (1, 8192, 2, 8, 8.0), (3, 8192, 3, 5, None),
    (200, 1024, 2, 16, 8.0), (140, 136, 1, 8, 8.0)])
def test_mosaic_stream_schedule(b, s, stages, g, lazy):
  """The stream schedule (one CTA per SM, each a run of (row, tile) units that crosses rows,
  parts merged in the kernel) against the reference and against its jnp model, which follows
  the same tables: ragged rows (lengths 1 to S, not multiples of the tile, hidden prefixes), a
  row spread over every CTA (B 1 x 8k), more rows than CTAs (B 200, 140), the query-lane
  paddings; float32 output, two calls in one program (the merge counters start at zero in
  each), then bf16 output; a row without visible slots gives zeros."""
  rng = np.random.default_rng(b * s + g)
  k, v = make_kv("nvfp4", (b, s, 4, 128), b + 1), make_kv("nvfp4", (b, s, 4, 128), b + 2)
  q = jax.random.normal(jax.random.key(b), (b, 4 * g, 128), jnp.float32).astype(jnp.bfloat16)
  lengths = rng.integers(1, s + 1, b)
  lengths[0], lengths[-1] = s, 1
  valid = np.arange(s)[None, :] < lengths[:, None]
  valid[1::3] &= np.arange(s)[None, :] >= (lengths[1::3] // 4)[:, None]  # hidden prefixes
  if b > 2:
    valid[b // 2] = False  # no visible slot
  valid = jnp.asarray(valid)
  f32 = jnp.float32
  kw = dict(schedule="stream", stages=stages, lazy_tau=lazy)

  @jax.jit
  def twice(q, k, v, valid):
    return (_mosaic(q, k, v, valid, out_dtype=f32, **kw),
            _mosaic(q * 2, k, v, valid, out_dtype=f32, **kw))

  ref = jax.jit(kernels.decode_attention_ref)
  seen = valid.any(axis=1)
  for got, qq in zip(twice(q, k, v, valid), (q, q * 2)):
    assert relerr(got[seen], ref(qq, k, v, valid)[seen]) < MOSAIC_TOL
    assert relerr(got, _mosaic(qq, k, v, valid, out_dtype=f32, emulate=True, **kw)) < 1e-2
    assert not np.asarray(got[~seen]).any()
  got = _mosaic(q, k, v, valid, **kw)
  assert got.dtype == jnp.bfloat16 and relerr(got[seen], ref(q, k, v, valid)[seen]) < MOSAIC_TOL


@pytest.mark.parametrize("b,s", [(1, 8192), (200, 1024)])
def test_mosaic_stream_counters_given(b, s):
  """The merges' counters as an input (`PhysicalQuery.counts`, what the q/k/v kernel zeroes in
  the model) give the kernel's own counters' output bit for bit, and the kernel leaves them
  zero: the same counters serve three calls in a row (two in one program, one after it), each
  the same output; a count left behind would keep a row's last part from merging. A row spread
  over every CTA (B 1 x 8k) and more rows than CTAs (B 200), ragged."""
  from trace_jax.kernels import attention_mgpu as AM
  rng = np.random.default_rng(b + s)
  k, v = make_kv("nvfp4", (b, s, 4, 128), b + 5), make_kv("nvfp4", (b, s, 4, 128), b + 6)
  q = jax.random.normal(jax.random.key(b + 7), (b, 32, 128), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray(np.r_[s, rng.integers(1, s + 1, b - 1)])  # row 0 whole
  run = jax.jit(functools.partial(AM.decode_attention, schedule="stream",
                                  out_dtype=jnp.float32))
  own = np.asarray(run(AM.PhysicalQuery(AM.to_physical(q)), k, v, lengths))
  counts = jnp.zeros((b * 4,), jnp.int32)
  pq = AM.PhysicalQuery(AM.to_physical(q), counts)

  @jax.jit
  def twice(pq, k, v, lengths):
    return run(pq, k, v, lengths), run(pq, k, v, lengths)

  outs = [*twice(pq, k, v, lengths), run(pq, k, v, lengths)]
  for got in outs:
    np.testing.assert_array_equal(np.asarray(got), own)
  np.testing.assert_array_equal(np.asarray(counts), np.zeros(b * 4, np.int32))
  assert relerr(own, jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)) < MOSAIC_TOL


@pytest.mark.parametrize("schedule,stages,g", [
    ("stream", 4, 8), ("stream", 3, 16), ("stream", 4, 5), ("splits", 4, 8), ("splits", 2, 16)])
def test_mosaic_v_halves(schedule, stages, g):
  """V through SMEM one head_dim half at a time (TRACE_JAX_ATTN_V_SMEM=halves; room for a 4th
  stage) gives the whole-V kernel's output bit for bit (each PV accumulator takes the same
  operands), float32 out, ragged rows, and the reference's within MOSAIC_TOL."""
  b, s = 7, 1000
  k, v = make_kv("nvfp4", (b, s, 4, 128), 21), make_kv("nvfp4", (b, s, 4, 128), 22)
  q = jax.random.normal(jax.random.key(23), (b, 4 * g, 128), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray([1000, 999, 513, 64, 65, 17, 1])
  kw = dict(schedule=schedule, out_dtype=jnp.float32)
  got = _mosaic(q, k, v, lengths, stages=stages, v_halves=True, **kw)
  whole = _mosaic(q, k, v, lengths, stages=min(stages, 3), v_halves=False, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(whole))
  assert relerr(got, jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)) < MOSAIC_TOL


@pytest.mark.parametrize("schedule,g", [("stream", 8), ("stream", 16), ("splits", 8)])
def test_mosaic_prefetch_v(schedule, g):
  """V's code words and scales loaded with K's (TRACE_JAX_ATTN_PREFETCH_V=on) give the default
  load order's output bit for bit (the same registers, decoded later), V in halves, ragged
  rows, float32 out."""
  from trace_jax.kernels import attention_mgpu as AM
  b, s = 7, 1000
  k, v = make_kv("nvfp4", (b, s, 4, 128), 24), make_kv("nvfp4", (b, s, 4, 128), 25)
  q = jax.random.normal(jax.random.key(26), (b, 4 * g, 128), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray([1000, 999, 513, 64, 65, 17, 1])
  outs = [np.asarray(AM.decode_attention(q, k, v, lengths, schedule=schedule, stages=4,
                                         v_halves=True, prefetch_v=on, out_dtype=jnp.float32))
          for on in (False, True)]
  np.testing.assert_array_equal(outs[1], outs[0])
  assert relerr(outs[1], jax.jit(kernels.decode_attention_ref)(q, k, v, lengths)) < MOSAIC_TOL


@pytest.mark.parametrize("s", [1000, 8192])
def test_kv_words_caches_equal_nibble_caches(s):
  """Caches of bit-placed code words ("kv_words", the GPU default where the Mosaic kernel reads
  the cache) give the compiled kernels the same outputs as the same caches nibble-packed: the
  Mosaic kernel bit for bit (its `WEIGHT_DECODE_ASM` decode gives `DECODE_ASM`'s registers;
  both schedules); the Pallas decode and prefill kernels, whose in-kernel un-placing lets
  Triton schedule the tile differently, to a bf16 rounding of the output (session 27, H200:
  1-2 of 16,384 elements one bf16 step apart)."""
  b, kvh, g, hd = 4, 4, 8, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), s + 3), make_kv("nvfp4", (b, s, kvh, hd), s + 4)
  kw, vw = (jax.jit(tq.with_packing, static_argnums=1)(x, "kv_words") for x in (k, v))
  assert kw.packing == "kv_words"
  q = jax.random.normal(jax.random.key(s), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = np.ones((b, s), bool)
  valid[1, : s // 3] = False
  valid[3, 1:] = False
  valid = jnp.asarray(valid)
  from trace_jax.kernels import attention_pallas
  seen = {}
  for name, run in (("stream", functools.partial(_mosaic, schedule="stream")),
                    ("splits", functools.partial(_mosaic, schedule="splits")),
                    ("pallas", jax.jit(attention_pallas.decode_attention))):
    a = np.asarray(run(q, kw, vw, valid), np.float64)
    b_ = np.asarray(run(q, k, v, valid), np.float64)
    seen[name] = (int(np.sum(a != b_)), relerr(a, b_))
  print(seen)
  assert seen["stream"][0] == 0 and seen["splits"][0] == 0, seen
  assert seen["pallas"][1] < 1e-2 and seen["pallas"][0] <= 1e-3 * q.size, seen
  t = 64
  qp = jax.random.normal(jax.random.key(s + 1), (b, t, kvh * g, hd),
                         jnp.float32).astype(jnp.bfloat16)
  start = jnp.asarray([0, 5, s - t, 17], jnp.int32)
  a = np.asarray(_prefill(qp, kw, vw, valid, start, True), np.float64)
  b_ = np.asarray(_prefill(qp, k, v, valid, start, True), np.float64)
  assert relerr(a, b_) < 1e-2 and np.sum(a != b_) <= 1e-3 * a.size, (relerr(a, b_),
                                                                      np.sum(a != b_))
