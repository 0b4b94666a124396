"""Logical-axis rules: which mesh axes shard which parameter, activation and cache axes.

Every parameter's logical axes follow from its path in the params tree (the names
`models.transformer` documents); the same suffix match serves optimizer state (`mu`, `nu` mirror
the params tree) and the `TrainState`. `LOGICAL_RULES` maps logical axes to mesh axes; a mesh
axis that vanished (size 1) is skipped, and no mesh axis shards two dimensions of one array.

* Tensor and expert parallelism are exact: a mesh axis that does not divide its dimension is an
  error naming the leaf (GSPMD would otherwise pad, and a padded expert or head is wrong work).
* FSDP shards the `embed` dimension of master weights and optimizer state; where `fsdp` does not
  divide it, the largest other unsharded divisible dimension takes it, else the leaf stays
  replicated over `fsdp` (small leaves: norms, router).
* `QArray`/`Guidance` leaves: codes, scales and second-level scales get the same per-dimension
  spec. Along the block axis the shard boundary must fall between blocks, so the mesh axis must
  divide the number of blocks (not just the elements); a second-level scale dimension of size 1
  (a per-tensor `g`) is replicated.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from trace_jax import quant as tq
from trace_jax.parallel.mesh import axis_size

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # Activations: the batch is split over every axis that does not split a weight dimension
    # inside the layer (expert parallelism exchanges tokens inside the MoE layer).
    "batch": ("data", "fsdp", "expert"),
    "sequence": (),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "experts": ("expert",),
    "expert_ffn": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
}

# (path suffix regex, logical axes): the first match wins; unmatched leaves are replicated.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed/embedding", ("vocab", "embed")),
    (r"attn/q_proj/kernel", ("embed", "heads")),
    (r"attn/[kv]_proj/kernel", ("embed", "kv_heads")),
    (r"attn/o_proj/kernel", ("heads", "embed")),
    (r"attn/q_proj/bias", ("heads",)),
    (r"attn/[kv]_proj/bias", ("kv_heads",)),
    (r"attn/o_proj/bias", ("embed",)),
    (r"attn/[qk]_norm/scale", (None,)),
    (r"(input_norm|post_attn_norm|final_norm)/scale", ("embed",)),
    (r"moe/router/kernel", ("embed", None)),
    (r"moe/shared_gate", ("embed", None)),
    (r"moe/experts/gate_up_proj", ("experts", "embed", "expert_ffn")),
    (r"moe/experts/down_proj", ("experts", "expert_ffn", "embed")),
    (r"(mlp|shared)/(gate_proj|up_proj)/kernel", ("embed", "mlp")),
    (r"(mlp|shared)/down_proj/kernel", ("mlp", "embed")),
    (r"lm_head/kernel", ("embed", "vocab")),
)
_PARAM_RES = tuple((re.compile(r"(^|/)" + pat + r"$"), axes) for pat, axes in PARAM_AXES)

_BLOCKED = (tq.QArray, tq.Guidance)


def _is_blocked(x) -> bool:
  return isinstance(x, _BLOCKED)


def path_str(path) -> str:
  """A tree path as 'a/b/c' (dict keys, attribute names and sequence indices)."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def param_logical_axes(path: str, ndim: int) -> tuple[str | None, ...]:
  """The logical axes of the parameter at `path` ('layers_0/attn/q_proj/kernel', or any path
  ending so, e.g. inside optimizer state); all None (replicated) for unknown leaves."""
  for rx, axes in _PARAM_RES:
    if rx.search(path) and len(axes) == ndim:
      return axes
  return (None,) * ndim


def _mesh_axes(logical: str | None, mesh: Mesh) -> tuple[str, ...]:
  if logical is None:
    return ()
  if logical not in LOGICAL_RULES:
    raise ValueError(f"unknown logical axis {logical!r}; known: {sorted(LOGICAL_RULES)}")
  return tuple(a for a in LOGICAL_RULES[logical] if axis_size(mesh, a) > 1)


