"""Row gathers whose gradients add repeated rows in a fixed order.

The gradient of `x[rows]` is a scatter-add into x's shape. Where `rows` names a row more than
once, XLA:GPU adds the repeats with atomics in whatever order the threads arrive, so the train
step's sums change in their last bits from run to run: on an H100 (session 50,
benchmarks/loop_repeats.py) two runs of the small RL loop in one process parted at the second
step's parameters, and a killed run's resumption parted from the uninterrupted run. XLA's
deterministic ops (`rl.deterministic`) make every scatter deterministic, at 1.40x the mid-shape
train step's time (benchmarks/train_determinism.py). A scatter that adds once to each place is
deterministic already, whatever the order; only repeats need a fixed order. Two gathers repeat
rows, and each adds its repeats in a fixed order:
- the token embedding lookup (`models.transformer`): `take_rows`, whose gradient sorts the
  cotangent rows by row and sums each run of equal rows by a segmented scan;
- the MoE layer's dispatch of each token to its k experts (`dispatch.grouped_matmul`'s rows, on
  the XLA and reference paths): `take_copies`. Every token is taken k times and the routing's
  inverse permutation says where, so its gradient gathers each token's k cotangents and sums
  them (XLA's reduction over the k slots: a fixed order), with neither sort nor scatter
  (session 50 used `take_rows` here too).
  Its backward at a 30B-A3B layer's 32,768 tokens x top-8, width 2048, bf16 (H100, session 51,
  benchmarks/bench_take_rows.py): 0.40 ms, against 2.88 ms sorted and 4.90 ms for XLA's
  scatter-add.
With `take_rows` in both places and without deterministic ops (H100, session 50) 3 runs of the
loop repeated every step and the resumed run matched; the mid-shape train step took 0.742 s
against 0.734 s with plain gathers (one process each: within the spread between processes).

Costs not measured: with the tokens sharded over a mesh, `take_rows`' sort runs over the whole
batch (XLA gathers the cotangent rows to every device; on fake CPU devices: an all-gather and
sorts where the plain gather had none); `take_copies`' gather by the routing's global inverse
likewise reads cotangent rows from every device. Both are custom VJPs: forward-mode differentiation
(`jax.jvp`) through them raises.

TRACE_JAX_TAKE_ROWS (an A/B switch, read at import): `repeatable` (the default), `sorted`
(`take_copies` takes `take_rows`' sorted sum, as in session 50) or `plain` (both are the plain
gather, whose gradient XLA:GPU adds with atomics).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from trace_jax.settings import choice_setting

_TAKE_ROWS = choice_setting(
    "TRACE_JAX_TAKE_ROWS", "repeatable", ("repeatable", "sorted", "plain"),
    doc="repeated-row gathers' gradients in a fixed order, sorted, or XLA's scatter")


def take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
  """`x[rows]` along axis 0 (rows: int `[M]`, each in [0, n): `jnp.take`'s fill, NaN, for others);
  its gradient adds the cotangent rows of each x row in a fixed order: sorted stably by row,
  summed by a segmented scan, each sum added once to its row."""
  if rows.ndim != 1:
    raise ValueError(f"take_rows: rows must be 1-D, got shape {rows.shape}")
  if _TAKE_ROWS == "plain":
    return jnp.take(x, rows, axis=0)
  return _take_rows(x, rows.astype(jnp.int32), x.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take_rows(x, rows, n):
  del n
  return jnp.take(x, rows, axis=0)


def _take_rows_fwd(x, rows, n):
  return _take_rows(x, rows, n), rows


def _segment_sums(values, starts):
  """Inclusive sums within segments of `values [M, D]` (a segment begins where `starts [M]`)."""
  def add(a, b):
    (sa, va), (sb, vb) = a, b
    return sa | sb, jnp.where(sb[:, None], vb, va + vb)
  return jax.lax.associative_scan(add, (starts, values), axis=0)[1]


def _take_rows_bwd(n, rows, g):
  m = rows.shape[0]
  if m == 0:
    return jnp.zeros((n,) + g.shape[1:], g.dtype), None
  flat = g.reshape(m, math.prod(g.shape[1:]))
  order = jnp.argsort(rows, stable=True)
  r = rows[order]
  differs = r[1:] != r[:-1]
  sums = _segment_sums(flat[order], jnp.concatenate([jnp.ones((1,), bool), differs]))
  # each row's total sits at its segment's end: written there once (others fall out of range)
  dest = jnp.where(jnp.concatenate([differs, jnp.ones((1,), bool)]), r, n)
  out = jnp.zeros((n, flat.shape[1]), g.dtype).at[dest].add(sums, mode="drop")
  return out.reshape((n,) + g.shape[1:]), None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def take_copies(x: jax.Array, rows: jax.Array, inverse: jax.Array) -> jax.Array:
  """`x[rows]` along axis 0 where each of x's n rows is taken c = len(rows) / n times, at the
  places `inverse` lists: `rows[inverse[t * c + j]] == t` for j < c (a MoE layer's dispatch:
  rows = order // k, inverse = order's inverse permutation). Its gradient gathers row t's c
  cotangents `g[inverse[t * c:(t + 1) * c]]` and sums them (an XLA reduction over the c slots,
  deterministic; float32 sums for narrower types): one gather and a reduction, no sort, no
  scatter. Rows and inverse are not checked against each other (they are traced): a wrong
  inverse gives a wrong gradient. TRACE_JAX_TAKE_ROWS=sorted or =plain: `take_rows`."""
  if rows.ndim != 1 or inverse.shape != rows.shape:
    raise ValueError(f"take_copies: rows and inverse must be 1-D and alike, got {rows.shape} "
                     f"and {inverse.shape}")
  n = x.shape[0]
  if (n == 0) != (rows.shape[0] == 0) or (n and rows.shape[0] % n):
    raise ValueError(f"take_copies: {rows.shape[0]} rows do not take each of x's {n} rows "
                     "equally often")
  if _TAKE_ROWS != "repeatable":  # (its sorted sum, or the plain gather)
    return take_rows(x, rows)
  return _take_copies(x, rows.astype(jnp.int32), inverse.astype(jnp.int32))


@jax.custom_vjp
def _take_copies(x, rows, inverse):
  del inverse
  return jnp.take(x, rows, axis=0)


def _take_copies_fwd(x, rows, inverse):
  return _take_copies(x, rows, inverse), (inverse, x.shape[0])


def _take_copies_bwd(res, g):
  inverse, n = res
  if n == 0:
    return jnp.zeros(g.shape, g.dtype), None, None
  copies = jnp.take(g, inverse, axis=0).reshape(n, inverse.shape[0] // n, *g.shape[1:])
  acc = jnp.promote_types(g.dtype, jnp.float32)
  return jnp.sum(copies, axis=1, dtype=acc).astype(g.dtype), None, None


_take_copies.defvjp(_take_copies_fwd, _take_copies_bwd)
