"""Rollout throughput: BF16 vs FP4 policies side by side on a random-weight model, RL-shaped and
serving-shaped loads, with HF transformers `generate` as peer columns when torch is present.

On GPU every FP4 policy runs twice: on the Mosaic FP4 kernels (`kernels`, the engine's default)
and on the XLA path (`xla`: weights decoded to bf16 inside the program, tokamax or XLA grouped
matmul), and the two paths' tokens are compared. `--isolate` runs each row in its own process so
that its peak device memory is its own and one row's failure (out of memory) spares the rest.

  python launch/bench_rollout.py --preset=tiny --out=/tmp/bench_rollout.json          # CPU
  python launch/bench_rollout.py --preset=qwen3_30b_a3b_12l --batches=1,64 --isolate \\
      --prompt_len=256 --new_tokens=512 --hf_peer=false --out=$OUT/bench_rollout.json   # H200
"""

import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

# Config files import each other (`from configs import ...`): make the repository root
# importable however the launcher is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags

from trace_jax import compilation_cache, settings

flags.DEFINE_string("preset", "tiny", "Model preset (trace_jax.models.config.PRESETS).")
flags.DEFINE_integer("num_layers", 0, "Override the preset's layer count (0: keep it).")
flags.DEFINE_list("policies", ["bf16", "paper", "w4a16", "kv4"], "Policy presets to compare.")
flags.DEFINE_string("fp4_format", "nvfp4", "FP4 format of the policies.")
flags.DEFINE_list("batches", ["1", "8", "32"], "Sequences per batch; 'capacity': as many as "
                  "the engine's planner admits at prompt_len + new_tokens (device and, with "
                  "decode_chunk, host memory), which the row then fills.")
flags.DEFINE_list("paths", ["auto"], "FP4 matmul paths: kernels, xla (GPU) / reference (CPU); "
                  "auto = xla,kernels on GPU, reference elsewhere.")
flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.")
flags.DEFINE_integer("new_tokens", 32, "Generated tokens per sequence.")
flags.DEFINE_integer("generate_tokens", 0, "Tokens the timed rollout generates (0: new_tokens); "
                     "fewer than new_tokens keeps the engine, its KV cache and host guidance "
                     "arrays sized for new_tokens (a capacity row that must fit a device call).")
flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).")
flags.DEFINE_integer("one_token_repeats", 2, "Timed one-token rollouts (prefill + one step; the "
                     "fastest is reported: session 15's 8k-capacity BF16 row took 20-24 s for "
                     "its first, against 0.9 s after a whole rollout in session 12).")
flags.DEFINE_float("bandwidth", 4.27e12, "Device read bandwidth for the floor, bytes/s (H200).")
flags.DEFINE_boolean("hf_peer", True, "Also time HF transformers generate (eager, static cache).")
flags.DEFINE_boolean("record_guidance", True, "Record TRACE guidance as RL rollouts do.")
flags.DEFINE_bool("command_buffers", True, "Compile the rollout programs with XLA command "
                  "buffers (RolloutEngine(command_buffers=), its GPU default); false: XLA's "
                  "default capture.")
flags.DEFINE_integer("decode_chunk", 0, "Decode windows (guidance moved to host memory per "
                     "window, RolloutEngine(decode_chunk=)); 0: one program.")
flags.DEFINE_list("guidance_copies", [], "After the timed rollouts, a one-token and a whole "
                  "rollout with the chunked engine's guidance copied to host memory each of "
                  "these ways in turn (async, pinned: `engine.GUIDANCE_COPY`): an A/B in one "
                  "process.")
flags.DEFINE_boolean("resync", True, "Time a re-sync of new master values (needs the master, "
                     "the old and the new rollout copy at once: 48 BF16 layers do not fit).")
