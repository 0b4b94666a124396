"""Checkpoints for training state: a thin, resume-safe wrapper over orbax-checkpoint.

This module owns how a training state (an arbitrary pytree: params, optax state, typed PRNG
keys, Python ints/floats such as the step and the data-stream position, `QArray`s) is written
to and read back from a checkpoint directory. Orbax does the I/O, async writes, retention and
atomicity (each step is written to `<step>.orbax-checkpoint-tmp-*` and renamed when complete,
so a run killed mid-save leaves the previous step intact).

On disk a step holds two orbax items:
  arrays: the array leaves as a nested dict keyed by path components (readable by plain orbax);
  meta:   JSON listing every leaf in flatten order (its path, kind, dtype, shape; Python
          scalars are stored here by value; typed PRNG keys keep their impl name).
With a `target` the restore rebuilds the exact tree (namedtuples, dataclasses, `QArray`
static metadata) from the target's treedef; without one it returns nested dicts/lists.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["Checkpointer", "CheckpointMismatchError"]

_FORMAT = "trace_jax.checkpoint/1"
_ARRAYS = "arrays"
_META = "meta"


class CheckpointMismatchError(ValueError):
  """The checkpoint's tree does not match the restore target (keys, shapes or leaf kinds)."""


# --------------------------------------------------------------------------- paths

def _component(k) -> tuple[str, Any]:
  """A path entry as a JSON-able (tag, key) pair: d=dict key, s=sequence index, a=attribute."""
  tu = jax.tree_util
  if isinstance(k, tu.DictKey):
    key = k.key
    # JSON keeps str/int/bool; anything else is named by its repr (plain restore only).
    return ("d", key if isinstance(key, (str, int)) else repr(key))
  if isinstance(k, tu.SequenceKey):
    return ("s", k.idx)
  if isinstance(k, tu.GetAttrKey):
    return ("a", k.name)
  if isinstance(k, tu.FlattenedIndexKey):
    return ("s", k.key)
  return ("d", repr(k))


def _storage_name(comp: tuple[str, Any]) -> str:
  return str(comp[1])


def _keystr(path) -> str:
  return jax.tree_util.keystr(tuple(path)) if path else "<root>"


def _is_prng_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _impl_name(key) -> str:
  # A str for registered impls; a PRNGSpec (whose str() is the impl name) otherwise.
  return str(jax.random.key_impl(key))


def _leaf_kind(x) -> str:
  if _is_prng_key(x):
    return "key"
  if isinstance(x, jax.Array):
    return "jax"
  if isinstance(x, np.ndarray):
    return "np"
  if isinstance(x, np.generic):  # before float: np.float64 subclasses float
    return "npscalar"
  if isinstance(x, bool):
    return "bool"
  if isinstance(x, int):
    return "int"
  if isinstance(x, float):
    return "float"
  if isinstance(x, str):
    return "str"
  raise TypeError(f"cannot checkpoint a leaf of type {type(x).__name__}")


def _set_nested(tree: dict, names: list[str], value, where: str) -> None:
  node = tree
  for n in names[:-1]:
    node = node.setdefault(n, {})
    if not isinstance(node, dict):
      raise ValueError(f"checkpoint key collision at {where}: two leaves map to the same name")
  if names[-1] in node:
    raise ValueError(f"checkpoint key collision at {where}: two leaves map to the same name "
                     "(e.g. dict keys 1 and '1')")
  node[names[-1]] = value


def _get_nested(tree: dict, names: list[str]):
  for n in names:
    tree = tree[n]
  return tree


def _names(comps) -> list[str]:
  # A bare array as the whole state has an empty path; give it a name orbax can store.
  return [_storage_name(c) for c in comps] or ["value"]


def _remove_tmp_dirs(directory: str) -> None:
  """Deletes `<step>.orbax-checkpoint-tmp-*` directories (one process does it)."""
  if jax.process_index() != 0 or not os.path.isdir(directory):
    return
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


# --------------------------------------------------------------------------- Checkpointer

