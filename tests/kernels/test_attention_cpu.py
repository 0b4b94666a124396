"""CPU tests of decode attention: the reference against numpy over independently dequantized
K/V and against the model's own attention, the in-kernel scale decode against `dequantize`, the
split-K combine against a plain softmax, and the Pallas kernel itself in interpret mode against
the reference (ragged masks, lengths 1 and non-multiples of the tile, several splits).
`test_lowers_for_cuda` lowers the GPU kernel where `jax-cuda13-plugin` is installed;
tests/kernels/test_attention_gpu.py runs it on a GPU."""

import dataclasses
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import attention_pallas as AP
from trace_jax.kernels import attention_ref as R

FORMATS = [None, "mxfp8", "nvfp4", "mxfp4"]
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


def np_dequant(x) -> np.ndarray:
  """Independent numpy decode of a K/V QArray `[B, S, KVH, hd]` (blocks along hd), float64."""
  if not isinstance(x, tq.QArray):
    return np.asarray(x, np.float64)
  codes = np.asarray(x.codes)
  if x.fmt.is_fp4:
    c = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
    q = E2M1[c]
  else:
    q = codes.astype(np.float64)  # float8_e4m3fn -> exact
  if x.fmt.scale == "e8m0":
    b = np.asarray(x.scales).view(np.uint8).astype(np.float64)
    s = np.where(b == 255, np.nan, 2.0 ** (b - 127))
  else:  # d = s * g rounded to float32, as NUMERICS defines the NVFP4 block scale
    s = np.asarray(x.scales).astype(np.float32) * np.asarray(x.global_scale, np.float32)
    s = s.astype(np.float64)
  return (q * np.repeat(s, x.fmt.block, axis=-1))[..., :x.shape[-1]]


