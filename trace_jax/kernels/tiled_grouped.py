"""Grouped (ragged) matmul as a loop over row tiles, each tile holding rows of one group only.

Why: `jax.lax.ragged_dot`, which defines the grouped matmul (`reference.grouped_matmul_ref`)
and was the trainer's for float32 experts until session 51, is lowered by XLA:GPU (jax 0.11.2,
and XLA:CPU likewise slow) by expanding x to
`[M, E, K]` with the other groups' columns zeroed and one dense `[M, E K] x [E K, N]` product:
E times the products' work and memory (deviceless compile for an H200, session 51: 12 GiB of
temporaries for the forward of 12,288 rows x 128 experts, K 2048, N 1536; the 4-layer
30B-A3B train step asked for 36-96 GiB and did not fit an H100). Here the rows, sorted by group,
are laid into tiles of `tile` rows (a group's last tile padded with zero rows), and a
`lax.scan` multiplies each tile by its group's weight. The loop runs ceil(M / tile) + E tiles (a
static count: at most one partly filled tile a group, the rest padding), so the tile shrinks to
about M / E rows where the rows are few (`tile_for`); the temporaries are the tiled rows,
`[(M + E tile), K]` and `[(M + E tile), N]`.

Measured: on an H100 (session 52, CUPTI device time of forward + dx + dw, benchmarks/
bench_tiled_grouped.py) one 30B-A3B expert product, 16,384 rows x 128 experts, K 2048, N 1536:
ragged_dot 786 ms, tiles of 128 rows 29.3 ms, 16 of them a loop step 21.7 ms (a second run:
16 / 32 / 64 a step 21.7 / 20.7 / 20.2); bench_parallel's mid shape (49,152 rows, 32 experts,
512 x 512) 56.7 / 12.1 / 4.3 ms (second run: 4.8 / 4.0 / 3.9, tiles of 256 at 16 a step 3.5);
the mid train step 0.729 / 0.241 / 0.090 s; the 4-layer 30B-A3B train step (out of memory with
ragged_dot) 0.262 s at 16 a step. On 2 CPU cores (session 51) the tiny train step 0.283-0.321
s against 0.395-0.463 s with ragged_dot.
Compiled for an H200 (deviceless), the gradient of a 12,288-row 30B-A3B expert product holds
0.62 GiB of temporaries against 21 GiB. `dispatch.grouped_matmul` takes it by default, with
tiles of up to 256 rows, 32 a step (TRACE_JAX_GROUPED_REF, TRACE_JAX_GROUPED_TILE,
TRACE_JAX_GROUPED_TILES_PER_STEP).

A loop step may take `per_step` tiles at once (one batched product, their weights gathered:
`per_step` [K, N] copies): fewer steps where each step's fixed costs (its ~10 kernel launches,
the weight copy XLA makes for `w[g]`) are large against a small tile's product (above: 2.9-3.8x
faster at the mid shape, 1.35-1.49x at 30B-A3B's). On the CPU the bits do not change with it (tiny
train step, 3 steps: the same parameter hash at 1, 4, 16 and 32); on the H100 the products
at 16, 32 and 64 a step were bit for bit equal, the mid train step at 1 and 16 was not (each
repeatable).

The gradient is a custom VJP in the same loop: dx tile by tile, and dw summed tile after tile
into its group's slot (a dynamic-update-slice in the loop's carry: a fixed order, no atomics).
Products at `precision` (HIGHEST: full float32) with float32 accumulation; the result float32.
Rows past `sum(group_sizes)` give zeros, as `ragged_dot`'s do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def step_shape(m: int, num_groups: int, tile: int, per_step: int = 1) -> tuple[int, int]:
  """(loop steps, tiles a step) for m rows: tiles enough for any group sizes,
  sum(ceil(s / tile)) <= m / tile + groups, in as few steps of at most `per_step` tiles as
  can hold them, the tiles spread evenly over the steps (padding: fewer tiles than steps)."""
  t = -(-m // tile) + num_groups
  steps = -(-t // per_step)
  return steps, -(-t // steps)


def tile_count(m: int, num_groups: int, tile: int, per_step: int = 1) -> int:
  """The tiles of `step_shape`: loop steps x tiles a step."""
  steps, per = step_shape(m, num_groups, tile, per_step)
  return steps * per


def tile_table(group_sizes: jax.Array, m: int, tile: int, per_step: int = 1):
  """(slot_row [T * tile], row_slot [m], tile_group [T]) for m rows sorted by group:
  slot s of the tiles holds row slot_row[s] (m: a zero row), row r sits at slot row_slot[r]
  (T * tile for rows past the groups: a zero row), tile t multiplies group tile_group[t]
  (tiles past the last group's: the last group, their rows zeros)."""
  e = group_sizes.shape[0]
  t = tile_count(m, e, tile, per_step)
  gs = group_sizes.astype(jnp.int32)
  ends = jnp.cumsum(gs)
  tiles = (gs + tile - 1) // tile
  tile_ends = jnp.cumsum(tiles)
  rows = jnp.arange(m, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), e - 1).astype(jnp.int32)
  within = rows - (ends - gs)[group]
  slot = (tile_ends - tiles)[group] * tile + within
  row_slot = jnp.where(rows < ends[-1], slot, t * tile).astype(jnp.int32)
  # (rows past the groups all point past the end: dropped)
  slot_row = jnp.full((t * tile,), m, jnp.int32).at[row_slot].set(rows, mode="drop")
  tile_group = jnp.minimum(jnp.searchsorted(tile_ends, jnp.arange(t), side="right"), e - 1)
  return slot_row, row_slot, tile_group.astype(jnp.int32)


