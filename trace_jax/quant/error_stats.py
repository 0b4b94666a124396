"""Quantization error statistics per format (used by the formats notebook and benchmark)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant.fake_quant import fake_quant


def sample(dist: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
  """Test tensors: "normal" = N(0, 1), "student_t3" = Student-t with 3 degrees of freedom."""
  rng = np.random.default_rng(seed)
  if dist == "normal":
    return rng.standard_normal(shape).astype(np.float32)
  if dist == "student_t3":
    return rng.standard_t(3, shape).astype(np.float32)
  raise ValueError(f"unknown distribution {dist!r}; use 'normal' or 'student_t3'")


def relative_rmse(x: jax.Array, fmt: str, second_level: str = "row") -> float:
  """||fake_quant(x) - x||_2 / ||x||_2 with blocks along the last axis."""
  x = jnp.asarray(x, jnp.float32)
  err = fake_quant(x, fmt, second_level=second_level) - x
  return float(jnp.sqrt(jnp.sum(err * err) / jnp.sum(x * x)))


def error_table(formats=("mxfp4", "mxfp4_floor", "nvfp4", "nvfp4_4o6", "mxfp8"),
                dists=("normal", "student_t3"), shape=(256, 4096), seed=0,
                second_level: str = "row") -> dict[str, dict[str, float]]:
  """{dist: {format: relative RMSE}} on freshly sampled tensors."""
  return {d: {f: relative_rmse(sample(d, shape, seed), f, second_level) for f in formats}
          for d in dists}
