"""Choose a GPU kernel or the `jnp` reference for each matmul call."""

from __future__ import annotations

import jax

from trace_jax.kernels import reference


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def matmul(x, w, out_dtype=None) -> jax.Array:
  """`x @ w`; w `[K, N]` array or FP4 `QArray` (blocks along K)."""
  return reference.matmul_ref(x, w, out_dtype)


def grouped_matmul(x, w, group_sizes, out_dtype=None) -> jax.Array:
  """Grouped (ragged) matmul of expert-sorted rows `x [M, K]` with `w [E, K, N]`."""
  return reference.grouped_matmul_ref(x, w, group_sizes, out_dtype)
