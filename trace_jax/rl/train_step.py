"""The learner: aligned QAT forward over rollout tokens, GRPO/PPO loss with token-level IS
correction, gradient accumulation, AdamW on float32 master weights, and mismatch metrics.

Alignment modes (`RLConfig.alignment`):
* "none": the trainer runs BF16 (the naive FP4-rollout baseline; also the BF16 reference run
  when the rollout is BF16);
* "qat": independent QAT: the trainer fake-quantizes the policy's sites with its own scales and
  round-to-nearest;
* "trace": rollout-guided rounding at guided sites with the rollout's recorded guidance, plain
  fake-quant elsewhere, weights fake-quantized from the same master values the rollout was
  synced from.
`routing_replay` (R3) dispatches tokens to the experts the rollout chose; gate weights come from
this forward's router, so the router still learns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rl import objectives as obj
from trace_jax.rollout import Rollout

ALIGNMENTS = ("none", "qat", "trace")


@dataclasses.dataclass(frozen=True)
class RLConfig:
  alignment: str = "trace"
  routing_replay: bool = True
  temperature: float = 1.0  # the sampling temperature: logprobs are compared under it
  clip_low: float = 0.2
  clip_high: float = 0.2
  is_mode: str = "tis"  # token-level truncated importance sampling, or "none"
  is_clip: float = 5.0  # paper: 5; FlashRL's TIS: 2
  aggregation: str = "token_mean"
  normalize_std: bool = True  # False: Dr.GRPO
  kl_coef: float = 0.0
  aux_loss_coef: float = 0.0
  z_loss_coef: float = 0.0
  micro_batches: int = 1
  learning_rate: float = 3e-4
  warmup_steps: int = 5
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.98
  grad_clip: float = 1.0
  deterministic: bool = False  # the train step compiled with XLA's deterministic ops (below)

  def __post_init__(self):
    if self.alignment not in ALIGNMENTS:
      raise ValueError(f"unknown rl.alignment {self.alignment!r}; use one of {ALIGNMENTS}")


@dataclasses.dataclass(frozen=True)
class TrainState:
  params: dict
  opt_state: optax.OptState
  step: jax.Array


jax.tree_util.register_dataclass(TrainState, data_fields=["params", "opt_state", "step"],
                                 meta_fields=[])


@dataclasses.dataclass(frozen=True)
class TrainBatch:
  """One RL batch, every leaf batch-first (so it splits into micro-batches)."""

  tokens: jax.Array  # [R, T]
  positions: jax.Array  # [R, T]
  token_mask: jax.Array  # [R, T]
  target_mask: jax.Array  # [R, T] tokens scored by the loss (the completions)
  weights: jax.Array  # [R, T] per-token weights of the loss sum (global normalization)
  advantages: jax.Array  # [R]
  rollout_logprobs: jax.Array  # [R, T] aligned with tokens (0 outside completions)
  routes: jax.Array | None  # [R, L_moe, T, k]
  guidance: dict | None  # {layer: {site: Guidance}}
  rollout_codes: dict | None  # {layer: {"codes:site": QArray}} (diagnostics)
  ref_logprobs: jax.Array | None = None


jax.tree_util.register_dataclass(
    TrainBatch, data_fields=["tokens", "positions", "token_mask", "target_mask", "weights",
                             "advantages", "rollout_logprobs", "routes", "guidance",
                             "rollout_codes", "ref_logprobs"], meta_fields=[])


def make_optimizer(cfg: RLConfig, total_steps: int | None = None) -> optax.GradientTransformation:
  warm = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
  sched = optax.join_schedules([warm, optax.constant_schedule(cfg.learning_rate)],
                               [max(cfg.warmup_steps, 1)])
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


def init_state(params, optimizer) -> TrainState:
  # A copy: the jitted step donates its state, which must not free the caller's arrays.
  params = jax.tree_util.tree_map(lambda a: jnp.array(a, jnp.float32, copy=True), params)
  return TrainState(params, optimizer.init(params), jnp.int32(0))


def _split_records(records: dict) -> tuple[dict, dict]:
  guid, codes = {}, {}
  for layer, sites in records.items():
    g = {s: v for s, v in sites.items() if not s.startswith("codes:")}
    c = {s: v for s, v in sites.items() if s.startswith("codes:")}
    if g:
      guid[layer] = g
    if c:
      codes[layer] = c
  return guid, codes


def batch_from_rollout(rollout: Rollout, rewards, group_size: int, cfg: RLConfig,
                       ref_logprobs=None) -> TrainBatch:
  """Assemble the learner's batch: advantages from rewards `[R]` (groups of `group_size`
  consecutive rows), masks and logprobs aligned with the full token sequences."""
  return _batch_from_rollout(rollout, jnp.asarray(rewards, jnp.float32), ref_logprobs,
                             group_size, cfg.normalize_std, cfg.aggregation)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _batch_from_rollout(rollout, rewards, ref_logprobs, group_size, normalize_std, aggregation):
  r, p = rollout.tokens.shape[0], rollout.prompt_len
  pad = jnp.zeros((r, p))
  target = jnp.concatenate([pad.astype(bool), rollout.completion_mask], axis=1)
  rollout_lp = jnp.concatenate([pad, rollout.logprobs], axis=1)
  adv = obj.group_advantages(rewards, group_size, normalize_std)
  guidance, codes = _split_records(rollout.guidance)
  routes = None if rollout.routes is None else jnp.transpose(rollout.routes, (1, 0, 2, 3))
  return TrainBatch(rollout.tokens, rollout.positions, rollout.token_mask, target,
                    obj.token_weights(target, aggregation), adv, rollout_lp, routes,
                    guidance or None, codes or None, ref_logprobs)


def trainer_context(policy: tq.QuantPolicy, cfg: RLConfig, record_codes: bool = False):
  if cfg.alignment == "none" or not policy.quantizes_anything:
    return M.QuantContext()
  return M.QuantContext(policy, "qat", record_codes=record_codes)


def _token_logprobs(logits, tokens, temperature):
  """logp[:, t] of tokens[:, t] given the prefix, for t >= 1 (column 0 is 0)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32) / temperature, axis=-1)
  lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(lp, ((0, 0), (1, 0)))


