"""Where a benchmark or report came from: date, device, versions, git commit, exact command
(every result JSON carries these, see BENCHMARKS.md)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys


def git_commit() -> str:
  """HEAD of the checkout holding this package; outside a git checkout (a copy sent to a GPU
  machine) the `TRACE_JAX_COMMIT` environment variable, else "unknown"."""
  if os.environ.get("TRACE_JAX_COMMIT"):
    return os.environ["TRACE_JAX_COMMIT"]
  try:
    return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                   stderr=subprocess.DEVNULL,
                                   cwd=os.path.dirname(os.path.abspath(__file__))).strip()
  except Exception:  # noqa: BLE001 - not a checkout, or git missing
    return "unknown"


def run_info() -> dict:
  import jax
  dev = jax.devices()[0]
  return dict(date=datetime.date.today().isoformat(), device=str(dev),
              device_kind=dev.device_kind,
              platform=platform.platform(), jax_version=jax.__version__,
              git_commit=git_commit(), command=" ".join([sys.executable] + sys.argv),
              xla_flags=os.environ.get("XLA_FLAGS", ""))