flags.DEFINE_string("init_dtype", "bfloat16", "dtype of the random master weights.")
flags.DEFINE_boolean("host_master", False, "Draw the master weights in host memory and sync "
                     "from there, part by part (`RolloutEngine.sync` of numpy leaves): the "
                     "device never holds the whole master (48 layers' bf16 master, 61 GB, "
                     "does not fit an 80 GB GPU beside the FP4 weights). The re-sync is then "
                     "a second sync of the same host master (a host sync redoes every part).")
flags.DEFINE_float("host_reserve_gib", 20.0, "A capacity row's planning leaves this much of the "
                   "host memory available then to what the process takes before the rollout "
                   "(48 FP4 layers: free host memory fell 10.6 GiB from planning to the timed "
                   "rollout in session 12, 15.0 GiB in session 15, where 12 GiB was too little).")
flags.DEFINE_boolean("isolate", False, "Run each row in a subprocess (GPU: honest peak memory).")
flags.DEFINE_integer("row_timeout", 600, "Seconds per isolated row.")
flags.DEFINE_string("row", "", "Internal: run one row 'policy:path:batch' and print it.")
flags.DEFINE_string("tokens_dir", "", "Internal: where rows save their last tokens.")
flags.DEFINE_string("out", "bench_rollout.json", "Output JSON path.")
compilation_cache.define_flags()
FLAGS = flags.FLAGS


