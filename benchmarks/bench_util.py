"""Helpers shared by the GPU benchmark scripts (imported as a sibling module: the scripts run as
`python benchmarks/<name>.py`, which puts this folder on `sys.path`)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time

# The small MoE shapes of the trainer benchmarks (bench_parallel's "tiny" and "mid" presets,
# train_determinism's shapes): vocabulary 128, rotary theta 10,000
SMALL_MOE = {
    "tiny": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 num_experts=4, num_experts_per_tok=2, moe_ffn_size=64),
    "mid": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                num_experts=32, num_experts_per_tok=4, moe_ffn_size=256),
}


def small_moe_config(preset: str, **fields):
  """`models.tiny` at a `SMALL_MOE` shape, other config fields (max_seq_len, dtype) given."""
  from trace_jax import models as M  # noqa: PLC0415 - plot scripts import this module without jax
  if preset not in SMALL_MOE:
    raise ValueError(f"unknown small MoE preset {preset!r}: one of {sorted(SMALL_MOE)}")
  return M.tiny(vocab_size=128, rope_theta=10000.0, **fields, **SMALL_MOE[preset])


def trainer_config(preset: str, **fields):
  """A trainer benchmark's model: a `SMALL_MOE` preset, or "a3b_l<N>" (the Qwen3-30B-A3B shape
  with N layers); other config fields (max_seq_len, dtype) given."""
  from trace_jax import models as M  # noqa: PLC0415
  if preset.startswith("a3b_l") and preset[len("a3b_l"):].isdigit():
    return M.qwen3_30b_a3b(num_layers=int(preset[len("a3b_l"):]), **fields)
  if preset not in SMALL_MOE:
    raise ValueError(f"unknown preset {preset!r}: one of {sorted(SMALL_MOE)} or a3b_l<layers>")
  return small_moe_config(preset, **fields)


def random_rollout_model(preset: str, layers: int, prompt_len: int, cache_new_tokens: int,
                         batch: int, on_host: bool = False):
  """The rollout benchmarks' model and load: `models.preset(preset)` with `layers` layers and
  room for `prompt_len + cache_new_tokens` tokens, its random bf16 master (key 0; on_host: in
  host memory, `random_params`) and `batch` random prompts of `prompt_len` tokens (numpy seed
  0), so that every script that times a rollout of one shape times the same numbers. Returns
  (config, params, prompts)."""
  import jax  # noqa: PLC0415 - plot scripts import this module without jax
  import numpy as np  # noqa: PLC0415

  from trace_jax import models as M  # noqa: PLC0415
  cfg = M.preset(preset).replace(num_layers=layers, max_seq_len=prompt_len + cache_new_tokens)
  params = M.random_params(cfg, jax.random.key(0), "bfloat16", on_host=on_host)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, cfg.vocab_size, prompt_len)) for _ in range(batch)]
  return cfg, params, prompts


def digest(*trees) -> str:
  """The first 16 hex digits of the SHA-256 of every array leaf's bytes, in order: how the
  repeat benchmarks compare runs' numbers (tokens, logprobs, parameters)."""
  import jax  # noqa: PLC0415 - plot scripts import this module without jax
  import numpy as np  # noqa: PLC0415
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(trees):
    h.update(np.asarray(leaf).tobytes())
  return h.hexdigest()[:16]


def result_header(benchmark: str, **extra) -> dict:
  """The provenance every benchmark JSON starts with: name, UTC date, device, jax version,
  whether the kernels ran there (`kernels_on`: on a Hopper GPU, unless TRACE_JAX_KERNELS), the
  commit and the source tree that ran (an A/B side's own), the command line, the TRACE_JAX_*
  and XLA_FLAGS settings it ran under (an A/B side is often only a setting) and the TRACE_JAX_*
  names among them that nothing reads (each also a warning on stderr); then `extra`."""
  import datetime
  import sys

  import jax

  from trace_jax import provenance, settings
  from trace_jax.kernels import dispatch
  return dict(benchmark=benchmark,
              date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
              device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
              kernels_on=dispatch.kernels_on(),
              git_commit=provenance.git_commit(), source_tree=provenance.source_tree(),
              command=" ".join([os.path.basename(sys.executable)] + sys.argv),
              settings=provenance.settings(), unknown_settings=settings.warn_unknown(),
              **extra)


