"""Run metrics: the `metrics.jsonl` writer (plus TensorBoard), console progress, and plots.

This module owns the on-disk metric format that launchers, notebooks and reports share:
`<workdir>/metrics.jsonl`, one JSON object per step, always with an int "step" (the metric
names other tools read are fixed in DESIGN.md "Contracts"). Values are plain JSON: numpy/jax
scalars become int/float/bool, non-finite floats become null (strict JSON), nested dicts are
flattened with "/" ("mismatch": {"k3_kl": x} -> "mismatch/k3_kl").

Resume: `MetricWriter(workdir, resume_step=k)` drops lines with step > k, so a run killed
and resumed from checkpoint k ends with exactly the lines of an uninterrupted run. Every
`write` reaches the file at once (a kill loses nothing that was written), and writes for the
same step are merged into that step's single line.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["MetricWriter", "Progress", "read_metrics", "plot_metrics", "to_json_value",
           "flatten_metrics", "format_metrics", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- JSON values

def to_json_value(x: Any) -> Any:
  """A metric value as plain JSON: numpy/jax scalars -> int/float/bool, arrays -> lists,
  NaN/inf -> None. Raises TypeError for values that have no JSON form."""
  if x is None or type(x) in (bool, str):
    return x
  if type(x) is int:
    return x
  if type(x) is float:
    return x if math.isfinite(x) else None
  # numpy/jax values (checked before subclasses: np.float64 is a float, np.str_ a str)
  if hasattr(x, "__array__") or isinstance(x, np.generic):
    a = np.asarray(x)  # device -> host for jax arrays
    if a.ndim == 0:
      if a.dtype.kind == "b":
        return bool(a)
      if a.dtype.kind in "iu":
        return int(a)
      if a.dtype.kind in "US":
        return str(a.item())
      try:
        return to_json_value(float(a))  # also bfloat16/float8 (numpy kind 'V')
      except (TypeError, ValueError):
        pass
    else:
      # Nested lists keep the shape; exotic floats (bfloat16, float8) go through float64.
      return to_json_value(a.tolist() if a.dtype.kind in "biuf" else
                           a.astype(np.float64).tolist())
  if isinstance(x, (list, tuple)):
    return [to_json_value(v) for v in x]
  for t in (bool, int, float, str):  # other subclasses (IntEnum, ...)
    if isinstance(x, t):
      return to_json_value(t(x))
  raise TypeError(f"metric value of type {type(x).__name__} has no JSON form: {x!r}")


def flatten_metrics(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dicts -> one level with "/"-joined keys."""
  out: dict[str, Any] = {}
  for k, v in metrics.items():
    key = f"{prefix}{k}"
    if isinstance(v, Mapping):
      out.update(flatten_metrics(v, key + "/"))
    else:
      out[key] = v
  return out


def _is_primary() -> bool:
  # Only process 0 writes files and prints in multi-host runs; jax is imported lazily so that
  # reading and plotting metrics never initializes a backend.
  try:
    import jax
    return jax.process_index() == 0
  except Exception:  # noqa: BLE001 - no backend: a single-process tool
    return True


def _abs(path: str | os.PathLike) -> str:
  return os.path.abspath(os.path.expanduser(os.fspath(path)))


# --------------------------------------------------------------------------- writer

