"""Issues 7 and 8's kernel bars, read from one run's JSONs: each figure beside its peer from the
same run, the bar, the bytes-moved floor and whether the bar is met; a Markdown table and a JSON.

  PYTHONPATH=. python benchmarks/kernel_bars.py --kernels bench_kernels.json \
      [--attention bench_attention.json] [--out kernel_bars.json]

The bars (issue 7, `../shared/BENCHMARKS.md`; issue 8 for the attention):
- FP4 weight products at decode shapes (dense rows `nvfp4`, B <= 16; B 64 is shown, not judged):
  >= 2.8 TB/s on the bytes the kernel streams, >= 3x XLA's bf16 dot by device time of the call
  (every kernel of it, `us_call`), and at 8192 x 28672, B 1 a kernel of <= 37 us.
- Grouped FP4 expert products (`nvfp4_auto`, the engine's launch) at decode sizes (<= 512 rows):
  >= 60% of the read ceiling on the kernel's bytes, >= 3x tokamax's bf16 `ragged_dot` by call
  (rows between 512 and 32,768 are shown, not judged); at prefill size (32,768 rows) >= 0.8x
  tokamax's throughput and >= 10x XLA's `ragged_dot`.
- Every product's output against its reference (float32 of the dequantized weights): relative
  error <= 1e-4 as float32 output (accumulation order), <= 4e-3 as the model's bf16 output (one
  bf16 rounding is 2**-9 relative at most, ~1.7e-3 over a row's norm).
- FP4-KV decode attention (`nvfp4_mosaic_kvwords`, the GPU default) at 8k-32k contexts: >= 60%
  of the read ceiling on its KV bytes by call, >= 3x the bf16-KV kernel by call; its output
  within 1e-2 of the reference's largest magnitude (FP4 K and V are decoded exactly; the
  softmax's bf16 probabilities round).

A figure whose peer did not run (tokamax not installed, a row with an error) is listed with its
peer missing and judged "no peer", not met.
"""

from __future__ import annotations

import argparse
import json
import sys

TOL_F32, TOL_BF16, TOL_ATTN = 1e-4, 4e-3, 1e-2
PREFILL_ROWS = 32768  # the prefill-size bar's rows (issue 7)


def _by_name(rows) -> dict:
  return {r["name"]: r for r in rows if not r.get("error")}


def _peer(rows: dict, name: str, variant: str, peer: str):
  return rows.get(name[:-len(variant)] + peer) if name.endswith(variant) else None


def _fig(what, shape, measured, bar, met, floor_us=None, kernel_us=None, peer=None, unit=""):
  out = dict(figure=what, shape=shape, measured=measured, unit=unit, bar=bar,
             met="no peer" if measured is None else None if met is None else bool(met))
  if floor_us is not None and kernel_us:
    out.update(floor_us=round(floor_us, 2), kernel_over_floor=round(kernel_us / floor_us, 3))
  if peer is not None:
    out["peer_us_call"] = round(peer, 2)
  return out


def _ratio(peer, row):
  return None if peer is None else peer["us_call"] / row["us_call"]


def product_bars(kernel_json: dict) -> list[dict]:
  """The matmul kernels' figures against issue 7's bars (module docstring)."""
  ceiling = kernel_json["read_ceiling_TBps"]
  rows = _by_name(kernel_json["rows"])
  out = []
  for name, r in rows.items():
    fl = dict(floor_us=r.get("floor_us"), kernel_us=r.get("us_kernel"))
    if r["kind"] == "dense" and r["variant"] == "nvfp4":
      shape = f"{r['K']}x{r['N']} B{r['B']}"
      judged = r["B"] <= 16
      xla = _peer(rows, name, "nvfp4", "xla_bf16")
      tb, x = r["TBps_kernel"], _ratio(xla, r)
      out.append(_fig("FP4 dense, TB/s (kernel)", shape, round(tb, 3), ">= 2.8",
                      tb >= 2.8 if judged else None, **fl))
      out.append(_fig("FP4 dense vs XLA bf16, by call", shape, x and round(x, 3), ">= 3x",
                      x is not None and x >= 3 if judged else None,
                      peer=xla and xla["us_call"]))
      if (r["K"], r["N"], r["B"]) == (8192, 28672, 1):
        out.append(_fig("FP4 GEMV kernel", shape, round(r["us_kernel"], 2), "<= 37 us",
                        r["us_kernel"] <= 37, unit="us", **fl))
    elif r["kind"] == "grouped" and r["variant"] == "nvfp4_auto":
      shape = f"K{r['K']} N{r['N']} M{r['M']}"
      tok = _peer(rows, name, "nvfp4_auto", "tokamax_bf16")
      xla = _peer(rows, name, "nvfp4_auto", "xla_bf16")
      t = _ratio(tok, r)
      if r["M"] < PREFILL_ROWS:  # decode sizes; past 512 rows shown, not judged
        judged = r["M"] <= 512
        share = r["TBps_kernel"] / ceiling
        out.append(_fig("grouped FP4, share of read ceiling (kernel)", shape, round(share, 3),
                        ">= 0.6", share >= 0.6 if judged else None, **fl))
        out.append(_fig("grouped FP4 vs tokamax bf16, by call", shape, t and round(t, 3),
                        ">= 3x", t is not None and t >= 3 if judged else None,
                        peer=tok and tok["us_call"]))
      else:
        x = _ratio(xla, r)
        out.append(_fig("grouped FP4 vs tokamax bf16, by call", shape, t and round(t, 3),
                        ">= 0.8x", t is not None and t >= 0.8, peer=tok and tok["us_call"]))
        out.append(_fig("grouped FP4 vs XLA ragged_dot, by call", shape, x and round(x, 2),
                        ">= 10x", x is not None and x >= 10, peer=xla and xla["us_call"]))
    else:
      continue
    for key, tol in (("relerr_f32", TOL_F32), ("relerr_bf16", TOL_BF16)):
      if r.get(key) is not None:
        out.append(_fig(f"{r['kind']} FP4 output vs reference, {key}", shape,
                        float(f"{r[key]:.3g}"), f"<= {tol:g}", r[key] <= tol))
  return out


