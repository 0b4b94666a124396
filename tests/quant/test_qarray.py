"""`QArray` code packings: "kv_words" (the decode attention kernel's bit-placed words) holds the
same values as the nibble packing; conversions, errors, and the guidance taken from either."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import quant as tq
from trace_jax.quant import e2m1


def _q(fmt="nvfp4", axis=-1, shape=(3, 5, 64)):
  x = jax.random.normal(jax.random.key(0), shape, jnp.float32)
  kw = dict(second_level="row") if fmt == "nvfp4" else {}
  return jax.jit(lambda x: tq.quantize(x, fmt, axis=axis, **kw))(x)


def _packed(q, packing):
  return jax.jit(tq.with_packing, static_argnums=1)(q, packing)


@pytest.mark.parametrize("fmt,axis", [("nvfp4", -1), ("mxfp4", 1)])
def test_kv_words_hold_the_same_values(fmt, axis):
  q = _q(fmt, axis, (3, 64, 5) if axis == 1 else (3, 5, 64))
  w = _packed(q, "kv_words")
  assert w.packing == "kv_words" and w.shape == q.shape and w.codes.shape == q.codes.shape
  assert not np.array_equal(np.asarray(w.codes), np.asarray(q.codes))  # the bytes did move
  deq, codes = jax.jit(tq.dequantize), jax.jit(lambda a: a.unpacked_codes())
  np.testing.assert_array_equal(np.asarray(deq(w)), np.asarray(deq(q)))
  np.testing.assert_array_equal(np.asarray(codes(w)), np.asarray(codes(q)))
  # along the block axis each 4 bytes are one placed word
  c = np.moveaxis(np.asarray(q.codes), axis, -1)
  want = e2m1.place_kv_words(jnp.asarray(c))
  np.testing.assert_array_equal(np.moveaxis(np.asarray(w.codes), axis, -1), np.asarray(want))
  back = _packed(w, "nibbles")
  assert back.packing == "nibbles"
  np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(q.codes))
  assert tq.with_packing(q, "nibbles") is q


def test_packing_errors_name_the_problem():
  with pytest.raises(ValueError, match="unknown FP4 code packing 'words'"):
    tq.with_packing(_q(), "words")
  with pytest.raises(ValueError, match="FP4 codes, not mxfp8"):
    tq.with_packing(_q("mxfp8"), "kv_words")


def test_full_guidance_payload_is_nibble_packed():
  """A rollout's full-code guidance is the nibble packing whatever the QArray's packing (the
  trainer reads it as nibbles)."""
  q = _q()
  for packing in ("nibbles", "kv_words"):
    g = jax.jit(tq.make_guidance, static_argnums=1)(_packed(q, packing), False)
    np.testing.assert_array_equal(np.asarray(g.payload), np.asarray(q.codes))
