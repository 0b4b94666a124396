"""Per-row sampling settings (`RowSampling`) against the batch-wide rule (`SamplingParams`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rollout import RowSampling, SamplingParams, sample

SETTINGS = [SamplingParams(0.0), SamplingParams(1.0), SamplingParams(0.7, top_k=5),
            SamplingParams(1.3, top_p=0.6), SamplingParams(0.9, top_k=7, top_p=0.8),
            SamplingParams(0.0, top_k=3)]


def test_row_settings_sample_what_each_setting_samples_alone():
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(len(SETTINGS), 32)) * 3, jnp.float32)
  for trial in range(2):
    keys = jax.random.split(jax.random.key(trial), len(SETTINGS))
    tok, lp = jax.jit(sample)(logits, keys, RowSampling.of(SETTINGS))
    for i, s in enumerate(SETTINGS):
      want_tok, want_lp = sample(logits[i:i + 1], keys[i:i + 1], s)
      assert int(tok[i]) == int(want_tok[0]), (trial, s)
      np.testing.assert_allclose(float(lp[i]), float(want_lp[0]), rtol=1e-6, atol=1e-6)
  # Each row's filter holds: a top-k row only ever samples among its k largest logits.
  keys = jax.random.split(jax.random.key(9), 64)
  row = jnp.broadcast_to(logits[2], (64, 32))
  tok, _ = sample(row, keys, RowSampling.of([SETTINGS[2]] * 64))
  top5 = set(np.argsort(-np.asarray(logits[2]))[:5].tolist())
  assert set(np.asarray(tok).tolist()) <= top5 and len(set(np.asarray(tok).tolist())) > 1


def _chi2_ok(counts, probs, n):
  """Pearson's chi-square of counts against n * probs under a bound no correct sampler exceeds
  but by chance (~1e-6 for these degrees of freedom): a wrong sampler is far above it."""
  keep = probs * n >= 5
  exp = probs[keep] * n
  stat = float(np.sum((counts[keep] - exp) ** 2 / exp))
  dof = int(keep.sum()) - 1
  return stat < dof + 10 * np.sqrt(2 * dof) + 30, (stat, dof)


def test_inverse_cdf_draws_the_softmax_distribution(monkeypatch):
  """`inverse_cdf_sample` against the probabilities: frequencies over many keys (a row across
  several blocks, -inf entries never drawn; blocks of 64 entries, so that 20,000 draws stay
  cheap on CPU), the same token for a row whatever else is in the batch, and at the real block
  size the edge cases (all weight in the last entry of a block, a one-entry vocabulary)."""
  from trace_jax.rollout import sampling  # noqa: PLC0415
  rng = np.random.default_rng(1)
  block = sampling.CDF_BLOCK
  monkeypatch.setattr(sampling, "CDF_BLOCK", 64)
  v = 3 * 64 + 37  # a ragged last block
  logits = rng.normal(size=v) * 2.5
  logits[rng.choice(v, 40, replace=False)] = -np.inf  # filtered entries
  n = 20000
  keys = jax.random.split(jax.random.key(4), n)
  rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, v))
  tok = np.asarray(jax.jit(sampling.inverse_cdf_sample)(keys, rows))
  p = np.exp(logits - logits.max())
  p /= p.sum()
  assert np.all(p[tok] > 0)
  ok, stat = _chi2_ok(np.bincount(tok, minlength=v), p, n)
  assert ok, stat
  # a row's token does not depend on the other rows
  mixed = rows.at[1::2].set(jnp.asarray(rng.normal(size=v), jnp.float32))
  got = np.asarray(jax.jit(sampling.inverse_cdf_sample)(keys[:64], mixed[:64]))
  np.testing.assert_array_equal(got[::2], tok[:64:2])
  # edge cases at the real block size: one positive entry at a block's end, one entry
  monkeypatch.setattr(sampling, "CDF_BLOCK", block)
  edge = np.full((4, 2 * block + 5), -np.inf, np.float32)
  edge[:, block - 1] = 0.0
  assert set(np.asarray(sampling.inverse_cdf_sample(keys[:4], jnp.asarray(edge))).tolist()) == {
      block - 1}
  one = sampling.inverse_cdf_sample(keys[:3], jnp.zeros((3, 1), jnp.float32))
  assert np.asarray(one).tolist() == [0, 0, 0]
  # a target at the total (where rounding puts u * total for the largest uniforms) with the
  # last block empty, and the smallest uniform: the last and the first entry with weight
  row = np.full(3 * block, -np.inf, np.float32)
  row[[3, block + 5, 700]] = rng.normal(size=3)
  got = np.asarray(sampling.invert_cdf(jnp.asarray([1.0, 0.0], jnp.float32),
                                       jnp.asarray(np.stack([row, row]))))
  assert got.tolist() == [700, 3], got


@pytest.mark.parametrize("sampler", ["gumbel", "hashed_gumbel", "inverse_cdf"])
def test_sampler_draws_the_tempered_softmax(monkeypatch, sampler):
  """Each draw `sample` can make (`TRACE_JAX_SAMPLER`: `jax.random.categorical` per row, the
  default; Gumbel noise from a counter hash; the inverse CDF) by the same frequency test,
  through `sample` at temperature 0.8: the draw follows softmax(logits / 0.8)."""
  from trace_jax.rollout import sampling  # noqa: PLC0415
  monkeypatch.setattr(sampling, "SAMPLER", sampler)
  monkeypatch.setattr(sampling, "CDF_BLOCK", 64)  # 20,000 rows: the sums are [rows, 64, 64]
  rng = np.random.default_rng(2)
  logits = rng.normal(size=300) * 2.0
  n = 20000
  keys = jax.random.split(jax.random.key(5), n)
  rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, 300))
  tok, _ = jax.jit(sample, static_argnums=2)(rows, keys, SamplingParams(0.8))
  p = np.exp(logits / 0.8 - (logits / 0.8).max())
  p /= p.sum()
  ok, stat = _chi2_ok(np.bincount(np.asarray(tok), minlength=300), p, n)
  assert ok, stat
