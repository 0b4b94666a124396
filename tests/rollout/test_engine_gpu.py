"""GPU tests of the rollout engine: the programs as the GPU compiles them. Run on the GPU machine:

  JAX_PLATFORMS=cuda PYTHONPATH=. python -m pytest -q -m gpu -p no:xdist tests/rollout
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True, scope="module")
def _need_gpu():
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")


def test_command_buffers_give_the_same_rollout():
  """XLA command buffers over the decode windows (CUDA graphs holding the while loop, its
  device-side condition and the Mosaic kernels) give bit-identical tokens, logprobs and
  guidance, also when rows stop at different steps and a window ends the rollout early; and
  so does the one-program engine (no windows: what the chunked engine's pipelined windows,
  each launched before the host reads whether the last one ended, must equal)."""
  cfg = M.preset("qwen3_30b_a3b").replace(num_layers=2, max_seq_len=64 + 48)
  params = M.random_params(cfg, jax.random.key(0), "bfloat16")
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(3, cfg.vocab_size, int(n))) for n in rng.integers(20, 64, 12)]
  max_new = [int(n) for n in rng.integers(5, 48, len(prompts))]
  out = []
  for on, chunk in ((False, 16), (True, 16), (False, 0)):
    eng = RolloutEngine(cfg, tq.make_policy("paper"), max_new_tokens=48, prompt_bucket=64,
                        decode_chunk=chunk, command_buffers=on)
    assert eng.use_kernels and eng.command_buffers is on
    eng.sync(params)
    out.append(eng.generate(prompts, sampling=SamplingParams(temperature=1.0), seed=3,
                            max_new_tokens=max_new))
    del eng
  a = out[0]
  assert int(np.asarray(a.completion_mask).sum()) > 0
  for b in out[1:]:
    for f in ("tokens", "completion_mask", "logprobs", "routes"):
      np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), f)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y),
                           b.guidance, a.guidance)


def _fresh_process(code: str, tag: str, timeout: int) -> str:
  """Run `code` in a new Python process from the repository root; its last stdout line that
  starts with `tag`."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
      "PYTHONPATH")])))
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                     timeout=timeout, env=env, cwd=root)
  assert r.returncode == 0, r.stderr[-3000:]
  return [x for x in r.stdout.splitlines() if x.startswith(tag)][-1]


_SECOND_CALL = """
import sys
import jax
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams
from trace_jax.rollout import engine as E
cfg = M.tiny(num_layers=2).replace(dtype="bfloat16")
eng = RolloutEngine(cfg, tq.make_policy("bf16"), max_new_tokens=4)
eng.sync(M.init_params(M.tiny(num_layers=2), jax.random.key(0)))
for seed in (1, 2, 3):
  eng.generate([[3, 4, 5]], sampling=SamplingParams(temperature=1.0), seed=seed)
print("SIZES", [p._cache_size() for p in E._PROGRAMS.values()], "tokamax" in sys.modules)
"""


def test_bf16_engine_compiles_its_program_once():
  """In a fresh process (tokamax not yet imported), a BF16 engine whose grouped matmuls go to
  tokamax compiles its program once over three rollouts: importing tokamax creates JAX user
  contexts, which change every jit's cache key; imported inside the first rollout's trace it
  made the second rollout compile again (`kernels.import_gpu_libraries`)."""
  pytest.importorskip("tokamax")  # without it nothing is imported late: the test would be moot
  line = _fresh_process(_SECOND_CALL, "SIZES", 240)
  assert line == "SIZES [1] True", line  # one program, compiled once; tokamax was in use


