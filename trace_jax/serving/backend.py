"""What the server and the A/B tool serve: a model loaded at BF16 or under an FP4 `QuantPolicy`,
its tokenizer, chat template and scheduler (`serve.scheduler`: "slots", step-level with token
streaming, or "batch", request-level), built from one config.

The config is `configs/serve_compare.py` (which extends the RL config, so the task, tokenizer,
model shape and FP4 policy resolve through `rl.loop.build`, the same rules as training). An
"arm" (`baseline` or `candidate`) names the precision to serve: `config[arm]` sets
`rollout.precision`, `rollout.policy` and `rollout.fp4_format`.

Weights come from, in order: `init_checkpoint` (an HF checkpoint directory), `serve.
trainer_checkpoint` (a `launch/train_rl.py` workdir: its latest checkpoint's params) or a random
init (seeded; say so in any result).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from trace_jax import models as M
from trace_jax.checkpoint import Checkpointer
from trace_jax.rl import loop
from trace_jax.rl.compare import override
from trace_jax.rollout import CapacityError, RolloutEngine
from trace_jax.serving.scheduler import BatchScheduler, SlotScheduler
from trace_jax.tasks import HFTokenizer

ARMS = ("baseline", "candidate")


def arm_config(config, arm: str):
  """`config` with `rollout.{precision,policy,fp4_format}` set from `config[arm]`."""
  if arm not in ARMS:
    raise loop.ConfigError(f"arm must be one of {ARMS}, got {arm!r}")
  a = config[arm]
  return override(config, {"rollout.precision": a.precision, "rollout.policy": a.policy,
                           "rollout.fp4_format": a.fp4_format})


def weights_source(config) -> str:
  if config.init_checkpoint:
    return f"HF checkpoint {config.init_checkpoint}"
  if config.serve.trainer_checkpoint:
    return f"trainer checkpoint {config.serve.trainer_checkpoint}"
  return f"random init (seed {config.seed})"


def load_params(config, setup: loop.Setup):
  """Master weights per `weights_source`, in `serve.load_dtype`. An HF checkpoint stays in host
  memory (`on_host`): the engine's sync makes the serving copy layer by layer, so the device
  never holds the whole master beside it (a 30B-A3B bf16 master is 61 GB)."""
  dtype = jnp.dtype(config.serve.load_dtype)
  if config.init_checkpoint:
    _, params = M.load_hf_checkpoint(config.init_checkpoint, dtype=dtype, on_host=True)
    return params
  if config.serve.trainer_checkpoint:
    ckdir = os.path.join(os.path.expanduser(config.serve.trainer_checkpoint), "checkpoints")
    if not os.path.isdir(ckdir):
      raise loop.ConfigError(f"serve.trainer_checkpoint {config.serve.trainer_checkpoint!r} has "
                             "no checkpoints/ directory: pass a launch/train_rl.py workdir")
    ckpt = Checkpointer(ckdir, keep=None)
    try:
      params = ckpt.restore()["train"]["params"]
    finally:
      ckpt.close()
  else:
    params = M.init_params(setup.model_config, jax.random.key(config.seed))
  return jax.tree_util.tree_map(lambda a: a.astype(dtype), params)


def render_chat(tokenizer, messages: Sequence[dict]) -> str:
  """The prompt text of a chat. HF tokenizers with a chat template use it (with the generation
  prompt). Otherwise (the tiny char tokenizer has no role tokens) the template is: the messages'
  contents in order, joined by one space; a single user message renders to its content, the
  form the tiny task models are trained on."""
  if isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template:
    return tokenizer.chat_text(messages)
  return " ".join(m["content"] for m in messages)


@dataclasses.dataclass
class ServingModel:
  """A loaded model behind a scheduler; `close()` stops the scheduler."""

  name: str
  arm: str
  setup: loop.Setup
  engine: RolloutEngine
  scheduler: SlotScheduler | BatchScheduler
  setup_s: float  # load + quantize + warm-up compiles
  source: str

  @property
  def tokenizer(self):
    return self.setup.tokenizer

  @property
  def stop_tokens(self) -> tuple[int, ...]:
    tok = self.tokenizer
    return tuple(sorted(getattr(tok, "stop_ids", None) or {tok.eos_id}))

  def chat_prompt(self, messages: Sequence[dict]) -> str:
    return render_chat(self.tokenizer, messages)

  def close(self) -> None:
    self.scheduler.close()


def warm_up(model: "ServingModel", sampling) -> None:
  """Compile every batch bucket (slots: every prefill size and the decode chunk; batches: for
  `sampling`) before serving, so no client pays for it."""
  from trace_jax.serving.scheduler import GenerationRequest
  k = model.engine.config.vocab_size - 3
  sched = model.scheduler
  slots = isinstance(sched, SlotScheduler)
  for size in sched.buckets:
    # Distinct short prompts (ids above the special ones), so the batch fills to `size`; two
    # tokens each, so the slot decoder also runs a decode chunk.
    reqs = [GenerationRequest((3 + i % k,) * (1 + i // k), 2 if slots else 1, sampling, 0,
                              model.stop_tokens) for i in range(size)]
    if slots:
      with sched.hold():  # admitted together: one prefill of `size`
        futs = [sched.submit(r) for r in reqs]
    else:
      futs = [sched.submit(r) for r in reqs]
    for f in futs:
      f.result()


def device_bytes(serve_config) -> int | None:
  """The device memory serving plans with: `serve.device_gib` if set, else None (the
  device's own, measured by the engine)."""
  gib = float(serve_config.get("device_gib", 0.0) or 0.0)
  if gib < 0:
    raise loop.ConfigError(f"serve.device_gib must be >= 0, got {gib}")
  return int(gib * 2**30) or None


def build_serving(config, arm: str = "candidate", *, warm_sampling: Any = None,
                  log=print) -> ServingModel:
  """Load weights, quantize them per the arm's policy, start the scheduler, warm it up."""
  t0 = time.perf_counter()
  cfg = arm_config(config, arm)
  setup = loop.build(cfg)
  sc = cfg.serve
  params = load_params(cfg, setup)
  engine = RolloutEngine(setup.rollout_config, setup.policy, max_new_tokens=setup.max_new_tokens,
                         prompt_bucket=setup.prompt_len, record_guidance=False,
                         record_routes=False, device_bytes=device_bytes(sc))
  engine.sync(params)
  del params  # only the serving copy stays on the device
  context = setup.prompt_len + setup.max_new_tokens
  fit = engine.capacity(context)
  if fit < int(sc.max_batch):  # (before a warm-up or a client finds it out of memory)
    raise CapacityError(
        f"serve.max_batch={sc.max_batch} sequences of {context} tokens do not fit: "
        f"{fit} do next to {engine.weight_bytes / 2**30:.3g} GiB of {arm} weights on a device "
        f"of {engine.planned_device_bytes / 2**30:.3g} GiB "
        "(lower serve.max_batch or the context, or quantize more)")
  buckets = [int(b) for b in str(sc.batch_buckets).split(",") if b]
  if sc.scheduler == "slots":
    scheduler = SlotScheduler(engine, slots=int(sc.max_batch), chunk=int(sc.decode_chunk),
                              max_queue=int(sc.max_queue), prompt_len=setup.prompt_len,
                              prefill_sizes=buckets)
  elif sc.scheduler == "batch":
    scheduler = BatchScheduler(engine, max_batch=int(sc.max_batch), max_queue=int(sc.max_queue),
                               batch_wait_s=float(sc.batch_wait_s), prompt_len=setup.prompt_len,
                               buckets=buckets)
  else:
    raise loop.ConfigError(f"serve.scheduler must be 'slots' or 'batch', got {sc.scheduler!r}")
  name = sc.model_name or f"trace-{arm}"
  model = ServingModel(name, arm, setup, engine, scheduler, 0.0, weights_source(cfg))
  if warm_sampling is not None:
    warm_up(model, warm_sampling)
  jax.block_until_ready(engine.params)
  model.setup_s = time.perf_counter() - t0
  log(f"{arm}: {setup.policy.name if hasattr(setup.policy, 'name') else cfg.rollout.policy} "
      f"weights {engine.weight_bytes / 2**20:.1f} MiB from {model.source}, ready in "
      f"{model.setup_s:.1f} s")
  return model
