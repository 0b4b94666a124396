"""Main job. Until the RL loop lands (issue: "The RL loop end to end"), this is a placeholder
that runs the part of TRACE that exists: the FP4 numerics core. It measures each format's error,
shows rollout-guided rounding reproducing rollout codes that round-to-nearest flips, and writes
`metrics.jsonl` in --workdir.

  python launch/train_rl.py --workdir /tmp/trace_jax_run
"""

import json
import os

from absl import app
from absl import flags

flags.DEFINE_string("workdir", "/tmp/trace_jax_run", "Output directory (created if missing).")
flags.DEFINE_integer("seed", 0, "PRNG seed.")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp
  import numpy as np

  from trace_jax import quant as tq
  from trace_jax.quant import error_stats

  workdir = os.path.abspath(os.path.expanduser(FLAGS.workdir))
  os.makedirs(workdir, exist_ok=True)
  print("trace_jax: the RL loop is not built yet; running the FP4 numerics demo instead.")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; workdir {workdir}")
  table = error_stats.error_table(shape=(256, 2048), seed=FLAGS.seed)
  rng = np.random.default_rng(FLAGS.seed)
  x_roll = jnp.asarray(rng.standard_t(3, (64, 2048)).astype(np.float32))
  x_train = x_roll * (1 + 1e-3 * jnp.asarray(rng.standard_normal(x_roll.shape), jnp.float32))
  record = {"step": 0}
  for fmt in ("nvfp4", "mxfp4"):
    q = tq.quantize(x_roll, fmt, second_level="row")
    ref = q.unpacked_codes()
    rtn = tq.quantize(x_train, fmt, second_level="row").unpacked_codes()
    guided = tq.guided_quantize(x_train, tq.make_guidance(q)).unpacked_codes()
    record[f"{fmt}/code_agreement_rtn"] = float(jnp.mean(rtn == ref))
    record[f"{fmt}/code_agreement_guided"] = float(jnp.mean(guided == ref))
  for dist, row in table.items():
    for fmt, v in row.items():
      record[f"quant_rel_rmse/{dist}/{fmt}"] = v
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")
  print(f"{'relative RMSE':14s}" + "".join(f"{k:>12s}" for k in table["normal"]))
  for dist, row in table.items():
    print(f"{dist:14s}" + "".join(f"{v:12.4f}" for v in row.values()))
  for fmt in ("nvfp4", "mxfp4"):
    print(f"{fmt}: trainer-vs-rollout code agreement, round-to-nearest "
          f"{record[f'{fmt}/code_agreement_rtn']:.5f} -> TRACE guided "
          f"{record[f'{fmt}/code_agreement_guided']:.5f}")
  print(f"wrote {os.path.join(workdir, 'metrics.jsonl')}")


if __name__ == "__main__":
  app.run(main)
