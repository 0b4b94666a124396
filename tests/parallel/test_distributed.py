"""Multi-host: initialize() settings, checkpoints restored onto another mesh shape, and a
2-process localhost RL run (gloo collectives) equal to the single-process run."""

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from trace_jax import models as M
from trace_jax import parallel as par
from trace_jax import quant as tq
from trace_jax import rl
from trace_jax.checkpoint import Checkpointer
from trace_jax.parallel import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_initialize_settings_from_args_env_and_errors(monkeypatch):
  for var in ("TRACE_COORDINATOR_ADDRESS", "TRACE_NUM_PROCESSES", "TRACE_PROCESS_ID",
              "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  assert distributed.initialize() is False  # nothing set: single process, nothing done
  assert distributed.initialize(num_processes=1) is False
  monkeypatch.setenv("TRACE_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.setenv("TRACE_NUM_PROCESSES", "4")
  monkeypatch.setenv("JAX_PROCESS_ID", "2")
  assert distributed.resolve() == dict(coordinator_address="10.0.0.1:1234", num_processes=4,
                                       process_id=2)
  assert distributed.resolve(process_id=3)["process_id"] == 3  # arguments win
  monkeypatch.delenv("JAX_PROCESS_ID")
  with pytest.raises(ValueError, match=r"missing \['process_id'\]"):
    distributed.initialize()
  with pytest.raises(ValueError, match=r"process_id 7 is not in \[0, num_processes=4\)"):
    distributed.initialize(process_id=7)
  monkeypatch.setenv("TRACE_NUM_PROCESSES", "four")
  with pytest.raises(ValueError, match="num_processes must be an integer"):
    distributed.resolve()


def test_checkpoint_saved_on_one_mesh_restores_onto_another(tmp_path):
  cfg = M.tiny(num_layers=2)
  params = M.init_params(cfg, jax.random.key(0))
  opt = optax.adamw(1e-3)
  policy = tq.make_policy("paper", "nvfp4")
  qparams = jax.jit(M.quantize_params, static_argnums=1)(params, policy)
  mesh_a = par.make_mesh(dict(fsdp=8))
  mesh_b = par.make_mesh(dict(data=2, expert=2, tensor=2))
  state = {"train": rl.init_state(params, opt), "rollout": qparams}
  saved = jax.device_put(state, par.param_shardings(state, mesh_a))
  with Checkpointer(tmp_path, keep=1) as ckpt:
    ckpt.save(1, saved, force=True)
    ckpt.wait()
    target = jax.device_put(state, par.param_shardings(state, mesh_b))
    got = ckpt.restore(1, target=target)
  want_sh = par.param_shardings(state, mesh_b)
  for g, w, sh in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(state),
                      jax.tree_util.tree_leaves(want_sh)):
    assert g.sharding == sh
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  assert isinstance(got["rollout"]["layers_0"]["moe"]["experts"]["down_proj"], tq.QArray)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _worker(out, workdir, per_process, env_extra):
  env = dict(os.environ, **env_extra)
  for var in ("XLA_FLAGS", "JAX_PLATFORMS"):
    env.pop(var, None)
  return subprocess.Popen([sys.executable, os.path.join(HERE, "mp_worker.py"), str(out),
                           str(workdir), str(per_process)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # ~100-250 s on 2 CPU cores: three processes compile the whole RL step
@pytest.mark.parametrize("decode_chunk", [0, 2], ids=["one_program", "decode_windows"])
def test_two_process_rl_run_equals_single_process(tmp_path, decode_chunk):
  """2 processes x 2 CPU devices (gloo) vs 1 process x 4 devices, mesh data=2 x expert=2,
  two RL steps with checkpoints and an eval; the metrics every process returns are equal. With
  decode windows too: each window's guidance goes to host memory (on every process, the whole
  batch's) and into the train step. The task's 4 new tokens run as a window of 2 and the last
  window in pieces of one step (`GUIDANCE_TAIL` 1), each cut on every process before its
  copy."""
  port = _free_port()
  t0 = time.time()
  chunk = {"TRACE_TEST_DECODE_CHUNK": str(decode_chunk), "TRACE_JAX_GUIDANCE_TAIL": "1"}
  procs = [_worker(tmp_path / f"p{i}.json", tmp_path / "multi", 2, {
      "TRACE_COORDINATOR_ADDRESS": f"localhost:{port}", "TRACE_NUM_PROCESSES": "2",
      "TRACE_PROCESS_ID": str(i), **chunk}) for i in range(2)]
  procs.append(_worker(tmp_path / "ref.json", tmp_path / "single", 4, chunk))
  try:
    for p in procs:
      out, _ = p.communicate(timeout=600)
      assert p.returncode == 0, out[-3000:]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  elapsed = time.time() - t0
  res = [json.loads((tmp_path / f).read_text()) for f in ("p0.json", "p1.json", "ref.json")]
  assert [(r["processes"], r["devices"]) for r in res] == [(2, 4), (2, 4), (1, 4)]
  ref = res[2]["rows"]
  assert [r["step"] for r in ref] == [1, 2] and "eval/pass_rate" in ref[-1]
  for r in res[:2]:
    assert len(r["rows"]) == len(ref)
    for got, want in zip(r["rows"], ref):
      assert set(got) == set(want)
      for k in want:  # gloo all-reduces sum in another order: measured <= 1e-7 relative
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7, err_msg=k)
  # Process 0 wrote the metrics and the shared checkpoints.
  assert os.path.exists(tmp_path / "multi" / "metrics.jsonl")
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints"))[:3] == ["0", "1", "2"]
  print(f"2-process RL test: {elapsed:.1f} s")


_CHECK = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
from trace_jax.kernels import dispatch
from trace_jax.parallel import distributed
if os.environ.get("STAND_IN_HOPPER"):  # this host's GPU taken for a Hopper: the kernels on
  dispatch.kernels_on = lambda: True
try:
  distributed.initialize(timeout_s=60)
  print("AGREE")
except ValueError as e:
  print("ERROR", e)
"""


def _two_processes(env0: dict, env1: dict) -> list[str]:
  """The last line each of two processes of one job prints after `initialize` (`_CHECK`)."""
  port = _free_port()
  procs = []
  for i, extra in enumerate((env0, env1)):
    env = dict(os.environ, TRACE_COORDINATOR_ADDRESS=f"localhost:{port}",
               TRACE_NUM_PROCESSES="2", TRACE_PROCESS_ID=str(i), **extra)
    for var in ("XLA_FLAGS", "JAX_PLATFORMS", "TRACE_JAX_SAMPLER", "STAND_IN_HOPPER"):
      if var not in extra:
        env.pop(var, None)
    procs.append(subprocess.Popen([sys.executable, "-c", _CHECK], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  try:
    outs = [p.communicate(timeout=150)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [o.strip().splitlines()[-1] if o.strip() else "" for o in outs]


def test_processes_that_read_different_settings_stop_naming_the_setting():
  """Two processes of one job (gloo, localhost): a program-shaping setting set differently
  (TRACE_JAX_SAMPLER) stops both at `initialize`, each naming it and its own value; the same
  settings, or a different compilation cache path (no program changes with it), pass; hosts whose
  GPU kinds gate the kernels differently (`kernels_on`) stop too."""
  got = _two_processes({"TRACE_JAX_SAMPLER": "gumbel"}, {"TRACE_JAX_SAMPLER": "inverse_cdf"})
  assert got[0].startswith("ERROR the processes of this job read different values of "
                           "TRACE_JAX_SAMPLER (process 0 has TRACE_JAX_SAMPLER='gumbel')"), got
  assert "TRACE_JAX_SAMPLER (process 1 has TRACE_JAX_SAMPLER='inverse_cdf')" in got[1], got
  got = _two_processes({"TRACE_JAX_COMPILATION_CACHE": "/tmp/a"},
                       {"TRACE_JAX_SAMPLER": "gumbel", "TRACE_JAX_COMPILATION_CACHE": "/tmp/b"})
  assert got == ["AGREE", "AGREE"], got
  # Hosts of different GPU kinds (one a Hopper: the kernels on there only) stop alike, told
  # how to run such a job.
  got = _two_processes({"STAND_IN_HOPPER": "1"}, {})
  assert "different values of kernels_on (process 0 has kernels_on='True')" in got[0], got
  assert "(process 1 has kernels_on='False')" in got[1], got
  assert all("TRACE_JAX_KERNELS=off on every host" in g for g in got), got
