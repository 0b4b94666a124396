"""Advantages, loss aggregation, IS weights and mismatch metrics against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import rl


def test_group_advantages():
  r = np.array([1, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0], np.float32)
  got = np.asarray(rl.group_advantages(jnp.asarray(r), 4))
  g = r.reshape(3, 4)
  want = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).ravel()
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert np.all(got[4:8] == 0)  # an all-correct group carries no signal
  dr = np.asarray(rl.group_advantages(jnp.asarray(r), 4, normalize_std=False))
  np.testing.assert_allclose(dr, (g - g.mean(1, keepdims=True)).ravel(), rtol=1e-6)
  with pytest.raises(ValueError, match="whole number of groups"):
    rl.group_advantages(jnp.ones(5), 4)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_sum_norm"])
def test_token_weights(agg):
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], bool)
  w = np.asarray(rl.token_weights(jnp.asarray(mask), agg))
  if agg == "token_mean":
    want = mask / 4
  elif agg == "seq_mean_token_mean":
    want = mask / mask.sum(1, keepdims=True) / 2
  else:
    want = mask / 8
  np.testing.assert_allclose(w, want)


def test_is_weights_equal_clipped_ratios_and_pg_gradient():
  rng = np.random.default_rng(0)
  logp = jnp.asarray(rng.normal(-2, 0.5, (3, 5)).astype(np.float32))
  roll = logp + jnp.asarray(rng.normal(0, 1.0, (3, 5)).astype(np.float32))
  adv = jnp.asarray([1.0, -0.5, 2.0])
  w = rl.token_weights(jnp.ones((3, 5), bool), "token_mean")
  for clip in (2.0, 5.0):
    _, m = rl.policy_loss(logp, jax.lax.stop_gradient(logp), roll, adv, w, is_clip=clip)
    ratio = np.exp(np.asarray(logp) - np.asarray(roll))
    np.testing.assert_allclose(float(m["loss/is_weight_mean"]), np.minimum(ratio, clip).mean(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(m["loss/is_clip_frac"]), (ratio > clip).mean())
    # On-policy (rho = 1): d loss / d logp = -A * w_is * weight, the IS-weighted PG gradient.
    g = jax.grad(lambda lp: rl.policy_loss(lp, jax.lax.stop_gradient(lp), roll, adv, w,
                                           is_clip=clip)[0])(logp)
    want = -np.asarray(adv)[:, None] * np.minimum(ratio, clip) / 15
    np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5)


def test_ppo_clip_only_where_ratio_leaves_band():
  logp = jnp.log(jnp.asarray([[0.5, 0.5]]))
  prox = jnp.log(jnp.asarray([[0.3, 0.49]]))  # ratios 1.67 and 1.02
  w = jnp.full((1, 2), 0.5)
  loss, m = rl.policy_loss(logp, prox, prox, jnp.asarray([1.0]), w, is_mode="none")
  np.testing.assert_allclose(float(m["loss/pg_clip_frac"]), 0.5)
  np.testing.assert_allclose(float(loss), -(1.2 * 0.5 + (0.5 / 0.49) * 0.5), rtol=1e-6)


def test_mismatch_metrics():
  rng = np.random.default_rng(1)
  a = rng.normal(-1, 0.3, (4, 6)).astype(np.float32)
  b = a + rng.normal(0, 0.05, (4, 6)).astype(np.float32)
  mask = rng.random((4, 6)) > 0.3
  m = rl.mismatch_metrics(jnp.asarray(a), jnp.asarray(b), jnp.asarray(mask))
  d = (a - b)[mask]
  np.testing.assert_allclose(float(m["mismatch/k3_kl"]), np.mean(np.exp(d) - 1 - d), rtol=1e-4)
  np.testing.assert_allclose(float(m["mismatch/abs_logp_diff"]), np.mean(np.abs(d)), rtol=1e-5)
  np.testing.assert_allclose(float(m["mismatch/max_abs_logp_diff"]), np.max(np.abs(d)))
