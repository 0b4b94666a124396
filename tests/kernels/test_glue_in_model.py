"""The rollout glue kernels inside the model (`kernels.append_kv`: the decode step's K/V cache
write; `kernels.quantize_rows`: activation-site quantization), run in Pallas interpret mode in
place of the dispatch's choice: a one-layer model with the FP4 "paper" policy (expert sites
W4A4, NVFP4 KV) gives the same logits, cache and guidance records, bit for bit, as the XLA
paths, over a prompt and decode steps."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import kv_append, row_quant

PATCHES = {
    "append_kv": lambda kc, vc, k, v, i: kv_append.append(kc, vc, k, v, i, interpret=True),
    "quantize_rows": lambda x, fmt: row_quant.quantize_rows(x, fmt, interpret=True),
}


# slow-marked (CI runs them; ~20 s each on 2 cores): the kernels' own tests (test_kv_append,
# test_row_quant) stay in the default suite
@pytest.mark.parametrize("names", [pytest.param(("append_kv",), marks=pytest.mark.slow),
                                   pytest.param(("quantize_rows",), marks=pytest.mark.slow),
                                   pytest.param(("append_kv", "quantize_rows"),
                                                marks=pytest.mark.slow)],
                         ids=["kv_append", "row_quant", "both"])
def test_model_with_kernels_is_bitwise_the_xla_path(monkeypatch, names):
  cfg = M.tiny(num_layers=1)
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)

  def run():
    step = jax.jit(lambda p, t, c, i: M.apply(p, t, cfg, ctx, cache=c, cache_index=i))
    out = step(params, tokens[:, :3], M.init_cache(cfg, 2, 8, policy.kv_format), 0)
    outs = [(out.logits, out.records)]
    for s in range(3, tokens.shape[1]):  # then decode steps
      out = step(params, tokens[:, s:s + 1], out.cache, s)
      outs.append((out.logits, out.records))
    return outs, out.cache

  want = run()
  calls = {name: 0 for name in names}

  def counted(name):
    def fn(*args):
      calls[name] += 1
      return PATCHES[name](*args)
    return fn

  for name in names:
    monkeypatch.setattr(kernels, name, counted(name))
  got = run()
  assert all(calls.values()), calls  # each kernel took part
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
