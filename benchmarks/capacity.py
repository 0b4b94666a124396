"""How many rollout sequences fit on one GPU, per policy and context length: the engine's own
capacity planner (`rollout.capacity_limits`, the rule `RolloutEngine.generate` enforces) applied to
the real rollout weight bytes of a model shape, with no device needed (weights are shapes only,
from `jax.eval_shape` of the engine's weight sync).

  python benchmarks/capacity.py --out benchmarks/results/capacity_h200_30b_a3b.json

Default device: an H200 as `benchmarks/h200_rollout.sh` runs it (143,771 MiB,
XLA_PYTHON_CLIENT_MEM_FRACTION=0.94). The planner keeps 10% headroom and counts per sequence the
KV cache, recorded guidance and routes at the full context plus a decode step's transients, and
beside the weights, when the batch takes more than one prefill pass, a pass's cache
(--prefill_tokens, the engine's default).
With --decode_chunk the engine moves guidance to host memory window by window, so a second limit
applies: the host's memory (--host_gib, default the 128 GiB of the H200 host the device README
describes), which must hold each sequence's guidance for the whole context and two windows
(`rollout.host_tokens_held`); `sequences` is the smaller of the device- and host-limited figures.
These are planned figures; a GPU run that fills them is what confirms them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from trace_jax import models as M  # noqa: E402
from trace_jax import quant as tq  # noqa: E402
from trace_jax.provenance import run_info  # noqa: E402
from trace_jax.rollout import engine as E  # noqa: E402


def abstract_weight_bytes(config, policy) -> int:
  """Bytes of the rollout weights the engine's sync makes, computed from shapes alone."""
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(E.rollout_weight_shapes(config, policy)))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--policies", default="bf16,kv8,kv4,w4a16,paper")
  ap.add_argument("--contexts", default="2048,8192,32768")
  ap.add_argument("--device_mib", type=float, default=143771.0)
  ap.add_argument("--mem_fraction", type=float, default=0.94)
  ap.add_argument("--record_guidance", type=int, default=1)
  ap.add_argument("--decode_chunk", type=int, default=0,
                  help="> 0: the chunked engine (guidance of the prompt + two windows on device)")
  ap.add_argument("--prompt_len", type=int, default=512,
                  help="prompt bucket: sets the guidance held with --decode_chunk and the rows "
                       "of a prefill pass")
  ap.add_argument("--host_gib", type=float, default=128.0,
                  help="host memory, with --decode_chunk (the H200 host: 128 GiB)")
  ap.add_argument("--prefill_tokens", type=int, default=65536,
                  help="prompt tokens per prefill pass (the engine's default): a batch of more "
                       "passes holds a pass's cache of --prompt_len slots beside the weights")
  ap.add_argument("--out", default="capacity.json")
  a = ap.parse_args()
  config = M.preset(a.preset)
  device_bytes = int(a.device_mib * 2**20 * a.mem_fraction)
  host_bytes = int(a.host_gib * 2**30) if a.decode_chunk > 0 else None
  contexts = [int(c) for c in a.contexts.split(",")]
  prefill_pass = E.prefill_pass(a.prefill_tokens, a.prompt_len)
  rows = []
  for name in a.policies.split(","):
    policy = tq.make_policy(name)
    wb = abstract_weight_bytes(config, policy)
    for ctx in contexts:
      plan = E.planning(a.prompt_len, ctx, a.decode_chunk, prefill_pass, host_bytes)
      per = E.bytes_per_sequence(config, policy, ctx, bool(a.record_guidance),
                                 plan.get("guidance_tokens"))
      row = {"policy": name, "policy_full": policy.name, "context": ctx, "weight_bytes": wb,
             "bytes_per_sequence": per}
      if host_bytes is not None:
        row["host_bytes_per_sequence"] = E.host_bytes_per_sequence(
            config, policy, ctx, bool(a.record_guidance), plan["host_tokens"])
      on_device, on_host = E.capacity_limits(config, policy, ctx, wb, device_bytes,
                                             bool(a.record_guidance), **plan)
      if host_bytes is not None:
        row["sequences_device_limited"] = on_device
        row["sequences_host_limited"] = on_host  # None: nothing goes to host memory
      row["sequences"] = min(n for n in (on_device, on_host) if n is not None)
      rows.append(row)
  for r in rows:
    base = next(b for b in rows if b["policy"] == "bf16" and b["context"] == r["context"])
    r["vs_bf16"] = r["sequences"] / base["sequences"] if base["sequences"] else None
  out = {**run_info(), "benchmark": "capacity", "preset": a.preset,
         "device_bytes": device_bytes, "host_bytes": host_bytes, "headroom": 0.9,
         "record_guidance": bool(a.record_guidance), "decode_chunk": a.decode_chunk,
         "guidance_tokens_on_device": (E.guidance_tokens_held(a.prompt_len, a.decode_chunk)
                                       or "whole context"), "results": rows,
         "note": "planned by rollout.capacity_limits from the shapes of the rollout weights; "
                 "not measured on a device"
                 + ("; sequences = min(device-limited, host-limited)" if host_bytes else "")}
  with open(a.out, "w") as f:
    json.dump(out, f, indent=2)
  host = host_bytes is not None
  print(f"{'policy':8s} {'context':>8s} {'weights GB':>10s} {'MB/seq':>9s} "
        + (f"{'host MB/seq':>11s} {'device-lim':>10s} {'host-lim':>8s} " if host else "")
        + f"{'sequences':>9s} {'vs bf16':>7s}")
  for r in rows:
    on_host = r.get("sequences_host_limited")
    print(f"{r['policy']:8s} {r['context']:8d} {r['weight_bytes'] / 1e9:10.2f} "
          f"{r['bytes_per_sequence'] / 1e6:9.1f} "
          + (f"{r['host_bytes_per_sequence'] / 1e6:11.1f} {r['sequences_device_limited']:10d} "
             f"{'-' if on_host is None else on_host:>8} " if host else "")
          + f"{r['sequences']:9d} {r['vs_bf16'] or 0:7.2f}")
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pols = a.policies.split(",")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    w = 0.8 / len(pols)
    for i, p in enumerate(pols):
      ys = [next(r["sequences"] for r in rows if r["policy"] == p and r["context"] == c)
            for c in contexts]
      ax.bar(np.arange(len(contexts)) + i * w, ys, w, label=p)
    ax.set_xticks(np.arange(len(contexts)) + 0.4 - w / 2, [f"{c // 1024}k" for c in contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("sequences that fit")
    ax.set_yscale("log")
    host = (f", host {a.host_gib:.0f} GiB, decode windows of {a.decode_chunk}"
            if a.decode_chunk > 0 else "")
    ax.set_title(f"{a.preset}: rollout sequences per GPU ({device_bytes / 1e9:.0f} GB{host}, "
                 "planned)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.splitext(a.out)[0] + ".png", dpi=120)
  except ImportError:
    pass


if __name__ == "__main__":
  main()
