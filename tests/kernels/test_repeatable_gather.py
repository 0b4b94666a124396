"""`kernels.take_rows` and `kernels.take_copies`: the forward is `x[rows]` bit for bit; the
gradient adds each row's cotangents (a float64 enumeration with numpy's unbuffered `np.add.at`
as the reference), rows never taken get zeros, and two jitted gradients agree bit for bit."""

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


def _dispatch_case(n=11, k=3, tail=(4,), seed=3):
  """A MoE dispatch's rows (n tokens, each in k slots, sorted by a random expert per slot), their
  inverse, x and the cotangents."""
  rng = np.random.default_rng(seed)
  experts = rng.integers(0, 5, n * k)
  order = np.argsort(experts, kind="stable")
  inverse = np.argsort(order)
  x = rng.standard_normal((n, *tail)).astype(np.float32)
  g = rng.standard_normal((n * k, *tail)).astype(np.float32)
  return x, order // k, inverse, g


@pytest.mark.parametrize("dtype,tail", [(jnp.float32, (2, 3)), (jnp.bfloat16, (4,))])
def test_take_copies_gradient_sums_each_tokens_slots(dtype, tail):
  x, rows, inverse, g = _dispatch_case(tail=tail)
  xd, gd = jnp.asarray(x, dtype), jnp.asarray(g, dtype)
  got_x = kernels.take_copies(xd, jnp.asarray(rows), jnp.asarray(inverse))
  np.testing.assert_array_equal(np.asarray(got_x), np.asarray(xd)[rows])
  grad = jax.jit(jax.grad(lambda x: jnp.sum(
      (kernels.take_copies(x, jnp.asarray(rows), jnp.asarray(inverse)) * gd).astype(jnp.float32))))
  got = np.asarray(grad(xd)).astype(np.float64)
  want = np.zeros(x.shape, np.float64)
  np.add.at(want, rows, np.asarray(gd).astype(np.float64))
  # float32: a few float32 roundings of sums of 3; bf16: the float32 sum rounded once to bf16
  # (half a bf16 unit: 2^-8 of the value), not three bf16 roundings
  tol = 4e-6 if dtype == jnp.float32 else 2.0 ** -8 * np.abs(want)
  assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) - tol)
  np.testing.assert_array_equal(got, np.asarray(grad(xd)).astype(np.float64))


def test_take_copies_checks_its_rows():
  with pytest.raises(ValueError, match="1-D and alike"):
    kernels.take_copies(jnp.zeros((4, 2)), jnp.zeros((8,), jnp.int32), jnp.zeros((7,), jnp.int32))
  with pytest.raises(ValueError, match="equally often"):
    kernels.take_copies(jnp.zeros((4, 2)), jnp.zeros((6,), jnp.int32), jnp.zeros((6,), jnp.int32))
  empty = jnp.zeros((0,), jnp.int32)
  grad = jax.grad(lambda x: jnp.sum(kernels.take_copies(x, empty, empty)))(jnp.zeros((0, 2)))
  assert grad.shape == (0, 2)
  with pytest.raises(ValueError, match="it needs rows"):
    kernels.grouped_matmul(jnp.zeros((4, 2)), jnp.zeros((1, 2, 3)), jnp.asarray([4], jnp.int32),
                           rows_inverse=jnp.arange(4))


@pytest.mark.parametrize("by_rows", [False, True])
def test_grouped_matmul_dispatch_gradient(by_rows):
  """grouped_matmul's rows with their inverse (take_copies) against the sorted sum (take_rows)
  and a float64 enumeration. by_rows: row-chunk tables (identity order, the caller's rows),
  which the reference path sorts itself, composing the inverse."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  n, k, e, d, f = 6, 2, 5, 8, 3
  rng = np.random.default_rng(3)
  ids = rng.integers(0, e, n * k).astype(np.int32)
  if by_rows:
    order, inverse, sizes, tables = dispatch.row_chunks(jnp.asarray(ids), e)
  else:
    order, inverse, sizes, tables = kernels.route(jnp.asarray(ids), e)
  x = rng.standard_normal((n, d)).astype(np.float32)
  w = rng.standard_normal((e, d, f)).astype(np.float32)
  gy = rng.standard_normal((n * k, f)).astype(np.float32)  # token-order output cotangents

  def loss(x, with_inverse):
    y = kernels.grouped_matmul(x, jnp.asarray(w), sizes, rows=order // k,
                               rows_inverse=inverse if with_inverse else None, out_rows=inverse,
                               tables=tables)
    return jnp.sum(y * gy)

  ours = np.asarray(jax.grad(loss)(jnp.asarray(x), True))
  sorted_sum = np.asarray(jax.grad(loss)(jnp.asarray(x), False))
  want = np.zeros(x.shape, np.float64)  # token t's slot j: gy[t k + j] w[ids[t k + j]]^T
  np.add.at(want, np.arange(n * k) // k,
            np.einsum("mf,mdf->md", gy.astype(np.float64), w.astype(np.float64)[ids]))
  np.testing.assert_allclose(ours, want, rtol=0, atol=2e-5)
  np.testing.assert_allclose(ours, sorted_sum, rtol=0, atol=2e-5)
