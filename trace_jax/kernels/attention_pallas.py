"""Pallas decode attention over a bf16, FP8 (MXFP8) or FP4 (NVFP4, MXFP4) KV cache: split-K
over the sequence, GQA, ragged valid masks, scales decoded in the kernel.

Owns the kernel body, its launch configuration (tile, splits), the per-call plumbing of q and the
outputs, and the combine step. The result is defined by `attention_ref.decode_attention_ref`.

Design:
- grid (batch, KV head, split): one program reads the K/V slots of its split for one KV head
  once and serves all `G = H / KVH` query heads of that head (padded to `Gp >= 16` rows, the
  smallest tensor-core tile). K/V are read in place from the cache layout `[B, S, KVH, ...]`
  (no copy per call); a split walks its slots in tiles of `block_k` with an online softmax and
  writes unnormalized partial outputs with their running max and sum; `combine_splits` (XLA,
  tiny) merges the splits. Splits are chosen so that about two programs per SM run.
- FP4 codes stay packed: the low nibbles of a byte row are the even head_dim elements, the high
  nibbles the odd ones, so the kernel decodes the two halves separately and multiplies them
  with q's even/odd halves (split outside, once per call); the output halves are interleaved
  back outside. No shuffle in the kernel. A nibble becomes an e4m3 bit pattern worth
  `E2M1 * 2**-6` in four integer ops (`e2m1.as_e4m3_bits`), then the hardware e4m3 conversion.
  A cache of "kv_words" (`QArray.packing`, the Mosaic kernel's bit-placed words: the GPU
  default for caches that kernel reads, which this one reads when they are short and in
  prefill) gets its tile's words put back in nibble order first (9 masked rotations a word).
- scales are decoded in the kernel from their bytes (E8M0 by the integer rule
  `formats.e8m0_from_bits`, E4M3 by the e4m3 conversion; NVFP4 `d = s * g` formed in float32 as
  `formats.nvfp4_divisor` does), each element `q * d` in float32 then rounded to bf16: exactly
  the bf16 value `dequantize(...).astype(bf16)` gives, so K and V enter the tensor-core products
  with the values the model's reference path uses; only the float32 summation order and the
  place where probabilities are rounded to bf16 differ (online softmax).
- masked slots (`valid` false, past the last valid slot, past the cache) get probability 0. The
  reference gives a row with no valid slot the mean of V; the kernel gives 0 (decode always has
  the current token). Programs skip tiles past the last valid slot of their row.

Lowering: a portable Pallas body (`pl.pallas_call`, BlockSpecs, masked loads, `dot_general`)
that runs in `interpret=True` on CPU (the tests run the real kernel logic there) and on the GPU
through the Triton lowering (`pallas.triton.CompilerParams`; deprecated since jax 0.11, still
shipped in 0.11.2). Constraints of the compiled path (else `dispatch` uses the reference):
bf16 queries, head_dim a power of two >= 32 that the format's block divides, at most 64 query
heads per KV head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from trace_jax import quant as tq
from trace_jax.kernels import attention_ref as R
from trace_jax.quant import e2m1
from trace_jax.quant import formats as F

NUM_SMS = 132  # H200
MAX_GROUPS = 64


def _pow2_at_least(n: int, lo: int) -> int:
  p = lo
  while p < n:
    p *= 2
  return p


def kernel_supported(q, k, v) -> str | None:
  """None if the compiled kernel handles these operands, else the reason it does not."""
  if q.dtype != jnp.bfloat16:
    return f"queries are {q.dtype}, the kernel takes bfloat16"
  hd = q.shape[-1]
  if hd < 32 or hd & (hd - 1):
    return f"head_dim {hd} is not a power of two >= 32"
  if q.shape[1] // k.shape[2] > MAX_GROUPS:
    return f"more than {MAX_GROUPS} query heads per KV head"
  for x in (k, v):
    if isinstance(x, tq.QArray):
      if hd % x.fmt.block:
        return f"{x.fmt.name} block {x.fmt.block} does not divide head_dim {hd}"
    elif x.dtype != jnp.bfloat16:
      return f"K/V arrays are {x.dtype}, the kernel takes bfloat16 or QArrays"
  if type(k) is not type(v) or (isinstance(k, tq.QArray) and (k.fmt, k.packing)
                                 != (v.fmt, v.packing)):
    return "K and V differ in format or code packing"
  return None


# --------------------------------------------------------------------------- operand plumbing

def _kv_operands(x) -> tuple[list[jax.Array], tq.Format | None]:
  """The arrays the kernel reads for K or V, all in the cache layout `[B, S, KVH, ...]`:
  bf16 `[.., hd]`; MXFP8 codes `[.., hd]` uint8 + scales `[.., nb]` uint8; FP4 packed codes
  `[.., hd/2]` uint8 + scales `[.., nb]` uint8 (+ NVFP4 `g` `[B, S, KVH]` float32)."""
  if not isinstance(x, tq.QArray):
    return [x], None
  u8 = lambda a: lax.bitcast_convert_type(a, jnp.uint8)  # noqa: E731  (same width: a view)
  ops = [x.codes if x.fmt.is_fp4 else u8(x.codes), u8(x.scales)]
  if x.fmt.two_level:
    ops.append(x.global_scale[..., 0].astype(jnp.float32))
  return ops, x.fmt


def _placed(x) -> bool:
  """Whether cache operand `x` holds bit-placed code words ("kv_words")."""
  return isinstance(x, tq.QArray) and x.packing == "kv_words"


def _split_q(q, kvh: int, gp: int, parts: int) -> jax.Array:
  """q `[B, H, hd]` -> `[B, KVH, parts, Gp, hd / parts]` (parts 2: even, odd head_dim)."""
  b, h, hd = q.shape
  g = h // kvh
  qg = jnp.pad(q.reshape(b, kvh, g, hd), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
  if parts == 1:
    return qg[:, :, None]
  return jnp.stack([qg[..., 0::2], qg[..., 1::2]], axis=2)


def combine_splits(o, m, l, axis: int):
  """Merge split-K partials along `axis`: o unnormalized sums `sum_j exp(s_j - m) v_j`, m
  running maxima, l sums `sum_j exp(s_j - m)`; m and l of o's rank, size 1 on the axes of the
  values themselves (e.g. o `[..., n, Gp, D]`, m `[..., n, Gp, 1]`), so each kernel merges its
  partials in the layout it writes them. Splits without a valid slot carry l = 0 and
  m = -1e30 and drop out; rows without any give 0."""
  w = jnp.exp(m - jnp.max(m, axis=axis, keepdims=True))
  den = jnp.sum(w * l, axis=axis)
  num = jnp.sum(w * o, axis=axis)
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


# --------------------------------------------------------------------------- the kernel

def _e4m3(u8):
  return lax.bitcast_convert_type(u8, jnp.float8_e4m3fn).astype(jnp.float32)


def _decode_tile(ops, fmt: tq.Format | None, parts: int, dtype, placed: bool = False):
  """Loaded tile operands -> `parts` arrays `[T, hd / parts]` of K or V values in `dtype`:
  `code * d` in float32 (d the block scale, NVFP4 `s * g` formed first), rounded once.
  placed: the codes are "kv_words" (`QArray.packing`), put back in nibble order first."""
  if fmt is None:
    return [ops[0].astype(dtype)]
  codes, sbytes = ops[0], ops[1]
  if placed:
    codes = e2m1.unplace_kv_words(codes)
  t, w = codes.shape
  nb = sbytes.shape[1]
  if fmt.scale == "e8m0":
    d = F.e8m0_from_bits(sbytes)
  else:
    d = _e4m3(sbytes) * ops[2][:, None]
  if fmt.is_fp4:  # E2M1 as e4m3 (value code * 2**-6), so the scale carries 2**6: exact while
    # d * 64 stays finite (MX exponents <= 121)
    d = d * jnp.float32(e2m1.E4M3_OF_E2M1_SCALE)
    vals = [_e4m3(e2m1.as_e4m3_bits(codes, high)) for high in (False, True)]  # even, odd
  else:
    vals = [_e4m3(codes)]
  per = w // nb  # elements of one block in each part
  return [(x.reshape(t, nb, per) * d[:, :, None]).reshape(t, w).astype(dtype) for x in vals]


def _load_slots(ref, off, ok, *, block_k: int):
  """Slots `off .. off + block_k - 1` of a `[S, ...]` ref; slots where `ok` is false read 0."""
  from jax.experimental.pallas import triton as plt
  idx = (pl.ds(off, block_k),) + (slice(None),) * (len(ref.shape) - 1)
  mask = ok.reshape((block_k,) + (1,) * (len(ref.shape) - 1))
  return plt.load(ref.at[idx], mask=mask, other=0)


def _attend_tile(carry, qs, k_refs, v_refs, off, inb, allowed, *, fmt, parts: int,
                 block_k: int, scale: float, placed: bool):
  """One online-softmax step over the slot tile at `off` (shared by the decode and prefill
  kernels): `carry` (running max, running sum, unnormalized outputs per part) updated by the
  query rows `qs` against the tile's K/V; `allowed` (broadcastable to [rows, block_k]) masks
  scores, `inb` masks the loads."""
  m, l, accs = carry
  ks = _decode_tile([_load_slots(r, off, inb, block_k=block_k) for r in k_refs], fmt, parts,
                    jnp.bfloat16, placed)
  s = sum(lax.dot_general(qp, kp, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32) for qp, kp in zip(qs, ks))
  s = jnp.where(allowed, s * scale, R.NEG)
  m_new = jnp.maximum(m, jnp.max(s, axis=1))
  p = jnp.where(allowed, jnp.exp(s - m_new[:, None]), 0.0)
  corr = jnp.exp(m - m_new)
  vs = _decode_tile([_load_slots(r, off, inb, block_k=block_k) for r in v_refs], fmt, parts,
                    jnp.bfloat16, placed)
  pb = p.astype(jnp.bfloat16)
  accs = tuple(a * corr[:, None] + lax.dot_general(pb, vp, (((1,), (0,)), ((), ())),
                                                  preferred_element_type=jnp.float32)
               for a, vp in zip(accs, vs))
  return m_new, l * corr + jnp.sum(p, axis=1), accs


def _attend_init(rows: int, width: int, parts: int):
  """The online-softmax state before the first tile: max -1e30, sum 0, outputs 0."""
  return (jnp.full((rows,), R.NEG, jnp.float32), jnp.zeros((rows,), jnp.float32),
          tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(parts)))


def _kernel(len_ref, valid_ref, q_ref, *refs, n_k: int, fmt, parts: int, block_k: int,
            split_len: int, scale: float, placed: bool):
  k_refs, v_refs = refs[:n_k], refs[n_k:2 * n_k]
  o_ref, m_ref, l_ref = refs[2 * n_k:]
  gp = q_ref.shape[1]
  start = pl.program_id(2) * split_len
  end = jnp.minimum(start + split_len, len_ref[0])
  n_tiles = jnp.maximum(end - start + block_k - 1, 0) // block_k
  qs = [q_ref[p] for p in range(parts)]
  ar = jnp.arange(block_k)

  def body(i, carry):
    off = start + i * block_k
    inb = (off + ar) < end
    ok = inb & (_load_slots(valid_ref, off, inb, block_k=block_k) != 0)
    return _attend_tile(carry, qs, k_refs, v_refs, off, inb, ok[None, :], fmt=fmt,
                        parts=parts, block_k=block_k, scale=scale, placed=placed)

  init = _attend_init(gp, qs[0].shape[1], parts)
  m, l, accs = lax.fori_loop(0, n_tiles, body, init)
  for p_, a in enumerate(accs):
    o_ref[p_] = a
  m_ref[...] = m
  l_ref[...] = l


def _kv_spec(a):
  """A program's view of a cache operand `[B, S, KVH, ...]`: all slots of head j of row i."""
  s = a.shape[1]
  if a.ndim == 3:
    return pl.BlockSpec((None, s, None), lambda i, j, t: (i, 0, j))
  return pl.BlockSpec((None, s, None, a.shape[3]), lambda i, j, t: (i, 0, j, 0))


