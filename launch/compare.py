"""Serving A/B with a verdict: BF16 baseline vs FP4 candidate on identical prompts, context
length and offered load; acceptance limits from the config, fixed before the runs.

  python launch/compare.py --workdir /tmp/ab                                # CPU, tiny model
  python launch/compare.py --workdir /tmp/ab --config.init_checkpoint=/tmp/sft/hf \\
      --config.limits.max_pass_rate_drop=0.02 --config.candidate.policy=w4a16
  python launch/compare.py --config=configs/serve_compare.py:gpu --workdir $OUT/ab   # GPU

Writes limits.json (first), report.json, report.md and PNG plots into --workdir. One arm per
job: --config.compare.only_arm=baseline, then =candidate, then neither (builds the report from
the two measurements; limits and config must not change in between).
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
                        "serve_compare.py")
config_flags.DEFINE_config_file("config", _DEFAULT, "Config file (get_config()).")
flags.DEFINE_string("workdir", None, "Directory for limits.json, report.json/md and plots.")
compilation_cache.define_flags()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  settings.warn_unknown()
  compilation_cache.enable()
  from trace_jax.rl import loop
  from trace_jax.serving import compare
  try:
    report = compare.run_compare(FLAGS.config, FLAGS.workdir)
  except loop.ConfigError as e:
    sys.exit(f"error: {e}")
  if report is not None:
    print(compare.markdown_report(report))


if __name__ == "__main__":
  app.run(main)
