"""GPU probe of the Mosaic NVFP4 decode-attention kernel (`trace_jax/kernels/attention_mgpu.py`),
piece by piece, to localize a wrong result:

1. the in-register tile decoder alone (a small kernel: load codes + scales in the wgmma layout,
   decode, store the two head_dim halves) against a numpy decode in the physical order;
2. the whole kernel against its `jnp` model (`emulate_kernel`) on the same operands, per output
   (running max, running sum, O^T per warpgroup / head_dim half), for inputs that isolate the K
   step (V constant), the V step (q = 0: uniform probabilities) and both (random).

  PYTHONPATH=. python benchmarks/probe_attention_mgpu.py --out probe.npz
"""

import argparse
import json

import numpy as np

import jax
import jax.numpy as jnp

from trace_jax import quant as tq
from trace_jax.kernels import attention_mgpu as A
from trace_jax.quant import e2m1


def decode_probe(kc, ks):
  """kc uint32 [64, 64], ks uint32 [64, 8] (one 64-token tile) -> bf16 [4, 2, 64, 64]."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax import lax
  decode = A._tile_decoder()
  layout = plgpu.Layout.WGMMA

  def body(kc_g, ks_g, out_g, kc_s, ks_s, out_s, bar):
    wg = lax.axis_index("wg")
    plgpu.copy_gmem_to_smem(kc_g, kc_s.at[wg], bar.at[wg])
    plgpu.barrier_wait(bar.at[wg])
    plgpu.copy_gmem_to_smem(ks_g, ks_s.at[wg], bar.at[wg])
    plgpu.barrier_wait(bar.at[wg])
    h0, h1 = decode(plgpu.load(kc_s.at[wg, :, pl.ds(16 * wg, 16)], (), layout=layout),
                    plgpu.load(ks_s.at[wg], (), layout=layout))
    out_s[wg, 0] = h0
    out_s[wg, 1] = h1
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_s.at[wg], out_g.at[wg])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((4, 2, 64, 64), jnp.bfloat16),
      num_threads=4, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      scratch_types=dict(kc_s=plgpu.SMEM((4, 64, 64), jnp.uint32),
                         ks_s=plgpu.SMEM((4, 64, 8), jnp.uint32),
                         out_s=plgpu.SMEM((4, 2, 64, 64), jnp.bfloat16),
                         bar=plgpu.Barrier(num_arrivals=1, num_barriers=4)))(kc, ks)


def numpy_decode(kc, ks):
  """The decoder's intended result: [4 heads, 2 halves, 64 tokens, 64 physical]."""
  c8 = np.asarray(kc).view(np.uint8).reshape(64, 4, 64)
  vals = np.asarray(e2m1.decode(e2m1.unpack_nibbles(jnp.asarray(c8))), np.float64)  # [64,4,128]
  sb = np.asarray(ks).view(np.uint8).reshape(64, 4, 8)
  sv = np.asarray(jnp.asarray(sb).view(jnp.float8_e4m3fn).astype(jnp.float32), np.float64)
  x = vals * np.repeat(sv, 16, axis=-1) * 2.0 ** -A.ROW_SHIFT
  x = x[..., A.PHYS_TO_LOGICAL]  # [64, 4, 128 physical]
  return np.transpose(x.reshape(64, 4, 2, 64), (1, 2, 0, 3))