def default_config(b: int, kvh: int, s: int, fp4: bool = False) -> dict:
  """Tile of 128 slots (smaller for short caches) and enough splits for ~2 programs per SM;
  FP4 caches: tiles of 64 and twice the splits (their in-kernel decode wants more programs in
  flight: on the H200, 2026-11-30 sweep, B16 x 8k NVFP4 90.9 us against 122.6 us with the bf16
  choice; B64 x 1k 47.6 against 50.2; bf16 caches gained nothing from either change)."""
  block_k = min(64 if fp4 else 128, _pow2_at_least(s, 16))
  tiles = -(-s // block_k)
  splits = max(1, min(tiles, (2 if fp4 else 1) * -(-2 * NUM_SMS // (b * kvh))))
  return dict(block_k=block_k, splits=splits, num_warps=4, num_stages=2)


def decode_attention(q, k, v, valid, *, scale: float | None = None, out_dtype=None,
                     config: dict | None = None, interpret: bool = False) -> jax.Array:
  """The kernel path of `decode_attention_ref` (same arguments and result up to float32
  summation order): q `[B, H, hd]`, k/v `[B, S, KVH, hd]` bf16 arrays or `QArray`s, valid
  `[B, S]` bool or lengths `[B]`. interpret: run the Pallas body on CPU (tests)."""
  b, h, hd, s, kvh = R.check_decode_args(q, k, v, valid)
  if not interpret:
    why = kernel_supported(q, k, v)
    if why:
      raise ValueError(f"decode attention kernel: {why}")
  out_dtype = out_dtype or q.dtype
  scale = hd ** -0.5 if scale is None else scale
  allowed = R.allowed_slots(valid, s)
  k_ops, fmt = _kv_operands(k)
  v_ops, _ = _kv_operands(v)
  fp4 = fmt is not None and fmt.is_fp4
  parts = 2 if fp4 else 1
  gp = _pow2_at_least(h // kvh, 16)
  cfg = dict(default_config(b, kvh, s, fp4), **(config or {}))
  block_k = cfg["block_k"]
  tiles = -(-s // block_k)
  split_tiles = -(-tiles // cfg["splits"])
  split_len = split_tiles * block_k
  n_splits = -(-tiles // split_tiles)

  qk = _split_q(q.astype(jnp.bfloat16), kvh, gp, parts)
  w = hd // parts
  # per row: slots past the last valid one are never read
  last = s - jnp.argmax(allowed[:, ::-1], axis=1)
  kv_len = jnp.where(jnp.any(allowed, axis=1), last, 0).astype(jnp.int32)
  valid8 = allowed.astype(jnp.int8)

  kernel = functools.partial(_kernel, n_k=len(k_ops), fmt=fmt, parts=parts, block_k=block_k,
                             split_len=split_len, scale=float(scale), placed=_placed(k))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    compiler_params = plt.CompilerParams(num_warps=cfg["num_warps"],
                                         num_stages=cfg["num_stages"])
  o, m, l = pl.pallas_call(
      kernel,
      grid=(b, kvh, n_splits),
      in_specs=[pl.BlockSpec((1,), lambda i, j, t: (i,)),
                pl.BlockSpec((None, s), lambda i, j, t: (i, 0)),
                pl.BlockSpec((None, None, parts, gp, w), lambda i, j, t: (i, j, 0, 0, 0))]
               + [_kv_spec(a) for a in k_ops + v_ops],
      out_specs=[pl.BlockSpec((None, None, None, parts, gp, w),
                              lambda i, j, t: (i, j, t, 0, 0, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda i, j, t: (i, j, t, 0)),
                 pl.BlockSpec((None, None, None, gp), lambda i, j, t: (i, j, t, 0))],
      out_shape=[jax.ShapeDtypeStruct((b, kvh, n_splits, parts, gp, w), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, n_splits, gp), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, n_splits, gp), jnp.float32)],
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"decode_attention_{fmt.name if fmt else 'bf16'}",
  )(kv_len, valid8, qk, *k_ops, *v_ops)
  # [B, KVH, n, P, Gp, W] -> merge splits -> [B, KVH, Gp, W, P] (interleave even/odd)
  out = combine_splits(jnp.moveaxis(o, 3, 2), m[:, :, None, ..., None], l[:, :, None, ..., None],
                       axis=3)  # [B, KVH, P, Gp, W]
  out = jnp.moveaxis(out, 2, -1).reshape(b, kvh, gp, hd)[:, :, :h // kvh]
  return out.reshape(b, h, hd).astype(out_dtype)


# --------------------------------------------------------------------------- prefill (flash)

def _prefill_kernel(start_ref, first_ref, mask_ref, q_ref, *refs, n_k: int, fmt, parts: int,
                    block_q: int, block_k: int, g: int, t: int, scale: float, placed: bool):
  """One program: `block_q` query rows (token-major, the G heads of one KV head) of one batch
  row against the cache slots they may see, flash-style (online softmax over slot tiles)."""
  k_refs, v_refs, o_ref = refs[:n_k], refs[n_k:2 * n_k], refs[2 * n_k]
  s = mask_ref.shape[0]
  r0 = pl.program_id(2) * block_q
  q_slot = start_ref[0] + (r0 + jnp.arange(block_q)) // g  # [block_q]: each row's own slot
  # slots a row may see: key_mask'ed slots in [first valid slot, own slot]
  hi = jnp.minimum(start_ref[0] + jnp.minimum((r0 + block_q - 1) // g, t - 1) + 1, s)
  lo = jnp.minimum(first_ref[0], hi) // block_k * block_k
  n_tiles = (hi - lo + block_k - 1) // block_k
  qs = [q_ref[p] for p in range(parts)]
  ar = jnp.arange(block_k)

  def body(i, carry):
    off = lo + i * block_k
    inb = (off + ar) < hi
    ok = inb & (_load_slots(mask_ref, off, inb, block_k=block_k) != 0)
    allowed = ok[None, :] & ((off + ar)[None, :] <= q_slot[:, None])
    return _attend_tile(carry, qs, k_refs, v_refs, off, inb, allowed, fmt=fmt, parts=parts,
                        block_k=block_k, scale=scale, placed=placed)

  init = _attend_init(block_q, qs[0].shape[1], parts)
  _, l, accs = lax.fori_loop(0, n_tiles, body, init)
  inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)  # a row seeing no slot gives 0
  for p_, a in enumerate(accs):
    o_ref[p_] = (a * inv[:, None]).astype(o_ref.dtype)


def default_prefill_config(rows: int, fp4: bool = False) -> dict:
  """128 query rows per program (fewer for short prompts); FP4 caches 64 slots per step and 4
  warps, others 32 slots and 8 warps: the best of the H200 launch sweep (2026-11-30, B=16,
  prompt 2048: NVFP4 3.54 ms against 3.96 for 64 slots x 8 warps; bf16 2.35 ms against 3.10)."""
  return dict(block_q=min(128, _pow2_at_least(rows, 16)), block_k=64 if fp4 else 32,
              num_warps=4 if fp4 else 8, num_stages=2)


def prefill_attention(q, k, v, key_mask, q_start, *, scale: float | None = None,
                      out_dtype=None, config: dict | None = None,
                      interpret: bool = False) -> jax.Array:
  """The kernel path of `attention_ref.prefill_attention_ref` (same arguments; the same result up
  to float32 summation order and bf16 rounding of the probabilities, except that a query row
  that may see no slot gives 0 where the reference averages V): T query tokens per row over a
  KV cache that already holds them, read in place in any format. Grid (batch, KV head, blocks
  of `block_q` query rows); a program walks only the slot tiles between its rows' first
  `key_mask`'ed slot and its last row's own slot (causal and left-padding skip)."""
  b, t, h, hd = q.shape
  _, _, _, s, kvh = R.check_decode_args(q[:, 0], k, v, key_mask)
  if not interpret:
    why = kernel_supported(q[:, 0], k, v)
    if why:
      raise ValueError(f"prefill attention kernel: {why}")
  out_dtype = out_dtype or q.dtype
  scale = hd ** -0.5 if scale is None else scale
  allowed = R.allowed_slots(key_mask, s)
  k_ops, fmt = _kv_operands(k)
  v_ops, _ = _kv_operands(v)
  fp4 = fmt is not None and fmt.is_fp4
  parts = 2 if fp4 else 1
  g = h // kvh
  rows = t * g
  cfg = dict(default_prefill_config(rows, fp4), **(config or {}))
  block_q, block_k = cfg["block_q"], cfg["block_k"]
  rows_pad = -(-rows // block_q) * block_q

  # q [B, T, H, hd] -> [B, KVH, P, rows_pad, hd / P]: rows token-major (row r: token r // G)
  qr = jnp.swapaxes(q.astype(jnp.bfloat16).reshape(b, t, kvh, g, hd), 1, 2)
  qr = jnp.pad(qr.reshape(b, kvh, rows, hd), ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
  qr = qr[:, :, None] if parts == 1 else jnp.stack([qr[..., 0::2], qr[..., 1::2]], axis=2)
  w = hd // parts
  start = jnp.broadcast_to(jnp.asarray(q_start, jnp.int32).reshape(-1), (b,))
  first = jnp.where(jnp.any(allowed, axis=1), jnp.argmax(allowed, axis=1), s).astype(jnp.int32)

  kernel = functools.partial(_prefill_kernel, n_k=len(k_ops), fmt=fmt, parts=parts,
                             block_q=block_q, block_k=block_k, g=g, t=t, scale=float(scale),
                             placed=_placed(k))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as plt
    compiler_params = plt.CompilerParams(num_warps=cfg["num_warps"],
                                         num_stages=cfg["num_stages"])
  o = pl.pallas_call(
      kernel,
      grid=(b, kvh, rows_pad // block_q),
      in_specs=[pl.BlockSpec((1,), lambda i, j, r: (i,)),
                pl.BlockSpec((1,), lambda i, j, r: (i,)),
                pl.BlockSpec((None, s), lambda i, j, r: (i, 0)),
                pl.BlockSpec((None, None, parts, block_q, w), lambda i, j, r: (i, j, 0, r, 0))]
               + [_kv_spec(a) for a in k_ops + v_ops],
      out_specs=pl.BlockSpec((None, None, parts, block_q, w), lambda i, j, r: (i, j, 0, r, 0)),
      out_shape=jax.ShapeDtypeStruct((b, kvh, parts, rows_pad, w), out_dtype),
      compiler_params=compiler_params,
      interpret=interpret,
      name=f"prefill_attention_{fmt.name if fmt else 'bf16'}",
  )(start, first, allowed.astype(jnp.int8), qr, *k_ops, *v_ops)
  # [B, KVH, P, rows, W] -> [B, KVH, T, G, hd] (interleave even/odd) -> [B, T, H * hd]
  o = jnp.moveaxis(o[:, :, :, :rows], 2, -1).reshape(b, kvh, t, g, hd)
  return jnp.swapaxes(o, 1, 2).reshape(b, t, h * hd)
