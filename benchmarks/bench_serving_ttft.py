"""Time to first token and latency of the two serving schedulers under the same load: the
step-level `SlotScheduler` (tokens streamed per decode chunk) and the request-level
`BatchScheduler` (a batch's tokens when it ends).

  PYTHONPATH=. python benchmarks/bench_serving_ttft.py --variant gpu --arm candidate \
      --requests 96 --concurrency 32 --out $OUT/serving_ttft.json
  PYTHONPATH=. python benchmarks/bench_serving_ttft.py --variant cpu --requests 48 \
      --concurrency 8 --max_new_tokens 32 --out /tmp/serving_ttft_cpu.json   # tiny model, CPU

Per scheduler: build the arm's serving model from `configs/serve_compare.py` (`--variant`),
warm it up (every compiled shape), then offer `--requests` prompts of the arm's task with
`--concurrency` closed-loop clients (`compare.offer_load`), each asking for the scheduler's
max_tokens at `--temperature`. Records TTFT, latency and per-token latency percentiles (seconds,
from each request's send time), throughput and the generated-token counts; writes JSON after
every scheduler. Random-init weights unless `--init_checkpoint` is given (stop tokens then end
answers at random lengths; the numbers are about timing, not answers).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

from configs import serve_compare
from trace_jax.provenance import run_info
from trace_jax.rl.compare import override
from trace_jax.rollout import SamplingParams
from trace_jax.serving import backend, compare
from trace_jax.serving.scheduler import GenerationRequest


def measure(config, arm: str, scheduler: str, n_requests: int, concurrency: int,
            temperature: float, log=print) -> dict:
  cfg = override(config, {"serve.scheduler": scheduler, "load.concurrency": concurrency,
                                  "load.rate": 0.0})
  sampling = SamplingParams(temperature)
  model = backend.build_serving(cfg, arm, warm_sampling=sampling, log=log)
  try:
    _, examples = compare.load_examples(backend.arm_config(cfg, arm))
    tok = model.tokenizer
    prompts = [tuple(tok.encode(e.prompt)) for e in examples]
    prompts = [prompts[i % len(prompts)] for i in range(n_requests)]
    max_tokens = model.scheduler.max_tokens
    reqs = [GenerationRequest(p, max_tokens, sampling, i, model.stop_tokens)
            for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    results = compare.offer_load(model, reqs, cfg.load)
    wall = time.perf_counter() - t0
    ttft, lat, tpot, gen, errors = [], [], [], 0, 0
    for res, sent in results:
      if isinstance(res, Exception):
        errors += 1
        continue
      first = res.finished_at if res.first_token_at is None else res.first_token_at
      ttft.append(first - sent)
      lat.append(res.finished_at - sent)
      tpot.append(res.per_token_s)
      gen += len(res.tokens)
    return dict(scheduler=scheduler, arm=arm, requests=n_requests, concurrency=concurrency,
                max_tokens=max_tokens, slots_or_max_batch=model.scheduler.max_batch,
                decode_chunk=int(cfg.serve.decode_chunk), setup_s=model.setup_s, wall_s=wall,
                completion_tokens=gen, throughput_tok_s=gen / wall, errors=errors,
                ttft_s=compare.percentiles(ttft), latency_s=compare.percentiles(lat),
                per_token_s=compare.percentiles(tpot),
                mean_tokens=gen / max(n_requests - errors, 1))
  finally:
    model.close()


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--variant", default="cpu", choices=["cpu", "gpu"])
  ap.add_argument("--arm", default="candidate", choices=list(backend.ARMS))
  ap.add_argument("--schedulers", default="slots,batch")
  ap.add_argument("--requests", type=int, default=48)
  ap.add_argument("--concurrency", type=int, default=8)
  ap.add_argument("--temperature", type=float, default=0.7)
  ap.add_argument("--decode_chunk", type=int, default=0, help="0: the config's")
  ap.add_argument("--max_new_tokens", type=int, default=0, help="0: the config's")
  ap.add_argument("--init_checkpoint", default="")
  ap.add_argument("--out", required=True)
  args = ap.parse_args()
  config = serve_compare.get_config(args.variant)
  if args.decode_chunk:
    config.serve.decode_chunk = args.decode_chunk
  if args.max_new_tokens:
    config.rollout.max_new_tokens = args.max_new_tokens
  if args.init_checkpoint:
    config.init_checkpoint = args.init_checkpoint
  out = dict(run_info=run_info(), device=str(jax.devices()[0]), variant=args.variant, rows=[])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  for sched in args.schedulers.split(","):
    row = measure(config, args.arm, sched, args.requests, args.concurrency, args.temperature)
    out["rows"].append(row)
    print(f"{sched}: TTFT p50 {row['ttft_s']['p50']:.4f} s p95 {row['ttft_s']['p95']:.4f} s | "
          f"latency p50 {row['latency_s']['p50']:.4f} s p95 {row['latency_s']['p95']:.4f} s | "
          f"{row['throughput_tok_s']:.1f} tok/s, {row['mean_tokens']:.1f} tokens/request",
          flush=True)
    with open(args.out, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
