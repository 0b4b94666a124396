"""The persistent XLA compilation cache for launches: a restarted or resumed run (or the next
benchmark row) loads its compiled programs from disk instead of compiling them again. A 12-layer
30B-A3B rollout program took 2 minutes to compile on the H200; 48 layers take several times that.

Flag `--compilation_cache` (or environment TRACE_JAX_COMPILATION_CACHE): a directory, shared by
the hosts of a multi-host run if they share a filesystem; "" (the default) leaves caching off.
"""

from __future__ import annotations

import os

import jax
from absl import flags

ENV = "TRACE_JAX_COMPILATION_CACHE"


def define_flags() -> None:
  if "compilation_cache" in flags.FLAGS:
    return
  flags.DEFINE_string("compilation_cache", None,
                      f"Directory of the persistent XLA compilation cache (default: ${ENV}, "
                      "else off).")


def enable(path: str | None = None, min_compile_secs: float = 1.0) -> str | None:
  """Turn the cache on at `path` (default: the flag, then the environment). Returns the
  directory in use, or None when caching stays off. Programs that compile faster than
  `min_compile_secs` are not stored."""
  if path is None:
    path = flags.FLAGS.compilation_cache if ("compilation_cache" in flags.FLAGS
                                             and flags.FLAGS.is_parsed()) else None
  path = path if path is not None else os.environ.get(ENV, "")
  if not path:
    return None
  path = os.path.abspath(os.path.expanduser(path))
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_secs))
  return path