class Checkpointer:
  """Saves and restores a training-state pytree every `save_every` steps, keeping `keep`.

  ckpt = Checkpointer(workdir / "checkpoints", keep=3, save_every=100)
  ckpt.save(step, state)            # no-op unless step % save_every == 0 (or force=True)
  state = ckpt.restore(target=state)  # latest step, same tree/dtypes/shardings as target
  ckpt.wait(); ckpt.close()
  """

  def __init__(self, directory: str | os.PathLike, keep: int | None = 3, save_every: int = 1,
               *, async_save: bool = True):
    d = os.fspath(directory)
    # Remote paths (gs://...) are left alone; local ones are made absolute (orbax needs that).
    self.directory = d if "://" in d else os.path.abspath(os.path.expanduser(d))
    if save_every is None or save_every < 1:
      raise ValueError(f"save_every must be a positive int, got {save_every!r}")
    if keep is not None and keep < 1:
      raise ValueError(f"keep must be a positive int or None (keep all), got {keep!r}")
    self.keep = keep
    self.save_every = int(save_every)
    # Leftovers of a save that was killed are removed when the next run starts. Orbax's own
    # cleanup runs in a background thread (a restore can still see the junk), so local
    # directories are cleaned here, synchronously; remote ones are left to orbax.
    remote = "://" in self.directory
    if not remote:
      _remove_tmp_dirs(self.directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, create=True, enable_async_checkpointing=async_save,
        cleanup_tmp_directories=remote)
    self._mngr = ocp.CheckpointManager(self.directory, options=options)

  # ------------------------------------------------------------------ queries

  def latest_step(self) -> int | None:
    """The newest complete step, or None when the directory holds no checkpoint."""
    self.wait()
    return self._mngr.latest_step()

  def all_steps(self) -> list[int]:
    self.wait()
    return sorted(self._mngr.all_steps())

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  # ------------------------------------------------------------------ save

  def save(self, step: int, state: Any, *, force: bool = False) -> bool:
    """Saves `state` as `step` (asynchronously by default); returns whether it saved.

    Skipped when `step` is not a multiple of `save_every` (unless `force`) or when that step
    is already on disk (a resumed run re-reaching a saved step must not fail).
    """
    step = int(step)
    if not (force or self.should_save(step)):
      return False
    if step in self._mngr.all_steps():
      return False
    arrays: dict = {}
    leaves_meta = []
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
      comps = [_component(k) for k in path]
      where = _keystr(path)
      try:
        kind = _leaf_kind(x)
      except TypeError as e:
        raise TypeError(f"{e} at {where}") from None
      entry: dict[str, Any] = {"key": where, "path": comps, "kind": kind}
      if kind in ("bool", "int", "float", "str"):
        entry["value"] = x  # small Python values live in the JSON metadata
      else:
        if kind == "key":
          entry["impl"] = _impl_name(x)
          entry["key_shape"] = list(x.shape)
          x = jax.random.key_data(x)
        elif kind == "np":
          x = np.array(x, copy=True)  # async save: later in-place edits must not leak in
        elif kind == "npscalar":
          x = np.asarray(x)
        entry["dtype"] = str(x.dtype)
        entry["shape"] = list(x.shape)
        _set_nested(arrays, _names(comps), x, where)
      leaves_meta.append(entry)
    meta = {"format": _FORMAT, "step": step, "jax_version": jax.__version__,
            "leaves": leaves_meta}
    items = {_META: ocp.args.JsonSave(meta)}
    if arrays:  # orbax cannot write an empty tree; a scalars-only state lives in meta alone
      items[_ARRAYS] = ocp.args.PyTreeSave(arrays)
    return bool(self._mngr.save(step, args=ocp.args.Composite(**items), force=True))

  def wait(self) -> None:
    """Blocks until pending async saves are on disk (and finalized)."""
    self._mngr.wait_until_finished()

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # ------------------------------------------------------------------ restore

  def restore(self, step: int | None = None, target: Any = None) -> Any:
    """Restores `step` (default: the latest).

    With `target` (a pytree like the saved state; leaves may be arrays, `jax.ShapeDtypeStruct`s
    or Python scalars), the result has the target's tree structure, dtypes and shardings;
    a checkpoint whose keys, shapes or leaf kinds differ raises `CheckpointMismatchError`
    naming the first mismatching key. Without a target: nested dicts (namedtuple/dataclass
    fields by name) and lists, arrays on the first local device, typed keys re-wrapped.
    """
    self.wait()
    if step is None:
      step = self._mngr.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    step = int(step)
    if step not in self._mngr.all_steps():
      raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory} "
                              f"(have {sorted(self._mngr.all_steps())})")
    meta = self._mngr.restore(step, args=ocp.args.Composite(
        **{_META: ocp.args.JsonRestore()}))[_META]
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
      raise ValueError(f"{self.directory}/{step} is not a trace_jax checkpoint")
    leaves_meta = meta["leaves"]

    if target is None:
      targets = [None] * len(leaves_meta)
      treedef = None
    else:
      flat, treedef = jax.tree_util.tree_flatten_with_path(target)
      _check_structure(step, leaves_meta, flat)
      targets = [x for _, x in flat]

    restore_args: dict = {}
    for entry, t in zip(leaves_meta, targets):
      if "dtype" in entry:
        _set_nested(restore_args, _names(entry["path"]), _restore_arg(entry, t), entry["key"])
    stored = {}
    if restore_args:
      stored = self._mngr.restore(step, args=ocp.args.Composite(
          **{_ARRAYS: ocp.args.PyTreeRestore(restore_args=restore_args)}))[_ARRAYS]

    values = []
    for entry, t in zip(leaves_meta, targets):
      if "dtype" in entry:
        v = _get_nested(stored, _names(entry["path"]))
      else:
        v = entry["value"]
      values.append(_finish_leaf(entry, v, t))
    if treedef is not None:
      return jax.tree_util.tree_unflatten(treedef, values)
    return _build_plain(leaves_meta, values)


# --------------------------------------------------------------------------- restore helpers

