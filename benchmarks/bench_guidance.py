"""Issue 8's guidance bar ("guidance capture <= 5% of rollout time"): whole rollouts timed with
TRACE guidance recorded and not, in one process. Each round times every side once, in an order
rotated round by round, so a drift of the device's clocks or the host's state reaches all sides
alike (session 53 timed one call a side and saw the second side 36% slower a step).

Sides, one engine each (compiled once, all kept):
- `one_program on|off` (decode_chunk 0): guidance stays in device memory, so the difference is
  what recording costs the device (the records' writes, the prompt's records);
- `chunked on|off` (windows of --decode_chunk steps): the guided engine under each way its
  records reach host memory, `GUIDANCE_COPY` (async | pinned) x `GUIDANCE_LANDING` (inline |
  thread). The last window's records land after the device has finished, so a short rollout
  pays that tail in a larger share than a long one: --new_tokens takes several lengths. A
  guided chunked side may end in ` tailN`: its last window in pieces down to N steps
  (`GUIDANCE_TAIL`; tail0: whole); without, the engine's default.

All engines share one copy of the rollout weights; `--sides` runs some of the sides (each
guided one with its unguided side), so a deep model fits beside its cache.

Per length and side: the first call (compiles; a pinned side's first copies pin their pages)
and the median of --rounds timed calls; for each guided side its share, (on - off) / on,
against its engine's unguided side; for the chunked sides the host's parts of the median call
(`ChunkTimeline`). Every round checks that all sides drew the same tokens and logprobs (one
seed a round): recording guidance, and where it goes, must not change them.

  PYTHONPATH=. python benchmarks/bench_guidance.py --layers 4 --batch 256 --prompt_len 512 \
      --new_tokens 256,1024 --decode_chunk 128 --rounds 3 --out $OUT/bench_guidance.json

The PNG beside the JSON (`--plot JSON` draws it alone): each guided side's share by length, its
reach over the calls (fastest guided call against the slowest unguided, and back) as error bars,
the bar at 5%.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

import bench_util  # (a sibling module: see its docstring)
from trace_jax import compilation_cache
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams
from trace_jax.rollout import engine as engine_module

BAR = 0.05  # issue 8: guidance capture at most 5% of the rollout's time
DEFAULT_WAY = "chunked on async inline"  # (GUIDANCE_COPY, GUIDANCE_LANDING as shipped)
WAYS = (("async", "inline"), ("async", "thread"), ("pinned", "inline"), ("pinned", "thread"))


def side_names(ways=WAYS) -> list[str]:
  """The sides in their first round's order: each engine's unguided side before its guided ones."""
  return (["one_program off", "one_program on", "chunked off"]
          + [f"chunked on {copy} {landing}" for copy, landing in ways])


def baseline(side: str) -> str:
  """The unguided side a guided one is measured against."""
  return side.split(" ")[0] + " off"


def split_tail(side: str) -> tuple[str, int | None]:
  """A side's name without its ` tailN` (`GUIDANCE_TAIL`), and N (None where not given)."""
  head, _, last = side.rpartition(" ")
  if head.startswith("chunked on ") and last.startswith("tail") and last[4:].isdigit():
    return head, int(last[4:])
  return side, None


def chosen_sides(arg: str) -> list[str]:
  """The sides `--sides` names (comma-separated; empty: all), each guided one's unguided side
  added, in `side_names` order (a side's tail variants after it, as asked)."""
  sides = side_names()
  if not arg:
    return sides
  asked = [x.strip() for x in arg.split(",")]
  unknown = sorted(x for x in asked if split_tail(x)[0] not in sides)
  if unknown:
    raise ValueError(f"unknown sides {unknown}: choose among {sides}, a guided chunked one "
                     "optionally ending in ' tailN'")
  wanted = asked + [baseline(x) for x in asked if " on" in x]
  return sorted(dict.fromkeys(wanted), key=lambda x: sides.index(split_tail(x)[0]))


