"""Where a rollout's decode time goes on the GPU: the engine's generate under the JAX profiler,
device kernels summed by name and by source scope, and the cost of recording TRACE guidance.

  PYTHONPATH=. python benchmarks/profile_decode.py --layers 4 --policy paper --path kernels \
      --out $OUT/profile_decode_paper.json

Per run (one policy and matmul path): compile + warm up, time `generate` with guidance recording
on and (with --guidance_cost) off, then trace one steady call with `jax.profiler.trace(...,
create_perfetto_trace=True)` and read the Perfetto JSON it writes. Device events are summed by
kernel name and by the scope in their `tf_op`/`long_name` argument (the jit name stack, numbers
dropped), and divided by the decode steps of the call. The JSON keeps the top entries of each.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

# XLA dumps the optimized HLO of the generate program as it compiles it (no extra compile): its
# instructions' `op_name` metadata names the source (layers_#/moe/..., attention, sampling) of
# every kernel the trace shows, also inside the decode while loop where the trace has no scope.
HLO_DUMP = tempfile.mkdtemp(prefix="hlo_dump_")
if "xla_dump_to" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={HLO_DUMP}"
                             " --xla_dump_hlo_as_text"
                             " --xla_dump_hlo_module_re=jit_(generate_program|prefill_program"
                             "|_decode)").strip()

import jax

import bench_util

from trace_jax import compilation_cache
from trace_jax import quant as tq
from trace_jax.provenance import run_info
from trace_jax.rollout import RolloutEngine, SamplingParams


def _median(xs):
  return sorted(xs)[len(xs) // 2]


def _timed(engine, prompts, new, repeats, chunk=0):
  """(first call s, median of the rest s, guidance bytes per token, window paces). No rollout
  is kept alive past its own call: at capacity its host guidance (347 MB a sequence at 8k)
  would leave the next call short of host memory (session 14: 264 sequences refused, 269 fit).
  Window paces: for each timed call (the first left out), ms a step between consecutive decode
  windows' records reaching host memory (bench_rollout's `window_step_ms`; no one-token call
  subtracted, so the host's per-call work, which moved a one-token call by 0.15 s between
  processes in session 49, stays out of it); empty without decode windows."""
  from trace_jax.rollout.engine import window_step_ms
  s = SamplingParams(temperature=1.0)
  ts, paces = [], []
  for r in range(repeats + 1):
    t = time.perf_counter()
    out = engine.generate(prompts, n=1, sampling=s, seed=1 + r, max_new_tokens=new)
    jax.block_until_ready(out.tokens)
    ts.append(time.perf_counter() - t)
    per_token = out.guidance_bytes_per_token()
    del out
    timeline = getattr(engine, "last_timeline", None)
    if r and chunk and timeline is not None:
      paces.append([round(p, 4) for p in window_step_ms(timeline.marks, timeline.pieces)])
  return ts[0], _median(ts[1:]), per_token, paces


def _scope(args):
  """The jit name-stack scope a device event's own arguments carry (see
  `bench_util.source_scope`), or "?"."""
  for key in ("tf_op", "long_name", "hlo_op", "name"):
    v = args.get(key)
    if isinstance(v, str) and "/" in v:
      return bench_util.source_scope(v.split(":")[0])
  return "?"


def optimized_hlo_dumps(dump_dir=HLO_DUMP) -> list[str]:
  """The rollout programs' optimized-HLO dump files (the whole generate program; with decode
  windows, the prefill and the window programs), smallest first; the decode loop's program
  last (the window program where there is one)."""
  files = [f for pat in ("generate_program", "prefill_program", "_decode")
           for f in glob.glob(os.path.join(dump_dir, f"*jit_{pat}.*after_optimizations.txt"))]
  return sorted(set(files), key=lambda f: ("jit__decode." in os.path.basename(f),
                                           os.path.getsize(f)))


_INSTR = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]+)"')


def _norm(name: str) -> str:
  return re.sub(r"[.\-]", "_", name)


def hlo_sources(dump_dir=HLO_DUMP) -> dict:
  """{instruction name (dots as underscores): its op_name} from the optimized HLO dumps."""
  out = {}
  for f in optimized_hlo_dumps(dump_dir):
    with open(f) as fh:
      for line in fh:
        m = _INSTR.match(line)
        if m:
          out[_norm(m.group(1))] = m.group(2)
  return out


def summarize_trace(log_dir, steps, top=40, sources=None):
  files = glob.glob(os.path.join(log_dir, "**", "*perfetto_trace.json.gz"), recursive=True)
  if not files:
    return {"error": f"no perfetto trace under {log_dir}: "
                     + ", ".join(glob.glob(os.path.join(log_dir, "**", "*"), recursive=True)[:20])}
  with gzip.open(files[0], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  pname, tname = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      pname[e["pid"]] = e["args"].get("name", "")
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      tname[(e["pid"], e["tid"])] = e["args"].get("name", "")
  by_name, by_scope, by_thread, by_source = (collections.Counter() for _ in range(4))
  sources = sources or {}
  count, ops_by_scope = collections.Counter(), collections.Counter()
  name_source = {}
  arg_keys = set()
  # kernels of the decode window programs (`jit__decode`), by the module each event names:
  # the prefill's kernels share names with the loop's (every Mosaic kernel is
  # "kernel_mosaic_gpu_kernel"), so a count per step alone counts the prefill's big expert
  # products in
  loop_us, loop_count, loop_source = (collections.Counter() for _ in range(3))
  # the prefill program's kernels (`jit_prefill_program`: the prompt's passes and the first
  # step's carry), in ms of the traced call, not per step
  pre_us, pre_count = collections.Counter(), collections.Counter()
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    proc = pname.get(e["pid"], "")
    thread = tname.get((e["pid"], e.get("tid")), "")
    if "GPU" not in proc and "gpu" not in proc.lower() and "device" not in proc.lower():
      continue
    by_thread[f"{proc} | {thread}"] += e["dur"]
    args = e.get("args", {})
    if thread == "XLA Ops":  # one event per HLO op: the scope view, when streams lack tf_op
      ops_by_scope[_scope(args)] += e["dur"]
    if "stream" not in thread.lower():
      continue  # XLA op / module summary lines duplicate the kernel events
    arg_keys.update(args)
    by_name[e["name"][:120]] += e["dur"]
    count[e["name"][:120]] += 1
    by_scope[_scope(args)] += e["dur"]
    # kernels inside the decode loop's command buffer carry no hlo_op; a fusion's kernel is
    # named after its HLO instruction, so the name finds it
    op = sources.get(_norm(str(args.get("hlo_op", "")))) or sources.get(_norm(e["name"]))
    src = bench_util.source_scope(op) if op else "(unattributed) " + e["name"][:60]
    by_source[src] += e["dur"]
    name_source[e["name"][:120]] = src
    module = str(args.get("hlo_module", ""))
    if "_decode" in module:
      loop_us[src] += e["dur"]
      loop_count[src] += 1
    elif "prefill_program" in module:
      pre_us[src] += e["dur"]
      pre_count[src] += 1
  total = sum(by_name.values())
  per_step = lambda us: us / max(steps, 1) / 1e3  # noqa: E731 - ms per decode step
  # the decode loop alone: kernels that run at least once per step (prefill kernels, which the
  # traced call also holds, run a fraction of a time per step)
  decode_names = [k for k in by_name if count[k] >= 0.5 * steps]
  decode_source, decode_calls = collections.Counter(), collections.Counter()
  for k in decode_names:
    decode_source[name_source.get(k, k)] += by_name[k]
    decode_calls[name_source.get(k, k)] += count[k]
  decode_total = sum(by_name[k] for k in decode_names)
  decode_calls_total = sum(count[k] for k in decode_names)
  loop_rule = "kernels run at least every other step (prefill kernels of the same name in)"
  if loop_us:
    decode_source, decode_calls = loop_us, loop_count
    decode_total, decode_calls_total = sum(loop_us.values()), sum(loop_count.values())
    loop_rule = "kernels of the decode window programs (hlo_module jit__decode)"
  return {
      "trace_file": os.path.basename(files[0]),
      "device_kernel_ms_per_step": per_step(total),
      "threads_ms_per_step": {k: per_step(v) for k, v in by_thread.most_common(12)},
      "top_kernels": [{"name": k, "ms_per_step": per_step(v), "calls_per_step": count[k] / steps,
                       "frac": v / max(total, 1)} for k, v in by_name.most_common(top)],
      "top_scopes": [{"scope": k, "ms_per_step": per_step(v), "frac": v / max(total, 1)}
                     for k, v in by_scope.most_common(top)],
      "top_sources": [{"source": k, "ms_per_step": per_step(v), "frac": v / max(total, 1)}
                      for k, v in by_source.most_common(top)],
      "decode_loop": {
          "rule": loop_rule,
          "kernel_ms_per_step": per_step(decode_total),
          "kernels_per_step": decode_calls_total / max(steps, 1),
          "sources": [{"source": k, "ms_per_step": per_step(v),
                       "calls_per_step": decode_calls[k] / max(steps, 1)}
                      for k, v in decode_source.most_common(60)]},
      "prefill": {
          "rule": "kernels of the prefill program (hlo_module jit_prefill_program), ms of the "
                  "traced call",
          "kernel_ms": sum(pre_us.values()) / 1e3,
          "kernels": sum(pre_count.values()),
          "sources": [{"source": k, "ms": v / 1e3, "calls": pre_count[k]}
                      for k, v in pre_us.most_common(40)]},
      "hlo_instructions_mapped": len(sources),
      "top_xla_op_scopes": [{"scope": k, "ms_per_step": per_step(v)}
                            for k, v in ops_by_scope.most_common(top)],
      "event_arg_keys": sorted(arg_keys)[:30],
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--policy", default="paper")
  ap.add_argument("--path", default="kernels", choices=["kernels", "xla"])
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--cache_new_tokens", type=int, default=0,
                  help="the engine's max_new_tokens (cache and arrays sized for prompt + this; "
                       "0: --new_tokens): a capacity-shaped rollout generates fewer")
  ap.add_argument("--decode_chunk", type=int, default=0, help="the engine's decode windows")
  ap.add_argument("--no_command_buffers", action="store_true",
                  help="XLA's default command buffers, not the engine's (GPU_COMMAND_BUFFERS)")
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--guidance_cost", action="store_true",
                  help="also time the same engine with guidance recording off (one more compile)")
  ap.add_argument("--guidance_first", default="on", choices=["on", "off"],
                  help="with --guidance_cost: which engine runs first (each in turn)")
  ap.add_argument("--out", default="profile_decode.json")
  ap.add_argument("--hlo_out", default="",
                  help="also write the decode loop's kernels (from the optimized HLO) here, one "
                       "line each: instruction, op, shape, source")
  a = ap.parse_args()
  # TRACE_JAX_COMPILATION_CACHE: a side that loads the programs another process compiled (and
  # autotuned) runs that process's kernels
  compilation_cache.enable()
  cache_new = a.cache_new_tokens or a.new_tokens
  cfg, params, prompts = bench_util.random_rollout_model(
      a.preset, a.layers, a.prompt_len, cache_new, a.batch)
  policy = tq.make_policy(a.policy)
  out = {**run_info(), "benchmark": "profile_decode", **vars(a), "policy_full": policy.name}
  guidance = [True, False] if a.guidance_cost else [True]
  if a.guidance_cost and a.guidance_first == "off":
    guidance = [False, True]  # the other order (session 53: off ran 36% slower, second)
  for rec in guidance:
    eng = RolloutEngine(cfg, policy, max_new_tokens=cache_new, prompt_bucket=a.prompt_len,
                        record_guidance=rec, use_kernels=a.path == "kernels",
                        decode_chunk=a.decode_chunk,
                        command_buffers=False if a.no_command_buffers else None)
    eng.sync(params)
    if rec is guidance[-1]:
      # the last engine: free the bf16 master (61 GB at 48 layers), which a capacity-sized
      # KV cache needs (session 14: 272 x 8k did not fit beside it)
      params = None
    first, full, per_token, paces = _timed(eng, prompts, a.new_tokens, a.repeats,
                                           a.decode_chunk)
    _, one, _, _ = _timed(eng, prompts, 1, a.repeats)
    step_ms = 1e3 * (full - one) / (a.new_tokens - 1)
    key = "guidance_on" if rec else "guidance_off"
    out[key] = {"first_call_s": first, "total_s": full, "prefill_plus_one_s": one,
                "decode_step_ms": step_ms,
                "window_step_ms_median": (_median([sum(p) / len(p) for p in paces if p])
                                          if any(paces) else None),
                "guidance_bytes_per_token": per_token, "window_step_ms": paces}
    print(key, json.dumps(out[key]), flush=True)
    if rec:
      d = tempfile.mkdtemp(prefix="prof_")
      s = SamplingParams(temperature=1.0)
      with jax.profiler.trace(d, create_perfetto_trace=True):
        r = eng.generate(prompts, n=1, sampling=s, seed=7, max_new_tokens=a.new_tokens)
        jax.block_until_ready(r.tokens)
      # the traced call's tokens and logprobs by hash: sides of an A/B that must not change the
      # numbers (a launch setting) compare them across processes
      out["traced_call_sha256"] = {
          f: bench_util.digest(getattr(r, f))
          for f in ("tokens", "logprobs") if getattr(r, f, None) is not None}
      print("traced call sha256", json.dumps(out["traced_call_sha256"]), flush=True)
      del r
      out["profile"] = summarize_trace(d, a.new_tokens, sources=hlo_sources())
      if a.hlo_out:
        dumps = optimized_hlo_dumps()
        if dumps:  # the decode loop's program
          with open(dumps[-1]) as src, open(a.hlo_out, "w") as dst:
            dst.write(bench_util.decode_loop_listing(src.read()))
      p = out["profile"]
      print("device kernel ms/step", p.get("device_kernel_ms_per_step"), p.get("error", ""),
            "| HLO instructions mapped:", p.get("hlo_instructions_mapped"))
      loop = p.get("decode_loop", {})
      print(f"decode loop: {loop.get('kernel_ms_per_step', 0):.3f} ms of kernels, "
            f"{loop.get('kernels_per_step', 0):.0f} kernels per step ({loop.get('rule')})")
      if not a.no_command_buffers:  # (session 44's s42a read 11 "kernels" a step of 1,115)
        print("  (command buffers on: the trace shows only the kernels outside the decode "
              "windows' graphs; profile with --no_command_buffers for the step's kernels)")
      for row in loop.get("sources", [])[:45]:
        print(f"  loop {1e3 * row['ms_per_step']:7.1f} us x{row['calls_per_step']:5.1f}"
              f"  {row['source']}")
      pre = p.get("prefill", {})
      if pre.get("kernels"):
        print(f"prefill program: {pre['kernel_ms']:.3f} ms of kernels in the traced call, "
              f"{pre['kernels']} kernels")
        for row in pre["sources"][:20]:
          print(f"  prefill {row['ms']:8.3f} ms x{row['calls']:5d}  {row['source']}")
      # every program's kernels, the prompt's prefill included (spread over the steps): a
      # kernel the prefill also runs shows its decode cost in the loop rows above, not here
      print("all programs, prefill included (ms a decode step, calls a step):")
      for row in p.get("top_kernels", [])[:25]:
        print(f"  {row['ms_per_step']:8.3f} ms {row['frac']:6.1%} x{row['calls_per_step']:5.1f}"
              f"  {row['name'][:90]}")
    del eng
  if a.guidance_cost:
    # With decode windows, the step by the windows' pace: (whole - one token) / steps credits
    # the prompt's guidance landing to the steps (session 53 read -36% and -75% from it).
    # Whole rollouts, on against off, are benchmarks/bench_guidance.py's.
    by = "window_step_ms_median" if a.decode_chunk else "decode_step_ms"
    on, off = out["guidance_on"][by], out["guidance_off"][by]
    if on and off:
      out["guidance_cost_frac_of_step"] = (on - off) / on
      out["guidance_cost_step_from"] = by
  with open(a.out, "w") as f:
    json.dump(out, f, indent=2)


if __name__ == "__main__":
  main()
