"""The empty KV cache: the same bits as quantizing a zero cache, built without quantizing it."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import models as M
from trace_jax import quant as tq


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_empty_cache_equals_quantized_zeros(fmt):
  cfg = M.tiny()
  cache = M.init_cache(cfg, 3, 8, fmt)
  shape = (3, 8, cfg.num_kv_heads, cfg.head_dim)
  want = tq.quantize(jnp.zeros(shape, jnp.float32), fmt, axis=-1, second_level="row")
  for got in (cache.layers[0].k, cache.layers[-1].v):
    assert got.shape == want.shape and got.fmt == want.fmt and got.axis == want.axis
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
      assert a.shape == b.shape and a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a).view(np.uint8) if a.dtype.itemsize == 1
                                    else np.asarray(a), np.asarray(b).view(np.uint8)
                                    if b.dtype.itemsize == 1 else np.asarray(b))
  np.testing.assert_array_equal(np.asarray(tq.dequantize(cache.layers[0].k)), 0)


def test_empty_cache_program_only_broadcasts_full_size():
  """Inside a jit the full-size cache fields are broadcasts (regression: quantizing a zero cache
  of 30B-A3B size made XLA constant-fold for minutes)."""
  cfg = M.tiny()
  b, s = 5, 48
  text = jax.jit(lambda: M.init_cache(cfg, b, s, "nvfp4")).lower().as_text()
  full = re.compile(rf"tensor<{b}x{s}x")
  ops = {m.group(1) for line in text.splitlines()
         if line.strip().startswith("%") and full.search(line.split("->")[-1])
         for m in [re.search(r"= \"?([a-z_.]+)", line)] if m}
  assert ops and ops <= {"stablehlo.broadcast_in_dim"}, ops


def test_kv_words_cache_decodes_as_a_nibble_cache():
  """A model (kv4: NVFP4 K/V) prefilling and decoding into a cache of bit-placed code words
  ("kv_words", the GPU default where the Mosaic kernel reads the cache) gives the same logits,
  records and cache values, bit for bit, as into a nibble-packed one; the cache stays placed
  and its codes are the nibble cache's, placed."""
  cfg = M.tiny(num_layers=1)
  params = M.init_params(cfg, jax.random.key(0))
  policy = tq.make_policy("kv4", "nvfp4", guided_layers=1.0)
  ctx = M.QuantContext(policy, "rollout")
  apply = jax.jit(M.apply, static_argnums=(2, 3))
  tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, cfg.vocab_size)
  outs = {}
  for packing in ("nibbles", "kv_words"):
    cache = M.init_cache(cfg, 2, 8, "nvfp4", packing=packing)
    pre = apply(params, tokens[:, :5], cfg, ctx, cache=cache, cache_index=0)
    steps = [pre]
    for s in (5, 6):
      steps.append(apply(params, tokens[:, s:s + 1], cfg, ctx, cache=steps[-1].cache,
                         cache_index=s))
    outs[packing] = steps
  for a, b in zip(outs["nibbles"], outs["kv_words"]):
    assert b.cache.layers[0].k.packing == "kv_words"
    for x, y in zip(jax.tree_util.tree_leaves((a.logits, a.records)),
                    jax.tree_util.tree_leaves((b.logits, b.records))):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    for x, y in ((a.cache.layers[0].k, b.cache.layers[0].k),
                 (a.cache.layers[0].v, b.cache.layers[0].v)):
      np.testing.assert_array_equal(np.asarray(tq.with_packing(x, "kv_words").codes),
                                    np.asarray(y.codes))
      np.testing.assert_array_equal(np.asarray(x.global_scale), np.asarray(y.global_scale))