def _median(xs):
  return sorted(xs)[len(xs) // 2]


def _engines(cfg, policy, a, sides, master: list) -> dict:
  """{(mode, guided): engine} for the sides asked, all on one copy of the rollout weights
  (recording guidance and decode windows do not change them; nothing here syncs again), so
  a deep model's sides fit beside its cache. `master`: a list holding the bf16 master, emptied
  once the first engine has synced (the master freed: a cache-sized batch needs its memory)."""
  params = master.pop()
  out, weights = {}, None
  for mode, guided in dict.fromkeys((s.split(" ")[0], s.split(" ")[1] == "on") for s in sides):
    eng = RolloutEngine(cfg, policy, max_new_tokens=a.cache_new_tokens,
                        prompt_bucket=a.prompt_len, record_guidance=guided,
                        decode_chunk=a.decode_chunk if mode == "chunked" else 0)
    if weights is None:
      eng.sync(params)
      weights, params = eng.params, None  # (the master freed: a cache-sized batch needs it)
    eng.params = weights
    out[mode, guided] = eng
  return out


def _call(engines, side: str, prompts, new: int, seed: int) -> dict:
  """One timed rollout of a side: seconds, digests, guidance bytes, the host's parts."""
  name, tail = split_tail(side)
  mode, guided, *way = name.split(" ")
  eng = engines[mode, guided == "on"]
  if way:
    eng.guidance_copy, eng.guidance_landing = way
  eng.guidance_tail = engine_module.GUIDANCE_TAIL if tail is None else tail
  t = time.perf_counter()
  r = eng.generate(prompts, n=1, sampling=SamplingParams(temperature=1.0), seed=seed,
                   max_new_tokens=new)
  jax.block_until_ready(r.tokens)
  row = {"s": time.perf_counter() - t, "tokens": bench_util.digest(r.tokens),
         "logprobs": bench_util.digest(r.logprobs), "guidance_bytes": r.guidance_bytes()}
  if mode == "chunked" and eng.last_timeline is not None:
    row["timeline"] = eng.last_timeline.as_dict()
  del r
  return row


def summarize(calls: dict) -> dict:
  """{side: summary} from {side: [first call, timed calls...]}, shares against `baseline`."""
  out = {}
  for side, rows in calls.items():
    timed = rows[1:]
    med = _median([r["s"] for r in timed])
    mid = min(timed, key=lambda r: abs(r["s"] - med))
    out[side] = {"first_s": round(rows[0]["s"], 4), "median_s": round(med, 4),
                 "timed_s": [round(r["s"], 4) for r in timed],
                 "guidance_bytes": rows[0]["guidance_bytes"]}
    if "timeline" in mid:
      out[side]["median_call_timeline"] = mid["timeline"]
  for side, row in out.items():
    if " on" in side:
      base = out[baseline(side)]
      off = base["median_s"]
      row["share"] = round((row["median_s"] - off) / row["median_s"], 4)
      row["meets_bar"] = row["share"] <= BAR
      row["share_range"] = share_range(row["timed_s"], base["timed_s"])
  return out


def share_range(guided_s, unguided_s) -> list[float]:
  """The share's reach over the calls: the fastest guided call against the slowest unguided,
  and the slowest against the fastest."""
  lo, hi = min(guided_s), max(guided_s)
  return [round((lo - max(unguided_s)) / lo, 4), round((hi - min(unguided_s)) / hi, 4)]


def plot(json_path: str) -> str:
  """Bars of each guided side's share by length, the bar dashed; the PNG beside the JSON."""
  import matplotlib  # noqa: PLC0415 - only where a plot is made
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  with open(json_path) as f:
    res = json.load(f)
  lengths = list(res["lengths"])
  guided = [s for s in res["sides"] if " on" in s]
  fig, ax = plt.subplots(figsize=(max(5.0, 2 + 1.6 * len(guided)), 4))
  width = 0.8 / len(lengths)
  for i, n in enumerate(lengths):
    got = res["lengths"][n]["sides"]
    shares = np.array([100 * got[s]["share"] for s in guided])
    ranges = 100 * np.array([share_range(got[s]["timed_s"], got[baseline(s)]["timed_s"])
                             for s in guided])
    reach = np.stack([shares - ranges[:, 0], ranges[:, 1] - shares])
    ax.bar(np.arange(len(guided)) + i * width, shares, width, yerr=reach, capsize=3,
           label=f"{n} new tokens")
  ax.axhline(100 * BAR, color="k", ls="--", lw=1, label="bar (5%)")
  ax.set_xticks(np.arange(len(guided)) + width * (len(lengths) - 1) / 2)
  ax.set_xticklabels([s.replace("chunked on ", "chunked\n").replace(" on", "")
                      + ("\n(the default way)" if s == DEFAULT_WAY else "") for s in guided],
                     fontsize=8)
  ax.set_ylabel("guidance share of the rollout, %")
  ax.legend(fontsize=8)
  out = json_path.rsplit(".", 1)[0] + ".png"
  bench_util.save_figure(fig, f"{res['device']}\nB {res['args']['batch']}, "
                         f"{res['args']['layers']} layers, jax {res['jax_version']}, "
                         f"{res['date'][:10]}", out)
  plt.close(fig)
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--policy", default="paper")
  ap.add_argument("--batch", type=int, default=256)
  ap.add_argument("--prompt_len", type=int, default=512)
  ap.add_argument("--new_tokens", default="256,1024", help="generation lengths, comma-separated")
  ap.add_argument("--cache_new_tokens", type=int, default=0,
                  help="the engines' max_new_tokens (0: the largest length)")
  ap.add_argument("--decode_chunk", type=int, default=128)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--sides", default="",
                  help="comma-separated side names (default all: " + ", ".join(side_names())
                  + "); each guided side's unguided one is added")
  ap.add_argument("--out", default="bench_guidance.json")
  ap.add_argument("--no_plot", action="store_true", help="(a machine without matplotlib)")
  ap.add_argument("--plot", default="", help="only plot this result JSON")
  a = ap.parse_args()
  if a.plot:
    plot(a.plot)
    return
  lengths = [int(x) for x in a.new_tokens.split(",")]
  a.cache_new_tokens = a.cache_new_tokens or max(lengths)
  if a.rounds < 1 or max(lengths) > a.cache_new_tokens:
    raise ValueError("--rounds must be >= 1 and every length <= --cache_new_tokens")
  sides = chosen_sides(a.sides)
  compilation_cache.enable()
  t0 = time.perf_counter()
  # (the master in host memory: the sync makes the rollout weights layer by layer, so 48
  # layers' 61 GB bf16 master never sits on an 80 GB device beside them)
  cfg, params, prompts = bench_util.random_rollout_model(
      a.preset, a.layers, a.prompt_len, a.cache_new_tokens, a.batch, on_host=True)
  master = [params]
  del params
  engines = _engines(cfg, tq.make_policy(a.policy), a, sides, master)
  stats = jax.devices()[0].memory_stats() or {}
  synced = {"s": round(time.perf_counter() - t0, 1),
            "weight_bytes": engines[next(iter(engines))].weight_bytes,
            "device_peak_bytes": stats.get("peak_bytes_in_use")}  # (None on CPU)
  print(f"weights drawn and synced in {synced['s']} s: {synced['weight_bytes'] / 2**30:.2f} "
        f"GiB, device peak {synced['device_peak_bytes']}", flush=True)
  res = bench_util.result_header("bench_guidance", args=vars(a), sides=sides, bar=BAR,
                                 synced=synced, lengths={})
  total, done = len(lengths) * (a.rounds + 1) * len(sides), 0
  for n in lengths:
    calls = {s: [] for s in sides}
    equal = []
    for rnd in range(a.rounds + 1):  # round 0: every side's first call
      order = sides[rnd % len(sides):] + sides[:rnd % len(sides)]
      rows = {}
      for side in order:
        rows[side] = _call(engines, side, prompts, n, seed=100 + rnd)
        calls[side].append(rows[side])
        done += 1
        if rnd == 0:  # (first calls compile: a deep model's take minutes each)
          print(f"  {n} tokens, first call of {side}: {rows[side]['s']:.1f} s "
                f"({time.perf_counter() - t0:.0f} s in)", flush=True)
      spent = time.perf_counter() - t0
      print(f"[{done}/{total}] {n} tokens round {rnd}: "
            + " ".join(f"{s.replace(' ', '_')}={r['s']:.3f}" for s, r in rows.items())
            + f" | {spent:.0f} s, ETA {spent / done * (total - done):.0f} s", flush=True)
      equal.append(len({(r["tokens"], r["logprobs"]) for r in rows.values()}) == 1)
    res["lengths"][str(n)] = {"sides": summarize(calls), "same_numbers_every_round": equal,
                              "tokens_sha256_round0": calls[sides[0]][0]["tokens"]}
    for side, row in res["lengths"][str(n)]["sides"].items():
      if "share" in row:
        print(f"{n} tokens, {side}: {row['median_s']:.4f} s against "
              f"{res['lengths'][str(n)]['sides'][baseline(side)]['median_s']:.4f}, "
              f"share {row['share']:.2%}", flush=True)
    # pinned host memory the pinned sides' copies took at once, which the runtime keeps
    res["pinned_peak_bytes"] = engine_module._PINNED.peak
    with open(a.out, "w") as f:  # after each length: a run cut short keeps the lengths done
      json.dump(res, f, indent=1)
    print("wrote", a.out, flush=True)
  if not a.no_plot:
    plot(a.out)


if __name__ == "__main__":
  main()
