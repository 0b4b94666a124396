"""RL with FP4 TRACE rollouts. Thin: flags in, `trace_jax.rl.loop.run` does the work.

  python launch/train_rl.py --workdir /tmp/trace_run                       # CPU default
  python launch/train_rl.py --config configs/tiny_arith.py --workdir /tmp/r \\
      --config.rl.alignment=qat --config.total_steps=50
  # multi-host: the same command on every host (or TRACE_* environment variables), e.g.
  python launch/train_rl.py --workdir /shared/r --config.mesh.data=-1 --config.mesh.expert=8 \\
      --coordinator_address=host0:1234 --num_processes=2 --process_id=$RANK
"""

import os
import sys

# Config files import each other (`from configs import ...`): make the repository root
# importable however the launcher is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
from ml_collections import config_flags

from trace_jax import compilation_cache, settings
from trace_jax.parallel import distributed

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                        "tiny_arith.py")
config_flags.DEFINE_config_file("config", _DEFAULT, "Config file (get_config()).")
flags.DEFINE_string("workdir", None, "Directory for metrics.jsonl, TensorBoard and checkpoints.")
distributed.define_flags()
compilation_cache.define_flags()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  distributed.initialize()  # a no-op for one process
  settings.warn_unknown()
  cache = compilation_cache.enable(workdir=FLAGS.workdir)
  if cache:
    print(f"compilation cache: {cache}")
  from trace_jax.rl import loop
  try:
    loop.run(FLAGS.config, FLAGS.workdir)
  except loop.ConfigError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