class MetricWriter:
  """Appends one JSON line per step to `<workdir>/metrics.jsonl` (+ TensorBoard scalars).

  resume_step: None starts a fresh log (an existing metrics.jsonl is kept as
    metrics.jsonl.prev); k resumes: lines with step > k are dropped, the rest kept.
  tensorboard: write TensorBoard event files into `workdir` when tensorboardX is importable.
  enabled: default: only on jax process 0; a disabled writer accepts and ignores writes.
  """

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int | None = None,
               tensorboard: bool = True, enabled: bool | None = None):
    self.workdir = _abs(workdir)
    self.path = os.path.join(self.workdir, METRICS_FILE)
    self.enabled = _is_primary() if enabled is None else bool(enabled)
    self._file: io.BufferedRandom | None = None
    self._tb = None
    self._last_step: int | None = None
    self._last_offset = 0
    self._last_record: dict | None = None
    if not self.enabled:
      return
    os.makedirs(self.workdir, exist_ok=True)
    if resume_step is None:
      if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
        os.replace(self.path, self.path + ".prev")  # never silently destroy an old run's log
      open(self.path, "wb").close()
    else:
      self._truncate_after(int(resume_step))
    self._file = open(self.path, "r+b")
    self._file.seek(0, os.SEEK_END)
    if tensorboard:
      self._tb = _open_tensorboard(self.workdir, resume_step)

  def _truncate_after(self, resume_step: int) -> None:
    """Keeps lines with step <= resume_step (atomically replaces the file)."""
    kept: list[bytes] = []
    if os.path.exists(self.path):
      with open(self.path, "rb") as f:
        for raw in f:
          try:
            rec = json.loads(raw)
          except ValueError:
            continue  # a line torn by a kill mid-write
          if isinstance(rec, dict) and isinstance(rec.get("step"), int) \
              and rec["step"] <= resume_step:
            kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
            self._last_record = rec
    tmp = self.path + ".tmp"
    with open(tmp, "wb") as f:
      f.writelines(kept)
    os.replace(tmp, self.path)
    if kept:
      self._last_step = self._last_record["step"]
      self._last_offset = sum(len(r) for r in kept[:-1])
    else:
      self._last_record = None

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Records `metrics` for `step`; returns the JSON record as written (merged per step)."""
    step = int(step)
    flat = flatten_metrics(metrics)
    flat.pop("step", None)
    record = {k: to_json_value(v) for k, v in flat.items()}
    if not self.enabled:
      return {"step": step, **record}
    f = self._file
    if f is None:
      raise RuntimeError("MetricWriter is closed")
    if step == self._last_step and self._last_record is not None:
      # Same step again (e.g. eval after train): rewrite that line so each step has one object.
      record = {**self._last_record, **record}
      f.seek(self._last_offset)
      f.truncate()
    else:
      f.seek(0, os.SEEK_END)
      self._last_offset = f.tell()
    record = {"step": step, **{k: v for k, v in record.items() if k != "step"}}
    f.write((json.dumps(record, allow_nan=False) + "\n").encode())
    f.flush()  # a killed process must not lose a step it reported
    self._last_step, self._last_record = step, record
    if self._tb is not None:
      for k, v in flat.items():
        fv = _tb_scalar(v)
        if fv is not None:
          self._tb.add_scalar(k, fv, step)
    return record

  def flush(self) -> None:
    if self._file is not None:
      self._file.flush()
      os.fsync(self._file.fileno())
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    if self._file is not None:
      self.flush()
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _tb_scalar(v) -> float | None:
  """A float for TensorBoard (NaN kept: a diverging curve should show), None if not scalar."""
  if isinstance(v, bool):
    return float(v)
  if isinstance(v, (int, float)):
    return float(v)
  if hasattr(v, "__array__") or isinstance(v, np.generic):
    a = np.asarray(v)
    if a.size == 1:
      try:
        return float(a.reshape(()))
      except (TypeError, ValueError):
        return None
  return None


def _open_tensorboard(workdir: str, resume_step: int | None):
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    log.info("tensorboardX not installed: metrics go to %s only", METRICS_FILE)
    return None
  # purge_step makes TensorBoard discard events past the resumed step from the killed run.
  purge = None if resume_step is None else int(resume_step) + 1
  return SummaryWriter(logdir=workdir, purge_step=purge, flush_secs=30)


# --------------------------------------------------------------------------- progress

def _fmt_value(v) -> str:
  if isinstance(v, bool) or v is None:
    return str(v)
  if isinstance(v, int):
    return str(v)
  try:
    f = float(np.asarray(v).reshape(()))
  except (TypeError, ValueError):
    return str(v)
  return f"{f:.4g}"


def _fmt_time(s: float) -> str:
  if not math.isfinite(s):
    return "?"
  s = int(round(s))
  h, rem = divmod(s, 3600)
  m, sec = divmod(rem, 60)
  return f"{h}:{m:02d}:{sec:02d}" if h else f"{m:02d}:{sec:02d}"


def format_metrics(metrics: Mapping[str, Any], keys: Sequence[str] | None = None) -> str:
  """`key=value` pairs with 4 significant digits (the chosen keys, in order, if given)."""
  flat = flatten_metrics(metrics)
  names = [k for k in keys if k in flat] if keys is not None else [k for k in flat if k != "step"]
  parts = []
  for k in names:
    try:
      parts.append(f"{k}={_fmt_value(flat[k])}")
    except Exception:  # noqa: BLE001 - a non-scalar metric is shown by type only
      parts.append(f"{k}=<{type(flat[k]).__name__}>")
  return " ".join(parts)


class Progress:
  """Progress over steps `start..total`: a tqdm bar (rate, ETA) on a terminal, otherwise one
  plain line per step with rate and ETA (logs, CI, notebooks with `bar=False`).

  with Progress(cfg.total_steps, start=resumed_step, desc="rl") as prog:
    for step in range(resumed_step + 1, cfg.total_steps + 1):
      ...
      prog.update(step, metrics)     # advances; metrics shown in the bar's postfix
      prog.log(step, metrics)        # a compact printed line (above the bar)
  """

  def __init__(self, total: int, start: int = 0, desc: str = "", *, bar: bool | None = None,
               keys: Sequence[str] | None = None, file=None, enabled: bool | None = None):
    self.total = int(total)
    self.start = int(start)
    self.step = int(start)
    self.desc = desc
    self.keys = list(keys) if keys is not None else None
    self.file = file if file is not None else sys.stderr
    self.enabled = _is_primary() if enabled is None else bool(enabled)
    self._t0 = time.monotonic()
    self._bar = None
    if bar is None:
      bar = bool(getattr(self.file, "isatty", lambda: False)())
    if bar and self.enabled:
      try:
        from tqdm.auto import tqdm
        self._bar = tqdm(total=self.total, initial=self.start, desc=desc or None,
                         file=self.file, dynamic_ncols=True, unit="step")
      except ImportError:
        self._bar = None

  @property
  def rate(self) -> float:
    """Steps per second since this Progress started (resumed steps excluded)."""
    dt = time.monotonic() - self._t0
    done = self.step - self.start
    return done / dt if dt > 0 and done > 0 else float("nan")

  @property
  def eta_s(self) -> float:
    r = self.rate
    return (self.total - self.step) / r if r and math.isfinite(r) and r > 0 else float("nan")

  def _prefix(self, step: int) -> str:
    head = f"{self.desc} " if self.desc else ""
    return f"{head}step {step}/{self.total}"

  def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
    """Marks `step` done; shows rate, ETA and (compactly) `metrics`."""
    step = int(step)
    prev, self.step = self.step, step
    if not self.enabled:
      return
    text = format_metrics(metrics, self.keys) if metrics else ""
    if self._bar is not None:
      self._bar.update(step - prev)
      if text:
        self._bar.set_postfix_str(text, refresh=False)
      return
    pct = 100.0 * step / self.total if self.total else 100.0
    line = (f"{self._prefix(step)} ({pct:.0f}%) | {self.rate:.3g} step/s | "
            f"ETA {_fmt_time(self.eta_s)}")
    print(line + (f" | {text}" if text else ""), file=self.file, flush=True)

  def log(self, step: int, metrics: Mapping[str, Any]) -> str:
    """Prints `step N/T | k=v ...` (above the bar when one is shown); returns the line."""
    line = f"{self._prefix(int(step))} | {format_metrics(metrics, self.keys)}"
    if self.enabled:
      if self._bar is not None:
        self._bar.write(line, file=self.file)
      else:
        print(line, file=self.file, flush=True)
    return line

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


# --------------------------------------------------------------------------- reading, plots

def _jsonl_path(path: str | os.PathLike) -> str:
  p = _abs(path)
  return os.path.join(p, METRICS_FILE) if os.path.isdir(p) else p


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """The records of a metrics.jsonl (or of a workdir holding one), in file order.
  Unparseable lines (one torn by a kill) are skipped."""
  out = []
  with open(_jsonl_path(path)) as f:
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec, dict):
        out.append(rec)
  return out


def _moving_average(y: np.ndarray, window: int) -> np.ndarray:
  """Trailing mean over the last `window` points (fewer at the start)."""
  c = np.cumsum(np.insert(y, 0, 0.0))
  n = np.arange(1, len(y) + 1)
  lo = np.maximum(n - window, 0)
  return (c[n] - c[lo]) / (n - lo)


def plot_metrics(path, keys: Sequence[str], out_png: str | os.PathLike, *, smooth: int = 1,
                 title: str | None = None, logy: bool = False) -> str:
  """One subplot per key of metric vs step, saved as a PNG; returns its absolute path.

  path: a metrics.jsonl or workdir, or {label: path} / [paths] to overlay several runs.
  smooth: trailing moving-average window (>1 also draws the raw curve faintly).
  logy: logarithmic y axis (mismatch metrics span orders of magnitude).
  """
  # Figure + Agg canvas directly: no pyplot, so a notebook's backend is left alone.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  if isinstance(path, Mapping):
    runs = {str(k): v for k, v in path.items()}
  elif isinstance(path, (list, tuple)):
    runs = {os.path.basename(os.path.dirname(_jsonl_path(p))) or str(p): p for p in path}
  else:
    runs = {"": path}
  records = {label: read_metrics(p) for label, p in runs.items()}
  keys = list(keys)
  if not keys:
    raise ValueError("plot_metrics needs at least one key")
  fig = Figure(figsize=(6.5, 2.6 * len(keys)), constrained_layout=True)
  FigureCanvasAgg(fig)
  axes = fig.subplots(len(keys), 1, squeeze=False)[:, 0]
  for ax, key in zip(axes, keys):
    drawn = False
    for label, recs in records.items():
      pts = [(r["step"], r[key]) for r in recs
             if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)
             and isinstance(r.get("step"), int)]
      if not pts:
        continue
      x, y = (np.asarray(v, dtype=np.float64) for v in zip(*pts))
      if smooth > 1:
        line, = ax.plot(x, y, alpha=0.25, linewidth=0.8)
        ax.plot(x, _moving_average(y, smooth), color=line.get_color(), label=label or None)
      else:
        ax.plot(x, y, label=label or None, marker="." if len(x) < 30 else None)
      drawn = True
    ax.set_ylabel(key)
    if logy and drawn:
      ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if not drawn:
      ax.text(0.5, 0.5, f"no data for {key}", ha="center", va="center", transform=ax.transAxes)
    elif len(records) > 1:
      ax.legend(fontsize="small")
  axes[-1].set_xlabel("step")
  if title or smooth > 1:
    fig.suptitle((title or "") + (f" (moving average {smooth})" if smooth > 1 else ""))
  out = _abs(out_png)
  os.makedirs(os.path.dirname(out), exist_ok=True)
  fig.savefig(out, dpi=100)
  return out
