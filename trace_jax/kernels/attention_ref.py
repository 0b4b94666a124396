"""Attention as the model computes it, in pure `jnp`: the definition of the decode attention
kernel's result (`decode_attention.py`) and the code the model's attention runs.

`attention` is the one formula (GQA grouping, scores in float32 times `scale`, masked slots at a
finite -1e30, float32 softmax, probabilities cast to the compute dtype for the value product).
`decode_attention_ref` is that formula for one query token per sequence over a KV cache whose
K/V are read exactly as the cache defines them (`read_kv`: `dequantize` to the compute dtype);
`prefill_attention_ref` is it for T query tokens per sequence (a prompt, or a chunk of one) that
the cache already holds, under the causal mask of their slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax import quant as tq

NEG = -1e30  # finite "minus infinity": a fully masked row stays finite


def read_kv(buf, dtype) -> jax.Array:
  """Cache K or V (`[B, S, KVH, hd]` array or `QArray`) as `dtype` values."""
  return tq.dequantize(buf, dtype) if isinstance(buf, tq.QArray) else buf.astype(dtype)


def attention(q, keys, values, allowed, scale: float, dtype) -> jax.Array:
  """q `[B, T, H, hd]`, keys/values `[B, S, KVH, hd]` (in `dtype`), allowed `[B, T, S]` ->
  `[B, T, H * hd]` in `dtype`. Query head h uses KV head h // (H / KVH)."""
  b, t, h, hd = q.shape
  kvh = keys.shape[2]
  if h % kvh:
    raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
  qg = q.reshape(b, t, kvh, h // kvh, hd)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(allowed[:, None, None], scores, NEG)
  probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
  return jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(b, t, h * hd)


def allowed_slots(valid, max_len: int | None = None) -> jax.Array:
  """`[B, S]` bool from a mask `[B, S]` or from lengths `[B]` (slots `0 .. length - 1`)."""
  valid = jnp.asarray(valid)
  if valid.ndim == 2:
    return valid.astype(bool)
  if valid.ndim == 1 and max_len is not None:
    return jnp.arange(max_len)[None, :] < valid[:, None]
  raise ValueError(f"valid must be a [batch, slots] mask or [batch] lengths, got shape "
                   f"{valid.shape}")


def check_decode_args(q, k, v, valid) -> tuple[int, int, int, int, int]:
  """Shapes (B, H, hd, S, KVH) of a decode attention call, with clear errors."""
  if q.ndim != 3:
    raise ValueError(f"q must be [batch, heads, head_dim], got shape {tuple(q.shape)}")
  b, h, hd = q.shape
  ks, vs = tuple(k.shape), tuple(v.shape)
  if len(ks) != 4 or ks != vs:
    raise ValueError(f"k and v must both be [batch, slots, kv_heads, head_dim], got {ks} and {vs}")
  if ks[0] != b or ks[3] != hd:
    raise ValueError(f"k/v shape {ks} does not match q shape {tuple(q.shape)} (batch, head_dim)")
  if h % ks[2]:
    raise ValueError(f"{h} query heads are not a multiple of {ks[2]} KV heads")
  for name, x in (("k", k), ("v", v)):
    if isinstance(x, tq.QArray) and x.axis != 3:
      raise ValueError(f"{name} must have its blocks along head_dim (axis 3), got axis {x.axis}")
  vshape = tuple(jnp.shape(valid))
  if vshape not in ((b, ks[1]), (b,)):
    raise ValueError(f"valid must be [batch, slots] = {(b, ks[1])} or lengths [{b}], got {vshape}")
  return b, h, hd, ks[1], ks[2]


def decode_attention_ref(q, k, v, valid, scale: float | None = None,
                         out_dtype=None) -> jax.Array:
  """Attention of one query token per sequence over a KV cache.

  q `[B, H, hd]`; k, v `[B, S, KVH, hd]` arrays or `QArray`s (blocks along head_dim); valid
  `[B, S]` bool (slots the token may attend to) or lengths `[B]`; scale default `hd ** -0.5`.
  K/V are read in `out_dtype` (default q's dtype), as the model reads its cache. Returns
  `[B, H, hd]` in `out_dtype`. A row with no allowed slot averages all of V (the model's
  behaviour); the kernel returns 0 there instead — callers always have one valid slot.
  """
  b, h, hd, s, _ = check_decode_args(q, k, v, valid)
  dtype = out_dtype or q.dtype
  scale = hd ** -0.5 if scale is None else scale
  allowed = allowed_slots(valid, s)
  out = attention(q[:, None].astype(dtype), read_kv(k, dtype), read_kv(v, dtype),
                  allowed[:, None], scale, dtype)
  return out.reshape(b, h, hd)


def prefill_allowed(key_mask, q_start, t: int) -> jax.Array:
  """`[B, T, S]`: query i of row b sits in slot `q_start (+ [b]) + i` and may see the slots at or
  before it that `key_mask [B, S]` marks."""
  q_slot = jnp.reshape(jnp.asarray(q_start), (-1, 1)) + jnp.arange(t)  # [1 or B, T]
  k_slot = jnp.arange(key_mask.shape[1])
  return (k_slot <= q_slot[:, :, None]) & key_mask[:, None, :]


def prefill_attention_ref(q, k, v, key_mask, q_start, scale: float | None = None,
                          out_dtype=None) -> jax.Array:
  """Attention of T query tokens per sequence over a KV cache that already holds them.

  q `[B, T, H, hd]`; k, v `[B, S, KVH, hd]` arrays or `QArray`s; key_mask `[B, S]` bool (slots
  holding tokens); q_start: int or `[B]` ints, the slot of query 0 (`prefill_allowed`). K/V read
  in `out_dtype` (default q's dtype) as `read_kv` defines. Returns `[B, T, H * hd]`."""
  if q.ndim != 4:
    raise ValueError(f"q must be [batch, tokens, heads, head_dim], got shape {tuple(q.shape)}")
  b, t, h, hd = q.shape
  check_decode_args(q[:, 0], k, v, key_mask)
  if jnp.ndim(key_mask) != 2:
    raise ValueError(f"key_mask must be [batch, slots], got shape {jnp.shape(key_mask)}")
  dtype = out_dtype or q.dtype
  scale = hd ** -0.5 if scale is None else scale
  return attention(q.astype(dtype), read_kv(k, dtype), read_kv(v, dtype),
                   prefill_allowed(key_mask, q_start, t), scale, dtype)
