"""The persistent XLA compilation cache for launches: a restarted or resumed run (or the next
benchmark row) loads its compiled programs from disk instead of compiling them again. A 12-layer
30B-A3B rollout program took 2 minutes to compile on the H200; 48 layers take several times that.

Flag `--compilation_cache` (or environment TRACE_JAX_COMPILATION_CACHE): a directory, shared by
the hosts of a multi-host run if they share a filesystem; "" leaves caching off. Unset, a run
with a workdir on a GPU caches in WORKDIR/xla_cache (`enable(workdir=...)`), every program: on
the GPU the numbers a program gives depend on the kernels XLA's autotuner picked when it
compiled, and two processes may pick differently (session 49, the 4-layer rollout at B 255 on an
H100: every process repeated its own tokens and logprobs bit for bit, a process that loaded
another's programs repeated that one's, and freshly compiling processes differed in logprobs,
at 512 tokens in tokens too; session 51, the small RL loop on an H100, each run a new process:
freshly compiling processes parted at the first train step, processes sharing a cache that
stored every program repeated every step, a killed run's resumption included,
benchmarks/loop_repeats.py --processes new). A resumed run then runs the killed run's programs.
Elsewhere (CPU) unset means off. A GPU run with a workdir stores every program in a cache named
by the flag or the environment too.
"""

from __future__ import annotations

import os

import jax
from absl import flags

from trace_jax.settings import declare

ENV = declare("TRACE_JAX_COMPILATION_CACHE", "", "a directory",
              "the persistent XLA compilation cache (what `--compilation_cache` defaults to)",
              shapes_programs=False)


def define_flags() -> None:
  if "compilation_cache" in flags.FLAGS:
    return
  flags.DEFINE_string("compilation_cache", None,
                      f"Directory of the persistent XLA compilation cache (default: ${ENV}; "
                      "else, for a run with a workdir on a GPU, WORKDIR/xla_cache, which makes "
                      "a resumed run repeat the killed one's numbers; else off; a GPU run with "
                      "a workdir stores every program wherever the cache is). '' turns it off.")


def enable(path: str | None = None, min_compile_secs: float = 1.0, *,
           workdir: str | None = None, platform: str | None = None) -> str | None:
  """Turn the cache on at `path` (default: the flag, then the environment). Returns the
  directory in use, or None when caching stays off. Programs that compile faster than
  `min_compile_secs` are not stored, except in a run with a `workdir` on a GPU (`platform`,
  default the default backend: call after `distributed.initialize`), which stores every program
  wherever its cache is (a program compiled afresh may give other numbers). With no directory
  given anywhere, such a run's cache is WORKDIR/xla_cache."""
  if path is None:
    path = flags.FLAGS.compilation_cache if ("compilation_cache" in flags.FLAGS
                                             and flags.FLAGS.is_parsed()) else None
  path = path if path is not None else os.environ.get(ENV)
  if path == "":
    return None
  if workdir and (platform or jax.default_backend()) == "gpu":
    path, min_compile_secs = path or os.path.join(workdir, "xla_cache"), 0.0
  if not path:
    return None
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
  return path
