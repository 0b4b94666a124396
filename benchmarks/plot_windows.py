"""The chunked rollout's pace window by window: ms a decode step against the context, beside the
bytes floor at that context, for `launch/bench_rollout.py` JSONs (each whole rollout's
`ChunkTimeline` marks: the spacing of its windows' records reaching host memory over the
window's steps; the first window's interval, which includes the prefill, is left out).

  python benchmarks/plot_windows.py --out windows.png \
      s36=benchmarks/results/session36_h200_2026-12-04/call4_bench_rollout_cap8k_48l.json

Rows with `window_step_ms` / `window_floor_ms` (bench_rollout since session 36) are drawn from
them; older rows with marks only get the floor by the row's KV bytes a token (the floor grows
by the live KV cache, linear in the context). Also draws the A/B rollouts of
`guidance_copy_rollouts`. Prints the table it draws: with a, b fitted to step = a + b * context
for the step and its floor (the part the context does not change, and a token's cost).
"""

from __future__ import annotations

import argparse

import numpy as np

import bench_util  # (a sibling module: see its docstring)


def window_arrivals(marks):
  # (as trace_jax.rollout.engine.window_arrivals: this script runs without jax)
  return [t for what, t in marks if what.startswith("window ") and what.endswith(" records")]


def windows_of(timeline, chunk, count):
  """[first step, steps] of each window a timeline launched: its `pieces` (since session 56: a
  guided rollout's last window runs in shorter pieces), else (older rows) `count` windows of
  `chunk`."""
  if timeline and timeline.get("pieces"):
    return [list(x) for x in timeline["pieces"]]
  return [[i * chunk, chunk] for i in range(count)]


def pace(marks, windows):
  """ms a step of each window after the first, from a timeline's marks (as
  trace_jax.rollout.engine.window_step_ms, by `windows_of`)."""
  arrived = window_arrivals(marks)
  return [1e3 * (b - a) / n for a, b, (_, n) in zip(arrived, arrived[1:], windows[1:])]


def contexts(n, prompt_len, windows):
  """The mean context of windows 1..n."""
  return [prompt_len + start + steps / 2 for start, steps in windows[1:n + 1]]


def floor_ms(row, ctx, bandwidth):
  """The row's bytes floor at each context: its floor at the mean context (prompt +
  generated / 2) plus the KV bytes of the tokens more or fewer."""
  cap = row["kv_bytes"] / row["batch"]  # a sequence's cache, all its capacity's tokens
  per_token = cap / row["context_capacity"]
  mean = row["prompt_len"] + row["generate_tokens"] // 2
  return [1e3 * (row["floor_bytes_per_step"] + per_token * row["batch"] * (c - mean)) / bandwidth
          for c in ctx]


def series(d):
  """[(name, contexts, step ms, floor ms)] of one bench_rollout JSON."""
  out, chunk, bandwidth = [], d["decode_chunk"], d.get("bandwidth_bytes_per_s", 4.27e12)
  for row in d.get("results", []):
    if row.get("error"):
      continue
    row = dict(row, prompt_len=d.get("prompt_len"),
               context_capacity=d.get("prompt_len") + d.get("new_tokens"))
    whole = (row.get("chunk_timelines") or {}).get(f"new_tokens_{row['generate_tokens']}")
    runs = []
    timed = whole[-1] if whole else None
    if row.get("window_step_ms"):
      runs.append(("timed", row["window_step_ms"], row["window_floor_ms"],
                   windows_of(timed, chunk, len(row["window_step_ms"]) + 1)))
    elif timed and timed.get("marks"):  # (rows before session 36 have no marks)
      windows = windows_of(timed, chunk, len(window_arrivals(timed["marks"])))
      runs.append(("timed", pace(timed["marks"], windows), None, windows))
    for ab in row.get("guidance_copy_rollouts") or []:
      t = ab.get("whole_timeline") or {}
      if t.get("marks"):
        windows = windows_of(t, chunk, len(window_arrivals(t["marks"])))
        runs.append((f"copy {ab['copy']}", pace(t["marks"], windows), None, windows))
    for name, steps, floors, windows in runs:
      if len(steps) < 2:
        continue
      ctx = contexts(len(steps), row["prompt_len"], windows)
      floors = floors or floor_ms(row, ctx, bandwidth)
      out.append((f"{row['policy']} B{row['batch']} {name}", ctx, steps, floors))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("inputs", nargs="+", help="label=bench_rollout.json")
  ap.add_argument("--out", default="windows.png")
  ap.add_argument("--skip", default="", help="leave out series whose name holds this (e.g. "
                                             "'copy pinned': the first pinned rollout's pages)")
  a = ap.parse_args()
  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, ax = plt.subplots(figsize=(8, 4.5))
  floor_drawn = False
  for label, d in bench_util.labelled_json(a.inputs):
    for name, ctx, steps, floors in series(d):
      if a.skip and a.skip in name:
        continue
      ax.plot(ctx, steps, "o-", label=f"{label} {name}")
      if not floor_drawn:
        ax.plot(ctx, floors, "k--", label="bytes floor")
        floor_drawn = True
      fit, ffit = np.polyfit(ctx, steps, 1), np.polyfit(ctx, floors, 1)
      print(f"{label} {name}: ms a step " + " ".join(f"{s:.2f}" for s in steps)
            + "; floor " + " ".join(f"{f:.2f}" for f in floors)
            + f"; share {sum(floors) / sum(steps):.3f}"
            + (f" ({sum(floors[1:]) / sum(steps[1:]):.3f} after the first)" if steps[1:] else "")
            + f"; fit a={fit[1]:.2f} ms "
            f"b={1e3 * fit[0]:.2f} us/token (floor a={ffit[1]:.2f} b={1e3 * ffit[0]:.2f})")
  ax.set_xlabel("context (tokens, a window's mean)")
  ax.set_ylabel("ms a decode step")
  ax.set_ylim(bottom=0)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax.set_title("decode pace window by window (records' arrivals)")
  fig.tight_layout()
  fig.savefig(a.out, dpi=120)
  print("wrote", a.out)


if __name__ == "__main__":
  main()
