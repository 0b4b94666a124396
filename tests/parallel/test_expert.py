"""Expert parallelism (all_to_all under shard_map, fixed capacity on XLA:CPU): equal to the dense
dropless MoE when nothing is dropped; dropped pairs counted exactly when capacity runs out."""

import functools
import math

import jax
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import parallel as par
from trace_jax.parallel import expert as ep

CFG = M.tiny(num_layers=2)
MESH = dict(data=2, expert=4)
_apply = jax.jit(lambda p, t, c: M.apply(p, t, c), static_argnums=2)


@functools.lru_cache(maxsize=None)
def _params():
  return M.init_params(CFG, jax.random.key(0))


def _tokens():
  return jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)


def _ep_apply(capacity_factor):
  mesh = par.make_mesh(MESH)
  cfg = CFG.replace(expert_parallel="fixed", expert_capacity_factor=capacity_factor)
  tokens = _tokens()
  with jax.set_mesh(mesh):
    return _apply(par.shard_params(_params(), mesh),
                  jax.device_put(tokens, par.batch_shardings(tokens, mesh)), cfg)


def _expected_drops(routes, capacity_factor):
  """Independent count: per (row shard, target expert shard), pairs past the capacity."""
  n_rows = MESH["data"] * MESH["expert"]
  e_loc = CFG.num_experts // MESH["expert"]
  total = 0
  for layer in np.asarray(routes):  # [B, T, k]
    pairs = layer.reshape(n_rows, -1)  # row shards hold consecutive batch rows
    cap = ep.capacity(pairs.shape[1], MESH["expert"], capacity_factor)
    for shard in pairs:
      counts = np.bincount(shard // e_loc, minlength=MESH["expert"])
      total += int(np.sum(np.maximum(counts - cap, 0)))
  return total


def test_fixed_capacity_without_drops_equals_dense_dropless():
  ref = _apply(_params(), _tokens(), CFG)
  out = _ep_apply(0.0)
  assert int(out.dropped_pairs) == 0 and int(ref.dropped_pairs) == 0
  np.testing.assert_array_equal(np.asarray(out.routes), np.asarray(ref.routes))
  # Only the grouped matmuls' row counts differ (float32 accumulation order).
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=0, atol=1e-5)
  np.testing.assert_allclose(float(out.aux_loss), float(ref.aux_loss), rtol=1e-6)


def test_dropped_pairs_are_counted_exactly():
  # Half the even share: imbalanced routing overflows. The first MoE layer's input does not
  # depend on dropping, so its routes are the dense forward's.
  ref = _apply(_params(), _tokens(), CFG)
  want = _expected_drops(ref.routes[:1], 0.5)
  assert want > 0 and _ep_apply_layer0_drops(0.5) == want


def _ep_apply_layer0_drops(capacity_factor):
  # A one-layer model: its dropped count is the first layer's alone.
  cfg = CFG.replace(num_layers=1, expert_parallel="fixed",
                    expert_capacity_factor=capacity_factor)
  params = {k: v for k, v in _params().items() if k != "layers_1"}
  mesh = par.make_mesh(MESH)
  tokens = _tokens()
  with jax.set_mesh(mesh):
    out = _apply(par.shard_params(params, mesh),
                 jax.device_put(tokens, par.batch_shardings(tokens, mesh)), cfg)
  return int(out.dropped_pairs)


def test_capacity_and_mode_errors():
  assert ep.capacity(96, 4, 0.0) == 96
  assert ep.capacity(96, 4, 1.0) == 24
  assert ep.capacity(96, 4, 1.25) == math.ceil(1.25 * 24)
  assert ep.capacity(96, 4, 100.0) == 96
  assert ep.resolve_mode("auto") == ("ragged" if jax.default_backend() == "gpu" else "fixed")
  with pytest.raises(ValueError, match="unknown expert-parallel dispatch"):
    ep.resolve_mode("bogus")
  with pytest.raises(ValueError, match="expert_parallel 'x'"):
    CFG.replace(expert_parallel="x")


@pytest.mark.gpu
def test_ragged_dispatch_equals_dense_on_gpu():
  """GPU only: XLA:CPU has no ragged_all_to_all."""
  if jax.device_count() < 2 or jax.default_backend() != "gpu":
    pytest.skip("needs 2 GPUs")
  mesh = par.make_mesh(dict(expert=2))
  cfg = CFG.replace(expert_parallel="ragged")
  tokens = _tokens()
  ref = _apply(_params(), tokens, CFG)
  with jax.set_mesh(mesh):
    out = _apply(par.shard_params(_params(), mesh),
                 jax.device_put(tokens, par.batch_shardings(tokens, mesh)), cfg)
  np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), rtol=0, atol=1e-4)
