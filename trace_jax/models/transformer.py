"""The MoE transformer (Qwen3-MoE family), pure-functional Flax linen, read top to bottom.

One code path serves three forwards (see `sites.QuantContext`): BF16, QAT (fake-quant or TRACE
guided fake-quant, optional routing replay) and the quantized rollout forward (packed FP4
weights, FP4 activations and KV cache, recording guidance and expert choices). The same call
runs a whole sequence (training / prefill) or a decode step against a `KVCache`.

Parameter paths (what `QuantPolicy` regexes match): `embed/embedding`,
`layers_{i}/{input_norm,post_attn_norm}/scale`, `layers_{i}/attn/{q,k,v,o}_proj/kernel`,
`layers_{i}/attn/{q,k}_norm/scale`, `layers_{i}/moe/router/kernel`,
`layers_{i}/moe/experts/{gate_up_proj,down_proj}` (`[E, D, 2F]`, `[E, F, D]`),
`layers_{i}/moe/shared/{gate_proj,up_proj,down_proj}/kernel`,
`layers_{i}/mlp/{gate_proj,up_proj,down_proj}/kernel`, `final_norm/scale`, `lm_head/kernel`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import kernels
from trace_jax import quant as tq
from trace_jax.models import kv_cache as kvc
from trace_jax.models.config import ModelConfig
from trace_jax.models.sites import (QuantContext, activation_site, apply_weight, codes_key,
                                    record_quantized, records_guidance,
                                    wants_guidance_bits)

_INIT = nn.initializers.normal(stddev=0.02)


def _param(module: nn.Module, name: str, init, shape):
  """A float32 parameter, or whatever the caller put there (a `QArray` at rollout): flax's own
  `param` would refuse a leaf whose shape is not the initializer's. `name` may be "dict/key"
  for a parameter held in a bare dict without a submodule (`embed/embedding`,
  `router/kernel`, the names HF-style paths and policies expect)."""
  top, _, key = name.partition("/")
  if module.has_variable("params", top):
    value = module.get_variable("params", top)
    return value[key] if key else value
  if not key:
    return module.param(name, init, shape, jnp.float32)
  return module.param(top, lambda rng: {key: init(rng, shape, jnp.float32)})[key]


def _path(module: nn.Module, name: str) -> str:
  return "/".join(module.scope.path + (name,))


# --------------------------------------------------------------------------- basic layers

class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    return rms_norm(x, _param(self, "scale", nn.initializers.ones, (x.shape[-1],)), self.eps)


class AddRMSNorm(nn.Module):
  """The residual add `x + h` and the RMS norm of the sum (`rms_norm`, the scale named as
  `RMSNorm`'s): in one kernel where `decode` says the call is a decode step's (no derivative is
  taken there) and the kernel takes them: `kernels.add_rms_norm`, or for an MoE's output left
  in its kernel's rows (`RoutedRows`) `kernels.combine_add_rms_norm`, its weighted sum too;
  h may be `kernels.KParts` (the o projection's K parts), added in `KParts.value`'s order.
  pad_rows (the attention's input norm): that kernel may return the norm as
  `kernels.PaddedRows` (opt-in, `kernels.norm_rows_padded`)."""
  eps: float

  @nn.compact
  def __call__(self, x, h, decode: bool = False, pad_rows: bool = False):
    scale = _param(self, "scale", nn.initializers.ones, (x.shape[-1],))
    both = None
    if decode and isinstance(h, RoutedRows):
      both = kernels.combine_add_rms_norm(x, h.rows, h.inverse, h.weights, scale, self.eps,
                                          pad_rows=pad_rows)
    elif decode:
      both = kernels.add_rms_norm(x, h, scale, self.eps)
    if both is not None:
      return both
    if isinstance(h, RoutedRows):
      h = h.value()
    if isinstance(h, kernels.KParts):
      h = h.value(x.dtype)
    x = x + h
    return x, rms_norm(x, scale, self.eps)


def rms_norm(x, scale, eps: float, rnd=None):
  """RMS norm over the last axis in float32, rounded to x's dtype, then times the scale (in x's
  dtype), rounded again: both roundings by `round_to`. Also traced inside the decode step's
  kernels (`kernels/qkv_append.py`, `add_norm.py`, `moe_combine.py`), which pass casts as
  rnd."""
  rnd = rnd or functools.partial(round_to, dtype=x.dtype)
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return rnd(scale.astype(x.dtype).astype(jnp.float32) * rnd(xf)).astype(x.dtype)


class Linear(nn.Module):
  """`x @ kernel (+ bias)`; kernel `[in, out]`, quantized per the context's policy. Operands in
  `dtype`; the result in `out_dtype` (default `dtype`), accumulated in float32 either way.
  keep_parts: the result may come as `kernels.KParts` (float32 K parts, unadded) where the
  product's kernel splits K, for an `AddRMSNorm` that adds them (the o projection)."""

  features: int
  ctx: QuantContext
  dtype: Any
  use_bias: bool = False
  out_dtype: Any = None
  keep_parts: bool = False

  @nn.compact
  def __call__(self, x):
    w = _param(self, "kernel", _INIT, (x.shape[-1], self.features))
    w = apply_weight(w, _path(self, "kernel"), self.ctx, self.dtype)
    out_dtype = self.out_dtype or self.dtype
    y = kernels.matmul(x.astype(self.dtype), w, out_dtype=out_dtype,
                       keep_parts=self.keep_parts and not self.use_bias)
    if self.use_bias:
      y = y + _param(self, "bias", nn.initializers.zeros, (self.features,)).astype(out_dtype)
    return y


def rope_inv_freq(hd: int, theta: float) -> jax.Array:
  """The rotary embedding's float32 frequencies `[hd / 2]`."""
  return 1.0 / (theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))


def rope(x, positions, theta: float):
  """Rotary embedding, rotate-half layout; x `[B, T, heads, hd]`, positions `[B, T]`."""
  hd = x.shape[-1]
  freqs = positions.astype(jnp.float32)[..., None] * rope_inv_freq(hd, theta)  # [B, T, hd/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  cos = jnp.cos(emb)[:, :, None, :].astype(x.dtype)
  sin = jnp.sin(emb)[:, :, None, :].astype(x.dtype)
  x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x * cos + rotated * sin


def rotate_halves(x1, x2, cos, sin):
  """`rope`'s rule on a row's halves (x1 the first hd / 2 elements; cos, sin `[hd / 2]` in x's
  dtype), for a kernel body that holds the halves apart: the output's halves, the same bits
  as `rope`'s (each a rounded product plus a rounded product; tested). `rope` keeps its
  concatenated form, which XLA:GPU fuses into fewer kernels."""
  return x1 * cos + (-x2) * sin, x2 * cos + x1 * sin


# --------------------------------------------------------------------------- attention

class Attention(nn.Module):
  config: ModelConfig
  ctx: QuantContext
  guided: bool

  @nn.compact
  def __call__(self, x, positions, key_mask, cache, cache_index, guidance, records):
    """x: the normalized stream `[B, T, D]`, or a decode step's as `kernels.PaddedRows`, which
    only the fused q/k/v product of an unquantized input reads as it is."""
    c, ctx, dt = self.config, self.ctx, self.config.compute_dtype
    padded = None
    if isinstance(x, kernels.PaddedRows):
      padded, x = x, x.value()
    b, t, _ = x.shape
    if ctx.activation_format("attn/in") is not None:
      padded = None
    x = activation_site(x, "attn/in", self.guided, ctx, guidance, records)
    nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    kv_fmt = ctx.activation_format("kv/k")
    fused = self._fused_qkv(nq + 2 * nkv)
    prepared = None
    if fused is not None:  # one call, not three (a decode step's FP4 GEMVs)
      qkv = kernels.matmul(x.astype(dt) if padded is None else padded, fused, out_dtype=dt)
      if t == 1 and cache is not None and kv_fmt is not None:
        prepared = self._decode_qkv(qkv[:, 0], positions[:, 0], cache, cache_index,
                                    wants_guidance_bits(kv_fmt, self.guided, ctx))
      if prepared is None:
        q, k, v = jnp.split(qkv, [nq, nq + nkv], axis=-1)
    else:
      q = Linear(nq, ctx, dt, c.attention_bias, name="q_proj")(x)
      k = Linear(nkv, ctx, dt, c.attention_bias, name="k_proj")(x)
      v = Linear(nkv, ctx, dt, c.attention_bias, name="v_proj")(x)
    if prepared is None:
      q, k, v = self._qk_norm_rope(q, k, v, positions)
    else:  # the kernel's q (norm, rope) is what attention reads; K and V are in the cache
      q = prepared[0]

    # K/V sites: what the cache holds (FP4 per the policy), the same values with or without it.
    if cache is not None and kv_fmt is not None:
      # a decode step's rows: the q/k/v kernel, or the K/V append kernel where it applies
      # (`kernels.decode_qkv`, `kernels.append_kv`)
      fused = (prepared[1:5] if prepared is not None
               else kernels.append_kv(cache.k, cache.v, k, v, cache_index) if t == 1 else None)
      # the kernel's compact guidance bits of the new rows, where it wrote them
      kv_bits = prepared[5] if prepared is not None and prepared[5] else (None, None)
      if fused is not None:
        k_cache, v_cache, kq, vq = fused
        layer = kvc.LayerKV(k_cache, v_cache)
      else:
        # K and V in one quantization (rows are independent under row scales: the same bits
        # as two), so each of its reductions is one kernel for both
        kvq = tq.quantize(jnp.stack([k, v]), kv_fmt, second_level="row", validate=False)
        kq, vq = (tq.map_blocked(kvq, lambda a, i=i: a[i], kvq.shape[1:], axis=kvq.axis - 1)
                  for i in (0, 1))
        layer = kvc.write_layer(cache, kq, vq, cache_index)
      if records_guidance(kv_fmt, self.guided, ctx):
        records["kv/k"] = tq.make_guidance(kq, ctx.policy.guidance_compact, kv_bits[0])
        records["kv/v"] = tq.make_guidance(vq, ctx.policy.guidance_compact, kv_bits[1])
      if ctx.record_codes:
        records[codes_key("kv/k")], records[codes_key("kv/v")] = kq, vq
    else:
      k = activation_site(k, "kv/k", self.guided, ctx, guidance, records)
      v = activation_site(v, "kv/v", self.guided, ctx, guidance, records)
      layer = None if cache is None else kvc.write_layer(cache, k, v, cache_index)

    if layer is not None:
      # Query i of a row sits in slot index + i (index: scalar or one per row).
      q_slot = jnp.reshape(cache_index, (-1, 1)) + jnp.arange(t)  # [1 or B, T]
      k_slot = jnp.arange(key_mask.shape[1])
    else:
      q_slot = k_slot = jnp.arange(t)
      q_slot = q_slot[None]
    allowed = (k_slot <= q_slot[:, :, None]) & key_mask[:, None, :]  # [B, T, S]

    scale = c.head_dim ** -0.5
    if layer is not None and t == 1:  # one decode token: the decode attention kernel on GPU
      o = kernels.decode_attention(q if prepared is not None else q[:, 0], layer.k, layer.v,
                                   allowed[:, 0], scale=scale,
                                   out_dtype=dt).reshape(b, t, c.num_heads * c.head_dim)
    elif layer is not None:  # a prompt (chunk) over the cache: the flash kernel on GPU
      o = kernels.prefill_attention(q, layer.k, layer.v, key_mask, cache_index, scale=scale,
                                    out_dtype=dt)
    else:
      o = kernels.attention(q, k, v, allowed, scale, dt)
    o = activation_site(o, "attn/o_in", self.guided, ctx, guidance, records)
    # (K parts only where `bf16_mgpu.ksplit_launch` splits the product: the block's
    # post-attention `AddRMSNorm` adds them)
    return Linear(c.hidden_size, ctx, dt, c.attention_bias, name="o_proj",
                  keep_parts=True)(o), layer

  def _qk_norm_rope(self, q, k, v, positions):
    """q, k, v `[B, T, heads, hd]` from the projections' outputs: the q/k norms (per the config),
    clipping, rotary embedding."""
    c = self.config
    b, t = q.shape[:2]
    if c.qk_norm == "full":  # OLMoE: over the whole projection
      q = RMSNorm(c.rms_norm_eps, name="q_norm")(q)
      k = RMSNorm(c.rms_norm_eps, name="k_norm")(k)
    if c.clip_qkv is not None:
      q, k, v = (jnp.clip(a, -c.clip_qkv, c.clip_qkv) for a in (q, k, v))
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm == "head":  # Qwen3: per head over head_dim
      q = RMSNorm(c.rms_norm_eps, name="q_norm")(q)
      k = RMSNorm(c.rms_norm_eps, name="k_norm")(k)
    return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

  def _decode_qkv(self, qkv, positions, cache, cache_index, guidance_bits: bool):
    """A decode token's attention inputs by one kernel (`kernels.decode_qkv`: q as the decode
    attention reads it, the caches with K/V written, the new rows and, where guidance_bits
    asks and the kernel writes them, their compact guidance bits), or None where
    `_qk_norm_rope` and the K/V write apply (norms over the whole projection, clipping, and
    wherever the kernel does not)."""
    c = self.config
    if c.clip_qkv is not None or c.qk_norm not in (None, "head"):
      return None
    params = self.variables.get("params", {})
    scales = ([params[n]["scale"] for n in ("q_norm", "k_norm")] if c.qk_norm == "head"
              else [None, None])
    return kernels.decode_qkv(qkv, positions, cache.k, cache.v, cache_index,
                              num_heads=c.num_heads, q_scale=scales[0], k_scale=scales[1],
                              eps=c.rms_norm_eps, theta=c.rope_theta,
                              guidance_bits=guidance_bits)

  def _fused_qkv(self, n: int):
    """The q_proj kernel where the rollout's weight sync put q, k and v side by side in it
    (`kernels.fuse_projections`: FP4 kernel-layout weights, or bf16 ones unless
    TRACE_JAX_BF16_DENSE=xla; k_proj's and v_proj's kernels are None then), else None."""
    if self.is_initializing() or not self.has_variable("params", "q_proj"):
      return None
    w = self.get_variable("params", "q_proj").get("kernel")
    fused = isinstance(w, kernels.PackedWeight) or (
        self.has_variable("params", "k_proj")
        and self.get_variable("params", "k_proj").get("kernel", 0) is None)
    return w if fused and w.shape[-1] == n else None


# --------------------------------------------------------------------------- feed-forward

class SwiGLU(nn.Module):
  """Dense SwiGLU MLP (dense layers and shared experts); `site` prefixes its activation sites."""

  ffn: int
  config: ModelConfig
  ctx: QuantContext
  guided: bool
  site: str

  @nn.compact
  def __call__(self, x, guidance, records):
    c, ctx, dt = self.config, self.ctx, self.config.compute_dtype
    x = activation_site(x, f"{self.site}/in", self.guided, ctx, guidance, records)
    h = (nn.silu(Linear(self.ffn, ctx, dt, name="gate_proj")(x))
         * Linear(self.ffn, ctx, dt, name="up_proj")(x))
    h = activation_site(h, f"{self.site}/down_in", self.guided, ctx, guidance, records)
    return Linear(c.hidden_size, ctx, dt, name="down_proj")(h)


def round_to(x, dtype):
  """Float32 x rounded to dtype's precision, kept in float32 (x itself for float32), by
  `lax.reduce_precision`. XLA:CPU keeps these roundings wherever it fuses the ops; XLA:GPU's
  ops still missed the MoE sum's rule in 9-29% of elements by roundings on the H200 (session
  40), where the decode kernels, which round with casts (`row_quant.rounding`), follow it bit
  for bit."""
  info = jnp.finfo(dtype)
  if info.bits >= 32:
    return x
  return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def combine_experts(slots, dtype, rnd=None):
  """The routed experts' output: for each token, its k expert rows weighted by its gates.
  slots: `(y_j [N, D], w_j [N, 1] float32)` for j = 0..k-1, in slot order. Each gate is cast to
  dtype, each product rounded to dtype, the products summed in float32 one slot after another
  (adds in order, no reduction for a compiler to reorder), the sum rounded ->
  `[N, D]` in dtype. rnd: the rounding (`round_to`; a kernel body casts). A kernel that loads
  slot by slot passes its loads as `slots`."""
  rnd = rnd or functools.partial(round_to, dtype=dtype)
  acc = None
  for y, w in slots:
    p = rnd(y.astype(jnp.float32) * w.astype(dtype).astype(jnp.float32))
    acc = p if acc is None else acc + p
  return rnd(acc).astype(dtype)


def expert_slots(y, weights):
  """`combine_experts`' slots of rows y `[N, k, D]` and gates `[N, k]`."""
  return ((y[:, j], weights[:, j:j + 1]) for j in range(weights.shape[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def combine_rows(y, weights, dtype):
  """`combine_experts` of rows y `[N, k, D]` and gates `[N, k]`, its derivative by broadcasts
  (the roundings passed straight through): the derivative of the slots' slices, k pads and adds,
  made the MoE's backward 1.7x slower on CPU (N 4,096, k 8, D 512: 184 against 108 ms)."""
  return combine_experts(expert_slots(y, weights), dtype)


def _combine_rows_fwd(y, weights, dtype):
  return combine_rows(y, weights, dtype), (y, weights)


def _combine_rows_bwd(dtype, res, g):
  y, weights = res
  g = g.astype(jnp.float32)[:, None, :]
  w = weights.astype(dtype).astype(jnp.float32)[..., None]
  return ((g * w).astype(y.dtype),
          jnp.sum(g * y.astype(jnp.float32), axis=-1).astype(weights.dtype))


combine_rows.defvjp(_combine_rows_fwd, _combine_rows_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoutedRows:
  """A decode step's routed-expert output before its weighted sum, left in the down kernel's
  chunk rows, so that the next residual add and norm take it in one kernel
  (`kernels.combine_add_rms_norm`). Token t's slot j row is `rows.gather()[inverse[t * k +
  j]]`; weights `[N, k]` float32; shape: the output's `[B, T, D]` (static)."""

  rows: kernels.ChunkRows
  inverse: jax.Array
  weights: jax.Array
  shape: tuple = dataclasses.field(metadata=dict(static=True))

  def value(self) -> jax.Array:
    """The output `shape` by XLA's ops (one gather, `combine_experts`)."""
    n, k = self.weights.shape
    y = kernels.ChunkRows(self.rows.rows, self.rows.slot[self.inverse], self.rows.n).gather()
    return combine_rows(y.reshape(n, k, -1), self.weights, self.rows.rows.dtype).reshape(
        self.shape)


class MoE(nn.Module):
  """Top-k softmax router, dropless dispatch by sorting (token, slot) pairs by expert, grouped
  matmuls over the sorted rows; optional routing replay (R3) and shared experts."""

  config: ModelConfig
  ctx: QuantContext
  guided: bool

  @nn.compact
  def __call__(self, x, token_mask, guidance, records, replay_routes, decode: bool = False):
    """decode: a decode step's call, whose routed output may stay in the down kernel's rows
    (`RoutedRows`) for the next norm's kernel, where `kernels.combine_in_kernel` says it will
    take them."""
    c, ctx, dt = self.config, self.ctx, self.config.compute_dtype
    b, t, d = x.shape
    e, k, f = c.num_experts, c.num_experts_per_tok, c.moe_ffn_size
    n = b * t
    xf = x.reshape(n, d)

    # Router in float32 at HIGHEST precision (`float32_dot`): tiny, and routing flips are what R3
    # guards against.
    w_r = _param(self, "router/kernel", _INIT, (d, e))
    logits = kernels.float32_dot(xf, w_r)  # [N, E]
    probs = jax.nn.softmax(logits, axis=-1)
    gates = None
    if replay_routes is None and ctx.mode == "rollout":
      # (on the GPU: softmax, top-k and the renormalized weights in one kernel; opt-in, the
      # router product's split-K parts summed there too, when nothing else reads the logits)
      gates = kernels.router_gates(xf, w_r, k, c.norm_topk_prob)
      if gates is None:
        gates = kernels.topk_gates(logits, k, c.norm_topk_prob)
    if gates is not None:
      weights, idx = gates
    elif replay_routes is None:
      # top_k's values are the gate weights (its derivative gathers the probabilities' at idx,
      # as a take_along_axis would; one gather kernel fewer per layer in a decode step)
      weights, idx = jax.lax.top_k(probs, k)
    else:
      idx = replay_routes.reshape(n, k).astype(jnp.int32)
      # Gate weights are recomputed from this forward's router, so the router learns under
      # replay.
      weights = jnp.take_along_axis(probs, idx, axis=-1)
    if c.norm_topk_prob and gates is None:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)

    # Auxiliaries over real tokens: Switch load balancing (E * sum_e f_e P_e) and router z-loss.
    m = token_mask.reshape(n).astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(m), 1.0)
    frac = jnp.sum(jax.nn.one_hot(idx, e) * m[:, None, None], axis=(0, 1)) / (denom * k)
    mean_prob = jnp.sum(probs * m[:, None], axis=0) / denom
    aux_loss = e * jnp.sum(frac * mean_prob)
    z_loss = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * m) / denom

    w_gu, w_dn = Experts(c, ctx, name="experts")()
    ep_mesh = None
    if c.expert_parallel != "off" and not isinstance(w_gu, kernels.PackedWeight):
      from trace_jax.parallel import expert as ep  # noqa: PLC0415 - parallel is a later layer
      ep_mesh = ep.context_mesh()
    if ep_mesh is not None:
      # Expert input site: quantized once per token (row-local), before dispatch.
      x_in = activation_site(x, "experts/in", self.guided, ctx, guidance, records).reshape(n, d)
      y, dropped = self._expert_parallel(ep, ep_mesh, x_in, idx, w_gu, w_dn, (b, t, k), guidance,
                                         records)
    else:
      # (token, slot) pairs sorted by expert, rows per expert (and the FP4 kernel's chunk
      # tables where one kernel builds them all)
      order, inverse, group_sizes, tables = kernels.route(idx.reshape(-1), e, w_gu)
      x_in = _experts_input_site(x, inverse, k, w_gu, tables, self.guided, ctx, guidance,
                                 records)
      # sorted row i is token order[i] // k; the kernel path folds these gathers into its own
      # (an operand laid out by the site's kernel needs none)
      rows = rows_inverse = None
      if not isinstance(x_in, kernels.OperandRows):
        x_in, rows, rows_inverse = x_in.astype(dt), order // k, inverse
      gu = kernels.grouped_matmul(x_in, w_gu, group_sizes, out_dtype=dt, rows=rows,
                                  rows_inverse=rows_inverse, tables=tables, keep_chunks=True)
      h = _down_input_site(gu, f, w_dn, tables, order, inverse, (b, t, k), self.guided, ctx,
                           guidance, records)
      defer = decode and not c.shared_ffn_size and kernels.combine_in_kernel()
      y = kernels.grouped_matmul(h, w_dn, group_sizes, out_dtype=dt,
                                 out_rows=None if defer else inverse, tables=tables,
                                 keep_chunks=defer)
      if isinstance(y, kernels.ChunkRows):
        return (RoutedRows(y, inverse, weights, (b, t, d)), idx.reshape(b, t, k), aux_loss,
                z_loss, jnp.int32(0))
      y = (y[inverse] if defer else y).reshape(n, k, d)
      dropped = jnp.int32(0)
    out = combine_rows(y, weights, dt)

    if c.shared_ffn_size:
      shared = SwiGLU(c.shared_ffn_size, c, ctx, self.guided, "shared", name="shared")(
          x, guidance, records).reshape(n, d)
      if c.shared_expert_gate:
        gate = kernels.float32_dot(xf, _param(self, "shared_gate", _INIT, (d, 1)))
        shared = shared * jax.nn.sigmoid(gate).astype(dt)
      out = out + shared
    return out.reshape(b, t, d), idx.reshape(b, t, k), aux_loss, z_loss, dropped

  def _expert_parallel(self, ep, mesh, x_in, idx, w_gu, w_dn, canon_lead, guidance, records):
    """Routed experts over the mesh's `expert` axis (`parallel.expert`); the down-projection
    input site runs on the expert's shard, its guidance and records in (token, slot) order."""
    c, ctx = self.config, self.ctx
    n, k = idx.shape
    site = "experts/down_in"
    g = None if guidance is None else guidance.get(site)
    g_rows = None if g is None else tq.reshape_rows(g, (n * k,))

    def site_fn(h, rows_guidance):
      rec: dict = {}
      local = None if rows_guidance is None else {site: rows_guidance}
      return activation_site(h, site, self.guided, ctx, local, rec), rec

    y, rec, dropped = ep.routed_experts(
        x_in, idx, w_gu, w_dn, mesh=mesh, ffn=c.moe_ffn_size, dtype=c.compute_dtype,
        capacity_factor=c.expert_capacity_factor, mode=c.expert_parallel, site_fn=site_fn,
        site_guidance=g_rows)
    for key, r in rec.items():
      records[key] = tq.reshape_rows(r, canon_lead)
    return y, dropped


class Experts(nn.Module):
  """The stacked routed-expert weights `gate_up_proj [E, D, 2F]` and `down_proj [E, F, D]`."""

  config: ModelConfig
  ctx: QuantContext

  @nn.compact
  def __call__(self):
    c, dt = self.config, self.config.compute_dtype
    e, d, f = c.num_experts, c.hidden_size, c.moe_ffn_size
    w_gu = _param(self, "gate_up_proj", _INIT, (e, d, 2 * f))
    w_dn = _param(self, "down_proj", _INIT, (e, f, d))
    return (apply_weight(w_gu, _path(self, "gate_up_proj"), self.ctx, dt),
            apply_weight(w_dn, _path(self, "down_proj"), self.ctx, dt))


def _experts_input_site(x, inverse, k, w_gu, tables, guided, ctx, guidance, records):
  """The routed experts' input site: x `[B, T, D]` quantized once per token (row-local), before
  dispatch, as rows `[B * T, D]`. In the rollout on the GPU one kernel
  quantizes it and lays the value out as the gate/up kernel's operand, each token's row at its
  k pairs' sorted rows (`kernels.quantize_rows_to_operand`, `OperandRows`)."""
  site = "experts/in"
  fmt = ctx.activation_format(site)
  fused = None
  if (guidance is None or guidance.get(site) is None) and ctx.mode == "rollout" and fmt:
    fused = kernels.quantize_rows_to_operand(
        x, fmt, inverse, k, w_gu, tables, guidance_bits=wants_guidance_bits(fmt, guided, ctx))
  if fused is None:
    return activation_site(x, site, guided, ctx, guidance, records).reshape(-1, x.shape[-1])
  q, operand, bits = fused  # bits: the guidance payload, where the kernel wrote it
  record_quantized(q, site, guided, ctx, records, payload=bits)
  return operand


def _down_input_site(gu, f, w_dn, tables, order, inverse, canon_lead, guided, ctx, guidance,
                     records):
  """The expert down-projection input site, h = silu(gate) * up of the gate/up rows gu. Rows
  are computed in expert-sorted order, but guidance and codes are exchanged in the canonical
  `[B, T, k, F]` order (token, slot), which does not depend on how the batch happened to be
  dispatched. In the rollout on the GPU one kernel makes h, its codes and the down kernel's
  operand from gu left in the gate/up kernel's chunks (`kernels.swiglu_quantize_rows`)."""
  site = "experts/down_in"
  g = None if guidance is None else guidance.get(site)
  fmt = ctx.activation_format(site)
  fused = None
  if g is None and ctx.mode == "rollout" and fmt is not None:
    fused = kernels.swiglu_quantize_rows(gu, f, fmt, w_dn, tables)
  local_rec: dict = {}
  if fused is not None:
    q, out = fused
    record_quantized(q, site, guided, ctx, local_rec)
  else:
    if isinstance(gu, kernels.ChunkRows):
      gu = gu.gather()
    h = nn.silu(gu[:, :f]) * gu[:, f:]
    local_guid = None
    if g is not None:
      local_guid = {site: tq.take_rows(tq.reshape_rows(g, (h.shape[0],)), order)}
    out = activation_site(h, site, guided, ctx, local_guid, local_rec)
  for key, rec in local_rec.items():
    records[key] = tq.reshape_rows(tq.take_rows(rec, inverse), canon_lead)
  return out


# --------------------------------------------------------------------------- the model

class Block(nn.Module):
  config: ModelConfig
  ctx: QuantContext
  layer: int

  @nn.compact
  def __call__(self, x, h_prev, positions, token_mask, key_mask, cache, cache_index, guidance,
               routes):
    """x: the residual stream before the previous block's MLP output h_prev (None in the first
    block), which this block adds before its input norm (one kernel in a decode step where it
    applies). Returns the stream and this block's MLP output unadded, likewise."""
    c = self.config
    guided = self.ctx.policy.is_guided_layer(self.layer, c.num_layers)
    decode = cache is not None and x.shape[1] == 1
    records: dict = {}
    if h_prev is None:
      xn = RMSNorm(c.rms_norm_eps, name="input_norm")(x)
    else:
      x, xn = AddRMSNorm(c.rms_norm_eps, name="input_norm")(x, h_prev, decode, pad_rows=True)
    h, new_cache = Attention(c, self.ctx, guided, name="attn")(
        xn, positions, key_mask, cache, cache_index, guidance, records)
    x, hn = AddRMSNorm(c.rms_norm_eps, name="post_attn_norm")(x, h, decode)
    if c.is_moe_layer(self.layer):
      h, chosen, aux, z, dropped = MoE(c, self.ctx, guided, name="moe")(
          hn, token_mask, guidance, records, routes, decode)
    else:
      h = SwiGLU(c.dense_ffn_size, c, self.ctx, guided, "mlp", name="mlp")(hn, guidance, records)
      chosen, aux, z, dropped = None, jnp.float32(0.0), jnp.float32(0.0), jnp.int32(0)
    return x, h, new_cache, chosen, aux, z, records, dropped


@dataclasses.dataclass
class ModelOutput:
  """Everything one forward produces besides the logits."""

  logits: jax.Array  # [B, T, V] float32
  cache: kvc.KVCache | None
  routes: jax.Array | None  # [L_moe, B, T, k] int32 experts chosen per MoE layer
  records: dict  # {layer: {site: Guidance | QArray}}
  aux_loss: jax.Array  # mean over MoE layers
  z_loss: jax.Array
  # (token, slot) pairs dropped by a fixed-capacity expert-parallel dispatch, over all layers
  # (0 for the dropless dispatch).
  dropped_pairs: jax.Array | None = None


jax.tree_util.register_dataclass(
    ModelOutput, data_fields=["logits", "cache", "routes", "records", "aux_loss", "z_loss",
                              "dropped_pairs"], meta_fields=[])


class Transformer(nn.Module):
  config: ModelConfig
  ctx: QuantContext = QuantContext()

  @nn.compact
  def __call__(self, tokens, positions, token_mask, cache=None, cache_index=0, guidance=None,
               routes=None, last_logits_only=False):
    c = self.config
    emb = _param(self, "embed/embedding", _INIT, (c.vocab_size, c.hidden_size))
    # (a repeated token's embedding gradient added in a fixed order: `kernels.take_rows`)
    x = kernels.take_rows(emb, tokens.reshape(-1)).reshape(*tokens.shape, c.hidden_size)
    x = x.astype(c.compute_dtype)
    key_mask = token_mask if cache is None else kvc.update_slice(cache.valid, token_mask,
                                                                  cache_index)
    new_layers, chosen, aux, z, records, dropped = [], [], [], [], {}, jnp.int32(0)
    moe_i, h = 0, None
    for i in range(c.num_layers):
      layer_routes = None
      if routes is not None and c.is_moe_layer(i):
        layer_routes = routes[moe_i]
      x, h, lc, ch, a, zz, rec, drop = Block(c, self.ctx, i, name=f"layers_{i}")(
          x, h, positions, token_mask, key_mask, None if cache is None else cache.layers[i],
          cache_index, None if guidance is None else guidance.get(i), layer_routes)
      dropped = dropped + drop
      new_layers.append(lc)
      if ch is not None:
        chosen.append(ch)
        aux.append(a)
        z.append(zz)
        moe_i += 1
      if rec:
        records[i] = rec
    decode = cache is not None and tokens.shape[1] == 1
    if h is None or (last_logits_only and not decode):
      if h is not None:
        x = x + (h.value() if isinstance(h, RoutedRows) else h)
      if last_logits_only:
        x = x[:, -1:]
      x = RMSNorm(c.rms_norm_eps, name="final_norm")(x)
    else:  # the last block's output added in the final norm (one kernel where it applies)
      _, x = AddRMSNorm(c.rms_norm_eps, name="final_norm")(x, h, decode)
    # Operands in the compute dtype, products exact and summed in float32: with bf16 this runs
    # on the GPU's tensor cores. Float32 operands made the vocab projection a float32 FFMA GEMM,
    # 1.04 ms of a 2.8 ms decode step (4 layers of the 30B-A3B shape, B=64, on the H200).
    if c.tie_embeddings:
      logits = kernels.matmul(x, emb.astype(x.dtype).T, out_dtype=jnp.float32)
    else:
      logits = Linear(c.vocab_size, self.ctx, c.compute_dtype, out_dtype=jnp.float32,
                      name="lm_head")(x)
    new_cache = None if cache is None else kvc.KVCache(tuple(new_layers), key_mask)
    mean = lambda v: jnp.mean(jnp.stack(v)) if v else jnp.float32(0.0)  # noqa: E731
    return ModelOutput(logits.astype(jnp.float32), new_cache,
                       jnp.stack(chosen) if chosen else None, records, mean(aux), mean(z),
                       dropped)


# --------------------------------------------------------------------------- functional API

def init_params(config: ModelConfig, key: jax.Array, dtype=None) -> dict:
  """Random parameters (normal, std 0.02; norms at 1), float32 unless `dtype` is given (the cast
  happens inside the initializing program, so a bf16 30B model never exists in float32)."""
  return _init_params(config, key, None if dtype is None else jnp.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _init_params(config: ModelConfig, key: jax.Array, dtype: str | None) -> dict:
  # Jitted: op-by-op initialization would compile every small op separately.
  tokens = jnp.zeros((1, 2), jnp.int32)
  variables = Transformer(config).init(key, tokens, jnp.zeros((1, 2), jnp.int32),
                                       jnp.ones((1, 2), bool))
  if dtype is None:
    return variables["params"]
  return jax.tree_util.tree_map(lambda a: a.astype(dtype), variables["params"])


def random_params(config: ModelConfig, key: jax.Array, dtype=None, on_host: bool = False) -> dict:
  """Parameters with `init_params`' shapes and distributions (normal with std 0.02; norm scales
  1, biases 0) but other values, made leaf by leaf without compiling the model: for benchmarks of
  large shapes, where only shapes and magnitudes matter. `init_params` runs flax's `init`, which
  compiles the whole forward once more (the 48-layer 30B-A3B shape took 149 s on the H200,
  session 12). One small program per distinct leaf shape; leaf i draws from `fold_in(key, i)`.
  on_host: numpy leaves, each moved to host memory once drawn (the device holds one at a time;
  `RolloutEngine.sync` takes such a master layer by layer)."""
  dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
  shapes = jax.eval_shape(lambda k: _init_params(config, k, None), key)
  paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
  leaves = []
  for i, (path, leaf) in enumerate(paths):
    name = getattr(path[-1], "key", str(path[-1]))
    kind = "ones" if name == "scale" else "zeros" if name == "bias" else "normal"
    x = _random_leaf(jax.random.fold_in(key, i), leaf.shape, dtype.name, kind)
    leaves.append(np.array(x) if on_host else x)  # (a copy: not a view of a device buffer)
  return jax.tree_util.tree_unflatten(tree, leaves)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _random_leaf(key, shape, dtype: str, kind: str):
  if kind == "ones":
    return jnp.ones(shape, dtype)
  if kind == "zeros":
    return jnp.zeros(shape, dtype)
  return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def default_positions(tokens: jax.Array, token_mask: jax.Array | None) -> jax.Array:
  """Positions counting only real tokens (left padding gets position 0)."""
  if token_mask is None:
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return jnp.maximum(jnp.cumsum(token_mask.astype(jnp.int32), axis=1) - 1, 0)


def apply(params, tokens, config: ModelConfig, ctx: QuantContext = QuantContext(), *,
          positions=None, token_mask=None, cache: kvc.KVCache | None = None, cache_index=0,
          guidance: dict | None = None, routes: jax.Array | None = None,
          last_logits_only: bool = False) -> ModelOutput:
  """The full forward: logits plus cache, routes, records and router auxiliaries.

  tokens `[B, T]`; token_mask `[B, T]` marks real tokens (default all); positions default to
  the count of real tokens before each one. With a `cache`, the T tokens are written at slots
  `cache_index .. cache_index + T - 1` and attend to every valid slot up to their own;
  `cache_index` is a scalar shared by the batch or `[B]`, one write position per row.
  guidance: `{layer: {site: Guidance}}` from a rollout (TRACE); routes `[L_moe, B, T, k]` to
  replay the rollout's expert choices. last_logits_only: logits `[B, 1, V]` of the last position
  only (a rollout's prefill needs just the next token's distribution; the full `[B, T, V]` float32
  logits of a 64 x 256-token prompt batch are 10 GB at a 152k vocabulary).
  """
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [batch, time], got shape {tokens.shape}")
  if token_mask is None:
    token_mask = jnp.ones(tokens.shape, bool)
  if positions is None:
    positions = default_positions(tokens, token_mask)
  if jnp.ndim(cache_index) not in (0, 1) or (jnp.ndim(cache_index) == 1
                                              and jnp.shape(cache_index) != tokens.shape[:1]):
    raise ValueError(f"cache_index must be a scalar or one index per row [{tokens.shape[0]}], "
                     f"got shape {jnp.shape(cache_index)}")
  if routes is not None:
    n_moe = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    want = (n_moe,) + tuple(tokens.shape) + (config.num_experts_per_tok,)
    if tuple(routes.shape) != want:
      raise ValueError(f"replayed routes have shape {tuple(routes.shape)}, expected {want} "
                       "(MoE layers, batch, time, top-k)")
  return Transformer(config, ctx).apply({"params": params}, tokens, positions, token_mask, cache,
                                        cache_index, guidance, routes, last_logits_only)


def forward(params, tokens, config: ModelConfig, ctx: QuantContext = QuantContext(),
            **kwargs) -> jax.Array:
  """Logits `[B, T, V]` (float32) for a whole sequence; see `apply` for the options."""
  return apply(params, tokens, config, ctx, **kwargs).logits
