"""Per-row sampling settings (`RowSampling`) against the batch-wide rule (`SamplingParams`)."""

import jax
import jax.numpy as jnp
import numpy as np

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
