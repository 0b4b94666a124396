"""Advantages, policy-gradient objectives and train/rollout mismatch metrics.

GRPO advantages are group-normalized rewards; the token loss is PPO's clipped surrogate with a
token-level importance weight correcting the rollout/trainer mismatch:

  loss_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) * w_t
  rho_t  = pi_theta / pi_prox        (pi_prox = the trainer's own logprob before the update)
  w_t    = min(pi_prox / pi_rollout, is_clip)   (truncated IS; paper default clip 5, TIS 2)

Mismatch metrics follow NUMERICS.md: d = logp_train - logp_rollout per response token;
k3 = mean(exp(d) - 1 - d), mean |d|, max |d|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-4) -> jax.Array:
  """GRPO advantages for rewards `[R]` laid out as consecutive groups of `group_size`
  (Dr.GRPO: `normalize_std=False`, centring only)."""
  if rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards are not a whole number of groups of "
                     f"{group_size}")
  r = rewards.reshape(-1, group_size).astype(jnp.float32)
  adv = r - jnp.mean(r, axis=1, keepdims=True)
  if normalize_std:
    adv = adv / (jnp.std(r, axis=1, keepdims=True) + eps)
  return adv.reshape(-1)


def token_weights(mask: jax.Array, aggregation: str) -> jax.Array:
  """Per-token weights `[R, T]` summing the token losses into the batch loss.

  token_mean: every response token of the batch counts equally (DAPO);
  seq_mean_token_mean: mean over each sequence's tokens, then over sequences (original GRPO);
  seq_sum_norm: sum over tokens / (num sequences * max length) (Dr.GRPO)."""
  m = mask.astype(jnp.float32)
  if aggregation == "token_mean":
    return m / jnp.maximum(jnp.sum(m), 1.0)
  if aggregation == "seq_mean_token_mean":
    per_seq = jnp.maximum(jnp.sum(m, axis=1, keepdims=True), 1.0)
    return m / per_seq / m.shape[0]
  if aggregation == "seq_sum_norm":
    return m / (m.shape[0] * m.shape[1])
  raise ValueError(f"unknown loss aggregation {aggregation!r}; use token_mean, "
                   "seq_mean_token_mean or seq_sum_norm")


def policy_loss(logp, logp_prox, logp_rollout, advantages, weights, *, clip_low=0.2,
                clip_high=0.2, is_mode="tis", is_clip=5.0, ref_logp=None, kl_coef=0.0):
  """(loss, metrics) for token logprobs `[R, T]` and sequence advantages `[R]`."""
  adv = advantages[:, None]
  rho = jnp.exp(logp - logp_prox)
  unclipped = rho * adv
  clipped = jnp.clip(rho, 1 - clip_low, 1 + clip_high) * adv
  surrogate = jnp.minimum(unclipped, clipped)
  log_w = jax.lax.stop_gradient(logp_prox - logp_rollout)
  if is_mode == "tis":
    w = jnp.minimum(jnp.exp(log_w), is_clip)
  elif is_mode == "none":
    w = jnp.ones_like(log_w)
  else:
    raise ValueError(f"unknown importance-sampling mode {is_mode!r}; use 'tis' or 'none'")
  per_token = -surrogate * w
  if ref_logp is not None and kl_coef:
    d = ref_logp - logp
    per_token = per_token + kl_coef * (jnp.exp(d) - 1 - d)
  loss = jnp.sum(per_token * weights)
  on = weights > 0
  n = jnp.maximum(jnp.sum(on), 1)
  metrics = {
      "loss/pg_clip_frac": jnp.sum((unclipped != clipped) & on) / n,
      "loss/is_weight_mean": jnp.sum(jnp.where(on, w, 0.0)) / n,
      "loss/is_clip_frac": jnp.sum((jnp.exp(log_w) > is_clip) & on) / n,
  }
  return loss, metrics


def mismatch_metrics(logp_train, logp_rollout, mask) -> dict:
  """NUMERICS.md mismatch metrics over the response tokens in `mask`."""
  d = jnp.where(mask, logp_train - logp_rollout, 0.0)
  n = jnp.maximum(jnp.sum(mask), 1)
  return {
      "mismatch/k3_kl": jnp.sum(jnp.where(mask, jnp.exp(d) - 1 - d, 0.0)) / n,
      "mismatch/abs_logp_diff": jnp.sum(jnp.abs(d)) / n,
      "mismatch/max_abs_logp_diff": jnp.max(jnp.abs(d)),
  }
