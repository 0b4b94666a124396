"""SFT warm start on a task, so a from-scratch tiny MoE has a non-zero pass rate before RL.

  python launch/sft.py --workdir /tmp/sft            # writes /tmp/sft/hf (HF checkpoint)
  python launch/train_rl.py --workdir /tmp/rl --config.sft.max_steps=0 \\
      --config.init_checkpoint=/tmp/sft/hf
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

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                        "tiny_arith.py")
config_flags.DEFINE_config_file("config", _DEFAULT, "Config file (get_config()).")
flags.DEFINE_string("workdir", None, "Output directory.")
compilation_cache.define_flags()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  settings.warn_unknown()
  cache = compilation_cache.enable(workdir=FLAGS.workdir)
  if cache:
    print(f"compilation cache: {cache}")
  from trace_jax.rl import loop
  try:
    loop.run_sft_only(FLAGS.config, FLAGS.workdir)
  except loop.ConfigError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main)
