"""FP4-vs-BF16 perplexity gap of a tiny random MoE on random text, per preset policy and format.

  python benchmarks/fp4_perplexity.py --out benchmarks/results/fp4_perplexity_cpu.json

The model has random weights (std `--init_std`) and the text is uniform random tokens, so the
absolute perplexities mean little; the gap shows how much each policy perturbs the model's
next-token distribution (rollout forward: packed FP4 weights, FP4 activations/KV per policy).
"""

import argparse
import json

import jax
import jax.numpy as jnp

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.provenance import run_info


def nll(params, tokens, config, ctx):
  """(mean next-token NLL, log-probs)."""
  logits = M.forward(params, tokens[:, :-1], config, ctx)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)), logp


def main():
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out", default="fp4_perplexity.json")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=128)
  ap.add_argument("--init_std", type=float, default=0.1)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args()
  cfg = M.tiny()
  params = M.init_params(cfg, jax.random.key(args.seed))
  params = jax.tree_util.tree_map(lambda a: a * (args.init_std / 0.02) if a.ndim >= 2 else a,
                                  params)
  tokens = jax.random.randint(jax.random.key(args.seed + 1), (args.batch, args.seq), 0,
                              cfg.vocab_size)
  f = jax.jit(nll, static_argnums=(2, 3))
  base, base_logp = f(params, tokens, cfg, M.QuantContext())
  base = float(base)
  rows = {"bf16": dict(nll=base, ppl=float(jnp.exp(base)), ppl_gap_pct=0.0, kl_from_bf16=0.0)}
  for fmt in ("nvfp4", "mxfp4"):
    for preset in ("w4a16", "kv4", "paper", "w4a4", "all_linear"):
      policy = tq.make_policy(preset, fmt)
      v, logp = f(M.quantize_params(params, policy), tokens, cfg,
                  M.QuantContext(policy, "rollout"))
      v = float(v)
      kl = float(jnp.mean(jnp.sum(jnp.exp(base_logp) * (base_logp - logp), axis=-1)))
      rows[policy.name] = dict(nll=v, ppl=float(jnp.exp(v)),
                               ppl_gap_pct=100 * (float(jnp.exp(v - base)) - 1),
                               kl_from_bf16=kl)
  out = dict(benchmark="fp4_perplexity", **run_info(), model="tiny (random weights)",
             init_std=args.init_std, tokens=[args.batch, args.seq],
             units=dict(nll="nats/token", ppl="perplexity", ppl_gap_pct="% over bf16",
                        kl_from_bf16="nats/token, KL(bf16 || policy) of next-token dists"),
             results=rows)
  with open(args.out, "w") as fh:
    json.dump(out, fh, indent=2)
  print(f"{'policy':18s} {'ppl':>9s} {'gap %':>8s} {'KL nats':>9s}")
  for k, r in rows.items():
    print(f"{k:18s} {r['ppl']:9.3f} {r['ppl_gap_pct']:8.3f} {r['kl_from_bf16']:9.5f}")


if __name__ == "__main__":
  main()
