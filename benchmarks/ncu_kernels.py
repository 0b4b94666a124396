"""One Mosaic GPU kernel of the project, called a few times on fresh random data, for Nsight
Compute (`ncu`) to profile: the hardware counters (issue slots, pipe use, warp stall reasons, per
SASS instruction stall samples) say what bounds a kernel where A/B timings only say how long it
took.

  ncu --clock-control none --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
      --set full -o OUT/ncu_CASE python3 benchmarks/ncu_kernels.py CASE

Cases: attn_b64_32k / attn_b16_8k (the NVFP4 decode attention, its default schedule),
attn_b256_ctx1600 (the 8k-capacity rollout's own shape: 256 rows of an 8,192-slot cache, each
row's first 1,536-1,663 slots visible, the context the rollout averages), gemv (the
FP4 GEMV, 8192 x 28672, one row), grouped256 / grouped2208 (the FP4 grouped expert matmul, 128
experts, K 2048, N 1536, 256 or 2,208 rows of top-8 routing: a decode batch of 32, the 8k-capacity
rollout's 276), qproj1 (the FP4 2048 x 4096 product at one row), swiglu2048 and rowop256 (the
Triton expert input kernels at B 256: `swiglu_quant`, `row_quant.quantize_rows_to_operand`;
profile them with --kernel-name regex:swiglu|row_quant). Each case
checks the kernel's result against its reference once (printed), so a profile is never of a
kernel that computes something else.
"""

from __future__ import annotations

import argparse

import numpy as np

import bench_util  # (a sibling module)


def main():
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("case", choices=("attn_b64_32k", "attn_b16_8k", "attn_b256_ctx1600", "gemv",
                                   "grouped256", "grouped2208", "qproj1", "swiglu2048",
                                   "rowop256"))
  ap.add_argument("--calls", type=int, default=3, help="kernel calls after the checked one")
  args = ap.parse_args()

  import jax
  import jax.numpy as jnp

  from trace_jax import kernels
  from trace_jax import quant as tq
  from trace_jax.kernels import attention_mgpu, reference

  keys = iter(jax.random.split(jax.random.key(int(np.random.SeedSequence().entropy % 2**31)),
                               8))

  if args.case == "swiglu2048":  # the expert down input's kernel at B 256 (Triton)
    from bench_swiglu_quant import case  # noqa: PLC0415 - a sibling module
    from trace_jax.kernels import swiglu_quant  # noqa: PLC0415
    gu, n_rows = case(2048, 0)
    kw = dict(f=768, fmt="nvfp4", n_rows=n_rows, k_pad=768)
    fn = jax.jit(lambda g: swiglu_quant.swiglu_quantize_rows(g, **kw)[1].data)
    ops = (gu,)
    want = jax.jit(lambda g: swiglu_quant.swiglu_quantize_rows_ref(g, **kw)[1].data)(gu)
  elif args.case == "rowop256":  # the experts' input quantized into the gate/up operand, B 256
    from trace_jax.kernels import row_quant  # noqa: PLC0415
    x = jax.random.normal(next(keys), (256, 1, 2048), jnp.bfloat16)
    dest = jax.random.permutation(next(keys), 2048).reshape(256, 8).astype(jnp.int32)
    kw = dict(n_rows=2080, k_pad=2048)
    fn = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand(a, "nvfp4", d, **kw)[1].data)
    ops = (x, dest)
    want = jax.jit(lambda a, d: row_quant.quantize_rows_to_operand_ref(
        a, "nvfp4", d, **kw)[1].data)(x, dest)
  elif args.case.startswith("attn"):
    b, s = {"attn_b64_32k": (64, 32768), "attn_b16_8k": (16, 8192),
            "attn_b256_ctx1600": (256, 8192)}[args.case]
    shape = (b, s, attention_mgpu.KV_HEADS, attention_mgpu.HEAD_DIM)

    def kv(key):
      x = jax.random.normal(key, shape, jnp.bfloat16)
      return tq.quantize(x, "nvfp4", second_level="row", validate=False)
    k, v = jax.jit(kv)(next(keys)), jax.jit(kv)(next(keys))
    q = jax.random.normal(next(keys), (b, 32, 128), jnp.bfloat16)
    valid = jnp.ones((b, s), bool)
    if args.case == "attn_b256_ctx1600":
      live = jax.random.randint(next(keys), (b, 1), 1536, 1664)
      valid = jnp.arange(s)[None, :] < live
    fn = jax.jit(attention_mgpu.decode_attention)
    ops = (q, k, v, valid)
    want = jax.jit(kernels.decode_attention_ref)(*ops)
  elif args.case.startswith("grouped"):
    e, kd, n, m = 128, 2048, 1536, int(args.case[len("grouped"):])
    w = jax.random.normal(next(keys), (e, kd, n), jnp.float32) * 0.02
    qw = tq.quantize(w, "nvfp4", axis=1, second_level=(0,), validate=False)
    pw = kernels.prepare_weight(qw)
    top = jax.lax.top_k(jax.random.normal(next(keys), (m // 8, e)), 8)[1].reshape(-1)
    gs = jnp.bincount(top, length=e).astype(jnp.int32)
    x = jax.random.normal(next(keys), (m, kd), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(lambda x, g, w: kernels.grouped_matmul(x, w, g, out_dtype=jnp.float32))
    ops = (x, gs, pw)
    # on the host, one expert at a time: under ncu, XLA's float32 ragged_dot at 2,208 rows
    # crashed the process (s24a, segfault before the first kernel)
    wd = np.asarray(jax.jit(tq.dequantize)(qw), np.float32)
    xs, ends = np.asarray(x, np.float32), np.cumsum(np.asarray(gs))
    want = np.concatenate([xs[a:b] @ wd[i] for i, (a, b) in
                           enumerate(zip(np.concatenate([[0], ends[:-1]]), ends))])
  else:
    kd, n = (8192, 28672) if args.case == "gemv" else (2048, 4096)
    w = jax.random.normal(next(keys), (kd, n), jnp.float32) * 0.02
    qw = tq.quantize(w, "nvfp4", axis=0, validate=False)
    pw = kernels.prepare_weight(qw)
    x = jax.random.normal(next(keys), (1, kd), jnp.float32).astype(jnp.bfloat16)
    fn = jax.jit(lambda x, w: kernels.matmul(x, w, jnp.float32))
    ops = (x, pw)
    want = reference.matmul_ref(x, qw, jnp.float32)
  err = bench_util.relerr_max(fn(*ops), want)
  print(f"{args.case}: relerr_max {err:.2e} (the kernel's first call)", flush=True)
  out = None
  for _ in range(args.calls):
    out = fn(*ops)
  jax.block_until_ready(out)
  print(f"{args.case}: {args.calls} more calls done", flush=True)


if __name__ == "__main__":
  main()