def _target_kind(t) -> str:
  if _is_prng_key(t) or (isinstance(t, jax.ShapeDtypeStruct)
                         and jax.dtypes.issubdtype(t.dtype, jax.dtypes.prng_key)):
    return "key"
  if isinstance(t, (bool, int, float, str)) and not isinstance(t, np.generic):
    return "scalar"
  return "array"


def _check_structure(step: int, leaves_meta: list[dict], flat: list) -> None:
  """Raises CheckpointMismatchError naming the first key where checkpoint and target differ."""
  saved = [e["key"] for e in leaves_meta]
  wanted = [_keystr(p) for p, _ in flat]
  if saved != wanted:
    saved_set, wanted_set = set(saved), set(wanted)
    for i in range(max(len(saved), len(wanted))):
      s = saved[i] if i < len(saved) else None
      w = wanted[i] if i < len(wanted) else None
      if s == w:
        continue
      if w is not None and w not in saved_set:
        why = f"key {w} is in the target but not in the checkpoint"
      elif s is not None and s not in wanted_set:
        why = f"key {s} is in the checkpoint but not in the target"
      else:
        why = f"leaf order differs at {w} (checkpoint has {s})"
      raise CheckpointMismatchError(
          f"checkpoint step {step} does not match the restore target: {why} "
          f"({len(saved)} leaves saved, {len(wanted)} in target). Was it written by a "
          "different model or optimizer config? Use a fresh workdir or the matching config.")
  for entry, (_, t) in zip(leaves_meta, flat):
    kind, tkind = entry["kind"], _target_kind(t)
    if (kind == "key") != (tkind == "key"):
      raise CheckpointMismatchError(
          f"checkpoint step {step}: key {entry['key']} is a {kind} leaf in the checkpoint "
          f"but the target has {type(t).__name__}")
    if "shape" in entry and tkind != "scalar":
      shape = tuple(entry["key_shape"] if kind == "key" else entry["shape"])
      tshape = tuple(getattr(t, "shape", np.shape(t)))
      if shape != tshape:
        raise CheckpointMismatchError(
            f"checkpoint step {step}: key {entry['key']} has shape {shape} in "
            f"the checkpoint but {tshape} in the target (checkpoint from a different model "
            "shape? use a fresh workdir or the matching config)")


def _local_sharding():
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _restore_arg(entry: dict, t):
  kind = entry["kind"]
  if kind in ("np", "npscalar", "key"):
    # Keys come back as raw uint32 data on the host and are wrapped (and placed) afterwards.
    return ocp.RestoreArgs(restore_type=np.ndarray)
  sharding = getattr(t, "sharding", None)
  if not isinstance(sharding, jax.sharding.Sharding):
    sharding = _local_sharding()
  dtype = None
  if t is not None and _target_kind(t) == "array" and hasattr(t, "dtype"):
    dtype = t.dtype  # the target decides the dtype (orbax convention); equal on resume
  if t is not None and isinstance(t, np.ndarray):
    return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)
  return ocp.ArrayRestoreArgs(sharding=sharding, dtype=dtype,
                              global_shape=tuple(entry["shape"]))


def _finish_leaf(entry: dict, v, t):
  kind = entry["kind"]
  if kind == "key":
    key = jax.random.wrap_key_data(jnp.asarray(v), impl=entry["impl"])
    sharding = getattr(t, "sharding", None)
    if isinstance(sharding, jax.sharding.Sharding):
      key = jax.device_put(key, sharding)
    return key
  if kind == "npscalar":
    v = np.asarray(v)
    v = v[()] if t is None or not isinstance(t, np.ndarray) else v
  elif kind == "np" and isinstance(t, (jax.Array, jax.ShapeDtypeStruct)):
    sharding = getattr(t, "sharding", None)
    v = jax.device_put(v, sharding if isinstance(sharding, jax.sharding.Sharding) else None)
  if t is not None and _target_kind(t) == "scalar" and kind not in ("bool", "int", "float", "str"):
    v = np.asarray(v).item()  # target asks for a Python scalar
  elif t is not None and _target_kind(t) == "array" and kind in ("bool", "int", "float"):
    v = jnp.asarray(v, dtype=t.dtype)
  return v


def _build_plain(leaves_meta: list[dict], values: list):
  """Nested dicts/lists from the recorded paths (no target: the tree's classes are unknown)."""
  if len(leaves_meta) == 1 and not leaves_meta[0]["path"]:
    return values[0]
  root: dict = {}
  for entry, v in zip(leaves_meta, values):
    node = root
    comps = [tuple(c) for c in entry["path"]]
    for c in comps[:-1]:
      node = node.setdefault(c, {})
    node[comps[-1]] = v
  return _materialize(root)


def _materialize(node):
  """Children all indexed by position become a list; anything else a dict by key/field name."""
  if not isinstance(node, dict):
    return node
  if node and all(tag == "s" for tag, _ in node):
    return [_materialize(node[c]) for c in sorted(node, key=lambda c: c[1])]
  return {key: _materialize(v) for (_, key), v in node.items()}