def _zero_signless(codes):
  """-0 (code 8) and +0 (code 0) are the same value: a sign flip of a zero is no disagreement."""
  return jnp.where(codes == 8, jnp.uint8(0), codes)


def code_agreement(train_codes: dict, rollout_codes: dict, token_mask, policy, num_layers):
  """Fraction of equal FP4 codes (all, guided and unguided sites, per layer) over real tokens."""
  eq = {"all": [0.0, 0.0], "guided": [0.0, 0.0], "unguided": [0.0, 0.0]}
  per_layer = {}
  for layer, sites in rollout_codes.items():
    lay = [0.0, 0.0]
    kind = "guided" if policy.is_guided_layer(layer, num_layers) else "unguided"
    for key, q_roll in sites.items():
      q_train = train_codes.get(layer, {}).get(key)
      if q_train is None:
        continue
      same = _zero_signless(q_train.unpacked_codes()) == _zero_signless(q_roll.unpacked_codes())
      m = token_mask.reshape(token_mask.shape + (1,) * (same.ndim - 2))
      m = jnp.broadcast_to(m, same.shape)
      hits, total = jnp.sum(same & m), jnp.sum(m)
      for k in ("all", kind):
        eq[k][0] += hits
        eq[k][1] += total
      lay[0] += hits
      lay[1] += total
    per_layer[layer] = lay
  out = {}
  for k, (h, t) in eq.items():
    if not isinstance(t, float):
      name = "mismatch/code_agreement" + ("" if k == "all" else f"_{k}")
      out[name] = h / jnp.maximum(t, 1)
  for layer, (h, t) in per_layer.items():
    if not isinstance(t, float):
      out[f"mismatch/code_agreement/layer_{layer}"] = h / jnp.maximum(t, 1)
  return out


def loss_fn(params, mb: TrainBatch, *, config: M.ModelConfig, ctx: M.QuantContext,
            cfg: RLConfig):
  use_guidance = cfg.alignment == "trace" and mb.guidance is not None
  routes = None
  if cfg.routing_replay and mb.routes is not None:
    routes = jnp.transpose(mb.routes, (1, 0, 2, 3))
  out = M.apply(params, mb.tokens, config, ctx, positions=mb.positions,
                token_mask=mb.token_mask, guidance=mb.guidance if use_guidance else None,
                routes=routes)
  logp = _token_logprobs(out.logits, mb.tokens, cfg.temperature)
  logp_prox = jax.lax.stop_gradient(logp)
  loss, metrics = obj.policy_loss(logp, logp_prox, mb.rollout_logprobs, mb.advantages,
                                  mb.weights, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                  is_mode=cfg.is_mode, is_clip=cfg.is_clip,
                                  ref_logp=mb.ref_logprobs, kl_coef=cfg.kl_coef)
  loss = loss + cfg.aux_loss_coef * out.aux_loss + cfg.z_loss_coef * out.z_loss
  metrics.update(obj.mismatch_metrics(logp_prox, mb.rollout_logprobs, mb.target_mask))
  metrics["router/aux_loss"] = out.aux_loss
  metrics["router/z_loss"] = out.z_loss
  if mb.routes is not None and out.routes is not None:
    same = out.routes == jnp.transpose(mb.routes, (1, 0, 2, 3))
    m = jnp.broadcast_to(mb.token_mask[None, :, :, None], same.shape)
    metrics["mismatch/route_agreement"] = jnp.sum(same & m) / jnp.maximum(jnp.sum(m), 1)
  if mb.rollout_codes is not None and ctx.record_codes:
    _, train_codes = _split_records(out.records)
    metrics.update(code_agreement(train_codes, mb.rollout_codes, mb.token_mask, ctx.policy,
                                  config.num_layers))
  return loss, metrics


