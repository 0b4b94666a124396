"""Multi-host setup: `jax.distributed.initialize` from absl flags or the environment, and the
host-side helpers the loop needs when arrays span processes.

Every process runs the same program (multi-controller JAX). The coordinator address, process
count and process id come from (first that is set) the arguments, the absl flags
`--coordinator_address --num_processes --process_id` (defined by `define_flags()`), or the
environment `TRACE_COORDINATOR_ADDRESS`, `TRACE_NUM_PROCESSES`, `TRACE_PROCESS_ID`
(`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` also work). With no
coordinator, or one process, nothing is initialized (single-process runs are unchanged).
On CPU, cross-process collectives use gloo (`jax_cpu_collectives_implementation`).
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np

from trace_jax import settings

_ENV = {"coordinator_address": ("TRACE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS"),
        "num_processes": ("TRACE_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
        "process_id": ("TRACE_PROCESS_ID", "JAX_PROCESS_ID")}


def define_flags() -> None:
  """The absl flags `initialize()` reads (call once in a launcher, before `app.run`)."""
  from absl import flags
  if "coordinator_address" in flags.FLAGS:
    return
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0 (multi-host).")
  flags.DEFINE_integer("num_processes", None, "Number of processes (multi-host).")
  flags.DEFINE_integer("process_id", None, "This process's id in [0, num_processes).")


def _from_flags(name):
  try:
    from absl import flags
    f = flags.FLAGS
    if name in f and f.is_parsed():
      return getattr(f, name)
  except Exception:  # noqa: BLE001 - absl missing or flags not parsed: fall through to env
    pass
  return None


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None) -> dict:
  """The settings `initialize` would use: arguments, then absl flags, then environment."""
  given = dict(coordinator_address=coordinator_address, num_processes=num_processes,
               process_id=process_id)
  out = {}
  for name, value in given.items():
    if value is None:
      value = _from_flags(name)
    if value is None:
      for var in _ENV[name]:
        if os.environ.get(var):
          value = os.environ[var]
          break
    out[name] = value
  for name in ("num_processes", "process_id"):
    if out[name] is not None:
      try:
        out[name] = int(out[name])
      except ValueError:
        raise ValueError(f"{name} must be an integer, got {out[name]!r}") from None
  return out


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, timeout_s: int = 300) -> bool:
  """Join the multi-process job; returns whether `jax.distributed` was initialized (False:
  single process, nothing done). Must run before anything touches a JAX backend; with several
  processes it starts the backend itself, for `check_settings_agree`'s all-gather (so set
  backend options such as XLA_PYTHON_CLIENT_MEM_FRACTION before calling it)."""
  s = resolve(coordinator_address, num_processes, process_id)
  n = s["num_processes"]
  if s["coordinator_address"] is None and (n is None or n == 1):
    return False
  if n == 1:
    return False
  missing = [k for k, v in s.items() if v is None]
  if missing:
    raise ValueError(f"multi-process run needs coordinator_address, num_processes and "
                     f"process_id; missing {missing} (flags --{' --'.join(missing)} or env "
                     f"{', '.join(_ENV[m][0] for m in missing)})")
  if not 0 <= s["process_id"] < n:
    raise ValueError(f"process_id {s['process_id']} is not in [0, num_processes={n})")
  # Cross-process collectives of CPU devices (the only kind on a CPU run; harmless on GPU).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(s["coordinator_address"], n, s["process_id"],
                             initialization_timeout=timeout_s)
  check_settings_agree()
  return True


KERNELS_ON = "kernels_on"  # (beside the settings in the agreement check: the kernel gate's answer)


def check_settings_agree() -> None:
  """Raises, in every process, where the processes of this job read different values of a
  TRACE_JAX_* setting that shapes the compiled programs (a kernel switch set on one host only
  would give processes different programs, whose collectives then wait on each other or
  mismatch). One all-gather of a checksum per setting; `initialize` calls it. A no-op for one
  process. Whether the GPU kernels run (`kernels_on`: the setting and the host's GPU kind) is
  checked alike: hosts of different GPU kinds would compile different programs."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process runs only

  from trace_jax.kernels import dispatch  # noqa: PLC0415 - loaded for a multi-process job only
  values = dict(settings.program_settings())
  values[KERNELS_ON] = str(dispatch.kernels_on())
  names = sorted(values)
  mine = np.array([zlib.crc32(values[k].encode()) & 0x7FFFFFFF for k in names], np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, settings]
  differ = [k for i, k in enumerate(names) if len(set(every[:, i].tolist())) > 1]
  if differ:
    raise ValueError(
        f"the processes of this job read different values of {', '.join(differ)} (process "
        f"{jax.process_index()} has "
        f"{', '.join(f'{k}={values[k]!r}' for k in differ)}): set the TRACE_JAX_* settings "
        "alike on every host (docs/settings.md)"
        + (f"; {KERNELS_ON} differs where the hosts' GPUs differ (the kernels run only on "
           "Hopper, compute capability 9.0): TRACE_JAX_KERNELS=off on every host takes the "
           "XLA path everywhere" if KERNELS_ON in differ else ""))


def is_primary() -> bool:
  """Whether this process writes host-side outputs (metrics, logs)."""
  return jax.process_index() == 0


def to_host(x) -> np.ndarray:
  """The full value of `x` as numpy on every process (gathered when it spans processes)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)
