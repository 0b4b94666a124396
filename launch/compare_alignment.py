"""BF16 rollout vs naive FP4 vs independent QAT vs TRACE on the same seeds and task.

  python launch/compare_alignment.py --workdir /tmp/compare            # CPU default
  python launch/compare_alignment.py --workdir /tmp/c --config.total_steps=100
"""

import os
import sys

# Config files import each other (`from configs import ...`): make the repository root
# importable however the launcher is started.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app
from absl import flags
from ml_collections import config_flags

from trace_jax import settings

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                        "tiny_arith.py")
config_flags.DEFINE_config_file("config", _DEFAULT, "Config file (get_config()).")
flags.DEFINE_string("workdir", None, "Directory for the runs, report.md, report.json, plots.")
flags.DEFINE_list("variants", [], "Subset of bf16_rollout,fp4_naive,fp4_qat,fp4_trace.")
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  settings.warn_unknown()
  from trace_jax.rl import compare, loop
  unknown = set(FLAGS.variants) - set(compare.VARIANTS)
  if unknown:
    sys.exit(f"error: unknown variants {sorted(unknown)}; choose from {list(compare.VARIANTS)}")
  try:
    report = compare.compare_alignment(FLAGS.config, FLAGS.workdir, FLAGS.variants or None)
  except loop.ConfigError as e:
    sys.exit(f"error: {e}")
  print(compare.markdown_report(report))


if __name__ == "__main__":
  app.run(main)