def make_kv(shape, seed, const=None):
  rng = np.random.default_rng(seed)
  if const is not None:
    x = np.full(shape, const, np.float32)
  else:
    x = rng.standard_normal(shape) * np.exp(rng.normal(size=shape[:-1] + (1,)))
  return tq.quantize(jnp.asarray(x, jnp.float32), "nvfp4", second_level="row")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="probe_attention_mgpu.npz")
  args = ap.parse_args()
  save, summary = {}, {}

  # 1. the decoder alone
  rng = np.random.default_rng(0)
  kc = rng.integers(0, 2 ** 32, (64, 64), dtype=np.uint64).astype(np.uint32)
  sbytes = rng.choice(np.arange(0x08, 0x70), (64, 32)).astype(np.uint8)  # positive E4M3
  ks = sbytes.view(np.uint32).reshape(64, 8)
  try:
    got = np.asarray(jax.jit(decode_probe)(jnp.asarray(kc), jnp.asarray(ks)), np.float64)
    want = numpy_decode(kc, ks)
    bad = got != want
    summary["decode"] = dict(mismatches=int(bad.sum()), of=int(bad.size),
                             per_head_half=bad.reshape(4, 2, -1).sum(-1).tolist(),
                             per_col=bad.sum((0, 1, 2)).tolist(),
                             per_row=bad.sum((0, 1, 3)).tolist())
    save.update(decode_got=got, decode_want=want)
  except Exception as e:  # noqa: BLE001
    summary["decode"] = dict(error=repr(e)[:800])
  print(json.dumps(summary["decode"]), flush=True)

  # 2. the kernel against its model
  b, kvh, g, hd = 2, 4, 8, 128
  cases = {
      "random_s128": (128, None, False),
      "vconst_s128": (128, 0.5, False),  # V all 0.5: O = l * 0.5 * 2**-8 * g_v... isolates K/P
      "q0_s128": (128, None, True),  # uniform probabilities: isolates V
      "random_s1000": (1000, None, False),
  }
  for name, (s, vconst, q0) in cases.items():
    k = make_kv((b, s, kvh, hd), 1)
    v = make_kv((b, s, kvh, hd), 2, const=vconst)
    q = jax.random.normal(jax.random.key(3), (b, kvh * g, hd), jnp.float32).astype(jnp.bfloat16)
    if q0:
      q = jnp.zeros_like(q)
    valid = jnp.ones((b, s), bool)
    outs = {}
    for tag, fn in (("kernel", A.mgpu_decode_kernel), ("model", A.emulate_kernel)):
      def capture(*ops, _fn=fn, _tag=tag, **kw):
        o, ml = _fn(*ops, **kw)
        outs[_tag] = (np.asarray(o), np.asarray(ml))
        return o, ml
      try:
        A.decode_attention(q, k, v, valid, splits=1, kernel_fn=capture)
      except Exception as e:  # noqa: BLE001
        outs[tag] = repr(e)[:800]
    if any(isinstance(x, str) for x in outs.values()):
      summary[name] = {t: x for t, x in outs.items() if isinstance(x, str)}
    else:
      (ko, kml), (mo, mml) = outs["kernel"], outs["model"]
      o_scale = np.abs(mo).max()
      d = dict(m_maxdiff=float(np.abs(kml[..., 0, :g] - mml[..., 0, :g]).max()),
               l_rel=float(np.abs(kml[..., 1, :g] - mml[..., 1, :g]).max()
                           / np.abs(mml[..., 1, :g]).max()),
               o_rel=float(np.abs(ko[..., :g] - mo[..., :g]).max() / o_scale),
               # [B, n, 4, 2, 64, 16]: error by warpgroup x half, by row (head_dim), by column
               o_rel_wg_half=(np.abs(ko - mo)[..., :g].max((0, 1, 4, 5)) / o_scale).round(3)
               .tolist(),
               o_rel_rows=(np.abs(ko - mo)[..., :g].max((0, 1, 2, 3, 5)) / o_scale).round(2)
               .tolist(),
               m_kernel=kml[0, 0, 0, 0, :g].tolist(), m_model=mml[0, 0, 0, 0, :g].tolist(),
               l_kernel=kml[0, 0, 0, 1, :g].tolist(), l_model=mml[0, 0, 0, 1, :g].tolist())
      summary[name] = d
      save.update({f"{name}_kernel_o": ko, f"{name}_kernel_ml": kml, f"{name}_model_o": mo,
                   f"{name}_model_ml": mml})
    print(name, json.dumps(summary[name]), flush=True)
  np.savez_compressed(args.out, **save)
  with open(args.out.replace(".npz", ".json"), "w") as f:
    json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main()