def np_attention(q, k, v, allowed, scale):
  """float64 softmax attention, GQA: q `[B, H, hd]`, k/v `[B, S, KVH, hd]`."""
  b, h, hd = q.shape
  kvh = k.shape[2]
  qg = q.reshape(b, kvh, h // kvh, hd)
  s = np.einsum("bkgd,bskd->bkgs", qg, k) * scale
  s = np.where(allowed[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bkgs,bskd->bkgd", p, v).reshape(b, h, hd)


def make_kv(fmt, shape, seed):
  """Random K/V with a spread of per-token magnitudes, in `fmt` (None: bf16 arrays)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.normal(size=shape[:-1] + (1,)))
  x = jnp.asarray(x, jnp.float32)
  if fmt is None:
    return x.astype(jnp.bfloat16)
  return tq.quantize(x, fmt, second_level="row")


def ragged_valid(b, s):
  """Left padding, a hole, a single valid slot (the last row: only slot 0)."""
  v = np.ones((b, s), bool)
  v[0, : s // 3] = False
  if b > 1:
    v[1, s // 2: s // 2 + 2] = False
    v[-1, 1:] = False
  return jnp.asarray(v)


def relerr(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert np.all(np.isfinite(a)), "non-finite output"
  return np.max(np.abs(a - b)) / np.max(np.abs(b))


# ------------------------------------------------------------------ reference

@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_vs_numpy(fmt):
  b, s, kvh, g, hd = 3, 23, 2, 3, 64
  k, v = make_kv(fmt, (b, s, kvh, hd), 0), make_kv(fmt, (b, s, kvh, hd), 1)
  q = jax.random.normal(jax.random.key(2), (b, kvh * g, hd), jnp.float32)
  valid = ragged_valid(b, s)
  ref = jax.jit(R.decode_attention_ref, static_argnames="scale")
  got = ref(q, k, v, valid, scale=0.3)
  want = np_attention(np.asarray(q, np.float64), np_dequant(k), np_dequant(v),
                      np.asarray(valid), 0.3)
  assert relerr(got, want) < 1e-5
  lengths = jnp.asarray([s, 7, 1])  # lengths: slots 0 .. n-1
  got = ref(q, k, v, lengths, scale=0.3)
  want = np_attention(np.asarray(q, np.float64), np_dequant(k), np_dequant(v),
                      np.arange(s)[None] < np.asarray(lengths)[:, None], 0.3)
  assert relerr(got, want) < 1e-5


def test_reference_is_the_models_decode_attention():
  """One decode token through the model's decode path (decode_attention, on CPU the reference)
  equals the same token through the model's general attention (a 2-token step whose second
  token is padding), bit for bit, for an FP4 (NVFP4) cache on the tiny preset (bf16 caches:
  tests/models/test_transformer.py::test_decode_with_cache_equals_full_forward)."""
  cfg = M.tiny(num_layers=1, dtype="bfloat16")
  params = M.init_params(cfg, jax.random.key(0))
  apply = jax.jit(M.apply, static_argnums=(2, 3))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
  mask = jnp.asarray(np.arange(7)[None] >= np.array([[2], [0]]))  # row 0 left-padded
  for policy in (tq.make_policy("kv4", "nvfp4"),):
    ctx = M.QuantContext(policy, "rollout")
    cache = M.init_cache(cfg, 2, 16, policy.kv)
    out = apply(params, tokens[:, :6], cfg, ctx, token_mask=mask[:, :6], cache=cache)
    pos = M.default_positions(tokens, mask)[:, 6:]
    one = apply(params, tokens[:, 6:], cfg, ctx, positions=pos, cache=out.cache, cache_index=6)
    two = apply(params, jnp.pad(tokens[:, 6:], ((0, 0), (0, 1))), cfg, ctx,
                  positions=jnp.pad(pos, ((0, 0), (0, 1))),
                  token_mask=jnp.asarray([[True, False]] * 2), cache=out.cache, cache_index=6)
    np.testing.assert_array_equal(np.asarray(one.logits[:, 0]), np.asarray(two.logits[:, 0]))


# ------------------------------------------------------------------ kernel pieces

@pytest.mark.parametrize("fmt", FORMATS[1:])
def test_in_kernel_scale_decode_equals_dequantize(fmt):
  """The kernel's tile decode (scale bytes, E2M1/E4M3 codes, NVFP4 s * g) gives exactly the
  bf16 values `dequantize(...).astype(bf16)` gives, including a NaN block scale."""
  x = make_kv(None, (1, 40, 1, 64), 3).astype(jnp.float32) * 1e3
  x = x.at[0, 5, 0, 7].set(jnp.nan)
  q = tq.quantize(x, fmt, second_level="row", validate=False)

  @jax.jit
  def decode(q):
    ops, f = AP._kv_operands(q)
    ops = [o[0, :, 0] for o in ops]  # one head's tile [S, ...]
    parts = AP._decode_tile(ops, f, 2 if f.is_fp4 else 1, jnp.bfloat16)
    return jnp.stack(parts, -1).reshape(40, 64) if f.is_fp4 else parts[0]

  got = decode(q)
  want = jax.jit(tq.dequantize, static_argnums=1)(q, jnp.bfloat16)[0, :, 0]
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
  assert np.isnan(np.asarray(got, np.float32)[5]).any()


def test_combine_splits_equals_softmax():
  rng = np.random.default_rng(4)
  g, n, d, width = 5, 40, 8, 10  # 4 splits of 10 slots
  s = rng.standard_normal((g, n)) * 3
  vals = rng.standard_normal((n, d))
  allowed = np.ones((g, n), bool)
  allowed[1, :] = False  # a row with nothing valid -> 0
  allowed[2, 10:20] = False  # an empty split for one row
  o, m, l = [], [], []
  for j in range(0, n, width):
    sj = np.where(allowed[:, j:j + width], s[:, j:j + width], -np.inf)
    mj = np.where(np.isfinite(sj.max(1)), sj.max(1), R.NEG)
    pj = np.where(allowed[:, j:j + width], np.exp(sj - mj[:, None]), 0.0)
    o.append(pj @ vals[j:j + width])
    m.append(mj)
    l.append(pj.sum(1))
  got = np.asarray(AP.combine_splits(jnp.asarray(np.stack(o)), jnp.asarray(np.stack(m))[..., None],
                                     jnp.asarray(np.stack(l))[..., None], axis=0))
  sm = np.where(allowed, s, -1e300)
  p = np.where(allowed, np.exp(sm - sm.max(1, keepdims=True)), 0.0)
  want = (p / np.maximum(p.sum(1, keepdims=True), 1e-300)) @ vals  # row 1: 0
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the kernel (interpret mode)

@functools.lru_cache(maxsize=None)
def _interpreted(cfg, fn=AP.decode_attention):
  """fn (a Pallas attention kernel) in interpret mode with launch config `cfg`, jitted once."""
  return jax.jit(functools.partial(fn, interpret=True, out_dtype=jnp.float32, config=dict(cfg)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernel_interpret_matches_reference(fmt):
  """S = 37 (not a multiple of the 16-slot tile), 3 splits of 16 + 16 + 5 slots, GQA 3 query
  heads per KV head (padded to 16 rows), ragged rows (left padding, a hole, one valid slot);
  for NVFP4 also one tile per split (no split-K). All match the reference to bf16 rounding
  (the kernel rounds probabilities to bf16 against its running max)."""
  b, s, kvh, g, hd = 3, 37, 2, 3, 64
  k, v = make_kv(fmt, (b, s, kvh, hd), 5), make_kv(fmt, (b, s, kvh, hd), 6)
  q = jax.random.normal(jax.random.key(7), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = ragged_valid(b, s)
  want = jax.jit(R.decode_attention_ref)(q, k, v, valid)
  split = _interpreted((("block_k", 16), ("splits", 3)))(q, k, v, valid)
  assert relerr(split, want) < 1e-2
  if fmt == "nvfp4":
    whole = _interpreted((("block_k", 64), ("splits", 1)))(q, k, v, valid)
    assert relerr(whole, want) < 1e-2 and relerr(split, whole) < 1e-2


# ------------------------------------------------------------------ prefill (flash) kernel

def np_prefill_allowed(key_mask, q_start, t):
  """Slot s is visible to query i of row b iff key_mask[b, s] and s <= q_start[b] + i (loops)."""
  b, s = key_mask.shape
  out = np.zeros((b, t, s), bool)
  for r in range(b):
    for i in range(t):
      for j in range(s):
        out[r, i, j] = key_mask[r, j] and j <= q_start[r] + i
  return out


def _prefill_case(fmt, seed=20):
  """B=3 rows, T=11 query tokens at slots q_start + i of an S=29 cache, GQA 3 heads per KV head:
  row 0 left-padded (its first queries see nothing), row 1 with a hole, row 2 starting at 10
  (a later chunk of a prompt)."""
  b, t, s, kvh, g, hd = 3, 11, 29, 2, 3, 64
  k, v = make_kv(fmt, (b, s, kvh, hd), seed), make_kv(fmt, (b, s, kvh, hd), seed + 1)
  q = jax.random.normal(jax.random.key(seed + 2), (b, t, kvh * g, hd),
                        jnp.float32).astype(jnp.bfloat16)
  key_mask = np.ones((b, s), bool)
  key_mask[0, :4] = False
  key_mask[1, 5:7] = False
  q_start = np.array([0, 3, 10])
  return q, k, v, jnp.asarray(key_mask), q_start


def test_prefill_reference_vs_numpy():
  q, k, v, key_mask, q_start = _prefill_case("nvfp4")
  got = jax.jit(R.prefill_attention_ref, static_argnames="scale")(
      q, k, v, key_mask, jnp.asarray(q_start), scale=0.3)
  allowed = np_prefill_allowed(np.asarray(key_mask), q_start, q.shape[1])
  qn, kn, vn = np.asarray(q, np.float64), np_dequant(k), np_dequant(v)
  for i in range(q.shape[1]):  # token i of every row is one decode-shaped attention
    seen = allowed[:, i].any(1)
    with np.errstate(invalid="ignore"):  # rows that see nothing: NaN, not compared
      want = np_attention(qn[:, i], kn, vn, allowed[:, i], 0.3).reshape(q.shape[0], -1)
    assert relerr(np.asarray(got[:, i])[seen], want[seen]) < 1e-2  # bf16 output


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_interpret_matches_reference(fmt):
  """Tiles of 16 query rows (3 blocks of the 33 rows, the last padded) and 16 slots; per-row
  starts (and for NVFP4 one scalar start). Rows that see a slot match the reference to bf16
  rounding; rows that see none give 0 (the reference averages V there)."""
  q, k, v, key_mask, q_start = _prefill_case(fmt)
  kern = _interpreted((("block_q", 16), ("block_k", 16)), AP.prefill_attention)
  starts = [jnp.asarray(q_start)] + ([jnp.int32(2)] if fmt == "nvfp4" else [])
  for start in starts:
    got = np.asarray(kern(q, k, v, key_mask, start))
    want = np.asarray(jax.jit(functools.partial(R.prefill_attention_ref, out_dtype=jnp.float32))(
        q, k, v, key_mask, start))
    seen = np_prefill_allowed(np.asarray(key_mask), np.broadcast_to(np.asarray(start), (3,)),
                              q.shape[1]).any(-1)  # [B, T]
    assert not seen.all() and seen.any()
    assert relerr(got[seen], want[seen]) < 1e-2
    np.testing.assert_array_equal(got[~seen], 0.0)


def test_prefill_is_the_models_cache_attention():
  """The model's prefill into a cache goes through `prefill_attention` (on CPU its reference): a
  left-padded prompt prefilled in one call and in two chunks (the second starting at slot 7)
  gives the same logits, and they equal a forward without a cache."""
  cfg = M.tiny(num_layers=1, dtype="float32")
  params = M.init_params(cfg, jax.random.key(3))
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size)
  mask = jnp.ones((2, 12), bool).at[0, :3].set(False)
  pos = M.default_positions(tokens, mask)
  apply = jax.jit(M.apply, static_argnums=(2,))
  whole = apply(params, tokens, cfg, positions=pos, token_mask=mask,
                cache=M.init_cache(cfg, 2, 16, None), cache_index=0)
  first = apply(params, tokens[:, :7], cfg, positions=pos[:, :7], token_mask=mask[:, :7],
                cache=M.init_cache(cfg, 2, 16, None), cache_index=0)
  second = apply(params, tokens[:, 7:], cfg, positions=pos[:, 7:], token_mask=mask[:, 7:],
                 cache=first.cache, cache_index=7)
  np.testing.assert_allclose(second.logits, whole.logits[:, 7:], rtol=1e-4, atol=1e-4)
  plain = apply(params, tokens, cfg, positions=pos, token_mask=mask)
  np.testing.assert_allclose(whole.logits[1], plain.logits[1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ dispatch, errors, lowering

def test_dispatch_cpu_uses_the_reference():
  k, v = make_kv("mxfp4", (2, 9, 2, 32), 11), make_kv("mxfp4", (2, 9, 2, 32), 12)
  q = jax.random.normal(jax.random.key(13), (2, 4, 32), jnp.float32).astype(jnp.bfloat16)
  valid = ragged_valid(2, 9)
  assert not kernels.on_gpu()
  np.testing.assert_array_equal(np.asarray(jax.jit(kernels.decode_attention)(q, k, v, valid)),
                                np.asarray(jax.jit(R.decode_attention_ref)(q, k, v, valid)))


def test_dispatch_on_gpu_sends_short_caches_to_pallas(monkeypatch):
  """On the GPU (faked), an NVFP4 cache the Mosaic kernel takes goes to it only above
  `SHORT_CACHE_SLOTS` batch x slots, to the Pallas kernel at or below; "mosaic" always takes it.
  (The kernels are replaced by markers: this checks the choice, the GPU tests the kernels.)"""
  from trace_jax.kernels import attention_mgpu, dispatch  # noqa: PLC0415
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "_ATTENTION_KERNEL", True)
  monkeypatch.setattr(dispatch, "_ATTENTION_MOSAIC", True)
  monkeypatch.setattr(attention_mgpu, "decode_attention", lambda *a, **kw: "mosaic")
  monkeypatch.setattr(dispatch, "_pallas_decode", lambda *a, **kw: "pallas")
  k = make_kv("nvfp4", (2, 16, 4, 128), 21)
  q = jnp.zeros((2, 32, 128), jnp.bfloat16)
  valid = jnp.ones((2, 16), bool)
  assert attention_mgpu.kernel_supported(q, k, k) is None
  for limit, want in ((32, "pallas"), (31, "mosaic"), (0, "mosaic")):  # 2 x 16 slots
    monkeypatch.setattr(dispatch, "SHORT_CACHE_SLOTS", limit)
    assert kernels.decode_attention(q, k, k, valid) == want, limit
    assert kernels.decode_attention(q, k, k, valid, use_kernel=True) == want, limit
    assert kernels.decode_attention(q, k, k, valid, use_kernel="mosaic") == "mosaic"
  # operands the Mosaic kernel does not take (2 KV heads) go to Pallas whatever the length
  k2 = make_kv("nvfp4", (2, 16, 2, 128), 22)
  assert kernels.decode_attention(jnp.zeros((2, 8, 128), jnp.bfloat16), k2, k2, valid) == "pallas"


def test_kv_packing_places_the_words_the_mosaic_kernel_reads(monkeypatch):
  """New caches hold "kv_words" exactly where the Mosaic kernel will read them: on the GPU
  (faked), NVFP4, 4 KV heads x 128, the Mosaic kernel on and TRACE_JAX_KV_WORDS not
  "nibbles"; nibble packing everywhere else (CPU: always)."""
  from trace_jax import models as M  # noqa: PLC0415
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  assert kernels.kv_packing(4, 128, "nvfp4") == "nibbles"  # CPU
  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
  monkeypatch.setattr(dispatch, "kernels_on", lambda: True)
  monkeypatch.setattr(dispatch, "_ATTENTION_MOSAIC", True)
  assert kernels.kv_packing(4, 128, "nvfp4") == "kv_words"
  for args in ((2, 128, "nvfp4"), (4, 64, "nvfp4"), (4, 128, "mxfp4"), (4, 128, None)):
    assert kernels.kv_packing(*args) == "nibbles", args
  cfg = M.tiny(num_layers=1, num_kv_heads=4, head_dim=128)
  assert M.init_cache(cfg, 2, 8, "nvfp4").layers[0].k.packing == "kv_words"
  monkeypatch.setattr(dispatch, "_KV_WORDS", "nibbles")
  assert kernels.kv_packing(4, 128, "nvfp4") == "nibbles"
  monkeypatch.setattr(dispatch, "_KV_WORDS", "placed")
  monkeypatch.setattr(dispatch, "_ATTENTION_MOSAIC", False)
  assert kernels.kv_packing(4, 128, "nvfp4") == "nibbles"


def test_bad_inputs_are_named():
  k = make_kv(None, (2, 9, 2, 32), 0)
  q = jnp.zeros((2, 4, 32), jnp.bfloat16)
  with pytest.raises(ValueError, match="q must be"):
    R.decode_attention_ref(q[0], k, k, jnp.ones((2, 9), bool))
  with pytest.raises(ValueError, match="not a multiple"):
    R.decode_attention_ref(jnp.zeros((2, 3, 32), jnp.bfloat16), k, k, jnp.ones((2, 9), bool))
  with pytest.raises(ValueError, match="valid must be"):
    R.decode_attention_ref(q, k, k, jnp.ones((2, 8), bool))
  with pytest.raises(ValueError, match="head_dim 16"):
    AP.decode_attention(jnp.zeros((2, 4, 16), jnp.bfloat16), k[..., :16], k[..., :16],
                        jnp.ones((2, 9), bool))
  with pytest.raises(ValueError, match="float32"):
    AP.decode_attention(q.astype(jnp.float32), k, k, jnp.ones((2, 9), bool))


def test_lowers_for_cuda():
  """The kernels' GPU lowering (Pallas -> Triton IR: shapes, masks, dots; the Mosaic NVFP4
  kernel: layouts, SMEM) runs on CPU with the plugin, decode and prefill, for every KV format at
  a Qwen3-30B-A3B head shape and a cache length of 1000."""
  pytest.importorskip("jax_cuda13_plugin")
  sds = jax.ShapeDtypeStruct
  b, s, kvh, h, hd = 2, 1000, 4, 32, 128
  # Triton lowering asks the device for its compute capability: name an abstract H200
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h200)):
    _lower_all(sds, b, s, kvh, h, hd)


def _lower_all(sds, b, s, kvh, h, hd):
  for fmt in FORMATS:
    kv = sds((b, s, kvh, hd), jnp.bfloat16) if fmt is None else jax.eval_shape(
        lambda x, f=fmt: tq.quantize(x, f, second_level="row", validate=False),
        sds((b, s, kvh, hd), jnp.float32))
    lowered = jax.jit(AP.decode_attention).trace(
        sds((b, h, hd), jnp.bfloat16), kv, kv, sds((b, s), jnp.bool_)).lower(
            lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    lowered = jax.jit(AP.prefill_attention).trace(  # a 300-token prompt chunk
        sds((b, 300, h, hd), jnp.bfloat16), kv, kv, sds((b, s), jnp.bool_),
        sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()
    if fmt == "nvfp4":  # bit-placed code words: the Pallas kernels' un-placing
      placed = jax.eval_shape(lambda x: tq.with_packing(x, "kv_words"), kv)
      for fn, args in ((AP.decode_attention, (sds((b, h, hd), jnp.bfloat16), placed, placed,
                                              sds((b, s), jnp.bool_))),
                       (AP.prefill_attention, (sds((b, 300, h, hd), jnp.bfloat16), placed,
                                               placed, sds((b, s), jnp.bool_),
                                               sds((b,), jnp.int32)))):
        assert "triton" in jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    if fmt == "nvfp4":  # the Mosaic kernels (layouts, inline PTX): split schedule (V decode
      # overlapped; both N sides, G 8 here, then 16; merges) and stream schedule
      from trace_jax.kernels import attention_mgpu as AM
      for overlap, heads, lazy, merge, schedule in (
          (False, h, 8.0, True, "splits"), (True, h, 8.0, True, None),
          (False, 16 * kvh, 8.0, True, "splits"), (False, h, None, True, "splits"),
          (False, h, 8.0, False, None), (False, h, 8.0, True, "stream"),
          (False, 16 * kvh, None, True, "stream")):
        lowered = jax.jit(functools.partial(AM.decode_attention, overlap=overlap,
                                            lazy_tau=lazy, merge=merge,
                                            schedule=schedule)).trace(
            sds((b, heads, hd), jnp.bfloat16), kv, kv, sds((b, s), jnp.bool_)).lower(
                lowering_platforms=("cuda",))
        assert "mosaic" in lowered.as_text()
      for heads, schedule, prefetch in ((h, "stream", False), (16 * kvh, "splits", False),
                                        (h, "stream", True)):  # V in halves, 4 stages
        lowered = jax.jit(functools.partial(AM.decode_attention, schedule=schedule, stages=4,
                                            v_halves=True, prefetch_v=prefetch)).trace(
            sds((b, heads, hd), jnp.bfloat16), kv, kv, sds((b, s), jnp.bool_)).lower(
                lowering_platforms=("cuda",))
        assert "mosaic" in lowered.as_text()


# ------------------------------------------------------------------ Mosaic NVFP4 kernel (CPU parts)

def _emulate_mosaic_decode(codes_u8, scales_u8, h, placed=False):
  """Numpy re-enactment of attention_mgpu's PTX (_SCALE_ASM, DECODE_ASM; placed: the
  "kv_words" cache's WEIGHT_DECODE_ASM) for one 64-token tile: codes [64, 4*64] and scale
  bytes [64, 4*8] of the cache rows, warpgroup (= KV head) h. Returns the two bf16 fragments
  as float32 [2, 64 rows, 64 physical columns]."""
  import ml_dtypes
  from tests.kernels.test_kernels_cpu import _decode_weight_word, _decode_word, _prmt
  decode_word = _decode_weight_word if placed else _decode_word
  words = codes_u8.reshape(64, 64, 4).view(np.uint32)[..., 0].astype(np.uint32)  # [64, 64]
  swords = scales_u8.reshape(64, 8, 4).view(np.uint32)[..., 0].astype(np.uint32)  # [64, 8]
  out = np.zeros((2, 64, 64), np.float32)
  for t in range(128):
    w, lane = t // 32, t % 32
    g8, c = lane // 4, lane % 4
    for ri in range(2):
      r = 16 * w + 8 * ri + g8
      w0, w1 = swords[r, 2 * h], swords[r, 2 * h + 1]  # the shuffle from lane (quad, h)
      pk = _prmt(np.array([w0], np.uint32), np.array([w1], np.uint32), c | ((4 + c) << 4))
      mults = []
      for byte in (pk & 0xFF, (pk >> np.uint32(8)) & 0xFF):
        val = byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32) * 2.0 ** 118
        bits = val.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)
        mults.append(bits | (bits << np.uint32(16)))
      for j in range(2):
        for wi in range(2):
          x = np.array([words[r, 16 * h + 8 * j + 2 * c + wi]], np.uint32)
          for o, val in enumerate(decode_word(x, mults[j])):
            for v in range(2):
              hb = ((val >> np.uint32(16 * v)) & np.uint32(0xFFFF)).astype(np.uint16)
              out[j, r, 8 * (4 * wi + o) + 2 * c + v] = hb.view(ml_dtypes.bfloat16).astype(
                  np.float32)[0]
  return out


@pytest.mark.parametrize("placed", [False, True], ids=["nibbles", "kv_words"])
def test_mosaic_decode_ptx_places_code_times_scale(placed):
  """The Mosaic kernel's decode (PTX re-enacted in numpy) puts, at each fragment position,
  the cache element that `PHYS_TO_LOGICAL` names, as `code * s * 2**-8` exactly; NaN scales
  give NaN. Every warpgroup (KV head) of a 64-token tile of an NVFP4 cache, its codes
  nibble-packed (`DECODE_ASM`) or bit-placed ("kv_words", `WEIGHT_DECODE_ASM`)."""
  from trace_jax.kernels import attention_mgpu as AM
  k = make_kv("nvfp4", (1, 64, 4, 128), 31)
  sb = np.asarray(k.scales).view(np.uint8).copy()
  sb[0, 5, 2, 3] = 0x7F  # a NaN block scale (head 2, block 3 of token 5)
  k = dataclasses.replace(k, scales=jnp.asarray(sb).view(jnp.float8_e4m3fn))
  codes = np.asarray(tq.with_packing(k, "kv_words" if placed else "nibbles").codes)
  codes = codes.reshape(64, 256)
  want = np_dequant(dataclasses.replace(k, global_scale=jnp.ones_like(k.global_scale)))[0]
  for h in range(4):
    got = _emulate_mosaic_decode(codes, sb.reshape(64, 32), h, placed)
    for j in range(2):
      exp = want[:, h, 64 * j + AM.PHYS_TO_LOGICAL[:64]] * 2.0 ** -8  # [64 rows, 64 phys]
      np.testing.assert_array_equal(got[j], exp.astype(np.float32))
  assert np.isnan(want[5, 2, 48:64]).all()


def test_mosaic_wrapper_emulated_matches_reference():
  """attention_mgpu.decode_attention around the kernel's jnp model: q permutation, row
  factors (the cache's own row scales times the kernel's factors), splits (S = 152: 3 tiles of
  64, the last partial; splits past a row's last needed tile unwritten, so masked), the
  combine (the in-kernel merge's formula, and XLA's) and un-permutation, against the reference
  on ragged rows (left padding, one valid slot); what the kernel refuses is named."""
  from trace_jax.kernels import attention_mgpu as AM
  b, s, kvh, g, hd = 2, 152, 4, 8, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 41), make_kv("nvfp4", (b, s, kvh, hd), 42)
  q = jax.random.normal(jax.random.key(43), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = np.ones((b, s), bool)
  valid[0, :70] = False  # tile 0 all hidden (the kernel's softmax starts from junk, then wipes it)
  valid[1, 1:] = False
  valid = jnp.asarray(valid)
  want = jax.jit(R.decode_attention_ref)(q, k, v, valid)
  for splits, lazy, merge in ((1, 8.0, True), (3, 8.0, True), (3, None, True), (3, 8.0, False)):
    # 3: row 1's later splits are dead (NaN in the model); lazy: the running max's slack (None:
    # exact every tile); merge: the split combine in the kernel or XLA's after it
    got = jax.jit(functools.partial(AM.decode_attention, splits=splits, out_dtype=jnp.float32,
                                    lazy_tau=lazy, merge=merge,
                                    kernel_fn=AM.emulate_kernel))(q, k, v, valid)
    assert relerr(got, want) < 1e-2
  # the stream schedule: tables, parts in slots (unwritten ones NaN in the model), the combine
  got = jax.jit(functools.partial(AM.decode_attention, schedule="stream", out_dtype=jnp.float32,
                                  kernel_fn=AM.emulate_stream_kernel))(q, k, v, valid)
  assert relerr(got, want) < 1e-2
  with pytest.raises(ValueError, match="stream schedule merges"):
    AM.decode_attention(q, k, v, valid, schedule="stream", merge=False)
  assert AM.kernel_supported(q, k, v) is None
  assert "format" in AM.kernel_supported(q, make_kv("mxfp4", (b, s, kvh, hd), 1), v)
  odd = make_kv("nvfp4", (b, 150, kvh, hd), 1)
  assert "multiple of 8" in AM.kernel_supported(q, odd, odd)
  with pytest.raises(ValueError, match="pipeline stages"):
    AM.decode_attention(q, k, v, valid, stages=5)
  # XLA's merge stages the partials through SMEM: 3 stages do not fit beside them at gp 16
  assert (AM.max_stages(16, merge=False), AM.max_stages(16, merge=True)) == (2, 3)
  # V through SMEM in halves frees 32 KB: a 4th stage with the in-kernel merge
  assert (AM.max_stages(8, True, v_halves=True), AM.max_stages(16, False, v_halves=True)) == (4, 2)
  q16 = jnp.zeros((b, 16 * kvh, hd), jnp.bfloat16)
  with pytest.raises(ValueError, match="1 to 2 fit"):
    AM.decode_attention(q16, k, v, valid, stages=3, merge=False)


def test_kv_words_caches_read_as_nibble_caches():
  """Caches of bit-placed code words ("kv_words") give every attention path the same result,
  bit for bit, as the same caches nibble-packed: the Pallas decode and prefill kernels
  (interpret mode: their in-kernel un-placing), the Mosaic kernel's jnp models (both
  schedules) and the references (through `dequantize`). Mixed packings are refused."""
  from trace_jax.kernels import attention_mgpu as AM
  words = lambda *xs: [tq.with_packing(x, "kv_words") for x in xs]  # noqa: E731
  b, s, kvh, g, hd = 3, 37, 2, 3, 64
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 5), make_kv("nvfp4", (b, s, kvh, hd), 6)
  q = jax.random.normal(jax.random.key(7), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = ragged_valid(b, s)
  for fn in (_interpreted((("block_k", 16), ("splits", 3))), jax.jit(R.decode_attention_ref)):
    np.testing.assert_array_equal(np.asarray(fn(q, *words(k, v), valid)),
                                  np.asarray(fn(q, k, v, valid)))
  q, k, v, key_mask, q_start = _prefill_case("nvfp4")
  kern = _interpreted((("block_q", 16), ("block_k", 16)), AP.prefill_attention)
  start = jnp.asarray(q_start)
  np.testing.assert_array_equal(np.asarray(kern(q, *words(k, v), key_mask, start)),
                                np.asarray(kern(q, k, v, key_mask, start)))
  b, s, kvh, g, hd = 2, 152, 4, 8, 128
  k, v = make_kv("nvfp4", (b, s, kvh, hd), 41), make_kv("nvfp4", (b, s, kvh, hd), 42)
  q = jax.random.normal(jax.random.key(43), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
  valid = jnp.asarray(np.arange(s)[None] < np.array([[150], [9]]))
  for kw in (dict(splits=3, kernel_fn=AM.emulate_kernel),
             dict(schedule="stream", kernel_fn=AM.emulate_stream_kernel)):
    fn = jax.jit(functools.partial(AM.decode_attention, out_dtype=jnp.float32, **kw))
    np.testing.assert_array_equal(np.asarray(fn(q, *words(k, v), valid)),
                                  np.asarray(fn(q, k, v, valid)))
  assert "packed as nibbles, V as kv_words" in AM.kernel_supported(q, k, *words(v))
  assert "code packing" in AP.kernel_supported(q, k, *words(v))


def test_stream_tables_cover_every_tile_once():
  """`stream_tables` against a plain enumeration: rows' needed tiles (a row without visible
  slots one empty unit) laid end to end and cut into runs of ceil(units / CTAs); each unit's
  row, tile and flags; each row's first CTA and part count; part slots (row + CTA) unique.
  Random ragged rows, fewer units than CTAs, one row over many CTAs; the large shapes take the
  tables' other arithmetic (binary search, cumsum)."""
  from trace_jax.kernels import attention_mgpu as AM
  rng = np.random.default_rng(5)
  cases = [(rng.integers(0, 9, 7), 8, 3), (np.array([3, 1, 0]), 3, 132),
           (np.array([128]), 128, 132), (rng.integers(1, 17, 300), 16, 132),
           (rng.integers(0, 300, 200), 512, 132), (rng.integers(0, 2, 5000), 1, 132)]
  tables = jax.jit(AM.stream_tables, static_argnums=(1, 2))
  for kt, s_tiles, n_ctas in cases:
    table, rows = (np.asarray(a) for a in tables(jnp.asarray(kt, jnp.int32), s_tiles, n_ctas))
    units = [(r, t, t == max(k, 1) - 1, k == 0) for r, k in enumerate(kt) for t in range(max(k, 1))]
    q = -(-len(units) // n_ctas)
    seen, parts = [], {}
    for c in range(n_ctas):
      n = table[c, 0]
      assert n == len(units[c * q:(c + 1) * q])
      for e in table[c, 1:1 + n]:
        r, t = e >> 13, (e >> 2) & 2047
        seen.append((r, t, bool(e & 2), bool(e & 1)))
        parts.setdefault(r, []).append(c)
    assert seen == units
    slots = set()
    for r, cs in parts.items():
      cs = sorted(set(cs))
      assert cs == list(range(cs[0], cs[-1] + 1))  # consecutive CTAs
      assert (rows[r] >> 8, rows[r] & 255) == (cs[0], len(cs))
      slots |= {r + c for c in cs}
    assert len(slots) == sum(len(set(cs)) for cs in parts.values())


def test_mosaic_ptx_assembles(tmp_path):
  """The Mosaic kernels' inline PTX (scale multipliers, the cache's nibble decode, the matmul
  weights' decode) assembles for sm_90a (ptxas, where the CUDA toolkit is installed), wrapped in
  a kernel that uses every output."""
  import re
  import shutil
  import subprocess
  from trace_jax.kernels import attention_mgpu as AM
  from trace_jax.kernels import fp4_mgpu
  ptxas = shutil.which("ptxas")
  if ptxas is None:
    pytest.skip("ptxas not installed")
  sub = lambda asm, regs: re.sub(r"\$(\d+)", lambda m: regs[int(m.group(1))], asm)  # noqa: E731
  ptx = "\n".join([
      ".version 8.5", ".target sm_90a", ".address_size 64",
      ".visible .entry k(.param .u64 out) {", ".reg .b32 %r<16>;", ".reg .b64 %rd<4>;",
      "ld.param.u64 %rd0, [out];", "cvta.to.global.u64 %rd1, %rd0;",
      "ld.global.u32 %r2, [%rd1];", "ld.global.u32 %r3, [%rd1+4];", "ld.global.u32 %r8, [%rd1+8];",
      sub(AM._SCALE_ASM, ["%r0", "%r1", "%r2", "%r3"]),
      sub(AM.DECODE_ASM, ["%r4", "%r5", "%r6", "%r7", "%r8", "%r0"]),
      sub(fp4_mgpu.WEIGHT_DECODE_ASM, ["%r10", "%r11", "%r12", "%r13", "%r8", "%r1"]),
      "add.u32 %r9, %r4, %r5;", "add.u32 %r9, %r9, %r6;", "add.u32 %r9, %r9, %r7;",
      "add.u32 %r9, %r9, %r10;", "add.u32 %r9, %r9, %r11;", "add.u32 %r9, %r9, %r12;",
      "add.u32 %r9, %r9, %r13;", "add.u32 %r9, %r9, %r1;", "st.global.u32 [%rd1], %r9;",
      "ret;", "}"])
  (tmp_path / "k.ptx").write_text(ptx)
  r = subprocess.run([ptxas, "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o",
                      str(tmp_path / "k.cubin")], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr


def test_layers_share_one_kernel(monkeypatch):
  """Every layer's attention call lowers to the same kernel function (`dispatch._lowered_once`):
  XLA then compiles one Triton kernel, not one per layer (unwrapped, the BF16 program's compile
  on the H200 grew 3.3 s per layer). Two calls of a two-layer-like program, lowered for CUDA,
  hold one Triton custom call; without the wrapper they held two."""
  pytest.importorskip("jax_cuda13_plugin")
  from jax._src.pallas.triton import gpu_info, pallas_call_registration  # noqa: PLC0415
  h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: h200)
  sds = jax.ShapeDtypeStruct
  b, s, kvh, h, hd = 2, 1000, 4, 32, 128

  def two_layers(q, k1, v1, k2, v2, valid, start):
    o = kernels.decode_attention(q, k1, v1, valid, use_kernel=True)
    o = kernels.decode_attention(o.astype(q.dtype), k2, v2, valid, use_kernel=True)
    p = kernels.prefill_attention(q[:, None], k1, v1, valid, start, use_kernel=True)
    return o, kernels.prefill_attention(p.reshape(q[:, None].shape), k2, v2, valid, start,
                                        use_kernel=True)

  kv = sds((b, s, kvh, hd), jnp.bfloat16)
  text = jax.jit(two_layers).trace(
      sds((b, h, hd), jnp.bfloat16), kv, kv, kv, kv, sds((b, s), jnp.bool_),
      sds((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("call @__gpu$xla.gpu.triton") == 2  # one decode, one prefill kernel


def test_head_dim_permutation_as_transpositions():
  """q's physical head_dim order (`to_physical`, a transposition XLA can fuse) is indexing by
  `PHYS_TO_LOGICAL`, and the output's way back (`_to_logical`) inverts it."""
  from trace_jax.kernels import attention_mgpu as AM
  x = np.random.default_rng(0).standard_normal((2, 4, 3, 128)).astype(np.float32)
  phys = np.asarray(AM.to_physical(jnp.asarray(x)))
  np.testing.assert_array_equal(phys, x[..., AM.PHYS_TO_LOGICAL])
  # _to_logical takes the kernel's [B, 4, 2, 64 physical, g] layout
  kernel_out = jnp.asarray(phys).reshape(2, 4, 3, 2, 64).transpose(0, 1, 3, 4, 2)
  np.testing.assert_array_equal(np.asarray(AM._to_logical(kernel_out)), x.reshape(2, 12, 128))