_HOST_SYNC = """
import json
import jax
import numpy as np
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine
cfg = M.preset("qwen3_30b_a3b").replace(num_layers=8, max_seq_len=64)
host = M.random_params(cfg, jax.random.key(0), "bfloat16", on_host=True)
out = {"numpy": all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(host)),
       "master": sum(x.nbytes for x in jax.tree_util.tree_leaves(host)),
       "largest_part": max(sum(x.nbytes for x in jax.tree_util.tree_leaves(p))
                           for p in host.values())}
leaves = []
for m in (host, None):
  if m is None:
    m = jax.device_put(host)
  eng = RolloutEngine(cfg, tq.make_policy("paper"), max_new_tokens=8, prompt_bucket=56)
  out["kernels"] = eng.use_kernels
  eng.sync(m)
  jax.block_until_ready(eng.params)
  out.setdefault("peaks", []).append(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
  out["weights"] = eng.weight_bytes
  leaves.append([np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(eng.params)])
  del eng, m
out["equal"] = len(leaves[0]) == len(leaves[1]) and all(
    np.array_equal(a, b) for a, b in zip(*leaves))
# a device sync after a host one donates the host-made weights it makes anew (kernel layout
# included): as many as the engine's own leaves after it (the others are the master's arrays)
eng = RolloutEngine(cfg, tq.make_policy("paper"), max_new_tokens=8, prompt_bucket=56)
eng.sync(host)
old = jax.tree_util.tree_leaves(eng.params)
dev = jax.device_put(host)
eng.sync(dev)
mine = [a for a in jax.tree_util.tree_leaves(eng.params)
        if not any(a is m for m in jax.tree_util.tree_leaves(dev))]
out["donated"] = [sum(a.is_deleted() for a in old), len(mine)]
print("HOST_SYNC", json.dumps(out))
"""


_RESYNC_PEAK = """
import json
import jax
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine
cfg = M.preset("qwen3_30b_a3b").replace(num_layers=8, max_seq_len=64)
master = M.random_params(cfg, jax.random.key(0), "bfloat16")
stats = jax.devices()[0].memory_stats
jax.block_until_ready(master)
out = {"master": stats()["bytes_in_use"], "before": stats()["peak_bytes_in_use"]}
eng = RolloutEngine(cfg, tq.make_policy("paper"), max_new_tokens=8, prompt_bucket=56)
peaks = []
for _ in range(3):
  eng.sync(master)
  jax.block_until_ready(eng.params)
  peaks.append(stats()["peak_bytes_in_use"])
out.update(peaks=peaks, weights=eng.weight_bytes, kernels=eng.use_kernels)
print("RESYNC", json.dumps(out))
"""


def test_resync_peak_on_gpu():
  """In a fresh process: re-syncs from a device master (8 layers of the 30B-A3B shape, FP4
  experts in the kernel layout) reach no higher device peak than the first sync: the old
  laid-out weights are donated to the new ones (the layout's program), not held beside them."""
  out = json.loads(_fresh_process(_RESYNC_PEAK, "RESYNC", 400)[len("RESYNC "):])
  print(out, "first sync's peak over master + weights:",
        (out["peaks"][0] - out["master"]) / out["weights"])
  assert out["kernels"]
  first, *again = out["peaks"]
  assert first > out["before"]  # the first sync set the peak (not the master's making)
  assert max(again) <= first + out["weights"] // 8


def test_sync_from_host_master_on_gpu():
  """In a fresh process: a host master (numpy leaves) synced part by part gives the device
  master's rollout weights bit for bit as the GPU computes them (FP4 quantization, the kernel
  layout, q/k/v fused), and its sync's device peak is the rollout weights and a few of the
  largest part's bytes (one layer's master and its quantization's transients), well below the
  weights plus the whole master that a device master's sync needs. A device sync after it
  donates the host-made weights that it makes anew (session 57: none were, on the H100, before
  the donation was kept by `keep_unused` and the old laid-out weights given to the layout's
  program)."""
  out = json.loads(_fresh_process(_HOST_SYNC, "HOST_SYNC", 400)[len("HOST_SYNC "):])
  print(out)
  assert out["numpy"] and out["kernels"] and out["equal"]
  host_peak, dev_peak = out["peaks"]
  assert host_peak <= out["weights"] + 3 * out["largest_part"]
  assert host_peak < out["weights"] + out["master"] / 2 <= dev_peak
  deleted, made = out["donated"]  # a later device sync donated the weights it makes anew
  assert deleted == made > 0