def _median(xs):
  xs = sorted(xs)
  return xs[len(xs) // 2]


_T0 = time.perf_counter()


def _log(msg):
  """A progress line: seconds since start and host memory free (a capacity row's guidance fills
  host memory), on stderr; an isolated row's lines are passed on by its parent and kept in its
  row's `progress`."""
  from trace_jax.rollout import engine  # noqa: PLC0415 - launcher imports stay lazy
  free = engine.host_memory_bytes() / 2**30
  print(f"[{FLAGS.row or 'bench'}] {time.perf_counter() - _T0:7.1f} s, host {free:.1f} GiB "
        f"free: {msg}", file=sys.stderr, flush=True)


def _bytes_floor(config, policy, weight_bytes_by_kind, batch, context):
  """Bytes a decode step must read: attention/dense weights, the experts the batch touches,
  lm_head/embedding row reads, and the live KV cache."""
  from trace_jax import models as M
  e, k = config.num_experts, config.num_experts_per_tok
  hit = e * (1 - (1 - k / e) ** batch)  # expected distinct experts per layer
  expert = weight_bytes_by_kind["experts"] * hit / e
  kv = M.cache_bytes_per_token(config, policy.kv_format, config.compute_dtype) * context * batch
  return weight_bytes_by_kind["other"] + expert + kv


def bench_engine(config, policy_name, path, batch, tokens_dir=""):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax import kernels
  from trace_jax import models as M
  from trace_jax import quant as tq
  from trace_jax.rollout import RolloutEngine, SamplingParams, tree_bytes

  gen_tokens = FLAGS.generate_tokens or FLAGS.new_tokens
  if not 0 < gen_tokens <= FLAGS.new_tokens:
    raise ValueError(f"--generate_tokens={gen_tokens} must be in 1..new_tokens={FLAGS.new_tokens}")
  policy = tq.make_policy(policy_name, FLAGS.fp4_format)
  params = M.random_params(config, jax.random.key(0), FLAGS.init_dtype,
                           on_host=FLAGS.host_master)
  jax.block_until_ready(params)
  _log(f"master weights made ({config.num_layers} layers, {FLAGS.init_dtype}, "
       f"{'host' if FLAGS.host_master else 'device'} memory)")
  engine = RolloutEngine(config, policy, max_new_tokens=FLAGS.new_tokens,
                         prompt_bucket=FLAGS.prompt_len, record_guidance=FLAGS.record_guidance,
                         use_kernels=path == "kernels", decode_chunk=FLAGS.decode_chunk,
                         command_buffers=None if FLAGS.command_buffers else False)
  t = time.perf_counter()
  engine.sync(params)
  jax.block_until_ready(engine.params)
  sync_s = time.perf_counter() - t
  # an RL step re-syncs with compiled code: the second sync compiles the re-sync program (it
  # donates the old rollout weights), the third is timed; new master values each time
  # donated: a second master copy beside the first does not fit at 48 layers (2 x 61 GB in bf16
  # and the rollout copy: out of memory on the H200, 2026-11-30)
  nudge = jax.jit(lambda p: jax.tree.map(lambda a: a * jnp.asarray(1.001, a.dtype), p),
                  donate_argnums=0)
  resync_s = None
  for _ in range(2 if FLAGS.resync else 0):
    if not FLAGS.host_master:
      params = nudge(params)
      jax.block_until_ready(params)
    t = time.perf_counter()
    engine.sync(params)
    jax.block_until_ready(engine.params)
    resync_s = time.perf_counter() - t
  _log(f"synced in {sync_s:.1f} s (compile included), re-synced in {resync_s} s")
  del params
  weights = engine.params
  experts = sum(tree_bytes(weights[f"layers_{i}"]["moe"]["experts"])
                for i in range(config.num_layers) if config.is_moe_layer(i))
  by_kind = {"experts": experts, "other": tree_bytes(weights) - experts
             - tree_bytes(weights["embed"])}  # embedding: only B rows are read
  rng = np.random.default_rng(0)
  planned = limits = None
  if batch == "capacity":  # the planner's figure for this engine, weights and device
    ctx_len, reserve = FLAGS.prompt_len + FLAGS.new_tokens, int(FLAGS.host_reserve_gib * 2**30)
    # one reading of free memory for both figures (`capacity` is the smaller limit)
    limits = engine.capacity_limits(ctx_len, FLAGS.prompt_len, host_reserve=reserve)
    batch = planned = min(n for n in limits if n is not None)
    _log(f"capacity: {batch} sequences of {ctx_len} tokens (device-limited {limits[0]}, "
         f"host-limited {limits[1]} with {FLAGS.host_reserve_gib} GiB reserved)")
  batch = int(batch)
  prompts = [list(rng.integers(3, config.vocab_size, FLAGS.prompt_len)) for _ in range(batch)]
  s = SamplingParams(temperature=1.0)

  timelines = {}  # the chunked engine's host seconds by part (`ChunkTimeline`), per call

  def generate(max_new, seed):
    t = time.perf_counter()
    out = engine.generate(prompts, n=1, sampling=s, seed=seed, max_new_tokens=max_new)
    jax.block_until_ready(out.tokens)
    return time.perf_counter() - t, out

  def timed(max_new, repeats):
    ts, out = [], None
    for r in range(repeats):
      out = None  # one rollout at a time: at capacity its guidance fills host memory
      t, out = generate(max_new, 2 + r)
      ts.append(t)
      if engine.last_timeline is not None:
        timelines.setdefault(f"new_tokens_{max_new}", []).append(engine.last_timeline.as_dict())
    return ts, out

  def log_timelines(max_new):
    for t in timelines.get(f"new_tokens_{max_new}", []):
      _log("host seconds by part: " + json.dumps(t["seconds"]) + "; within the landing: "
           + json.dumps(t["landing_seconds"]))

  _log("compiling")
  # max_new is an argument of the compiled program: one token compiles and warms up the same
  # program as a whole rollout does, without paying for one (a 48-layer row's budget)
  first_call, out = generate(1, 1)
  del out  # (as `_` it would stay alive: its host guidance arrays are sized for every step)
  _log(f"first call (compile, prefill, one step) {first_call:.1f} s; timing")
  # prefill + one step (same compiled program, early exit) before the whole rollout: host
  # memory available shrinks as the process runs (a capacity row is planned on what is free)
  ones = timed(1, FLAGS.one_token_repeats)[0]
  t_one = min(ones)
  _log(f"prefill + one step {', '.join(f'{t:.2f}' for t in ones)} s")
  log_timelines(1)
  fulls, out = timed(gen_tokens, FLAGS.repeats)
  t_full = _median(fulls)
  _log(f"median {t_full:.2f} s")
  log_timelines(gen_tokens)
  gen = int(np.sum(np.asarray(out.completion_mask)))
  guidance_per_token = out.guidance_bytes_per_token()
  completion = np.asarray(out.completion)
  del out
  default_copy, by_copy = engine.guidance_copy, []
  for copy in FLAGS.guidance_copies:
    engine.guidance_copy = copy
    row = {"copy": copy}
    by_copy.append(row)
    try:  # (an error is this A/B's, not the row's: the timed figures above stand)
      for what, max_new in (("one_token", 1), ("whole", gen_tokens)):
        t, out = generate(max_new, 2)
        del out
        row[f"{what}_s"] = t
        row[f"{what}_timeline"] = (None if engine.last_timeline is None
                                   else engine.last_timeline.as_dict())
    except Exception as e:  # noqa: BLE001
      row["error"] = f"{type(e).__name__}: {e}"
    _log(f"guidance copied {copy}: " + json.dumps(
        {k: v for k, v in row.items() if not k.endswith("timeline")}))
  engine.guidance_copy = default_copy
  step_s = (t_full - t_one) / max(gen_tokens - 1, 1)
  ctx = FLAGS.prompt_len + gen_tokens // 2
  floor_b = _bytes_floor(config, policy, by_kind, batch, ctx)
  # The chunked engine's pace window by window: the spacing of its windows' records reaching
  # host memory over the window's steps, which is the device's step once the device is the
  # bound (session 36: 13.6 -> 18.3 ms a step over the 48-layer rollout as contexts grew), each
  # beside the floor at that window's mean context; the first window's interval includes the
  # prefill and is left out. Unlike decode_step_ms, no one-token call is subtracted. (Windows
  # by the timeline's `pieces`: a guided rollout's last window runs in shorter pieces.)
  window_step_ms = window_floor_ms = []
  if timelines.get(f"new_tokens_{gen_tokens}"):
    from trace_jax.rollout.engine import window_step_ms as paces
    last = timelines[f"new_tokens_{gen_tokens}"][-1]
    window_step_ms = paces(last["marks"], last["pieces"])
    window_floor_ms = [1e3 * _bytes_floor(config, policy, by_kind, batch,
                                          FLAGS.prompt_len + start + n // 2) / FLAGS.bandwidth
                       for start, n in last["pieces"][1:len(window_step_ms) + 1]]
  if tokens_dir:
    np.save(os.path.join(tokens_dir, f"{policy_name}_{path}_{batch}.npy"), completion)
  peak = None
  try:
    peak = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
  except Exception:  # noqa: BLE001 - no stats on this backend
    pass
  return {
      "policy": policy_name, "policy_full": policy.name, "path": path, "batch": batch,
      "grouped_backend": kernels.grouped_backend() if path != "kernels" else "fp4_mgpu",
      "tokens_per_s": gen / t_full, "decode_step_ms": 1e3 * step_s,
      "prefill_plus_first_step_ms": 1e3 * t_one,
      "prefill_plus_first_step_each_ms": [1e3 * t for t in ones],
      "total_s": t_full, "generated_tokens": gen,
      "generate_tokens": gen_tokens,
      "first_call_s": first_call, "sync_s": sync_s, "resync_s": resync_s,
      "weight_bytes": tree_bytes(weights), "expert_weight_bytes": experts,
      "kv_bytes": int(M.cache_bytes_per_token(config, policy.kv_format, config.compute_dtype)
                      * (FLAGS.prompt_len + FLAGS.new_tokens) * batch),
      "guidance_bytes_per_token": guidance_per_token,
      "floor_bytes_per_step": floor_b, "floor_step_ms": 1e3 * floor_b / FLAGS.bandwidth,
      "floor_over_measured": (floor_b / FLAGS.bandwidth) / step_s,
      # the same share over the whole timed rollout (prefill included): no subtraction of the
      # one-token call, whose time need not be the whole rollout's prefill (session 15's BF16
      # 8k-capacity row: 20.0 s for prefill + one step, a step below the floor left after it)
      "rollout_floor_over_measured": (floor_b / FLAGS.bandwidth) * gen_tokens / t_full,
      "peak_device_bytes": peak, "planned_capacity": planned,
      "capacity_limits": limits, "host_reserve_gib": FLAGS.host_reserve_gib if planned else None,
      "window_step_ms": window_step_ms, "window_floor_ms": window_floor_ms,
      "floor_over_window_steps": (sum(window_floor_ms) / sum(window_step_ms)
                                  if window_step_ms else None),
      # the same without the first interval: window 0's records land after the prompt's, so a
      # host slow to copy those (5.6 GB at the 48-layer 8k-capacity shape) marks window 0 late
      # and squeezes its interval (session 38: 9.6 and 8.3 ms a step against ~14)
      "floor_over_window_steps_after_first": (sum(window_floor_ms[1:]) / sum(window_step_ms[1:])
                                              if window_step_ms[1:] else None),
      "chunk_timelines": timelines, "guidance_copy": default_copy,
      "guidance_copy_rollouts": by_copy,
  }


def bench_hf(config, batch):
  """HF transformers generate on the same shape (random weights, HF's own initializer, made on
  the device: no JAX in this process, which would take the GPU's memory): eager and static
  cache."""
  import torch
  import transformers

  from trace_jax import models as M
  dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  fields = M.to_hf_config(config, str(dtype).split(".")[1])
  hf_config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
  torch.manual_seed(0)
  with torch.device(dev):
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
  ids = torch.randint(3, config.vocab_size, (batch, FLAGS.prompt_len), device=dev)
  rows = []
  for impl in ("eager", "static"):
    kw = dict(max_new_tokens=FLAGS.new_tokens, min_new_tokens=FLAGS.new_tokens, do_sample=True)
    if impl == "static":
      kw["cache_implementation"] = "static"
    try:
      with torch.no_grad():
        model.generate(ids, **kw)
        ts = []
        for _ in range(FLAGS.repeats):
          t = time.perf_counter()
          model.generate(ids, **kw)
          if dev == "cuda":
            torch.cuda.synchronize()
          ts.append(time.perf_counter() - t)
      rows.append({"policy": f"hf_{impl}", "batch": batch,
                   "tokens_per_s": batch * FLAGS.new_tokens / _median(ts),
                   "total_s": _median(ts), "transformers_version": transformers.__version__,
                   "torch_version": torch.__version__})
    except Exception as e:  # noqa: BLE001 - record why the peer could not run
      rows.append({"policy": f"hf_{impl}", "batch": batch, "error": str(e)[:300]})
  return rows


def _paths(policy_name):
  from trace_jax import kernels
  from trace_jax import quant as tq
  paths = FLAGS.paths
  if paths == ["auto"]:
    paths = ["xla", "kernels"] if kernels.on_gpu() else ["reference"]
  if not any(f for _, f in tq.make_policy(policy_name, FLAGS.fp4_format).weight_rules):
    return ["xla" if kernels.on_gpu() else "reference"]  # BF16 weights: no FP4 path to choose
  return paths


def _run_isolated(spec, tokens_dir):
  """One row in a fresh process: its own peak memory, and an error stays a row. The row's
  progress lines are printed as they come (where a long row spends its time) and kept in the
  row's `progress`."""
  streams = {"stdout": [], "stderr": []}
  with subprocess.Popen(_child_cmd(spec, tokens_dir), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, errors="replace") as p:
    def pump(name):
      for line in getattr(p, name):
        streams[name].append(line)
        if name == "stderr" and line.startswith(f"[{spec}]"):
          print(line, end="", file=sys.stderr, flush=True)

    pumps = [threading.Thread(target=pump, args=(n,), daemon=True) for n in streams]
    for t in pumps:
      t.start()
    try:
      p.wait(timeout=FLAGS.row_timeout)
      timed_out = False
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()
      timed_out = True
    for t in pumps:
      t.join()
  stdout, stderr = ("".join(streams[n]) for n in ("stdout", "stderr"))
  r = _parse_row(None if timed_out else p.returncode, stdout, stderr)
  if timed_out:
    r["error"] = f"timed out after {FLAGS.row_timeout} s; " + r.get("error", "")
  r["progress"] = [line.rstrip() for line in streams["stderr"] if line.startswith(f"[{spec}]")]
  return r


def _child_cmd(spec, tokens_dir):
  argv = [a for a in sys.argv[1:] if not a.startswith(("--row", "--isolate", "--tokens_dir"))]
  return [sys.executable, sys.argv[0], *argv, f"--row={spec}", f"--tokens_dir={tokens_dir}",
          "--noisolate"]


def _parse_row(returncode, stdout, stderr):
  stdout, stderr = [o.decode(errors="replace") if isinstance(o, bytes) else o
                    for o in (stdout, stderr)]
  for line in (stdout or "").splitlines():
    if line.startswith("ROW_JSON "):
      return json.loads(line[len("ROW_JSON "):])
  tail = (stderr or stdout or "").strip().splitlines()[-3:]
  return {"error": f"exit {returncode}: " + " | ".join(tail)[-400:]}


def _agreement(rows, tokens_dir):
  """Per FP4 policy and batch: how often the kernel path's sampled tokens equal the XLA path's
  (same keys; a rounding-level difference can flip one sample, after which the sequence
  diverges, so whole-sequence equality is the stricter figure)."""
  import numpy as np
  out = []
  for r in rows:
    if r.get("path") != "kernels" or "error" in r:
      continue
    pk = os.path.join(tokens_dir, f"{r['policy']}_kernels_{r['batch']}.npy")
    px = os.path.join(tokens_dir, f"{r['policy']}_xla_{r['batch']}.npy")
    if os.path.exists(pk) and os.path.exists(px):
      a, b = np.load(pk), np.load(px)
      first = [int(np.argmax(x != y)) if np.any(x != y) else len(x) for x, y in zip(a, b)]
      out.append({"policy": r["policy"], "batch": r["batch"],
                  "same_token_frac": float(np.mean(a == b)),
                  "same_sequence_frac": float(np.mean(np.all(a == b, axis=1))),
                  "median_first_difference": float(np.median(first))})
  return out


def main(argv):
  del argv
  settings.warn_unknown()
  compilation_cache.enable()
  from trace_jax import models as M
  from trace_jax.provenance import run_info
  config = M.preset(FLAGS.preset).replace(max_seq_len=FLAGS.prompt_len + FLAGS.new_tokens)
  if FLAGS.num_layers:
    config = config.replace(num_layers=FLAGS.num_layers)
  if FLAGS.row:
    policy, path, batch = FLAGS.row.split(":")
    row = bench_engine(config, policy, path, batch if batch == "capacity" else int(batch),
                       FLAGS.tokens_dir)
    print("ROW_JSON " + json.dumps(row), flush=True)
    return
  tokens_dir = tempfile.mkdtemp(prefix="bench_rollout_tokens_")
  atexit.register(shutil.rmtree, tokens_dir, ignore_errors=True)  # (only the rows' agreement)
  rows = []
  head = dict(benchmark="bench_rollout", **run_info(), preset=FLAGS.preset,
              num_layers=config.num_layers,
              prompt_len=FLAGS.prompt_len, new_tokens=FLAGS.new_tokens,
              bandwidth_bytes_per_s=FLAGS.bandwidth, record_guidance=FLAGS.record_guidance,
              decode_chunk=FLAGS.decode_chunk, command_buffers=FLAGS.command_buffers,
              host_master=FLAGS.host_master,
              note="paths: kernels = Mosaic GPU FP4 kernels (engine default on GPU); xla = "
                   "weights decoded to bf16 in the program, grouped matmul by grouped_backend; "
                   "reference = the jnp reference (CPU)",
              units=dict(tokens_per_s="generated tokens/s (wall)", decode_step_ms="ms (wall)",
                         weight_bytes="bytes", kv_bytes="bytes at full context",
                         floor_step_ms="ms at the given bandwidth",
                         floor_over_measured="fraction of the bytes-moved floor reached "
                                             "by the decode step (whole rollout - one-token "
                                             "rollout; a slower one-token call makes it "
                                             "larger: session 35)",
                         rollout_floor_over_measured="the floor's steps over the whole timed "
                                                     "rollout (prefill included)",
                         window_step_ms="ms a step of each decode window after the first, "
                                        "from its records' arrivals (the device's pace)",
                         floor_over_window_steps="the windows' floors over their steps: the "
                                                 "step's share without the one-token call "
                                                 "(session 36)",
                         sync_s="s, first weight sync (compile included)",
                         first_call_s="s, compile + prefill + one decode step",
                         resync_s="s, a later sync of new master values (compiled)"))

  def save():
    out = dict(head, results=rows, path_agreement=_agreement(rows, tokens_dir))
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(out, f, indent=2)
    return out

  t0 = time.perf_counter()
  for b in [x if x == "capacity" else int(x) for x in FLAGS.batches]:
    for p in FLAGS.policies:
      for path in _paths(p):
        spec = f"{p}:{path}:{b}"
        if FLAGS.isolate:
          row = _run_isolated(spec, tokens_dir)
        else:
          try:
            row = bench_engine(config, p, path, b, tokens_dir)
          except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row = {"policy": p, "path": path, "batch": b, **row}  # (a capacity row: its own batch)
        rows.append(row)
        save()
        print(f"[{time.perf_counter() - t0:7.1f} s] " + json.dumps(
            {k: row.get(k) for k in ("policy", "path", "batch", "tokens_per_s",
                                     "decode_step_ms", "floor_over_measured",
                                     "rollout_floor_over_measured", "error")}),
            flush=True)
    if FLAGS.hf_peer and b != "capacity":
      missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
      if missing:  # (said, not skipped in silence)
        print(f"--hf_peer: no HF rows, {' and '.join(missing)} not installed here "
              "(pip install torch==2.13.0 transformers)", flush=True)
      else:
        rows += bench_hf(config, b)
  out = save()
  # (windows: the chunked engine's pace from its windows, `window_step_ms`, against its floor)
  print(f"{'policy':10s} {'path':9s} {'B':>4s} {'tok/s':>10s} {'step ms':>9s} "
        f"{'floor ms':>9s} {'of floor':>8s} {'rollout':>8s} {'windows':>8s} {'peak GB':>8s}")
  for r in rows:
    if "error" in r:
      print(f"{r['policy']:10s} {r.get('path', ''):9s} {str(r['batch']):>4s} error: "
            f"{r['error'][:70]}")
      continue
    peak = r.get("peak_device_bytes")
    print(f"{r['policy']:10s} {r.get('path', ''):9s} {str(r['batch']):>4s} "
          f"{r['tokens_per_s']:10.1f} "
          f"{r.get('decode_step_ms', float('nan')):9.2f} "
          f"{r.get('floor_step_ms', float('nan')):9.3f} "
          f"{r.get('floor_over_measured', float('nan')):8.2f} "
          f"{r.get('rollout_floor_over_measured', float('nan')):8.2f} "
          f"{r.get('floor_over_window_steps') or float('nan'):8.3f} "
          f"{(peak or float('nan')) / 1e9:8.1f}")
  for a in out["path_agreement"]:
    print(f"kernels vs xla {a['policy']} B={a['batch']}: same tokens {a['same_token_frac']:.3f}, "
          f"same sequences {a['same_sequence_frac']:.3f}")


if __name__ == "__main__":
  app.run(main)
