"""The persistent compilation cache: a second process loads what the first compiled."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROG = """
import logging, sys
import jax, jax.numpy as jnp
from trace_jax import compilation_cache
print("DIR", compilation_cache.enable(sys.argv[1], min_compile_secs=0))
logging.basicConfig(level=logging.DEBUG)
for name in ("jax._src.compilation_cache", "jax._src.compiler"):
  logging.getLogger(name).setLevel(logging.DEBUG)
f = jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T + 3.0)
print("SUM", float(f(jnp.ones((64, 64))).sum()))
"""


def _run(cache_dir):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  p = subprocess.run([sys.executable, "-c", PROG, cache_dir], capture_output=True, text=True,
                     timeout=120, env=env, cwd=ROOT)
  assert p.returncode == 0, p.stderr[-2000:]
  return p.stdout + p.stderr


def test_second_process_hits_the_cache(tmp_path):
  d = str(tmp_path / "xla_cache")
  first = _run(d)
  assert f"DIR {d}" in first
  assert os.listdir(d), "nothing was written to the cache"
  second = _run(d)
  assert "cache hit" in second.lower(), second[-3000:]
  sums = [line for line in (first + second).splitlines() if line.startswith("SUM")]
  assert len(set(sums)) == 1


def test_off_without_a_path(monkeypatch):
  from trace_jax import compilation_cache
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  assert compilation_cache.enable("") is None


def test_workdir_default_on_gpu_only(tmp_path, monkeypatch):
  """Unset anywhere, a run's workdir holds the cache on a GPU (every program stored), and
  nothing is cached elsewhere; the flag's '' or the environment's directory still decide, and a
  GPU run with a workdir stores every program there too (fresh compiles may differ)."""
  import jax
  from trace_jax import compilation_cache
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  saved = (jax.config.jax_compilation_cache_dir,
           jax.config.jax_persistent_cache_min_compile_time_secs)
  try:
    wd = str(tmp_path / "run")
    assert compilation_cache.enable(workdir=wd, platform="cpu") is None
    assert compilation_cache.enable(workdir=None, platform="gpu") is None
    assert compilation_cache.enable("", workdir=wd, platform="gpu") is None
    got = compilation_cache.enable(workdir=wd, platform="gpu")
    assert got == os.path.join(wd, "xla_cache") and os.path.isdir(got)
    assert jax.config.jax_compilation_cache_dir == got
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    other = str(tmp_path / "elsewhere")
    monkeypatch.setenv(compilation_cache.ENV, other)
    assert compilation_cache.enable(workdir=wd, platform="gpu") == other
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    assert compilation_cache.enable(workdir=wd, platform="cpu") == other
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
    assert compilation_cache.enable(workdir=None, platform="gpu") == other
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
  finally:
    jax.config.update("jax_compilation_cache_dir", saved[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", saved[1])