def tile_for(m: int, num_groups: int, largest: int) -> int | None:
  """The tile for m rows in num_groups groups: the power of two at or above m / num_groups, at
  least 16 and at most `largest` (the loop runs up to one padding tile a group, so fewer rows
  take smaller tiles); None below 16 rows a group (a decode step's few rows: ragged_dot's
  expansion then costs less than the loop; on 2 CPU cores, 32 rows x 8 groups: 134 us against
  179 with tiles, 1,024 x 8: 1,666 against 844, session 51)."""
  if m < 16 * num_groups:
    return None
  per_group = -(-m // num_groups)
  return max(1, min(largest, 1 << (per_group - 1).bit_length()))


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int = 128,
                   per_step: int = 1, precision=jax.lax.Precision.HIGHEST) -> jax.Array:
  """float32 `[M, N]`: rows of group e of x `[M, K]` (sorted by group) times w[e] `[K, N]`, in
  tiles of `tile` rows (see `tile_for` for a tile sized to the rows), `per_step` tiles a loop
  step (one batched product: fewer, larger steps, for `per_step` weight copies of [K, N])."""
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or group_sizes.shape != w.shape[:1]:
    raise ValueError(f"tiled grouped matmul: x [M, K], w [E, K, N], group_sizes [E]; got "
                     f"{x.shape}, {w.shape}, {group_sizes.shape}")
  if tile < 1 or per_step < 1:
    raise ValueError(f"tiled grouped matmul: tile and per_step must be >= 1, got {tile}, "
                     f"{per_step}")
  return _grouped(jnp.asarray(x), jnp.asarray(w), jnp.asarray(group_sizes), tile, per_step,
                  precision)


def _tiles(a, slot_row, steps, per_step, tile):
  """a's rows laid into the tiles `[steps, per_step, tile, ...]` (zeros for the empty slots,
  whose index is past a's rows)."""
  return jnp.take(a, slot_row, axis=0, mode="fill", fill_value=0).reshape(
      steps, per_step, tile, *a.shape[1:])


def _rows(tiles, row_slot):
  """The tiles' rows back in row order (zeros for rows past the groups, whose slot is past the
  tiles)."""
  return jnp.take(tiles.reshape(-1, tiles.shape[-1]), row_slot, axis=0, mode="fill",
                  fill_value=0)


def _dot(spec, a, b, precision):
  return jnp.einsum(spec, a.astype(jnp.float32), b.astype(jnp.float32), precision=precision,
                    preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped(x, w, group_sizes, tile, per_step, precision):
  return _forward(x, w, group_sizes, tile, per_step, precision)[0]


def _forward(x, w, group_sizes, tile, per_step, precision):
  m = x.shape[0]
  slot_row, row_slot, tile_group = tile_table(group_sizes, m, tile, per_step)
  steps, per_step = step_shape(m, w.shape[0], tile, per_step)
  xt = _tiles(x, slot_row, steps, per_step, tile)

  def one(_, inputs):
    x_tiles, g = inputs  # [per_step, tile, K], [per_step]
    return None, _dot("btk,bkn->btn", x_tiles, w[g], precision)

  _, yt = jax.lax.scan(one, None, (xt, tile_group.reshape(steps, per_step)))
  # x, not its tiles (larger by the padding), kept for the backward
  return _rows(yt, row_slot), (x, w, slot_row, row_slot, tile_group)


def _grouped_bwd(tile, per_step, precision, res, dy):
  x, w, slot_row, row_slot, tile_group = res
  steps, per_step = step_shape(x.shape[0], w.shape[0], tile, per_step)
  xt = _tiles(x, slot_row, steps, per_step, tile)
  dyt = _tiles(dy.astype(jnp.float32), slot_row, steps, per_step, tile)
  k, n = w.shape[1:]

  def one(dw, inputs):
    x_tiles, dy_tiles, g = inputs
    dx_tiles = _dot("btn,bkn->btk", dy_tiles, w[g], precision)
    parts = _dot("btk,btn->bkn", x_tiles, dy_tiles, precision)
    # each tile's dw added to its group's slot, tile after tile (a fixed order; tiles of one
    # step may share a group)
    for i in range(per_step):
      part = jax.lax.dynamic_slice(dw, (g[i], 0, 0), (1, k, n))
      dw = jax.lax.dynamic_update_slice(dw, part + parts[i][None], (g[i], 0, 0))
    return dw, dx_tiles

  dw, dxt = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32),
                         (xt, dyt, tile_group.reshape(steps, per_step)))
  return _rows(dxt, row_slot).astype(x.dtype), dw.astype(w.dtype), None


_grouped.defvjp(_forward, _grouped_bwd)
