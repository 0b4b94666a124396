"""`kernels.tiled_grouped`: the tile table by enumeration (every row in a tile of its own group,
at one slot, tiles within the static count), the product and its gradient against float64
enumeration row by row (empty groups, rows past the groups, tiles of 1 row up to more than M),
bit-for-bit repeats, and `dispatch.grouped_matmul`'s default tiles path against its ragged_dot
one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.kernels import dispatch, tiled_grouped

SIZES = [3, 0, 9, 1, 4]  # 17 rows in groups, an empty group; M = 20 leaves 3 rows past them


def _case(m=20, k=6, n=7, seed=0):
  rng = np.random.default_rng(seed)
  e = len(SIZES)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((e, k, n)).astype(np.float32)
  gy = rng.standard_normal((m, n)).astype(np.float32)
  group = np.repeat(np.arange(e), SIZES)  # the group of each row in the groups
  return x, w, gy, group


@pytest.mark.parametrize("tile,per_step", [(1, 1), (3, 1), (4, 1), (32, 1), (3, 4), (1, 16)])
def test_tile_table_places_each_row_in_a_tile_of_its_group(tile, per_step):
  m = 20
  slot_row, row_slot, tile_group = map(np.asarray, tiled_grouped.tile_table(
      jnp.asarray(SIZES), m, tile, per_step))
  t = tiled_grouped.tile_count(m, len(SIZES), tile, per_step)
  steps, per = tiled_grouped.step_shape(m, len(SIZES), tile, per_step)
  need = -(-m // tile) + len(SIZES)
  # as few steps as hold the tiles, at most per_step a step, less padding than a tile a step
  assert steps * per == t and per <= per_step and (steps - 1) * per_step < need <= t
  assert t - need < steps
  assert tile_group.shape == (t,) and slot_row.shape == (t * tile,)
  group = np.repeat(np.arange(len(SIZES)), SIZES)
  for r, g in enumerate(group):
    s = row_slot[r]
    assert slot_row[s] == r and tile_group[s // tile] == g
  assert np.all(row_slot[len(group):] == t * tile)  # rows past the groups: the zero row
  assert np.sum(slot_row < m) == len(group)  # every other slot is padding
  # a group's tiles are consecutive and as few as its rows need
  for g, size in enumerate(SIZES):
    used = {row_slot[r] // tile for r in np.flatnonzero(group == g)}
    assert len(used) == -(-size // tile)


# (3, 4): the 9-row group's three tiles in one loop step, their dw parts added in turn
@pytest.mark.parametrize("tile,per_step", [(1, 1), (3, 1), (128, 1), (3, 4), (1, 5), (4, 16)])
def test_product_and_gradient_against_enumeration(tile, per_step):
  x, w, gy, group = _case()
  sizes = jnp.asarray(SIZES)

  def product(x, w):
    return tiled_grouped.grouped_matmul(x, w, sizes, tile=tile, per_step=per_step)

  def loss(x, w):
    return jnp.sum(product(x, w) * gy)

  y = np.asarray(product(x, w))
  x64, w64, gy64 = (a.astype(np.float64) for a in (x, w, gy))
  want = np.zeros((x.shape[0], w.shape[2]))
  want_dx, want_dw = np.zeros(x.shape), np.zeros(w.shape)
  for r, g in enumerate(group):
    want[r] = x64[r] @ w64[g]
    want_dx[r] = gy64[r] @ w64[g].T
    want_dw[g] += np.outer(x64[r], gy64[r])
  np.testing.assert_allclose(y, want, rtol=0, atol=2e-5)
  assert not y[len(group):].any()  # rows past the groups
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  dx, dw = (np.asarray(a) for a in grad(x, w))
  np.testing.assert_allclose(dx, want_dx, rtol=0, atol=2e-5)
  np.testing.assert_allclose(dw, want_dw, rtol=0, atol=5e-5)
  assert not dw[1].any() and not dx[len(group):].any()  # the empty group, rows past
  again = grad(x, w)
  np.testing.assert_array_equal(dw, np.asarray(again[1]))


def test_bf16_inputs_keep_their_dtype_in_the_gradient():
  x, w, gy, _ = _case()
  xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  y = tiled_grouped.grouped_matmul(xb, wb, jnp.asarray(SIZES), tile=4)
  assert y.dtype == jnp.float32
  dx, dw = jax.grad(lambda a, b: jnp.sum(tiled_grouped.grouped_matmul(
      a, b, jnp.asarray(SIZES), tile=4) * gy), argnums=(0, 1))(xb, wb)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16


def test_bad_shapes_and_tile_are_named():
  with pytest.raises(ValueError, match="x \\[M, K\\], w \\[E, K, N\\]"):
    tiled_grouped.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 5, 2)), jnp.asarray([2, 2]))
  for bad in (dict(tile=0), dict(per_step=0)):
    with pytest.raises(ValueError, match="tile and per_step must be >= 1"):
      tiled_grouped.grouped_matmul(jnp.zeros((4, 3)), jnp.zeros((2, 3, 2)),
                                   jnp.asarray([2, 2]), **bad)


def test_tile_for_sizes_tiles_to_the_rows():
  assert tiled_grouped.tile_for(79, 5, 128) is None  # under 16 rows a group: ragged_dot
  assert tiled_grouped.tile_for(80, 5, 128) == 16
  assert tiled_grouped.tile_for(81, 5, 128) == 32  # 17 rows a group: the power of two above
  assert tiled_grouped.tile_for(24576, 8, 128) == 128  # capped


def test_dispatch_takes_the_tiles_by_default(monkeypatch):
  """grouped_matmul with rows (a MoE dispatch) on the tiles path (the default): the same values
  and gradient as TRACE_JAX_GROUPED_REF=ragged_dot (float32 rounding apart), and only the
  latter's program has a ragged_dot."""
  rng = np.random.default_rng(1)
  sizes, k, n = jnp.asarray([30, 0, 41, 16, 9]), 6, 7  # 96 rows: tiles of 32
  x = rng.standard_normal((96, k)).astype(np.float32)
  w = rng.standard_normal((5, k, n)).astype(np.float32)
  rows = jnp.asarray(rng.integers(0, 96, 96))
  gy = rng.standard_normal((96, n)).astype(np.float32)

  def run():  # (a new function each time: jit's trace cache is keyed by the function)
    def loss(x, w):
      return jnp.sum(dispatch.grouped_matmul(x, w, sizes, rows=rows) * gy)
    return jax.grad(loss, argnums=(0, 1))(x, w), str(jax.make_jaxpr(loss)(x, w))

  assert dispatch._GROUPED_REF == "tiles"
  got, program = run()
  assert "ragged_dot" not in program
  monkeypatch.setattr(dispatch, "_GROUPED_REF", "ragged_dot")
  want, program = run()
  assert "ragged_dot" in program
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=5e-5)
