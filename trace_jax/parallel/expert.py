"""Expert parallelism for the MoE layer: (token, slot) pairs travel to the shard that owns
their expert with `all_to_all` under `jax.shard_map`, are computed there with the grouped
matmul, and travel back.

Layout: the `expert` mesh axis splits the stacked expert weights `[E, ...]` (shard j owns experts
`j * E / n .. (j + 1) * E / n - 1`) and, like every batch axis, the tokens; pairs are exchanged
among the `expert` peers of one data/fsdp coordinate. Inside the layer each shard holds whole
experts: their `fsdp`/`tensor` shards are gathered on entry (tensor parallelism of experts is the
GSPMD path, `ModelConfig.moe_dispatch == "dropless"`).

Dispatch ("fixed capacity", every backend): a static buffer of `C` rows per (source, target)
shard pair. `C = capacity_factor * local pairs / n` rounded up (at most all local pairs); with
`capacity_factor <= 0` C is all local pairs, so nothing can be dropped (the buffer is n times the
pairs). A pair past its target's capacity is dropped (contributes 0) and counted. When nothing
is dropped the result is the dense dropless layer's: every row meets the same weights.

Dispatch ("ragged", GPU): `ragged_all_to_all` moves exactly the routed rows (receive buffer
sized for the worst case), capacity-free. "auto" picks it on GPU, where it passed the 2-GPU check
(tests/parallel/test_expert.py, marked gpu: equal to the single-device MoE to 1e-4, H200 x2,
2026-11-30) and ran the rollout and train step of benchmarks/bench_parallel.py; XLA:CPU has no
`ragged_all_to_all`, so "auto" is "fixed" there.

Row-wise side data travels with the rows: the TRACE guidance of the `experts/down_in` site goes
out with its pairs, and what the site records comes back in canonical (token, slot) order.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from trace_jax import kernels
from trace_jax import quant as tq

_BLOCKED = (tq.QArray, tq.Guidance)


def _is_blocked(x) -> bool:
  return isinstance(x, _BLOCKED)


def _map_rows(tree, fn, rows: int):
  """`fn` on every row-first leaf of a tree of arrays/QArrays/Guidance (shapes follow)."""
  def one(x):
    if _is_blocked(x):
      return tq.map_blocked(x, fn, (rows,) + tuple(x.shape[1:]))
    return fn(x)
  return jax.tree_util.tree_map(one, tree, is_leaf=_is_blocked)


def _wire(collective):
  """`collective` applied to bytes for bool and 1-byte float leaves (FP8 scales, masks): what
  the GPU collectives move for sure, and bit-exact."""
  def run(a):
    if a.dtype == jnp.bool_:
      return collective(a.astype(jnp.uint8)).astype(jnp.bool_)
    if a.dtype.itemsize == 1 and not jnp.issubdtype(a.dtype, jnp.integer):
      out = collective(jax.lax.bitcast_convert_type(a, jnp.uint8))
      return jax.lax.bitcast_convert_type(out, a.dtype)
    return collective(a)
  return run


def _local_weight(w):
  """A shard of stacked expert weights; a QArray's static shape follows its local leaves."""
  if isinstance(w, tq.QArray):
    return tq.map_blocked(w, lambda a: a, (w.codes.shape[0],) + tuple(w.shape[1:]))
  return w


def batch_axes(mesh) -> tuple[str, ...]:
  from trace_jax.parallel.rules import LOGICAL_RULES
  return tuple(a for a in LOGICAL_RULES["batch"] if mesh.shape.get(a, 1) > 1)


