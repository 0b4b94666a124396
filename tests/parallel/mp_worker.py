"""One process of the multi-process RL test (run as a subprocess, not collected by pytest).

  python tests/parallel/mp_worker.py OUT.json WORKDIR DEVICES_PER_PROCESS
Multi-process settings come from TRACE_COORDINATOR_ADDRESS / TRACE_NUM_PROCESSES /
TRACE_PROCESS_ID (absent: a single process). Writes the loop's returned metrics to OUT.json.
"""

import json
import os
import sys

out_path, workdir, per_process = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={per_process} "
                           "--xla_backend_optimization_level=0 "
                           "--xla_llvm_disable_expensive_passes=true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from trace_jax import parallel  # noqa: E402

parallel.initialize()

import jax  # noqa: E402

from configs import tiny_arith  # noqa: E402
from trace_jax.rl import compare, loop  # noqa: E402


def config():
  c = tiny_arith.get_config()
  return compare.override(c, {
      "sft.max_steps": 0, "total_steps": 2, "rollout.prompts_per_step": 4,
      "rollout.samples_per_prompt": 4, "eval.every": 2, "eval.size": 8, "checkpoint.every": 1,
      "mesh.data": 2, "mesh.expert": 2,
      # decode windows (guidance moved to host memory per window) when the test asks for them
      "rollout.decode_chunk": int(os.environ.get("TRACE_TEST_DECODE_CHUNK", "0"))})


rows = loop.run(config(), workdir, log=lambda *_: None)
rows = [{k: v for k, v in r.items() if k not in loop.TIMING_KEYS} for r in rows]
with open(out_path, "w") as f:
  json.dump({"process": jax.process_index(), "processes": jax.process_count(),
             "devices": jax.device_count(), "rows": rows}, f)
