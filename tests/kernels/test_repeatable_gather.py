"""`kernels.take_rows`: the forward is `x[rows]` bit for bit; the gradient adds each row's
cotangents (a float64 enumeration with numpy's unbuffered `np.add.at` as the reference), rows
never taken get zeros, and two jitted gradients agree bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import kernels


def _case(n=9, m=57, tail=(2, 3), seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, *tail)).astype(np.float32)
  rows = rng.integers(0, n - 2, m)  # the last two rows are never taken
  g = rng.standard_normal((m, *tail)).astype(np.float32)
  return x, rows, g


def test_forward_is_the_gather():
  x, rows, _ = _case()
  got = kernels.take_rows(jnp.asarray(x), jnp.asarray(rows))
  np.testing.assert_array_equal(np.asarray(got), x[rows])


def test_gradient_adds_each_rows_cotangents():
  x, rows, g = _case()
  grad = jax.jit(jax.grad(lambda x: jnp.sum(kernels.take_rows(x, jnp.asarray(rows)) * g)))
  got = np.asarray(grad(jnp.asarray(x)))
  want = np.zeros(x.shape, np.float64)
  np.add.at(want, rows, g.astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)
  assert not got[-2:].any()  # rows never taken
  np.testing.assert_array_equal(got, np.asarray(grad(jnp.asarray(x))))


def test_rows_taken_twice_sum_like_the_plain_gather():
  # a sum of two is one rounding whatever the order: equal to XLA's own scatter-add bit for bit
  x, _, _ = _case()
  rows = np.repeat(np.arange(x.shape[0]), 2)[np.random.default_rng(1).permutation(18)]
  g = np.random.default_rng(2).standard_normal((18, *x.shape[1:])).astype(np.float32)
  ours = jax.grad(lambda x: jnp.sum(kernels.take_rows(x, jnp.asarray(rows)) * g))(x)
  plain = jax.grad(lambda x: jnp.sum(x[jnp.asarray(rows)] * g))(x)
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))


def test_no_rows_no_gradient():
  x = jnp.ones((3, 2))
  grad = jax.grad(lambda x: jnp.sum(kernels.take_rows(x, jnp.zeros((0,), jnp.int32))))(x)
  np.testing.assert_array_equal(np.asarray(grad), np.zeros((3, 2)))


def test_rows_must_be_one_dimensional():
  with pytest.raises(ValueError, match="rows must be 1-D"):
    kernels.take_rows(jnp.zeros((4, 2)), jnp.zeros((2, 2), jnp.int32))