def write_result(path: str, benchmark: str, **fields) -> dict:
  """`result_header(benchmark, **fields)` written to `path` as JSON; returns it."""
  import json
  out = result_header(benchmark, **fields)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print("wrote", path)
  return out


READ_CEILING_TBPS = 4.27  # measured XLA bf16 GEMV read stream on the H200 (BENCHMARKS.md)
L2_BYTES = 60e6  # H200 L2: timed inputs rotate through copies larger than this


def labelled_json(items):
  """[(label, parsed JSON)] from `label=path` command-line arguments, in their order."""
  import json
  out = []
  for item in items:
    label, _, path = item.partition("=")
    if not path:
      raise ValueError(f"expected label=path, got {item!r}")
    with open(path) as f:
      out.append((label, json.load(f)))
  return out


def relerr_max(got, ref) -> float:
  """max |got - ref| / max |ref| in float64 (a kernel's error against its reference, as the
  benchmarks record it); NaN where `got` holds a non-finite value."""
  import numpy as np
  got = np.asarray(np.asarray(got, np.float32), np.float64)
  ref = np.asarray(np.asarray(ref, np.float32), np.float64)
  if not np.all(np.isfinite(got)):
    return float("nan")
  return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def start_watchdog(state: dict, hang_s: float, rows: list, save, log) -> None:
  """End the process (exit code 3) when the variant in `state` ("name", started at "t"; "t"
  None between variants) runs past `hang_s`, after recording it in `rows` and saving: a hung
  Mosaic GPU kernel stalls the whole GPU job otherwise."""

  def watch():
    while True:
      time.sleep(2)
      if state.get("t") and time.time() - state["t"] > hang_s:
        log("WATCHDOG: hung in", state.get("name"))
        rows.append(dict(name=state.get("name"), error="HUNG (watchdog)"))
        save()
        os._exit(3)

  threading.Thread(target=watch, daemon=True).start()


# The unit of `checked_timing`'s time, for the result header of the benchmarks that use it
CHECKED_TIMING_UNITS = dict(us="microseconds of CUPTI device time a call, median")


def checked_timing(row: dict, fn, inputs: tuple, want: list, outputs, equal_key: str,
                   iters: int) -> dict:
  """Fill `row` for one jitted variant `fn`: its outputs (`outputs(fn(*inputs))`, a list of
  numpy arrays) against `want` bit for bit (`row[equal_key]`), its CUPTI device time a call
  (all its kernels, median over `iters`: `us`) and kernel count (`kernels_per_call`); a
  variant that fails gets `error` instead (a row, not the end of the run)."""
  import numpy as np
  try:
    got = outputs(fn(*inputs))
    row[equal_key] = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    row.update(_cupti_us(fn, inputs, iters))
  except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end
    row["error"] = f"{type(e).__name__}: {e}"[:300]
  return row


def device_us_timing() -> str:
  """What `device_us` times on this backend, for a result header's `timing`."""
  import jax
  gpu = jax.default_backend() == "gpu"
  return "cupti_device_time(profiler.measure)" if gpu else "wall_time(median)"


def device_us(fn, args, iters: int) -> dict:
  """{us: median time a call of jitted `fn(*args)`, kernels_per_call}: CUPTI device time on the
  GPU, else wall time (a CPU run checks the script; its times are not the GPU's)."""
  import statistics

  import jax
  if jax.default_backend() == "gpu":
    return _cupti_us(fn, args, iters)
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append((time.perf_counter() - t) * 1e6)
  return dict(us=statistics.median(times))


def _cupti_us(fn, args, iters: int) -> dict:
  """{us: median CUPTI device time a call of jitted `fn(*args)` (all its kernels),
  kernels_per_call}: `checked_timing`'s and `device_us`'s GPU timing."""
  import statistics

  from jax.experimental.mosaic.gpu import profiler  # noqa: PLC0415 - GPU only
  _, tim = profiler.measure(fn.lower(*args).compile(), aggregate=False,
                            iterations=iters)(*args)
  return dict(us=statistics.median(sum(ms for _, ms in it) * 1e3 for it in tim),
              kernels_per_call=len(tim[0]))