def split_microbatches(tree, m: int):
  """Leaves `[R, ...]` -> `[m, R/m, ...]` (QArray/Guidance shapes follow), for `lax.scan`."""
  def split(x):
    if isinstance(x, (tq.QArray, tq.Guidance)):
      return tq.map_blocked(x, lambda a: a.reshape(m, -1, *a.shape[1:]),
                            (x.shape[0] // m,) + tuple(x.shape[1:]))
    return x.reshape(m, -1, *x.shape[1:])
  return jax.tree_util.tree_map(split, tree,
                                is_leaf=lambda x: isinstance(x, (tq.QArray, tq.Guidance)))


def train_step(state: TrainState, batch: TrainBatch, *, config: M.ModelConfig,
               ctx: M.QuantContext, cfg: RLConfig, optimizer: optax.GradientTransformation):
  """One optimizer step over `batch` (gradients accumulated over `cfg.micro_batches`)."""
  m = cfg.micro_batches
  r = batch.tokens.shape[0]
  if r % m:
    raise ValueError(f"batch of {r} rows does not split into {m} micro-batches")
  grad_fn = jax.value_and_grad(functools.partial(loss_fn, config=config, ctx=ctx, cfg=cfg),
                               has_aux=True)
  if m == 1:
    (loss, metrics), grads = grad_fn(state.params, batch)
  else:
    def body(acc, mb):
      (l, met), g = grad_fn(state.params, mb)
      return jax.tree_util.tree_map(jnp.add, acc, g), (l, met)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
    grads, (losses, mets) = jax.lax.scan(body, zeros, split_microbatches(batch, m))
    loss = jnp.sum(losses)  # weights are normalized over the whole batch
    metrics = {k: (jnp.max(v) if "max" in k else jnp.mean(v)) for k, v in mets.items()}
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics["loss/total"] = loss
  metrics["loss/grad_norm"] = optax.global_norm(grads)
  return TrainState(params, opt_state, state.step + 1), metrics


# XLA:GPU may add a gradient's scatter with atomics, in whatever order the threads arrive. The
# model's two gathers that repeat rows take their gradients in a fixed order instead
# (`kernels.take_rows` for the embedding, `kernels.take_copies` for the MoE dispatch: on an H100,
# sessions 50-51, the small RL loop then repeated every step in 3 runs and a killed run resumed
# with the uninterrupted run's numbers, in one process and in new ones). rl.deterministic=True
# compiles the trainer's programs with XLA's deterministic ops as well, for a model or loss that
# adds repeats some other way: every scatter then goes through XLA's slower deterministic
# expander (the mid-shape train step 1.40x as long on the H100). A compile option of the
# trainer's programs only: the rollout's keep XLA's autotuned choices.
DETERMINISTIC_COMPILE = {"xla_gpu_deterministic_ops": True}


def compile_options(deterministic: bool) -> dict:
  """XLA compile options for a trainer program (`jax.jit(..., compiler_options=...)`)."""
  return dict(DETERMINISTIC_COMPILE) if deterministic else {}


def make_train_step(config: M.ModelConfig, policy: tq.QuantPolicy, cfg: RLConfig,
                    optimizer: optax.GradientTransformation, record_codes: bool = False):
  """A jitted `(state, batch) -> (state, metrics)` that donates the old state."""
  kernels.import_gpu_libraries()  # before the step compiles (its docstring says why)
  ctx = trainer_context(policy, cfg, record_codes)
  fn = functools.partial(train_step, config=config, ctx=ctx, cfg=cfg, optimizer=optimizer)
  return jax.jit(fn, donate_argnums=(0,), compiler_options=compile_options(cfg.deterministic))


@functools.lru_cache(maxsize=None)
def learner(config: M.ModelConfig, policy: tq.QuantPolicy, cfg: RLConfig,
            record_codes: bool = False):
  """(optimizer, jitted train step) for these settings, built once per process (so runs that
  share a config share compiled programs)."""
  optimizer = make_optimizer(cfg)
  return optimizer, make_train_step(config, policy, cfg, optimizer, record_codes)


# --------------------------------------------------------------------------- guidance memory

def offload_to_host(tree):
  """Move guidance (or any pytree) off the device while the rollout of long sequences goes on;
  `to_device` brings it back for the train step."""
  return jax.device_get(tree)


def to_device(tree):
  return jax.device_put(tree)
