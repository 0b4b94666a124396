"""The aligned train step on the tiny model with FP4 rollouts: TRACE vs QAT vs none, routing
replay, finite-difference gradients, determinism."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax import rl
from trace_jax.rollout import RolloutEngine, SamplingParams

# The rollout computes in bf16, the trainer in f32: a realistic source of tiny numeric
# differences that push FP4 rounding decisions across boundaries.
TRAIN_CFG = M.tiny(num_layers=2)
ROLL_CFG = TRAIN_CFG.replace(dtype="bfloat16")
GROUP = 4


@functools.lru_cache(maxsize=None)
def _params():
  p = M.init_params(TRAIN_CFG, jax.random.key(0))
  return jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, p)


@functools.lru_cache(maxsize=None)
def _rollout(guided_layers: float):
  policy = tq.make_policy("paper", "nvfp4").replace(guided_layers=guided_layers)
  eng = RolloutEngine(ROLL_CFG, policy, max_new_tokens=12, record_codes=True)
  eng.sync(_params())
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, 60, 8)) for _ in range(4)]
  ro = eng.generate(prompts, n=GROUP, sampling=SamplingParams(temperature=1.0), seed=0)
  rewards = (np.arange(16) % 3 == 0).astype(np.float32)
  return policy, ro, rewards


@functools.lru_cache(maxsize=None)
def _step_fn(policy, cfg, record_codes=True):
  opt = rl.make_optimizer(cfg)
  return opt, rl.make_train_step(TRAIN_CFG, policy, cfg, opt, record_codes=record_codes)


@functools.lru_cache(maxsize=None)
def _step_metrics(alignment: str, guided_layers: float, replay: bool = True):
  policy, ro, rewards = _rollout(guided_layers)
  cfg = rl.RLConfig(alignment=alignment, routing_replay=replay)
  opt, step = _step_fn(policy, cfg)
  state = rl.init_state(_params(), opt)
  _, metrics = step(state, rl.batch_from_rollout(ro, rewards, GROUP, cfg))
  # the old state is donated whole (jit drops an unread argument's donation: a leaf the step
  # does not read would stay allocated beside its update)
  assert all(x.is_deleted() for x in jax.tree.leaves(state))
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def test_trace_aligns_codes_and_logprobs_far_better_than_qat():
  qat = _step_metrics("qat", 1.0)
  trace_all = _step_metrics("trace", 1.0)
  print("k3: qat %.2e trace-all %.2e; code agreement: qat %.5f trace-all %.5f" % (
      qat["mismatch/k3_kl"], trace_all["mismatch/k3_kl"], qat["mismatch/code_agreement"],
      trace_all["mismatch/code_agreement"]))
  # Guided sites: (almost) every code agrees; the rare exception is a trainer value more than
  # one grid step away from the rollout's, which one mantissa bit cannot identify.
  assert trace_all["mismatch/code_agreement_guided"] > 0.995
  assert qat["mismatch/code_agreement_guided"] < 0.9
  assert trace_all["mismatch/k3_kl"] < qat["mismatch/k3_kl"] / 20


@pytest.mark.slow  # three more train-step compiles (~45 s on 2 cores)
def test_partial_guidance_sits_between_and_no_qat_is_worst():
  qat, trace_all = _step_metrics("qat", 1.0), _step_metrics("trace", 1.0)
  trace_half, none = _step_metrics("trace", 0.5), _step_metrics("none", 1.0)
  print("k3: none %.2e qat %.2e trace-half %.2e trace-all %.2e" % (
      none["mismatch/k3_kl"], qat["mismatch/k3_kl"], trace_half["mismatch/k3_kl"],
      trace_all["mismatch/k3_kl"]))
  # A trainer that does not quantize at all is further from the FP4 rollout than QAT.
  assert qat["mismatch/k3_kl"] < none["mismatch/k3_kl"]
  # Guidance only on the deeper half sits between.
  assert trace_all["mismatch/k3_kl"] < trace_half["mismatch/k3_kl"] < qat["mismatch/k3_kl"]
  qat_half = _step_metrics("qat", 0.5)  # same rollout as trace_half: unguided sites are equal
  assert (trace_half["mismatch/code_agreement_unguided"]
          == pytest.approx(qat_half["mismatch/code_agreement_unguided"]))
  # With the first half unguided, deeper activations drift by more than one grid step more
  # often, so guided agreement there is lower than with full guidance but far above QAT's.
  assert (qat_half["mismatch/code_agreement_guided"] + 0.1
          < trace_half["mismatch/code_agreement_guided"])


def test_routing_replay_makes_trainer_experts_equal_rollout():
  assert _step_metrics("trace", 1.0, True)["mismatch/route_agreement"] == 1.0
  assert _step_metrics("qat", 1.0, True)["mismatch/route_agreement"] == 1.0


@pytest.mark.slow  # two more train-step compiles (~22 s on 2 cores); CI runs it
def test_train_step_deterministic_and_microbatching_equivalent():
  policy, ro, rewards = _rollout(1.0)  # (the rollout the alignment tests compiled)
  outs = []
  for m in (1, 1, 2):
    cfg = rl.RLConfig(alignment="trace", micro_batches=m, learning_rate=1e-2, warmup_steps=0)
    opt, step = _step_fn(policy, cfg, record_codes=False)
    state, metrics = step(rl.init_state(_params(), opt), rl.batch_from_rollout(ro, rewards, GROUP,
                                                                               cfg))
    outs.append((jax.device_get(state.params), float(metrics["loss/total"])))
  jax.tree_util.tree_map(np.testing.assert_array_equal, outs[0][0], outs[1][0])
  assert outs[0][1] == outs[1][1]
  # Two micro-batches accumulate to the same gradient up to float reassociation.
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), outs[0][0],
                         outs[2][0])
  np.testing.assert_allclose(outs[2][1], outs[0][1], rtol=1e-4, atol=1e-6)


def test_gradients_match_finite_differences_in_bf16_mode():
  policy, ro, rewards = _rollout(1.0)
  cfg = rl.RLConfig(alignment="none")
  batch = rl.batch_from_rollout(ro, rewards, GROUP, cfg)
  ctx = rl.trainer_context(policy, cfg)
  params = _params()

  # The surrogate's value at theta + eps*v uses logp_prox fixed at theta (as in the update).
  routes = jnp.transpose(batch.routes, (1, 0, 2, 3))  # replayed: top-k is not differentiable

  def logprobs(p):
    out = M.apply(p, batch.tokens, TRAIN_CFG, ctx, positions=batch.positions,
                  token_mask=batch.token_mask, routes=routes)
    return rl.train_step._token_logprobs(out.logits, batch.tokens, 1.0)

  @jax.jit
  def objective(p, prox):
    return rl.policy_loss(logprobs(p), prox, batch.rollout_logprobs, batch.advantages,
                          batch.weights)[0]

  prox = jax.jit(logprobs)(params)  # (eager, op by op, this forward took 14 s on 2 cores)
  grad = jax.grad(objective)(params, prox)
  for path in (("layers_0", "attn", "q_proj", "kernel"), ("layers_1", "moe", "router", "kernel"),
               ("lm_head", "kernel")):
    g = functools.reduce(lambda d, k: d[k], path, grad)
    v = jax.random.normal(jax.random.key(len(path[0])), g.shape)
    eps = 1e-3

    def shifted(s):
      p = jax.tree_util.tree_map(lambda a: a, params)
      node = functools.reduce(lambda d, k: d[k], path[:-1], p)
      node[path[-1]] = node[path[-1]] + s * eps * v
      return float(objective(p, prox))

    fd = (shifted(1) - shifted(-1)) / (2 * eps)
    an = float(jnp.sum(g * v))
    assert abs(fd - an) <= 2e-2 * abs(an) + 1e-5, (path, fd, an)
