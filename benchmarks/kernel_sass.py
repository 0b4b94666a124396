"""The SASS of a Mosaic GPU kernel as ptxas makes it for an H200, on a machine without a GPU:
compiles one kernel call for an H200 (deviceless, the `gpu_census.py` topology), with Mosaic's
dumps on, and prints the instructions of the kernel's main loop (the shortest backward branch
that holds a wgmma) opcode by opcode, with its registers, and how many of them come up to the
loop's last wgmma (a tile's own path where a rare tail shares the loop). What it is for:
seeing what a kernel change does to the loop (session 19 took the FP4-KV decode attention from
830 to 495 instructions a 64-token tile with it) before spending device time. It does not time
anything.

Needs the jax-cuda13 plugin line (Python >= 3.12, see `gpu_census.py`) and, for the SASS itself,
`nvdisasm` (pip `nvidia-cuda-nvdisasm`; ptxas comes with the plugin's CUDA packages), found on
PATH or in those packages' `cu13/bin` (`cuda_tools_path`):

  python benchmarks/kernel_sass.py attention --batch 16 --context 8192 --heads 32
  python benchmarks/kernel_sass.py matmul --n 28672 --k 8192 --rows 1
  python benchmarks/kernel_sass.py grouped --experts 128 --n 1536 --k 2048 --rows 256
  python benchmarks/kernel_sass.py file some_dump_dir/kernel.sass_ctrl   # an existing dump

`--dump_dir` keeps the dumps (PTX, ptxas info, SASS with control codes); `--listing` prints the
loop itself. A conditional inside the loop counts with both of its sides (the attention's lazy
max: 540 in all, 495 on a tile that keeps the max). Seen with it (session 19): the dense FP4
matmul's step (kb 4, one row) is 423 instructions, 86 of them uniform-datapath arithmetic of the
wgmma descriptors of the pipelined activation slots (taking the warpgroup index out of the loop,
which removed the attention's, changes nothing there: 422). ptxas's performance warnings are
printed too (session 22: wgmma accumulators touched in a branch while products may be in flight
made ptxas serialize every wgmma, C7515 / C7518, at an instruction count within 2% of the
unserialized loop).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile


def cuda_tools_path() -> str:
  """PATH with the pip CUDA packages' tools (`nvidia/cu13/bin`: nvdisasm, ptxas) in front,
  where those packages are installed; PATH as it is otherwise."""
  path = os.environ.get("PATH", "")
  try:
    import nvidia  # the pip CUDA packages' namespace (no CUDA is loaded)
  except ImportError:
    return path
  return os.pathsep.join([os.path.join(p, "cu13", "bin") for p in nvidia.__path__] + [path])


def main_loop(sass_text: str) -> list[str]:
  """The instructions of the shortest loop (backward branch) that holds a wgmma (HGMMA), in
  order; labels kept as `name:` lines."""
  ins, labels = [], {}
  for line in sass_text.splitlines():
    m = re.match(r"^(\.L_x_\d+):", line.strip())
    if m:
      labels[m.group(1)] = len(ins)
      ins.append(m.group(1) + ":")
      continue
    m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;?\s*$", line)
    if m:
      ins.append(m.group(1))
  best = None
  for j, text in enumerate(ins):
    m = re.search(r"BRA `?\(?(\.L_x_\d+)", text)
    if m and m.group(1) in labels and labels[m.group(1)] < j:
      start = labels[m.group(1)]
      shorter = best is None or j - start < best[1] - best[0]
      if shorter and any("HGMMA" in x for x in ins[start:j]):
        best = (start, j)
  if best is None:
    raise ValueError("no loop with a wgmma in this SASS")
  return ins[best[0]:best[1] + 1]


def through_last_wgmma(loop: list[str]) -> list[str]:
  """The loop's instructions up to its last wgmma and the waits right after it: a tile's own
  path where the loop also holds a rarely taken tail (the stream attention kernel's row merge,
  its global stores, loads and atomic, sits after its PV products in the same loop)."""
  body = [t for t in loop if not t.endswith(":")]
  last = max(i for i, t in enumerate(body) if "HGMMA" in t)
  while last + 1 < len(body) and opcode(body[last + 1]) == "WARPGROUP":
    last += 1
  return body[:last + 1]


def opcode(text: str) -> str:
  return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def report(sass_path: str, listing: bool) -> dict:
  with open(sass_path) as f:
    loop = main_loop(f.read())
  body = [t for t in loop if not t.endswith(":")]
  ops = collections.Counter(opcode(t) for t in body)
  with open(sass_path) as f:
    total = sum(1 for ln in f if re.search(r"/\*[0-9a-f]{4,}\*/\s+\S", ln))
  tile = through_last_wgmma(loop)
  print(f"{os.path.basename(sass_path)}: main loop {len(body)} instructions ({len(tile)} up to "
        f"its last wgmma), {total} in the kernel")
  print("  " + " ".join(f"{k}:{v}" for k, v in ops.most_common()))
  uniform = sum(v for k, v in ops.items() if k.startswith("U"))
  print(f"  uniform datapath {uniform}, barriers {ops.get('BAR', 0)}, wgmma {ops.get('HGMMA', 0)}")
  ptxas = sass_path.rsplit(".", 1)[0] + ".ptxas"
  warnings = []
  if os.path.exists(ptxas):
    with open(ptxas) as f:
      lines = f.read().splitlines()
    print("  " + " ".join(ln.split(":", 1)[1].strip() for ln in lines if "Used" in ln))
    # e.g. C7515 / C7518: every wgmma serialized (an accumulator touched in a branch while
    # products may be in flight), which no instruction count shows
    warnings = [ln.split(":", 1)[1].strip() for ln in lines if "Performance Loss" in ln]
    for w in warnings:
      print("  PTXAS: " + w)
  if listing:
    print("\n".join(loop))
  return dict(instructions=len(body), to_last_wgmma=len(tile), total_instructions=total,
              opcodes=dict(ops), ptxas_warnings=warnings)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("what", choices=("attention", "matmul", "grouped", "cluster", "file"))
  ap.add_argument("path", nargs="?", help="file: a .sass_ctrl dump")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--context", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=32, help="query heads (4 KV heads x 128)")
  ap.add_argument("--lazy", default="on", choices=("on", "off"), help="attention's lazy max")
  ap.add_argument("--packing", default="kv_words", choices=("kv_words", "nibbles"),
                  help="attention cache's code packing (kv_words: the GPU default)")
  ap.add_argument("--n", type=int, default=28672)
  ap.add_argument("--k", type=int, default=8192)
  ap.add_argument("--rows", type=int, default=1)
  ap.add_argument("--experts", type=int, default=128, help="grouped: experts (groups)")
  ap.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "mxfp4"))
  ap.add_argument("--kb", type=int, default=4, choices=(1, 2, 4, 8),
                  help="matmul / grouped: 64-wide K tiles a pipeline step (the weight's "
                  "layout); cluster: of the bf16 kernel's step")
  ap.add_argument("--splits", type=int, default=8, help="cluster: K splits (cluster size)")
  ap.add_argument("--wgs", type=int, default=2, help="cluster: compute warpgroups")
  ap.add_argument("--bm", type=int, default=None, help="cluster: rows a chunk (128 / 256)")
  ap.add_argument("--dump_dir", default="", help="keep Mosaic's dumps here")
  ap.add_argument("--listing", action="store_true", help="print the loop's instructions")
  a = ap.parse_args()
  if a.what == "file":
    report(a.path, a.listing)
    return
  # set here, not at import (tests import this module in processes that may use a GPU)
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # compile only: never touch a GPU
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to ask
  dump = a.dump_dir or tempfile.mkdtemp(prefix="kernel_sass_")
  os.makedirs(dump, exist_ok=True)
  os.environ.update(MOSAIC_GPU_DUMP_SASS="1", MOSAIC_GPU_DUMP_PTXAS="1",
                    MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=dump, PATH=cuda_tools_path())
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  import functools

  import jax
  import jax.numpy as jnp

  import gpu_census  # (a sibling module)

  from trace_jax import kernels
  from trace_jax import quant as tq
  from trace_jax.kernels import attention_mgpu
  sds = jax.ShapeDtypeStruct
  if a.what == "attention":
    shape = (a.batch, a.context, attention_mgpu.KV_HEADS, attention_mgpu.HEAD_DIM)
    kv = jax.eval_shape(lambda x: tq.with_packing(tq.quantize(
        x, "nvfp4", second_level="row", validate=False), a.packing), sds(shape, jnp.float32))
    fn = functools.partial(attention_mgpu.decode_attention,
                           lazy_tau=attention_mgpu.LAZY_TAU if a.lazy == "on" else None)
    args = (sds((a.batch, a.heads, attention_mgpu.HEAD_DIM), jnp.bfloat16), kv, kv,
            sds((a.batch, a.context), jnp.bool_))
  elif a.what == "grouped":  # expert-sorted rows, group sizes as the call's dynamic input
    pw = jax.eval_shape(lambda w: kernels.prepare_weight(tq.quantize(
        w, a.fmt, axis=1, second_level=(0,), validate=False), kb=a.kb),
        sds((a.experts, a.k, a.n), jnp.float32))
    fn = lambda x, pw, g: kernels.grouped_matmul(x, pw, g, use_kernel=True)  # noqa: E731
    args = (sds((a.rows, a.k), jnp.bfloat16), pw, sds((a.experts,), jnp.int32))
  elif a.what == "cluster":  # the bf16 dense product split over K in a cluster
    from trace_jax.kernels import bf16_mgpu
    fn = functools.partial(bf16_mgpu.cluster_matmul, splits=a.splits, wgs=a.wgs, kb=a.kb,
                           bm=a.bm)
    args = (sds((a.rows, a.k), jnp.bfloat16), sds((a.k, a.n), jnp.bfloat16))
  else:
    w = jax.random.normal(jax.random.key(0), (a.k, a.n), jnp.float32)
    pw = kernels.prepare_weight(tq.quantize(w * 0.02, a.fmt, axis=0, validate=False), kb=a.kb)
    fn = lambda x, pw: kernels.matmul(x, pw, use_kernel=True)  # noqa: E731
    args = (sds((a.rows, a.k), jnp.bfloat16), jax.tree.map(lambda x: sds(x.shape, x.dtype), pw))
  gpu_census.compile_for_h200(jax.jit(fn), args)
  found = sorted(glob.glob(os.path.join(dump, "*.sass*")))
  if not found:
    sys.exit(f"no SASS in {dump}: is nvdisasm on PATH?")
  for path in found:
    report(path, a.listing)


if __name__ == "__main__":
  main()