def attention_bars(attn_json: dict, kv: str = "nvfp4_mosaic_kvwords") -> list[dict]:
  """The FP4-KV decode attention's figures against issue 8's bars (module docstring)."""
  ceiling = attn_json["read_ceiling_TBps"]
  rows = _by_name(r for r in attn_json["rows"] if r.get("kind", "decode") == "decode")
  out = []
  for name, r in rows.items():
    if r.get("kv") != kv or not 8192 <= r.get("context", 0) <= 32768:
      continue
    shape = f"B{r['batch']} S{r['context']}"
    floor_us = r["kv_bytes"] / (ceiling * 1e12) * 1e6
    share = floor_us / r["us_call"]
    bf16 = _peer(rows, name, kv, "bf16")
    x = _ratio(bf16, r)
    out.append(_fig("FP4-KV attention, share of read ceiling (call)", shape, round(share, 3),
                    ">= 0.6", share >= 0.6, floor_us=floor_us, kernel_us=r["us_kernel"]))
    out.append(_fig("FP4-KV attention vs bf16 KV, by call", shape, x and round(x, 3), ">= 3x",
                    x is not None and x >= 3, peer=bf16 and bf16["us_call"]))
    out.append(_fig("FP4-KV attention vs reference, largest error over largest value", shape,
                    float(f"{r['relerr_max']:.3g}"), f"<= {TOL_ATTN:g}",
                    r["relerr_max"] <= TOL_ATTN))
  return out


def markdown(figures: list[dict], sources: bool = False) -> str:
  """The figures as a Markdown table (sources: a column naming each figure's run)."""
  lines = ["| figure | shape | measured | bar | met | peer us (call) | kernel / floor |"
           + (" run |" if sources else ""), "|---|---|---|---|---|---|---|"
           + ("---|" if sources else "")]
  for f in figures:
    met = {True: "yes", False: "**no**", None: "(not judged)"}.get(f["met"], f["met"])
    unit = f" {f['unit']}" if f["unit"] else ""
    lines.append(f"| {f['figure']} | {f['shape']} | {f['measured']}{unit} | {f['bar']} | {met} "
                 f"| {f.get('peer_us_call', '')} | {f.get('kernel_over_floor', '')} |"
                 + (f" {f.get('source', '')} |" if sources else ""))
  return "\n".join(lines)


def latest(runs: list[tuple[str, list[dict]]]) -> list[dict]:
  """One figure per (figure, shape) from several runs' figures, newest run first: the newest
  that measured it (a figure without a peer in a newer run is taken from an older run that had
  one); each keeps its run's name as `source` (peers and floors stay those of its own run)."""
  by_key = {}  # (a key given again keeps its place)
  for source, figures in runs:
    for f in figures:
      key = (f["figure"], f["shape"])
      had = by_key.get(key)
      if had is None or (had["measured"] is None and f["measured"] is not None):
        by_key[key] = dict(f, source=source)
  return list(by_key.values())


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kernels", required=True, action="append",
                  help="bench_kernels.py's JSON; repeated: newest first, each figure from the "
                       "newest run that measured it (`latest`)")
  ap.add_argument("--attention", default="", help="bench_attention.py's JSON")
  ap.add_argument("--attention_kv", default="nvfp4_mosaic_kvwords",
                  help="the attention rows' KV format to judge (the bf16 rows are the peer)")
  ap.add_argument("--out", default="", help="write the figures as JSON here")
  a = ap.parse_args(argv)
  runs, first = [], None
  for path in a.kernels:
    with open(path) as f:
      kj = json.load(f)
    if first is None:  # the newest run: its date, device and versions head the JSON
      first = kj
    runs.append((path, product_bars(kj)))
  if a.attention:
    with open(a.attention) as f:
      runs.append((a.attention, attention_bars(json.load(f), a.attention_kv)))
  figures = latest(runs)
  meta = {k: first.get(k) for k in ("date", "device", "jax_version", "git_commit", "source_tree")}
  print(markdown(figures, sources=len(a.kernels) > 1))
  judged = [f for f in figures if f["met"] is not None]
  print(f"\n{sum(f['met'] is True for f in judged)} of {len(judged)} judged figures meet their bar")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(benchmark="kernel_bars", **meta, sources=[*a.kernels, a.attention],
                     figures=figures), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