def logical_to_spec(logical_axes: Sequence[str | None], mesh: Mesh,
                    shape: Sequence[int] | None = None, name: str = "array",
                    units: Sequence[int] | None = None, fsdp_fallback: bool = False) -> P:
  """The `PartitionSpec` of an array with these logical axes on `mesh`.

  shape: validate divisibility (an error names `name`, the dimension and the mesh axes);
  units: per dimension, how many elements form one indivisible unit (a quantization block) —
  the mesh axes must divide `shape[d] // units[d]`.
  fsdp_fallback: where `fsdp` cannot shard its logical dimension, give it to the largest other
  unsharded divisible dimension (else drop it) instead of raising."""
  used: set[str] = set()
  dims: list[tuple[str, ...]] = []
  pending_fsdp = False
  units = units or (1,) * len(logical_axes)
  for d, logical in enumerate(logical_axes):
    axes = tuple(a for a in _mesh_axes(logical, mesh) if a not in used)
    if shape is not None and axes:
      n = math.prod(axis_size(mesh, a) for a in axes)
      count = shape[d] // units[d]
      if count % n or shape[d] % units[d]:
        if fsdp_fallback and axes == ("fsdp",):
          pending_fsdp, axes = True, ()
        else:
          what = (f"{count} quantization blocks of {units[d]}" if units[d] > 1
                  else f"size {shape[d]}")
          raise ValueError(
              f"cannot shard {name} (shape {tuple(shape)}) dimension {d} ({logical}, {what}) over "
              f"mesh axes {axes} of total size {n}: the size must divide it (choose a mesh "
              "that divides the model's dimensions)")
    used.update(axes)
    dims.append(axes)
  if pending_fsdp and shape is not None and "fsdp" not in used:
    f = axis_size(mesh, "fsdp")
    free = [d for d in range(len(dims)) if not dims[d] and (shape[d] // units[d]) % f == 0
            and shape[d] % units[d] == 0 and shape[d] > 1]
    if free:
      d = max(free, key=lambda i: (shape[i], -i))
      dims[d] = ("fsdp",)
  return P(*[None if not a else (a[0] if len(a) == 1 else a) for a in dims])


def _blocked_shardings(obj, logical_axes, mesh: Mesh, name: str, fsdp_fallback: bool):
  """A `QArray`/`Guidance` of `NamedSharding`s: one spec per logical dimension for its codes
  (payload) and scales, blocks kept whole; size-1 second-level scale dimensions replicated."""
  units = [obj.fmt.block if d == obj.axis else 1 for d in range(len(obj.shape))]
  spec = logical_to_spec(logical_axes, mesh, obj.shape, name, units, fsdp_fallback)
  full = tuple(spec) + (None,) * (len(obj.shape) - len(spec))
  fields = ("payload" if isinstance(obj, tq.Guidance) else "codes", "scales", "global_scale")
  out = {}
  for f in fields:
    leaf = getattr(obj, f)
    if leaf is None:
      out[f] = None
      continue
    s = tuple(None if leaf.shape[d] == 1 and obj.shape[d] != 1 else full[d]
              for d in range(leaf.ndim))
    out[f] = NamedSharding(mesh, P(*s))
  return dataclasses.replace(obj, **out)


def _leaf_sharding(path, x, mesh: Mesh, axes_fn, fsdp_fallback: bool):
  name = path_str(path) or "<root>"
  if _is_blocked(x):
    return _blocked_shardings(x, axes_fn(name, len(x.shape)), mesh, name, fsdp_fallback)
  shape = tuple(getattr(x, "shape", ()))
  if not shape:
    return NamedSharding(mesh, P())
  return NamedSharding(mesh, logical_to_spec(axes_fn(name, len(shape)), mesh, shape, name,
                                             fsdp_fallback=fsdp_fallback))


def _tree_shardings(tree, mesh: Mesh, axes_fn, fsdp_fallback: bool):
  return jax.tree_util.tree_map_with_path(
      lambda p, x: _leaf_sharding(p, x, mesh, axes_fn, fsdp_fallback), tree, is_leaf=_is_blocked)


def param_shardings(tree: Any, mesh: Mesh) -> Any:
  """`NamedSharding`s for a params tree, or any tree holding params-like subtrees (a
  `TrainState`, optax state): logical axes from each leaf's path, FSDP with fallback, QArrays
  with whole blocks per shard. Leaves may be arrays or `jax.ShapeDtypeStruct`s."""
  return _tree_shardings(tree, mesh, param_logical_axes, True)


def shard_params(tree: Any, mesh: Mesh) -> Any:
  """`tree` placed per `param_shardings` (a resharding copy when already on other devices)."""
  return jax.device_put(tree, param_shardings(tree, mesh))


def _batch_axes(name: str, ndim: int):
  return ("batch",) + (None,) * (ndim - 1)


def batch_shardings(tree: Any, mesh: Mesh) -> Any:
  """Shardings for a batch-first tree (train batch, prompts, rollout records): the leading
  dimension over the `batch` rule's mesh axes, the rest replicated."""
  return _tree_shardings(tree, mesh, _batch_axes, False)


def routes_shardings(routes, mesh: Mesh):
  """Routes `[L_moe, B, T, k]`: batch second."""
  return NamedSharding(mesh, logical_to_spec((None, "batch", None, None), mesh, routes.shape,
                                             "routes"))


def _cache_axes(name: str, ndim: int):
  if ndim == 4:  # K/V [B, S, KVH, head_dim]
    return ("batch", "sequence", "kv_heads", "head_dim")
  return ("batch",) + (None,) * (ndim - 1)  # valid [B, S]


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
  """Shardings for a `KVCache`: batch and KV heads (FP4 caches: blocks along head_dim stay
  whole because head_dim is never sharded)."""
  return _tree_shardings(cache, mesh, _cache_axes, False)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
