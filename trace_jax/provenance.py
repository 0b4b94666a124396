"""Where a benchmark or report came from: date, device, versions, git commit, exact command
(every result JSON carries these, see BENCHMARKS.md)."""

from __future__ import annotations

import datetime
import hashlib
import os
import platform
import subprocess
import sys

from trace_jax import settings as _settings
from trace_jax.settings import declare


COMMIT_ENV = declare("TRACE_JAX_COMMIT", "", "a commit",
                     "the commit result JSONs record outside a git checkout (device copies)",
                     shapes_programs=False)


def git_commit() -> str:
  """HEAD of the checkout holding this package; outside a git checkout (a copy sent to a GPU
  machine) the `TRACE_JAX_COMMIT` environment variable, else "unknown"."""
  if os.environ.get(COMMIT_ENV):
    return os.environ[COMMIT_ENV]
  try:
    return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                   stderr=subprocess.DEVNULL,
                                   cwd=os.path.dirname(os.path.abspath(__file__))).strip()
  except Exception:  # noqa: BLE001 - not a checkout, or git missing
    return "unknown"


def source_tree(path: str | None = None) -> str:
  """The git tree id of a source directory (default: this package), computed from its files the
  way git does (blobs `sha1("blob <size>\\0" + bytes)`, trees of `<mode> <name>\\0<raw id>`
  entries in git's order), so a result made from a copy without `.git` (a GPU machine's) still
  names its sources: `git rev-parse <commit>:trace_jax` gives the same id for the commit that
  holds them. Caches (`__pycache__`, `*.pyc`) are left out, as git's ignore rules do."""
  path = path or os.path.dirname(os.path.abspath(__file__))

  def obj(kind: bytes, data: bytes) -> bytes:
    return hashlib.sha1(kind + b" " + str(len(data)).encode() + b"\0" + data).digest()

  def tree(d: str) -> bytes | None:
    entries = []
    for name in os.listdir(d):
      full = os.path.join(d, name)
      if name == "__pycache__" or name.endswith(".pyc") or os.path.islink(full):
        continue
      if os.path.isdir(full):
        sub = tree(full)
        if sub is not None:  # git keeps no empty trees
          entries.append((name + "/", b"40000 " + name.encode(), sub))
      else:
        with open(full, "rb") as f:
          blob = obj(b"blob", f.read())
        mode = b"100755" if os.access(full, os.X_OK) else b"100644"
        entries.append((name, mode + b" " + name.encode(), blob))
    if not entries:
      return None
    entries.sort(key=lambda e: e[0].encode())  # git sorts a tree's names as if dirs end in "/"
    return obj(b"tree", b"".join(head + b"\0" + raw for _, head, raw in entries))

  top = tree(path)
  return top.hex() if top is not None else "empty"


def settings() -> dict:
  """The TRACE_JAX_* and XLA_FLAGS settings of this process: an A/B side is often only one.
  (`run_info`'s `unknown_settings` lists the TRACE_JAX_* names among them that nothing reads.)"""
  return {k: v for k, v in sorted(os.environ.items())
          if k.startswith(_settings.PREFIX) or k == "XLA_FLAGS"}


def run_info() -> dict:
  import jax

  from trace_jax.kernels import dispatch  # noqa: PLC0415 - the package imports provenance
  dev = jax.devices()[0]
  return dict(date=datetime.date.today().isoformat(), device=str(dev),
              device_kind=dev.device_kind,
              compute_capability=getattr(dev, "compute_capability", None),
              kernels_on=dispatch.kernels_on(),
              platform=platform.platform(), jax_version=jax.__version__,
              git_commit=git_commit(), source_tree=source_tree(),
              command=" ".join([sys.executable] + sys.argv),
              xla_flags=os.environ.get("XLA_FLAGS", ""), settings=settings(),
              unknown_settings=_settings.unknown_names())
