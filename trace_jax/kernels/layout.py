"""The kernel-side FP4 weight layout: `PackedWeight`, made once from a `QArray` at weight sync.

Owns the pre-shuffle of E2M1 codes into the order the Mosaic GPU kernel (`fp4_mgpu.py`) decodes
them in registers, the per-block scale bytes it reads next to them, the per-column output factor,
the matching permutation of activations, and a pure-`jnp` decode of the layout (the fallback
path and the tests' ground truth).

The kernel computes `out^T[n, b] = sum_k A[n, k] x^T[k, b]` ("swap AB": the weight is the 64-row
register operand of `wgmma`, the batch its N side). A warpgroup holds one 64x64 tile of `A` in
the wgmma register layout: thread t (warp w = t // 32, g = (t % 32) // 4, q = t % 4) holds rows
`w*16 + g` and `w*16 + 8 + g` and the physical columns `8*ci + 2*q + v` (ci 0..7, v 0..1).
We choose which logical K each physical column carries: physical `8*ci + 2*q + v` is logical
`16*q + 2*ci + v`, so the 32 codes a thread holds fall in ONE 16-wide K block per row. Each
thread then needs only two block scales per tile (rows r0, r1), stored in thread order next to
its codes, instead of eight shared ones. The activations are permuted the same way per call
(`permute_k`, a cheap gather XLA fuses into the producer of x).

Per tile each thread reads 4 uint32 of codes. Word j holds 8 codes of one row (r0 for j < 2,
r1 after), bit-placed (`_SRC` below) so that each decoded register takes one word-wide move
(none, shift, rotate) and one `and` to put every code's `s e1 e0 m` under bf16 bits 15, 8, 7, 6
(`fp4_mgpu.WEIGHT_DECODE_ASM`: 9 integer instructions a word, 13 with the multiplies); as bf16
that is `E2M1(code) * 2**-126` exactly (0.5 is a bf16 subnormal). One `mul.rn.bf16x2` by the
word's row multiplier `c = scale * 2**(126 - shift)` gives `q * scale * 2**-shift`, exact in
bf16 (NUMERICS: q*s is exact in bf16 for NVFP4, a power of two for MXFP4). The output is
multiplied by the fp32 column factor `g * 2**shift` (NaN where a block scale of that column is
NaN, so NaN never turns into a number). (Session 23's words held natural nibbles, decoded with
the attention cache's sign-replicating `prmt`, shift and `and` per register: 17 instructions a
word; before that 4 codes of each row, three funnel rotates, four `prmt` and four `and`.)

Scale bytes (one per block and row, two per thread and tile, in thread order per kernel step of
`kb` tiles):
  NVFP4: `c = s * 2**118` (shift 8) as bf16 has exponent field 236..253 and 3 mantissa bits:
         byte = (bf16_bits(c) - 0x7600) >> 4; the kernel rebuilds `(byte << 4) + 0x7600`.
  MXFP4: `c = 2**(e + 126 - shift)` with a per-column shift = max e - 1: byte = the bf16
         exponent field; the kernel rebuilds `byte << 7`. Two threads read each MXFP4 block
         scale, so it is stored twice: 4.5 bits per element, like NVFP4, instead of 4.25.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import QArray
from trace_jax.quant import e2m1
from trace_jax.quant import formats as F

TILE = 64  # rows and K columns of one decoded wgmma operand tile
N_ALIGN = 256  # N is padded to this, so 1, 2 or 4 compute warpgroups of 64 rows divide it
NV_SHIFT = 8  # NVFP4: c = s * 2**(126 - 8) stays finite in bf16 for s <= 448
NV_BIAS = 0x7600  # bf16 bits of 2**109 = 2**-9 * 2**118, the smallest NVFP4 multiplier


# --------------------------------------------------------------------------- static tables

_SRC = e2m1.wgmma_bit_sources()  # [register o, half v, E2M1 bit b] -> code word bit


def _slot_tables() -> tuple[np.ndarray, np.ndarray]:
  """(row, logical col) inside a 64x64 tile of each slot [thread 128, word 4, reg o 4, half 2].
  Register o of word j is the wgmma register (ci = 4 * (j % 2) + o, ri = j // 2)."""
  t = np.arange(128)[:, None, None, None]
  j = np.arange(4)[None, :, None, None]
  o = np.arange(4)[None, None, :, None]
  v = np.arange(2)[None, None, None, :]
  w, g, q = t // 32, (t % 32) // 4, t % 4
  rows = w * 16 + (j // 2) * 8 + g
  cols = 16 * q + 2 * (4 * (j % 2) + o) + v  # logical K of physical column 8*ci + 2*q + v
  shape = (128, 4, 4, 2)
  return np.broadcast_to(rows, shape).copy(), np.broadcast_to(cols, shape).copy()


_ROWS, _COLS = _slot_tables()


def _pair_perm(k: int) -> np.ndarray:
  """Source pair index of each physical element pair (pairs of K stay together)."""
  p = np.arange(k // 2)
  chunk, pp = p // 32, p % 32
  ci, q = pp // 4, pp % 4
  return chunk * 32 + q * 8 + ci


def permute_k(x: jax.Array) -> jax.Array:
  """Reorder the last axis (a multiple of 64) of activations into the kernel's physical K:
  physical `8*ci + 2*q + v` of each 64 chunk takes logical `16*q + 2*ci + v`. 2-byte types
  move as 4-byte pairs through one gather (XLA's transpose of these tiny axes ran at 0.4 TB/s
  on the H200)."""
  *lead, k = x.shape
  if x.dtype.itemsize == 2:
    u = jax.lax.bitcast_convert_type(x.reshape(*lead, k // 2, 2), jnp.uint32)
    u = jnp.take(u, jnp.asarray(_pair_perm(k), jnp.int32), axis=-1)
    return jax.lax.bitcast_convert_type(u, x.dtype).reshape(*lead, k)
  xr = x.reshape(*lead, k // TILE, 4, 8, 2)
  return jnp.swapaxes(xr, -3, -2).reshape(*lead, k)


def permute_k_rows(x: jax.Array, rows: jax.Array | None, n_rows: int, k_pad: int) -> jax.Array:
  """`permute_k` of the bf16 rows `x[rows]` (`x` itself without `rows`), padded to `n_rows`
  rows with copies of row 0 and to `k_pad` columns with zeros: the kernel's activation operand
  from a row gather and the pair permutation, two gathers with 1-D indices that XLA may fuse.
  x `[n, K]` (n >= 1), K <= k_pad; `rows` must be in range. The rows past `rows` are only ever
  computed into output rows nobody gathers (windows past the last group, a dense call's padding),
  so they need not be zeros, and a clamped gather needs no mask kernel (the
  fill-with-zeros form made XLA compute the rows' bounds as a kernel of its own)."""
  n, k = x.shape
  src = jnp.arange(n, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
  src = jnp.pad(src, (0, n_rows - src.shape[0]))
  x = x.astype(jnp.bfloat16)
  if k != k_pad:  # K not a multiple of the tile: pad the (unsorted, smaller) operand
    x = jnp.pad(x, ((0, 0), (0, k_pad - k)))
  u = jax.lax.bitcast_convert_type(x.reshape(n, k_pad // 2, 2), jnp.uint32)
  g = jnp.take(u, src, axis=0, mode="clip")
  g = jnp.take(g, jnp.asarray(_pair_perm(k_pad), jnp.int32), axis=1)
  return jax.lax.bitcast_convert_type(g, jnp.bfloat16).reshape(n_rows, k_pad)


# --------------------------------------------------------------------------- the pytree

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkRows:
  """A grouped matmul's result left in its kernel's chunk rows: result row i is
  `rows[slot[i], :n]`, zeros where `slot[i]` is out of range (`fp4_mgpu.gather_rows`).

  rows: [C * bm, N_pad] (one K split), slot: int32 [M]; n: the result's columns (static)."""

  rows: jax.Array
  slot: jax.Array
  n: int = dataclasses.field(metadata=dict(static=True))

  def gather(self) -> jax.Array:
    """The result `[M, n]` (one XLA gather)."""
    return jnp.take(self.rows[:, :self.n], self.slot, axis=0, mode="fill", fill_value=0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PaddedRows:
  """A decode step's normalized rows written with their row count rounded up for the bf16
  q/k/v kernel, which then needs no pad of its own (`dispatch.norm_rows_padded`): rows
  [R, D] (rows past n zero), the value `shape` (static) of its first n rows."""

  rows: jax.Array
  shape: tuple = dataclasses.field(metadata=dict(static=True))

  @property
  def n(self) -> int:
    return math.prod(self.shape[:-1])

  def value(self) -> jax.Array:
    """The rows as the model's value `[..., D]` (a slice)."""
    return self.rows[:self.n].reshape(self.shape)


def sum_parts(parts) -> jax.Array:
  """The float32 sum of a product's K parts (the first axis of an array, or a list of a kernel
  body's tiles), part 0 first, one add at a time: the one order every reader of `KParts`
  follows (a kernel too), so their sums agree."""
  acc = parts[0]
  for i in range(1, len(parts)):
    acc = acc + parts[i]
  return acc


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KParts:
  """A product's float32 partial sums over K parts, `parts [S, ..., N]`, left unadded for the
  kernel that reads them (the decode step's o projection with `bf16_mgpu.ksplit_launch`, read
  by the add + norm kernel, which adds them there instead of an XLA convert kernel)."""

  parts: jax.Array

  @property
  def shape(self) -> tuple:
    return tuple(self.parts.shape[1:])

  def value(self, dtype) -> jax.Array:
    """The product in `dtype`: `sum_parts`, rounded once."""
    return sum_parts(self.parts).astype(dtype)


def chunk_row_index(slot, src: int, ok):
  """Inside a kernel body: chunk-row indices `slot` read as `ChunkRows.gather` reads them
  (`jnp.take`'s fill mode: a negative one counts back from `src`, one out of range reads as
  zeros) -> (the index, 0 where it reads zeros or `ok` is false; whether it reads a row)."""
  slot = jnp.where(slot < 0, slot + src, slot)
  in_range = ok & (slot >= 0) & (slot < src)
  return jnp.where(in_range, slot, 0), in_range


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OperandRows:
  """Activation rows already in an FP4 matmul kernel's operand layout (`permute_k_rows`):
  data [n_rows, k_pad] bf16, of which the first m rows are the operand's (static)."""

  data: jax.Array
  m: int = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class PackedWeight:
  """An FP4 weight in the kernel's layout (registered pytree; metadata static).

  codes:  uint32 [E, N_pad/64, K_pad/64 * 16, 32]: per 64x64 tile of W^T, 128 threads x 16 bytes.
  scales: uint32 [E, N_pad/64, K_pad/64 * 2, 32]: per kernel step of `kb` tiles, 128 threads x
          2*kb bytes (tile-major, rows r0 then r1).
  factor: float32 [E, N_pad]: per output column, `g * 2**shift` (NaN for NaN scales).
  fmt: "nvfp4" or "mxfp4"; shape: logical (K, N) or (E, K, N); experts: whether E is real;
  kb: tiles per kernel step the scales are interleaved for.
  """

  codes: jax.Array
  scales: jax.Array
  factor: jax.Array
  fmt: str = dataclasses.field(metadata=dict(static=True))
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  kb: int = dataclasses.field(metadata=dict(static=True))

  @property
  def experts(self) -> bool:
    return len(self.shape) == 3

  @property
  def k(self) -> int:
    return self.shape[-2]

  @property
  def n(self) -> int:
    return self.shape[-1]

  @property
  def k_pad(self) -> int:
    return self.codes.shape[2] // 16 * TILE

  @property
  def n_pad(self) -> int:
    return self.codes.shape[1] * TILE

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def dtype(self):
    return jnp.float4_e2m1fn

  @property
  def nbytes(self) -> int:
    """Bytes the kernel streams: codes + scale bytes + column factors."""
    return int(sum(a.size * a.dtype.itemsize for a in (self.codes, self.scales, self.factor)))

  def __repr__(self) -> str:
    return f"PackedWeight({self.fmt}, shape={self.shape}, kb={self.kb}, nbytes={self.nbytes})"


jax.tree_util.register_dataclass(
    PackedWeight, data_fields=["codes", "scales", "factor"], meta_fields=["fmt", "shape", "kb"])


def _round_up(a: int, b: int) -> int:
  return -(-a // b) * b


def _pack_words(codes_nk: jax.Array) -> jax.Array:
  """[..., N, K] codes (N, K multiples of 64) -> uint32 [..., N/64, K/64*16, 32]."""
  *lead, n, k = codes_nk.shape
  c = codes_nk.reshape(*lead, n // TILE, TILE, k // TILE, TILE)
  c = jnp.moveaxis(c, -3, -2)  # [..., nt, kt, 64 rows, 64 cols]
  g = c[..., _ROWS, _COLS].astype(jnp.uint32)  # [..., nt, kt, 128, 4, 4, 2]
  words = jnp.zeros(g.shape[:-2], jnp.uint32)
  for o in range(4):
    for v in range(2):
      for b in range(4):
        words = words | (((g[..., o, v] >> b) & 1) << int(_SRC[o, v, b]))
  return words.reshape(*lead, n // TILE, (k // TILE) * 16, 32)


def _scale_stream(sb: jax.Array, fmt: F.Format, kb: int) -> jax.Array:
  """Per-(row, block) scale bytes [..., N, nb] -> uint32 [..., N/64, K/64*2, 32] in thread order
  (per step of kb tiles: thread, tile, row r0/r1)."""
  *lead, n, nb = sb.shape
  per_tile = TILE // fmt.block  # blocks per 64 columns: 4 (NVFP4) or 2 (MXFP4)
  kt = nb // per_tile
  s = sb.reshape(*lead, n // TILE, TILE, kt, per_tile)
  s = jnp.moveaxis(s, -3, -2)  # [..., nt, kt, 64 rows, blocks]
  t = np.arange(128)
  w, g, q = t // 32, (t % 32) // 4, t % 4
  rows = np.stack([w * 16 + g, w * 16 + 8 + g], -1)  # [128, 2]
  blk = (16 * q) // fmt.block  # this thread's block in the tile
  st = s[..., rows, blk[:, None]]  # [..., nt, kt, 128, 2]
  st = st.reshape(*st.shape[:-3], kt // kb, kb, 128, 2)
  st = jnp.swapaxes(st, -3, -2)  # [..., nt, steps, 128, kb, 2]
  st = st.reshape(*st.shape[:-4], kt // kb, 128 * 2 * kb // 4, 4).astype(jnp.uint32)
  words = st[..., 0] | (st[..., 1] << 8) | (st[..., 2] << 16) | (st[..., 3] << 24)
  return words.reshape(*lead, n // TILE, kt * 2, 32)


@functools.partial(jax.jit, static_argnames=("kb",))
def prepare_weight(q: QArray, *, kb: int = 4) -> PackedWeight:
  """Make the kernel layout from an FP4 weight `QArray`: dense `[K, N]` with blocks along K
  (axis 0) or stacked experts `[E, K, N]` (axis 1). Runs once at weight sync (jit-able).
  kb: 64-column tiles per kernel step (2, 4 or 8), baked into the scale order."""
  if not isinstance(q, QArray) or not q.fmt.is_fp4:
    raise TypeError(f"prepare_weight needs an FP4 QArray, got {q!r}")
  if kb not in (2, 4, 8):
    raise ValueError(f"kb must be 2, 4 or 8, got {kb}")
  if q.ndim not in (2, 3) or q.axis != q.ndim - 2:
    raise ValueError(f"expected [K, N] (axis 0) or [E, K, N] (axis 1), got {q!r}")
  fmt = q.fmt
  codes = q.blocked_codes()  # [E?, N, nb, block]
  codes = codes.reshape(*codes.shape[:-2], -1)  # [E?, N, Kq]
  s, g = q.blocked_scales()  # [E?, N, nb], g keepdims
  if q.ndim == 2:
    codes, s = codes[None], s[None]
    g = None if g is None else g[None]
  e, n, kq = codes.shape
  k_pad = _round_up(kq, TILE * kb)
  n_pad = _round_up(n, N_ALIGN)
  nb_pad = k_pad // fmt.block

  if fmt.scale == "e4m3":
    sf = s.astype(jnp.float32)
    bad = jnp.isnan(sf)
    c = (sf * np.float32(2.0 ** (126 - NV_SHIFT))).astype(jnp.bfloat16)
    bits = jax.lax.bitcast_convert_type(c, jnp.uint16).astype(jnp.int32)
    byte = jnp.clip((bits - NV_BIAS) >> 4, 0, 255)
    zero = sf == 0  # not made by quantize (s >= 2**-9), but decodes to 0 in the reference
    byte = jnp.where(bad | zero, 0, byte)
    codes = jnp.where(jnp.repeat(zero, fmt.block, axis=-1), jnp.uint8(0), codes)
    gcol = jnp.broadcast_to(g.astype(jnp.float32), s.shape)[..., 0] if g is not None else 1.0
    factor = gcol * np.float32(2.0 ** NV_SHIFT)
    pad_byte = 0
  else:
    ex, bad = F.e8m0_exponent_of(s)
    emax = jnp.max(jnp.where(bad, -127, ex), axis=-1)  # per column
    shift = emax - 1
    byte = jnp.clip(ex + 253 - shift[..., None], 1, 254)
    byte = jnp.where(bad, 1, byte)
    factor = F.pow2(jnp.clip(shift, -127, 127)) * jnp.where(shift < -127, np.float32(0.5), 1)
    pad_byte = 1
  factor = jnp.where(jnp.any(bad, axis=-1), jnp.float32(jnp.nan), factor)

  codes = jnp.pad(codes, ((0, 0), (0, n_pad - n), (0, k_pad - kq)))
  byte = jnp.pad(byte, ((0, 0), (0, n_pad - n), (0, nb_pad - byte.shape[-1])),
                 constant_values=pad_byte)
  factor = jnp.pad(factor, ((0, 0), (0, n_pad - n)))
  return PackedWeight(_pack_words(codes), _scale_stream(byte, fmt, kb), factor.astype(jnp.float32),
                      fmt.name, tuple(q.shape), kb)


def prepare_tree(tree, *, kb: int = 4):
  """`prepare_weight` on every FP4 weight `QArray` leaf of a parameter tree (dense `[K, N]` with
  blocks along axis 0, experts `[E, K, N]` along axis 1); other leaves unchanged. For the
  rollout's weight sync, so that `matmul`/`grouped_matmul` take the kernel path on GPU."""
  def conv(a):
    if (isinstance(a, QArray) and a.fmt.is_fp4 and a.ndim in (2, 3)
        and a.axis == a.ndim - 2):
      return prepare_weight(a, kb=kb)
    return a
  return jax.tree.map(conv, tree, is_leaf=lambda a: isinstance(a, QArray))


# Attention projections one call can make together at rollout (`fuse_projections`): each
# (dict key, [dict keys of its parts]); the part's own kernel leaf becomes None.
FUSED_PROJECTIONS = (("q_proj", ("q_proj", "k_proj", "v_proj")),)


def _side_by_side_problem(pws) -> str | None:
  """Why these PackedWeights cannot be put side by side (`concat_columns`), or None."""
  first = pws[0]
  for pw in pws:
    if pw.experts or (pw.fmt, pw.kb, pw.k, pw.k_pad) != (first.fmt, first.kb, first.k,
                                                          first.k_pad):
      return f"cannot put {pw} beside {first}: dense weights of one format, kb and K"
    if pw.n != pw.n_pad:
      return (f"{pw}: N {pw.n} is not a multiple of {N_ALIGN} (padding would sit between the "
              "parts)")
  return None


def _bf16_matrix(w) -> bool:
  return isinstance(w, jax.Array) and w.ndim == 2 and w.dtype == jnp.bfloat16


def concat_columns(pws) -> PackedWeight:
  """Dense PackedWeights [K, N_i] side by side: [K, sum N_i]. Exact: the layout's tiles are 64
  columns each and the column factors carry each part's own scales. Each N_i must be a multiple
  of N_ALIGN (no padding columns between the parts); formats, kb and K must agree."""
  why = _side_by_side_problem(pws)
  if why:
    raise ValueError(why)
  first = pws[0]
  cat = lambda name: jnp.concatenate([getattr(pw, name) for pw in pws], axis=1)  # noqa: E731
  return PackedWeight(cat("codes"), cat("scales"), cat("factor"), first.fmt,
                      (first.k, sum(pw.n for pw in pws)), first.kb)


def fuse_projections(tree, bf16: bool = False):
  """Where a dict of a parameter tree holds the parts of a `FUSED_PROJECTIONS` entry each as
  `{"kernel": dense PackedWeight}` (no bias) of one format, kb and K, each N unpadded (a
  multiple of N_ALIGN): the first part's kernel becomes the parts side by side
  (`concat_columns`) and the others' kernels None. The model then makes them in one
  call (`Attention`: one GEMV at decode, not three; the rollout's weight sync, unsharded
  weights). bf16: also parts that are bf16 [K, N_i] arrays of one K (concatenated: a new
  array beside the master's). Other dicts are unchanged."""
  if not isinstance(tree, dict):
    return tree
  out = {k: fuse_projections(v, bf16) for k, v in tree.items()}
  for key, parts in FUSED_PROJECTIONS:
    subs = [out.get(p) for p in parts]
    if not all(isinstance(d, dict) and set(d) == {"kernel"} for d in subs):
      continue
    ws = [d["kernel"] for d in subs]
    if bf16 and all(_bf16_matrix(w) and w.shape[0] == ws[0].shape[0] for w in ws):
      fused = jnp.concatenate(ws, axis=1)
    elif all(isinstance(w, PackedWeight) for w in ws) and not _side_by_side_problem(ws):
      fused = concat_columns(ws)
    else:
      continue
    out[key] = {"kernel": fused}
    for p in parts:
      if p != key:
        out[p] = {"kernel": None}
  return out


# --------------------------------------------------------------------------- jnp decode

def _unpack_words(words: jax.Array) -> jax.Array:
  """Inverse of `_pack_words`: uint32 [..., nt, kt*16, 32] -> codes uint8 [..., N, K]."""
  *lead, nt, kr, _ = words.shape
  kt = kr // 16
  w = words.reshape(*lead, nt, kt, 128, 4)
  slots = []
  for o in range(4):
    for v in range(2):
      code = jnp.zeros(w.shape, jnp.uint32)
      for b in range(4):
        code = code | (((w >> int(_SRC[o, v, b])) & 1) << b)
      slots.append(code)
  sl = jnp.stack(slots, -1).reshape(*w.shape, 4, 2)  # [..., nt, kt, 128, j, o, v]
  sl = jnp.moveaxis(sl, -3, -2)  # [..., 128, o, j, v] -> reorder to slot order [t, j, o, v]
  sl = jnp.swapaxes(sl, -3, -2)
  flat = sl.reshape(*lead, nt, kt, 4096)
  inv = np.empty(4096, np.int64)
  inv[(_ROWS * TILE + _COLS).ravel()] = np.arange(4096)
  tile = flat[..., inv].reshape(*lead, nt, kt, TILE, TILE)
  return jnp.moveaxis(tile, -3, -2).reshape(*lead, nt * TILE, kt * TILE).astype(jnp.uint8)


def _unscale_stream(words: jax.Array, block: int, kb: int) -> jax.Array:
  """Inverse of `_scale_stream`: [..., nt, kt*2, 32] uint32 -> bytes [..., N, K/block]."""
  *lead, nt, kr, _ = words.shape
  kt = kr // 2
  b = jnp.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1)
  b = b.reshape(*lead, nt, kt // kb, 128, kb, 2)
  b = jnp.swapaxes(b, -3, -2).reshape(*lead, nt, kt, 128, 2)
  t = np.arange(128)
  w, g, q = t // 32, (t % 32) // 4, t % 4
  per_tile = TILE // block
  out = jnp.zeros((*lead, nt, kt, TILE, per_tile), jnp.uint32)
  blk = (16 * q) // block
  out = out.at[..., w * 16 + g, blk].set(b[..., 0])
  out = out.at[..., w * 16 + 8 + g, blk].set(b[..., 1])
  out = jnp.moveaxis(out, -3, -2)
  return out.reshape(*lead, nt * TILE, kt * per_tile)


@jax.jit
def decode_parts(pw: PackedWeight) -> tuple[jax.Array, jax.Array]:
  """(a, factor): a bf16 `[E, K, N]` = `q * scale * 2**-shift` exactly as the kernel's bf16
  product makes it, and the float32 column factor `[E, N]`; the weight is `a * factor`."""
  fmt = F.get_format(pw.fmt)
  codes = _unpack_words(pw.codes)  # [E, N_pad, K_pad]
  byte = _unscale_stream(pw.scales, fmt.block, pw.kb).astype(jnp.int32)
  bits = (byte << 4) + NV_BIAS if fmt.scale == "e4m3" else byte << 7
  c = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16).astype(jnp.float32)
  q = jnp.asarray(np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                           np.float32))[codes.astype(jnp.int32)]
  # (q * 2**-126) * c in bf16, exact whenever representable (always for realistic scales)
  a = (q * jnp.repeat(c * np.float32(2.0 ** -126), fmt.block, axis=-1)).astype(jnp.bfloat16)
  a = jnp.swapaxes(a, -1, -2)[:, :pw.k, :pw.n]
  return a, pw.factor[:, :pw.n]


def decode_packed(pw: PackedWeight, dtype=jnp.float32) -> jax.Array:
  """Logical weight `[K, N]` / `[E, K, N]` decoded from the kernel layout: `a * factor` in
  float32 (equals `dequantize` of the source QArray up to float32 rounding of `s * g`)."""
  a, factor = decode_parts(pw)
  v = a.astype(jnp.float32) * factor[:, None, :]
  return (v if pw.experts else v[0]).astype(dtype)
