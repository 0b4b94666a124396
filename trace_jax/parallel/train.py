"""The RL train step under a mesh (GSPMD): state sharded per the logical-axis rules (FSDP for
master weights and AdamW moments, expert/tensor parallel weights), the batch over the batch
axes, and the updated state returned with the same shardings, so a step never moves weights."""

from __future__ import annotations

import functools

import jax
from jax.sharding import Mesh

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.parallel.rules import batch_shardings, param_shardings, replicated
from trace_jax.rl import train_step as ts


def state_shardings(config: M.ModelConfig, optimizer, mesh: Mesh):
  """Shardings of the `TrainState` for `config` and `optimizer` on `mesh`."""
  abstract = jax.eval_shape(
      lambda k: ts.init_state(M.init_params(config, k), optimizer), jax.random.key(0))
  return param_shardings(abstract, mesh)


@functools.lru_cache(maxsize=None)
def sharded_learner(config: M.ModelConfig, policy: tq.QuantPolicy, cfg: ts.RLConfig, mesh: Mesh,
                    record_codes: bool = False):
  """(optimizer, step, place_state) on `mesh`: `step(state, batch) -> (state, metrics)` places
  the batch over the batch axes and keeps the state's shardings (the old state is donated);
  `place_state(state)` moves a state (e.g. a fresh or restored one) onto the mesh."""
  optimizer = ts.make_optimizer(cfg)
  ctx = ts.trainer_context(policy, cfg, record_codes)
  fn = functools.partial(ts.train_step, config=config, ctx=ctx, cfg=cfg, optimizer=optimizer)
  sh = state_shardings(config, optimizer, mesh)
  jitted = jax.jit(fn, donate_argnums=(0,), out_shardings=(sh, replicated(mesh)),
                   compiler_options=ts.compile_options(cfg.deterministic))

  def place_state(state):
    return jax.device_put(state, sh)

  def step(state, batch):
    batch = jax.device_put(batch, batch_shardings(batch, mesh))
    with jax.set_mesh(mesh):
      return jitted(place_state(state), batch)

  return optimizer, step, place_state
