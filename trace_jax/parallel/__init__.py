"""Meshes, logical-axis sharding rules, expert parallelism and multi-host setup on top of
JAX's own SPMD runtime (GSPMD under `jax.jit`, `jax.shard_map` collectives,
`jax.distributed`)."""

from trace_jax.parallel.mesh import AXES, MeshConfig, axis_size, make_mesh
from trace_jax.parallel.rules import (LOGICAL_RULES, PARAM_AXES, batch_shardings, cache_shardings,
                                      logical_to_spec, param_logical_axes, param_shardings,
                                      replicated, routes_shardings, shard_params)

__all__ = [
    "AXES", "LOGICAL_RULES", "MeshConfig", "PARAM_AXES", "axis_size", "batch_shardings",
    "cache_shardings", "logical_to_spec", "make_mesh", "param_logical_axes", "param_shardings",
    "replicated", "routes_shardings", "shard_params", "initialize", "is_primary", "to_host",
    "sharded_learner", "state_shardings",
]


def __getattr__(name):
  # train.py imports the RL layer, which imports the rollout engine, which imports this
  # package: load it on first use.
  if name in ("sharded_learner", "state_shardings"):
    from trace_jax.parallel import train
    return getattr(train, name)
  raise AttributeError(name)

from trace_jax.parallel.distributed import initialize, is_primary, to_host  # noqa: E402