def keep_checked_row(res: dict, row: dict, label: str, equal_key: str, t0: float,
                     path: str) -> None:
  """A `checked_timing` row into the result: appended, printed (elapsed time, label, time a
  call, whether it equalled, the error if any) and the result saved to `path` (a run cut
  short keeps what it measured)."""
  import json
  import time
  res["rows"].append(row)
  print(f"[{time.time() - t0:6.1f}s] {label} {row.get('us', float('nan')):7.2f} us  equal "
        f"{row.get(equal_key)}  {row.get('error', '')[:80]}", flush=True)
  with open(path, "w") as f:
    json.dump(res, f, indent=1, default=str)


def timed_rows_for_plot(json_path: str):
  """(pyplot on the Agg backend, the saved result, its rows that have a time `us`): the start
  of the plot functions of the benchmarks that time each row once."""
  import json

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(json_path) as f:
    res = json.load(f)
  return plt, res, [r for r in res["rows"] if "us" in r]


def save_figure(fig, title: str, path: str) -> None:
  """Title, tight layout, PNG at `path` (120 dpi), and say so: the end of the plot scripts."""
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print("wrote", path)


def site_bars(json_path: str, title, log: bool = False, panel: str = "site") -> str:
  """Bars of us a call per variant, one panel per row's `panel` field ("site": `title(site)` its
  title; XLA's variants grey; log: a log scale), for the benchmarks that time each row once; the
  PNG beside the JSON, its path returned."""
  plt, res, rows = timed_rows_for_plot(json_path)
  groups: dict = {}
  for r in rows:
    groups.setdefault(r[panel], []).append((r["variant"], r["us"]))
  fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
  for ax, (site, vals) in zip(axes[0], groups.items()):
    ax.bar([v for v, _ in vals], [u for _, u in vals],
           color=["tab:gray" if v.startswith("xla") else "tab:blue" for v, _ in vals])
    ax.set_title(title(site), fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=60)
    if log:
      ax.set_yscale("log")
    ax.set_ylabel("us a call (CUPTI, all kernels)")
  out = json_path.rsplit(".", 1)[0] + ".png"
  save_figure(fig, f"{res.get('device')} jax {res.get('jax_version')} "
              f"{res.get('git_commit')} {res.get('date', '')[:10]}", out)
  return out


def abstract_h200():
  """Context for lowering Triton-lowered Pallas kernels for CUDA on a machine without a GPU
  (`--dry`): the Triton lowering asks the device for its compute capability."""
  import jax
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=dev))


def decode_loop_listing(hlo_text: str) -> str:
  """The kernels of the decode loop, one line each in program order: instruction, HLO op,
  output shape, source scope. The loop is the largest while body of the optimized module that
  runs no prefill attention (at large batches the prefill runs in passes, a loop of its own and
  a larger one: the census at B 276 listed it before session 20)."""
  lines = hlo_text.split("\n")
  bodies = set(re.findall(r"body=%([\w.\-]+)", hlo_text))
  best, best_key = [], None
  for name in bodies:
    start = next((i for i, l in enumerate(lines) if l.startswith(f"%{name} ")), None)
    if start is None:
      continue
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("}"))
    body = lines[start + 1:end]
    key = (not any("prefill_attention" in l for l in body), len(body))
    if best_key is None or key > best_key:
      best, best_key = body, key
  out = []
  for line in best:
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(", line)
    if not m or m.group(3) in ("parameter", "get-tuple-element", "tuple", "constant", "bitcast"):
      continue
    op = re.search(r'op_name="([^"]+)"', line)
    out.append(f"{m.group(1):40} {m.group(3):12} {m.group(2)[:60]:60} "
               f"{source_scope(op.group(1)) if op else ''}")
  return "\n".join(out) + "\n"


def source_scope(op_name: str) -> str:
  """A readable source scope: jit/while/vmap wrappers and numbers dropped."""
  parts = [p for p in re.sub(r"\d+", "#", op_name).split("/")
           if p and not p.startswith(("jit(", "while", "body", "cond", "pjit", "closed_call",
                                      "vmap(", "checkpoint", "remat"))]
  return "/".join(parts[:6]) or op_name