def context_mesh():
  """The mesh set by `jax.set_mesh` while tracing, when it has an `expert` axis > 1."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or mesh.shape.get("expert", 1) <= 1:
    return None
  return mesh


def capacity(local_pairs: int, n_shards: int, capacity_factor: float) -> int:
  if capacity_factor <= 0:
    return local_pairs
  return max(1, min(local_pairs, math.ceil(capacity_factor * local_pairs / n_shards)))


def resolve_mode(mode: str) -> str:
  if mode not in ("auto", "fixed", "ragged"):
    raise ValueError(f"unknown expert-parallel dispatch {mode!r}; use 'auto', 'fixed' or "
                     "'ragged'")
  if mode == "auto":
    return "ragged" if jax.default_backend() == "gpu" else "fixed"
  return mode


def routed_experts(x, idx, w_gu, w_dn, *, mesh, ffn: int, dtype, capacity_factor: float = 0.0,
                   mode: str = "auto",
                   site_fn: Callable[[jax.Array, Any], tuple[jax.Array, dict]] | None = None,
                   site_guidance=None):
  """The routed experts' output per (token, slot) pair, expert parallel over `mesh`.

  x `[N, D]` (the layer's quantized input rows), idx `[N, k]` expert ids, w_gu `[E, D, 2F]`,
  w_dn `[E, F, D]` (arrays or QArrays). site_fn(h, guidance_rows) -> (h, records) quantizes the
  down-projection input rows (guidance_rows: `site_guidance` `[N * k, F]` dispatched with them).
  Returns (y `[N, k, D]`, records with rows `[N * k, ...]` in (token, slot) order, dropped pairs
  (int32 scalar, summed over the mesh))."""
  mode = resolve_mode(mode)
  n, k = idx.shape
  e = w_gu.shape[0]
  n_ep = mesh.shape["expert"]
  if e % n_ep:
    raise ValueError(f"{e} experts do not split over an expert axis of {n_ep}")
  rows_axes = batch_axes(mesh)
  n_rows_shards = math.prod(mesh.shape[a] for a in rows_axes)
  if n % n_rows_shards:
    raise ValueError(f"{n} tokens do not split over the batch axes {rows_axes} "
                     f"({n_rows_shards} shards) for expert parallelism")
  e_loc = e // n_ep
  local_pairs = (n // n_rows_shards) * k
  cap = capacity(local_pairs, n_ep, capacity_factor) if mode == "fixed" else local_pairs
  site_fn = site_fn or (lambda h, g: (h, {}))
  row_spec = P(rows_axes)

  def body(x, idx, w_gu, w_dn, guid):
    w_gu, w_dn = _local_weight(w_gu), _local_weight(w_dn)
    nl = x.shape[0]
    flat = idx.reshape(-1)  # pair p = token * k + slot
    target = flat // e_loc
    pair_rows = {"x": jnp.repeat(x, k, axis=0), "e": (flat % e_loc).astype(jnp.int32)}
    if guid is not None:
      pair_rows["g"] = guid
    if mode == "fixed":
      recv, back = _fixed_dispatch(pair_rows, target, n_ep, cap)
    else:
      recv, back = _ragged_dispatch(pair_rows, target, n_ep)
    valid = recv["valid"]
    e_local = jnp.where(valid, recv["e"], e_loc)  # invalid rows sort last
    order, inverse = kernels.sort_by_group(e_local)
    group_sizes = kernels.count_by_group(e_local, e_loc)  # id e_loc: not local
    xs = recv["x"][order].astype(dtype)
    gu = kernels.grouped_matmul(xs, w_gu, group_sizes, out_dtype=dtype)
    h = jax.nn.silu(gu[:, :ffn]) * gu[:, ffn:]
    g_rows = None
    if "g" in recv:
      g_rows = _map_rows(recv["g"], lambda a: a[order], xs.shape[0])
    h, rec = site_fn(h, g_rows)
    ys = kernels.grouped_matmul(h, w_dn, group_sizes, out_dtype=dtype)
    out = {"y": ys[inverse], "rec": _map_rows(rec, lambda a: a[inverse], xs.shape[0])}
    got, dropped = back(out)
    dropped = jax.lax.psum(dropped, tuple(mesh.axis_names))
    return got["y"].reshape(nl, k, -1), got["rec"], dropped

  fn = jax.shard_map(body, mesh=mesh,
                     in_specs=(row_spec, row_spec, P("expert"), P("expert"), row_spec),
                     out_specs=(row_spec, row_spec, P()), check_vma=False)
  return fn(x, idx, w_gu, w_dn, site_guidance)


def _fixed_dispatch(pair_rows, target, n_ep: int, cap: int):
  """Pairs into `cap` rows per target shard (rank among the pairs with the same target), one
  `all_to_all` each way."""
  pairs = target.shape[0]
  onehot = jax.nn.one_hot(target, n_ep, dtype=jnp.int32)  # [pairs, n_ep]
  rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
  keep = rank < cap
  slot = jnp.where(keep, target * cap + rank, n_ep * cap)  # out of range: dropped
  rows = n_ep * cap

  a2a = _wire(lambda a: jax.lax.all_to_all(a, "expert", 0, 0, tiled=True))

  def send(a):
    return a2a(jnp.zeros((rows,) + a.shape[1:], a.dtype).at[slot].set(a, mode="drop"))

  payload = dict(pair_rows, valid=jnp.ones((pairs,), bool))
  recv = _map_rows(payload, send, rows)

  def back(out):
    def ret(a):
      a = a2a(a)
      safe = jnp.minimum(slot, rows - 1)
      got = a[safe]
      mask = keep.reshape((pairs,) + (1,) * (got.ndim - 1))
      return jnp.where(mask, got, jnp.zeros_like(got))
    return _map_rows(out, ret, pairs), jnp.sum(~keep).astype(jnp.int32)

  return recv, back


def _ragged_dispatch(pair_rows, target, n_ep: int):
  """Exactly the routed rows with `ragged_all_to_all` (GPU); receive buffers hold the worst
  case (every peer's pairs), so nothing is dropped."""
  pairs = target.shape[0]
  order, inv = kernels.sort_by_group(target)
  send_sizes = kernels.count_by_group(target, n_ep)
  in_off = jnp.cumsum(send_sizes) - send_sizes
  all_sizes = jax.lax.all_gather(send_sizes, "expert")  # [src, dst]
  me = jax.lax.axis_index("expert")
  # Where my rows land in each receiver's buffer: after the rows of lower-ranked senders.
  out_off = jnp.sum(jnp.where(jnp.arange(n_ep)[:, None] < me, all_sizes, 0), axis=0)
  recv_sizes = all_sizes[:, me]
  rows = n_ep * pairs

  def send(a):
    return _wire(lambda a: jax.lax.ragged_all_to_all(
        a, jnp.zeros((rows,) + a.shape[1:], a.dtype), in_off, send_sizes, out_off, recv_sizes,
        axis_name="expert"))(a[order])

  payload = dict(pair_rows, valid=jnp.ones((pairs,), bool))
  recv = _map_rows(payload, send, rows)
  # Returning: receivers send each sender's rows back to where they came from.
  back_in_off = jnp.cumsum(recv_sizes) - recv_sizes
  # Offset of my rows inside each sender's sorted pair list: its rows to lower-ranked receivers.
  back_out_off = (jnp.cumsum(all_sizes, axis=1) - all_sizes)[:, me]

  def back(out):
    def ret(a):
      got = _wire(lambda a: jax.lax.ragged_all_to_all(
          a, jnp.zeros((pairs,) + a.shape[1:], a.dtype), back_in_off, recv_sizes, back_out_off,
          send_sizes, axis_name="expert"))(a)
      return got[inv]
    return _map_rows(out, ret, pairs), jnp.int32(0)

  return recv, back
