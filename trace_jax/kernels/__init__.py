"""Matmul entry points the model calls, with pure-`jnp` references that define their results.

`matmul(x, w)` and `grouped_matmul(x, w, group_sizes)` accept plain arrays or FP4 `QArray`
weights (and FP4 `QArray` activations for W4A4). Dispatch: on a GPU backend with a kernel for
the case, the Pallas Mosaic GPU kernel; everywhere else the reference in `reference.py`.
"""

from trace_jax.kernels.dispatch import grouped_matmul, matmul

__all__ = ["grouped_matmul", "matmul"]
