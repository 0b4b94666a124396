"""Launchers start from any directory without PYTHONPATH, with config files that import other
config files (`from configs import tiny_arith`)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("launcher, args", [
    ("train_rl.py", ["--config", os.path.join(ROOT, "configs", "gpu_arith.py")]),
    ("compare.py", []),  # its default config, configs/serve_compare.py, imports tiny_arith
])
def test_launcher_loads_configs_from_anywhere(tmp_path, launcher, args):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", launcher), *args,
                      "--helpfull"], cwd=tmp_path, env=env, capture_output=True, text=True,
                     timeout=120)
  # (absl's --helpfull exits with status 1 after printing the flags)
  assert "Traceback" not in r.stderr, r.stderr[-2000:]
  assert "--compilation_cache" in r.stdout, r.stdout[-2000:]
