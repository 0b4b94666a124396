"""The RL loop end to end: task prompts -> FP4 rollout -> rewards -> advantages -> aligned train
step -> weight sync, with SFT warm start, held-out eval, metrics, checkpoints and resume.

Everything is driven by one `ml_collections.ConfigDict` (see `configs/tiny_arith.py`); the
launchers only parse flags. A killed run restarted with the same config and workdir resumes from
its last checkpoint and writes exactly the metrics an uninterrupted run writes: every random
choice is a function of (seed, step), and the data position travels in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trace_jax import models as M
from trace_jax import parallel
from trace_jax import quant as tq
from trace_jax.checkpoint import CheckpointMismatchError, Checkpointer
from trace_jax.metrics import MetricWriter, Progress
from trace_jax.rl import train_step as ts
from trace_jax.rollout import RolloutEngine, SamplingParams
from trace_jax.tasks import CharTokenizer, TaskStream, get_task, load_tokenizer


class ConfigError(ValueError):
  """A config that cannot run, with what to do about it."""


# --------------------------------------------------------------------------- setup

@dataclasses.dataclass
class Setup:
  task: Any
  tokenizer: Any
  model_config: M.ModelConfig
  rollout_config: M.ModelConfig
  policy: tq.QuantPolicy
  rl_config: ts.RLConfig
  sampling: SamplingParams
  prompt_len: int
  max_new_tokens: int
  decode_chunk: int = 0  # rollout decode windows; guidance goes to host memory per window
  command_buffers: bool = True  # False: the rollout keeps XLA's default command buffers


def _plain(d) -> dict:
  return d.to_dict() if hasattr(d, "to_dict") else dict(d)


def build(config) -> Setup:
  """Resolve the config into task, tokenizer, model shapes, policy and RL settings."""
  task = get_task(config.task.name, **_plain(config.task.kwargs))
  tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer != "char" else CharTokenizer()
  prompt_len = int(config.rollout.prompt_len or task.max_prompt_len)
  max_new = int(config.rollout.max_new_tokens or task.max_answer_len + 1)
  mc = _plain(config.model)
  preset = mc.pop("preset")
  if config.init_checkpoint:
    # The checkpoint's config.json defines the shape; the config only sets the compute dtype.
    cfg_path = os.path.join(os.path.expanduser(config.init_checkpoint), "config.json")
    if not os.path.exists(cfg_path):
      raise ConfigError(f"init_checkpoint {config.init_checkpoint!r} has no config.json: pass "
                        "a Hugging Face checkpoint directory")
    with open(cfg_path) as f:
      model_config = M.from_hf_config(json.load(f), dtype=mc.get("dtype", "bfloat16"))
  else:
    mc.setdefault("vocab_size", tokenizer.vocab_size)
    mc.setdefault("max_seq_len", prompt_len + max_new)
    model_config = M.preset(preset, **mc)
  if model_config.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"model vocab_size {model_config.vocab_size} < tokenizer vocab "
                      f"{tokenizer.vocab_size}: raise --config.model.vocab_size")
  mesh_cfg = _plain(config.get("mesh") or {})
  if int(mesh_cfg.get("expert", 1)) != 1:  # expert axis: the MoE layer exchanges tokens
    model_config = model_config.replace(
        expert_parallel=str(mesh_cfg.get("expert_parallel", "auto")),
        expert_capacity_factor=float(mesh_cfg.get("expert_capacity_factor", 0.0)))
  r = config.rollout
  if r.precision == "bf16":
    policy = tq.make_policy("bf16")
  elif r.precision == "fp4":
    policy = tq.make_policy(r.policy, r.fp4_format).replace(
        guided_layers=float(r.guided_layers), guidance_compact=bool(r.guidance_compact))
  else:
    raise ConfigError(f"rollout.precision must be 'bf16' or 'fp4', got {r.precision!r}")
  fields = {f.name for f in dataclasses.fields(ts.RLConfig)} - {"temperature"}
  rl_kw = {k: v for k, v in _plain(config.rl).items() if k in fields}
  rl_cfg = ts.RLConfig(**rl_kw, temperature=float(r.temperature))
  rollout_config = model_config.replace(dtype=r.dtype)
  sampling = SamplingParams(float(r.temperature), int(r.top_k), float(r.top_p))
  return Setup(task, tokenizer, model_config, rollout_config, policy, rl_cfg, sampling,
               prompt_len, max_new, int(r.get("decode_chunk", 0)),
               bool(r.get("command_buffers", True)))


def resolve_workdir(workdir: str) -> str:
  if not workdir:
    raise ConfigError("--workdir is required: pass a directory for metrics and checkpoints, "
                      "e.g. --workdir /tmp/trace_run")
  path = os.path.abspath(os.path.expanduser(workdir))
  os.makedirs(path, exist_ok=True)
  return path


def step_seed(seed: int, step: int, what: str) -> int:
  h = hashlib.blake2b(f"{seed}/{step}/{what}".encode(), digest_size=4).digest()
  return int.from_bytes(h, "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------- evaluation

def evaluate(engine: RolloutEngine, setup: Setup, examples, max_batch: int = 512) -> dict:
  """Greedy pass rate of the rollout engine (the policy as deployed) on `examples`."""
  tok = setup.tokenizer
  passed = 0.0
  for i in range(0, len(examples), max_batch):
    chunk = examples[i:i + max_batch]
    prompts = [tok.encode(e.prompt) for e in chunk]
    # Fixed shapes: pad the last chunk with copies so no new program compiles.
    pad = max_batch - len(prompts) if len(examples) > max_batch else 0
    ro = engine.generate(prompts + prompts[:1] * pad, n=1,
                         sampling=SamplingParams(temperature=0.0), seed=0,
                         stop_tokens=[tok.eos_id], prompt_len=setup.prompt_len)
    comps = tok.decode_batch(parallel.to_host(ro.completion)[:len(chunk)])
    rewards = setup.task.reward([e.prompt for e in chunk], comps, [e.answer for e in chunk])
    passed += float(np.sum(np.asarray(rewards) >= 1.0))
  return {"eval/pass_rate": passed / max(len(examples), 1)}


# --------------------------------------------------------------------------- SFT warm start

def sft_batch(setup: Setup, examples):
  """Teacher-forcing batch: left-padded prompt, then answer + eos (right-padded)."""
  tok, p, n = setup.tokenizer, setup.prompt_len, setup.max_new_tokens
  tokens = np.zeros((len(examples), p + n), np.int32)
  mask = np.zeros_like(tokens, bool)
  target = np.zeros_like(tokens, bool)
  for i, e in enumerate(examples):
    pr = tok.encode(e.prompt)
    ans = tok.encode(e.answer) + [tok.eos_id]
    if len(pr) > p or len(ans) > n:
      raise ConfigError(f"example {e} does not fit prompt_len {p} / max_new_tokens {n}")
    tokens[i, p - len(pr):p] = pr
    mask[i, p - len(pr):p] = True
    tokens[i, p:p + len(ans)] = ans
    mask[i, p:p + len(ans)] = True
    target[i, p:p + len(ans)] = True
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(target)


def run_sft(params, setup: Setup, config, engine: RolloutEngine, log=print):
  """Supervised warm start until the held-out greedy pass rate reaches the target. `params` are
  donated to the first step (deleted): use the returned ones."""
  sc = config.sft
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      optax.join_schedules([optax.linear_schedule(0.0, sc.learning_rate, sc.warmup_steps),
                            optax.constant_schedule(sc.learning_rate)], [sc.warmup_steps]),
      b2=0.98, weight_decay=0.01))
  cfg = setup.model_config

  # weights and moments donated: the old ones are not held beside the new (as the RL step)
  @functools.partial(jax.jit, donate_argnums=(0, 1),
                     compiler_options=ts.compile_options(setup.rl_config.deterministic))
  def step(params, opt_state, tokens, mask, target):
    def loss_fn(p):
      out = M.apply(p, tokens, cfg, token_mask=mask)
      logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
      lp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      t = target[:, 1:].astype(jnp.float32)
      return -jnp.sum(lp * t) / jnp.sum(t) + 0.01 * out.aux_loss
    loss, g = jax.value_and_grad(loss_fn)(params)
    upd, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, upd), opt_state, loss

  opt_state = opt.init(params)
  stream = TaskStream(setup.task, config.seed + 10_000, sc.batch_size)
  eval_set = setup.task.examples("eval", int(sc.eval_size))
  pass_rate, s = 0.0, 0
  t0 = time.time()
  for s in range(1, sc.max_steps + 1):
    params, opt_state, loss = step(params, opt_state, *sft_batch(setup, stream.next_batch()))
    if s % sc.eval_every == 0 or s == sc.max_steps:
      engine.sync(params)
      pass_rate = evaluate(engine, setup, eval_set)["eval/pass_rate"]
      log(f"sft step {s}/{sc.max_steps}: loss {float(loss):.4f} eval pass rate {pass_rate:.3f} "
          f"({(time.time() - t0) / s:.3f} s/step)")
      if pass_rate >= sc.target_pass_rate:
        break
  return params, {"sft/steps": s, "sft/pass_rate": pass_rate}


def make_engine(setup: Setup, record_codes: bool = False, mesh=None) -> RolloutEngine:
  """The rollout engine for `setup`: prompts padded to one bucket, so one program per batch."""
  return RolloutEngine(setup.rollout_config, setup.policy, max_new_tokens=setup.max_new_tokens,
                       prompt_bucket=setup.prompt_len, record_codes=record_codes, mesh=mesh,
                       decode_chunk=setup.decode_chunk,
                       command_buffers=None if setup.command_buffers else False)


def make_mesh(config):
  """The run's device mesh from `config.mesh` (rollout and training colocated on it), or None
  for a single-device run. Several processes with an all-1 mesh config: data parallel over
  every device."""
  mc = parallel.MeshConfig.from_config(config.get("mesh"))
  if mc.is_trivial:
    if jax.process_count() == 1:
      return None
    mc = parallel.MeshConfig(data=-1)
  return parallel.make_mesh(mc)


def warm_start(params, setup: Setup, config, engine: RolloutEngine, log=print):
  """RL's starting point: `params` (a random init), replaced by `config.init_checkpoint` when
  set, then the SFT warm start when `config.sft.max_steps` (which donates `params`). Returns
  (params, SFT info or None)."""
  if config.init_checkpoint:
    _, params = M.load_hf_checkpoint(config.init_checkpoint, progress=True)
  if not config.sft.max_steps:
    return params, None
  return run_sft(params, setup, config, engine, log)


# --------------------------------------------------------------------------- the loop

def _train_state_target(setup: Setup, optimizer, seed: int, stream: TaskStream):
  params = M.init_params(setup.model_config, jax.random.key(seed))
  state = ts.init_state(params, optimizer)
  return {"train": state, "data": stream.state(), "rng": jax.random.key(seed),
          "sft": {"steps": 0, "pass_rate": 0.0}}


PROGRESS_KEYS = ("reward/mean", "eval/pass_rate", "mismatch/k3_kl", "mismatch/code_agreement",
                 "time/rollout_s", "time/train_s")
# Wall-clock keys: everything else a run writes is a function of (config, step).
TIMING_KEYS = ("time/rollout_s", "time/train_s", "rollout/tokens_per_s")


def run(config, workdir: str, log=print, stop_after: int | None = None,
        init_params=None) -> list[dict]:
  """Run (or resume) RL per `config` in `workdir`; returns the metrics written this call.

  stop_after: end abruptly after that many steps of this call, without a final checkpoint
  (tests use it to simulate a killed process).
  init_params: start from these parameters instead of random/SFT (e.g. a shared SFT result)."""
  workdir = resolve_workdir(workdir)
  setup = build(config)
  rc, ec = config.rollout, config.eval
  mesh = make_mesh(config)
  if mesh is None:
    optimizer, step_fn = ts.learner(setup.model_config, setup.policy, setup.rl_config,
                                    bool(config.rl.code_agreement))
    # committed to the default device, as a restored checkpoint's arrays are: the programs
    # compiled for a fresh state then serve a resumed one (uncommitted and committed inputs are
    # different jit cache keys: a run resumed in the same process recompiled everything)
    place = lambda state: jax.device_put(state, jax.devices()[0])  # noqa: E731
  else:  # rollout and train step colocated on one mesh; sync reshards to the rollout rules
    optimizer, step_fn, place = parallel.sharded_learner(
        setup.model_config, setup.policy, setup.rl_config, mesh, bool(config.rl.code_agreement))
  if not parallel.is_primary():  # process 0 logs (and writes metrics: MetricWriter)
    log = lambda *_: None  # noqa: E731
  stream = TaskStream(setup.task, config.seed, int(rc.prompts_per_step))
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=int(config.checkpoint.keep),
                      save_every=int(config.checkpoint.every))
  engine = make_engine(setup, record_codes=bool(config.rl.code_agreement), mesh=mesh)
  target = _train_state_target(setup, optimizer, config.seed, stream)
  target["train"] = place(target["train"])  # restored straight onto the mesh
  if mesh is not None:  # every checkpointed array must be global when processes share a save
    target["rng"] = jax.jit(lambda: jax.random.key(config.seed),
                            out_shardings=parallel.replicated(mesh))()
  latest = ckpt.latest_step()
  if latest is None:
    if init_params is not None:
      params, info = init_params, None
    else:
      params, info = warm_start(target["train"].params, setup, config, engine, log)
    if info:
      target["sft"] = {"steps": int(info["sft/steps"]), "pass_rate": float(info["sft/pass_rate"])}
    target["train"] = place(ts.init_state(params, optimizer))
    ckpt.save(0, target, force=True)
    ckpt.wait()
    saved, start = target, 0
  else:
    try:
      saved = ckpt.restore(latest, target=target)
    except CheckpointMismatchError as e:
      raise ConfigError(f"the checkpoint in {workdir} was written for a different model or "
                        f"optimizer ({e}); use a fresh --workdir or the original config") from None
    start = latest
    log(f"resuming from step {latest} in {workdir}")
  state = saved["train"]
  stream.restore(saved["data"])
  writer = MetricWriter(workdir, resume_step=start)
  if start == 0:
    writer.write(0, {"sft/steps": saved["sft"]["steps"],
                     "sft/pass_rate": saved["sft"]["pass_rate"]})
  eval_set = setup.task.examples("eval", int(ec.size))
  engine.sync(state.params)
  tok, g = setup.tokenizer, int(rc.samples_per_prompt)
  written = []
  total = int(config.total_steps)
  progress = Progress(total, start=start, desc="rl", keys=PROGRESS_KEYS)
  for step in range(start, total):
    examples = stream.next_batch()
    prompts = [tok.encode(e.prompt) for e in examples]
    t0 = time.time()
    ro = engine.generate(prompts, n=g, sampling=setup.sampling,
                         seed=step_seed(config.seed, step, "rollout"), stop_tokens=[tok.eos_id],
                         prompt_len=setup.prompt_len)
    completions = tok.decode_batch(parallel.to_host(ro.completion))
    t_roll = time.time() - t0
    rewards = setup.task.reward([e.prompt for e in examples for _ in range(g)], completions,
                                [e.answer for e in examples for _ in range(g)])
    batch = ts.batch_from_rollout(ro, np.asarray(rewards, np.float32), g, setup.rl_config)
    t1 = time.time()
    state, m = step_fn(state, batch)
    engine.sync(state.params)
    m = jax.device_get(m)
    t_train = time.time() - t1
    gen_tokens = int(np.sum(parallel.to_host(ro.completion_mask)))
    record = {k: float(v) for k, v in m.items()}
    record.update({
        "reward/mean": float(np.mean(rewards)),
        "reward/std": float(np.std(rewards)),
        "time/rollout_s": t_roll, "time/train_s": t_train,
        "rollout/tokens_per_s": gen_tokens / max(t_roll, 1e-9),
        "rollout/mean_length": gen_tokens / ro.num_rows,
        "guidance/bytes_per_token": ro.guidance_bytes_per_token(),
        "guidance/bytes_per_step": ro.guidance_bytes(),
    })
    done = step + 1
    if done % int(ec.every) == 0 or done == total:
      record.update(evaluate(engine, setup, eval_set))
    writer.write(done, record)
    written.append(dict(record, step=done))
    progress.update(done, record)
    if ckpt.should_save(done) or done == total:
      ckpt.save(done, {"train": state, "data": stream.state(), "rng": saved["rng"],
                       "sft": saved["sft"]}, force=done == total)
      ckpt.wait()  # the next step donates `state`: its buffers must be on disk first
    if stop_after is not None and done - start >= stop_after:
      return written  # simulated kill: no final checkpoint, files left as they are
  progress.close()
  writer.close()
  ckpt.close()
  return written


def run_sft_only(config, workdir: str, log=print) -> dict:
  """SFT warm start alone: writes the result as an HF checkpoint in `workdir/hf` (loadable by
  `transformers` and by `--config.init_checkpoint` with sft.max_steps=0)."""
  workdir = resolve_workdir(workdir)
  setup = build(config)
  if not config.sft.max_steps:
    raise ConfigError("sft.max_steps is 0: nothing to do (set --config.sft.max_steps)")
  params, info = warm_start(M.init_params(setup.model_config, jax.random.key(config.seed)),
                            setup, config, make_engine(setup), log)
  out = os.path.join(workdir, "hf")
  M.save_hf_checkpoint(out, params, setup.model_config)
  writer = MetricWriter(workdir)
  writer.write(int(info["sft/steps"]), info)
  writer.close()
  log(f"saved {out}: {info}")
  return info
