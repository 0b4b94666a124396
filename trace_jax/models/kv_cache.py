"""The KV cache: per-layer K and V in bf16/f32 or block-quantized (FP4/FP8 `QArray`s, blocks along
head_dim, one second-level scale per token and head: row-local), plus which slots hold tokens.

NVFP4 caches read by the Mosaic decode attention kernel (the GPU default) hold their codes as
"kv_words" (`QArray.packing`: each 4-byte word bit-placed for the kernel's decode); the rows
quantized for a write (and the guidance and code records taken from them) keep the nibble
packing, and `write_layer` places them.

Slots are written at an index shared by the batch (the rollout engine: prompts are left-padded)
or at one index per row (`[B]`: the slot decoder, whose rows hold sequences of different lengths),
and `valid` marks real tokens so padding never takes part in attention.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import quant as tq
from trace_jax.kernels.attention_mgpu import SLOT_MULTIPLE
from trace_jax.kernels.attention_ref import read_kv
from trace_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerKV:
  k: jax.Array | tq.QArray  # [B, S, KVH, head_dim]
  v: jax.Array | tq.QArray


jax.tree_util.register_dataclass(LayerKV, data_fields=["k", "v"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class KVCache:
  layers: tuple[LayerKV, ...]
  valid: jax.Array  # [B, S] bool

  @property
  def max_len(self) -> int:
    return int(self.valid.shape[1])

  @property
  def batch(self) -> int:
    return int(self.valid.shape[0])

  @property
  def nbytes(self) -> int:
    return sum(int(x.nbytes) for x in jax.tree_util.tree_leaves(self.layers))


jax.tree_util.register_dataclass(KVCache, data_fields=["layers", "valid"], meta_fields=[])


def _empty(shape, fmt: tq.Format | None, dtype, packing: str = "nibbles"):
  if fmt is None:
    return jnp.zeros(shape, dtype)
  # Quantize one zero row and broadcast its fields: quantizing the whole zero cache inside a jit
  # made XLA constant-fold the quantization of every slot (minutes at 30B-A3B shapes on the
  # H200). Rows are independent ("row" second level), so the fields are the same bits.
  one = tq.quantize(jnp.zeros((1,) * (len(shape) - 1) + shape[-1:], jnp.float32), fmt, axis=-1,
                    second_level="row", validate=False)
  one = tq.with_packing(one, packing)
  grow = lambda a: None if a is None else jnp.broadcast_to(a, shape[:-1] + a.shape[-1:])  # noqa: E731
  return dataclasses.replace(one, codes=grow(one.codes), scales=grow(one.scales),
                             global_scale=grow(one.global_scale), shape=tuple(shape))


def padded_length(n: int) -> int:
  """`n` slots rounded up to the multiple the Mosaic NVFP4 decode kernel (the GPU default)
  takes, `attention_mgpu.SLOT_MULTIPLE` (8): the cache length the rollout allocates. Not to
  whole 64-slot tiles: the kernels handle a partial last tile, and on CPU the reference reads
  every slot (the default job's rollout took 0.097 s per RL step with 64-slot padding against
  0.062 s with this, whole job 1 min 48 s against 1 min 40 s, same venv). The extra slots are
  never valid, so they never take part in attention."""
  return -(-n // SLOT_MULTIPLE) * SLOT_MULTIPLE


def init_cache(config: ModelConfig, batch: int, max_len: int, kv_format: str | tq.Format | None,
               dtype=None, packing: str | None = None) -> KVCache:
  """An empty cache; `kv_format` None keeps K/V in `dtype` (default: the compute dtype);
  `packing` the FP4 codes' (`QArray.packing`; default `kernels.kv_packing`: "kv_words" where
  the Mosaic decode attention kernel reads the cache)."""
  fmt = None if kv_format is None else tq.get_format(kv_format)
  if packing is None:
    packing = kernels.kv_packing(config.num_kv_heads, config.head_dim, kv_format)
  dtype = dtype or config.compute_dtype
  shape = (batch, max_len, config.num_kv_heads, config.head_dim)
  layers = tuple(LayerKV(_empty(shape, fmt, dtype, packing), _empty(shape, fmt, dtype, packing))
                 for _ in range(config.num_layers))
  return KVCache(layers, jnp.zeros((batch, max_len), bool))


def cache_bytes_per_token(config: ModelConfig, kv_format: str | None, dtype=jnp.bfloat16) -> float:
  """Bytes one token occupies in the cache over all layers (K and V)."""
  elems = 2 * config.num_layers * config.num_kv_heads * config.head_dim
  if kv_format is None:
    return elems * jnp.dtype(dtype).itemsize
  fmt = tq.get_format(kv_format)
  g = 4 * 2 * config.num_layers * config.num_kv_heads if fmt.two_level else 0
  return elems * fmt.bits_per_element / 8 + g


def update_slice(buf, new, index, axis: int = 1):
  """Write pytree `new` (leaves `[B, T, ...]`) into `buf` (`[B, S, ...]`) at `index` along
  `axis`. Arrays, QArrays and Guidance trees alike: the two trees differ only in their static
  shapes, so they are matched leaf by leaf. `index` is a scalar shared by the batch or `[B]`,
  one per row (every leaf is batch-first, axis 0)."""
  leaves, treedef = jax.tree_util.tree_flatten(buf)
  if jnp.ndim(index) == 0:
    write = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis)
  else:  # per row: the same write on each row (axis shifts past the mapped batch axis)
    write = jax.vmap(functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis - 1))
  out = [write(b, n.astype(b.dtype), index)
         for b, n in zip(leaves, jax.tree_util.tree_leaves(new))]
  return jax.tree_util.tree_unflatten(treedef, out)


def put_rows(buf, rows, index):
  """`buf` (pytree, leaves `[B, ...]`) with rows `index` (`[k]`) replaced by `rows` (the same
  tree with leaves `[k, ...]`). Out-of-range indices are dropped: padding rows of a fixed-size
  insert point past the end."""
  leaves, treedef = jax.tree_util.tree_flatten(buf)
  out = [b.at[index].set(n if n.dtype == b.dtype else n.astype(b.dtype), mode="drop")
         for b, n in zip(leaves, jax.tree_util.tree_leaves(rows))]
  return jax.tree_util.tree_unflatten(treedef, out)


def _as_cache(buf, new):
  """New rows in the cache's code packing (quantized rows arrive nibble-packed)."""
  if isinstance(buf, tq.QArray) and isinstance(new, tq.QArray):
    return tq.with_packing(new, buf.packing)
  return new


def write_layer(layer: LayerKV, k_new, v_new, index) -> LayerKV:
  return LayerKV(update_slice(layer.k, _as_cache(layer.k, k_new), index),
                 update_slice(layer.v, _as_cache(layer.v, v_new), index))


read = read_kv  # K or V as `dtype` values (the definition lives with the attention reference)
