"""OpenAI-compatible server (/v1/completions, /v1/chat/completions) over the rollout engine, at
BF16 or under an FP4 policy, with step-level continuous batching and token streaming
(`serve.scheduler`).

  python launch/serve.py --arm=candidate                        # FP4 `paper`, tiny model, CPU
  python launch/serve.py --arm=baseline --config.init_checkpoint=/path/hf \\
      --config.tokenizer=/path/hf --port=8000 --api_key=$KEY
  curl -s 127.0.0.1:8000/v1/completions -H "Authorization: Bearer $KEY" \\
      -d '{"model": "trace-candidate", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}'

Binds 127.0.0.1 unless --host says otherwise. The API key may also come from TRACE_JAX_API_KEY.
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
flags.DEFINE_enum("arm", "candidate", ["baseline", "candidate"],
                  "Which precision of the config to serve (config.baseline / config.candidate).")
flags.DEFINE_string("host", "127.0.0.1", "Address to bind (0.0.0.0 exposes it to the network).")
flags.DEFINE_integer("port", 8000, "Port.")
flags.DEFINE_string("api_key", None, "Require 'Authorization: Bearer <key>' (default: "
                    "$TRACE_JAX_API_KEY, else no key).")
compilation_cache.define_flags()
FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  settings.warn_unknown()
  compilation_cache.enable()
  import uvicorn

  from trace_jax.rl import loop
  from trace_jax.rollout import SamplingParams
  from trace_jax.serving import build_serving
  from trace_jax.serving.server import API_KEY_ENV, build_app
  try:
    model = build_serving(FLAGS.config, FLAGS.arm, warm_sampling=SamplingParams(0.0))
  except loop.ConfigError as e:
    sys.exit(f"error: {e}")
  key = FLAGS.api_key or os.environ.get(API_KEY_ENV) or None
  if FLAGS.host not in ("127.0.0.1", "localhost", "::1") and not key:
    print(f"warning: serving on {FLAGS.host} without an API key", file=sys.stderr)
  app_ = build_app(model, api_key=key, max_body_bytes=int(FLAGS.config.serve.max_body_bytes))
  print(f"serving {model.name!r} on http://{FLAGS.host}:{FLAGS.port}/v1", flush=True)
  try:
    # Connections beyond the queue bound get 503 from uvicorn before reaching the app.
    sc = FLAGS.config.serve
    uvicorn.run(app_, host=FLAGS.host, port=FLAGS.port, log_level="info",
                limit_concurrency=int(sc.max_queue) + int(sc.max_batch) + 16)
  finally:
    model.close()


if __name__ == "__main__":
  app.run(main)
