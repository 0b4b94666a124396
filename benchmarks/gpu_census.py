"""The rollout's decode loop as XLA:GPU compiles it for an H200, on a machine without a GPU.

Compiles the engine's generate program for an H200 target description (deviceless AOT: no GPU,
no driver), from shapes alone, and lists the decode loop's kernels: one line each (instruction,
HLO op, output shape, source scope), then counts per step and per layer by kind (XLA fusions,
library GEMMs, Pallas/Mosaic kernels). What it is for: seeing what the compiler makes of a
change (how many kernels a layer, whether a product stays a GEMM) before spending device time.
It does not time anything, and without autotuning XLA's GEMM choices may differ from the GPU's;
tokamax (the BF16 engine's grouped matmul) picks its XLA fallback without a local GPU.

Needs Python >= 3.12 with jax, jax-cuda13-plugin[with-cuda] and jax-cuda13-pjrt (0.11.x) and,
for the BF16 engine's grouped matmul, tokamax (the carried wheels in .whl/):

  CUDA_VISIBLE_DEVICES=-1 JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python benchmarks/gpu_census.py \
      --policy paper --layers 4 --batch 1 --prompt_len 64 --new_tokens 128 --out census.json

(The script sets both variables itself when they are unset.) Checked against the H200's own
profiles (4 layers of 30B-A3B, FP4 kernels): 169 kernels a step at B=64 against 173 measured, 185
at B=1 against 191 (`benchmarks/results/session11_h200_2026-11-30/`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")  # compile only: never touch a GPU
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver to ask

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_util  # noqa: E402
import compile_time  # noqa: E402

from trace_jax import models as M  # noqa: E402
from trace_jax import quant as tq  # noqa: E402
from trace_jax.kernels import dispatch  # noqa: E402
from trace_jax.provenance import run_info  # noqa: E402

# The H200 as XLA:GPU describes a device (GpuTargetConfigProto text): 132 SMs, 227 KiB of shared
# memory a block, 141 GB; what the compiler's cost models and kernel emitters read.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


def h200_sharding():
  """A one-device sharding on a compile-only H200."""
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET,
                                      topology="1x1x1")
  mesh = topologies.make_mesh(topo, (1,), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_for_h200(program, args):
  """`program` (jitted) compiled for an H200 from the shapes and dtypes of `args` (a pytree)."""
  sh = h200_sharding()
  abstract = jax.tree_util.tree_map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), args)
  # Pallas' Triton lowering asks the device for its compute capability: name an abstract H200
  h200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  auto = (jax.sharding.AxisType.Auto,)  # as the compile-only mesh of the arguments
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh(
      (1,), ("x",), axis_types=auto, abstract_device=h200)):
    lowered = program.lower(*abstract)
  return lowered.compile()


def kind(line: str) -> str:
  """A listing line's kernel kind: mosaic / pallas (custom calls), gemm, xla (other fusions),
  or copy / other."""
  name, op = line.split()[:2]
  if op == "custom-call":
    return "mosaic" if "mpmd_map" in name or "mosaic" in line else "pallas"
  if "gemm" in name or "cublas" in line or "dot" == op:
    return "gemm"
  return "xla" if op == "fusion" else op


def census(policy_name: str, layers: int, batch: int, prompt_len: int, new_tokens: int,
           use_kernels: bool, preset: str = "qwen3_30b_a3b", fmt: str = "nvfp4",
           record_guidance: bool | None = None) -> dict:
  config = M.preset(preset, num_layers=layers)
  policy = tq.make_policy(policy_name, fmt)
  dispatch.on_gpu = lambda: True  # the kernel choices of a GPU backend
  dispatch.kernels_on = lambda: True  # and of a Hopper (the H200 target)
  if record_guidance is None:
    record_guidance = policy_name != "bf16"
  program, args = compile_time.generate_program(config, policy, batch, prompt_len, new_tokens,
                                                use_kernels, record_guidance=record_guidance)
  compiled = compile_for_h200(program, args)
  listing = bench_util.decode_loop_listing(compiled.as_text())
  lines = [ln for ln in listing.splitlines() if ln.strip()]
  kinds = collections.Counter(kind(ln) for ln in lines)
  per_layer = collections.Counter(kind(ln) for ln in lines if "layers_#" in ln)
  backend = dispatch.grouped_backend()
  if any("moe/kernel" in ln for ln in lines):
    backend = "fp4_mgpu"
  elif backend == "tokamax" and not any("ragged" in ln and "custom-call" in ln for ln in lines):
    # tokamax chooses its implementation by the local device: here its XLA fallback
    backend = "tokamax, compiled as its XLA fallback (no local GPU); the H200 runs its kernel"
  return dict(policy=policy_name, policy_full=policy.name, layers=layers, batch=batch,
              record_guidance=record_guidance,
              prompt_len=prompt_len, new_tokens=new_tokens, use_kernels=use_kernels,
              grouped_backend=backend,
              kernels_per_step=len(lines), by_kind=dict(kinds),
              in_layers_per_layer={k: v / layers for k, v in per_layer.items()},
              outside_layers=len(lines) - sum(per_layer.values()), listing=lines)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", default="qwen3_30b_a3b")
  ap.add_argument("--policy", default="paper")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt_len", type=int, default=256)
  ap.add_argument("--new_tokens", type=int, default=128)
  ap.add_argument("--path", default="kernels", choices=["kernels", "xla"])
  ap.add_argument("--guidance", default="auto", choices=["auto", "on", "off"],
                  help="record guidance (auto: for every policy but bf16, as the rollout does)")
  ap.add_argument("--out", default="")
  a = ap.parse_args()
  res = census(a.policy, a.layers, a.batch, a.prompt_len, a.new_tokens, a.path == "kernels",
               a.preset, record_guidance={"auto": None, "on": True, "off": False}[a.guidance])
  info = run_info()
  info.update(device="compile-only NVIDIA H200 (deviceless AOT)", device_kind="NVIDIA H200")
  res = dict(benchmark="gpu_census", **info, **res)
  print("\n".join(res["listing"]))
  print(f"{a.policy} {a.layers} layers B={a.batch}: {res['kernels_per_step']} kernels a step "
        f"{res['by_kind']}; per layer {res['in_layers_per_layer']}; "
        f"{res['outside_layers']} outside the layers")
  if a.out:
    with open(a.out, "w") as f:
      json.dump(res, f, indent=1)


if __name__ == "__main__":
  main()
