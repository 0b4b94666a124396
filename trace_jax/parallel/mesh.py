"""Device meshes from config: the `data`, `fsdp`, `expert` and `tensor` axes.

`MeshConfig` holds one size per axis (-1: whatever the devices leave over, at most one axis);
`make_mesh` builds a `jax.sharding.Mesh` over the given devices (default: all of them) in which
every axis of size 1 vanishes, so shardings and collectives only ever name real axes. A config
whose sizes are all 1 gives a one-device mesh with a single `data` axis of size 1 (nothing is
sharded; the program is the single-device one).

Disaggregated rollout/train: build two meshes over disjoint device lists
(`make_mesh(train_cfg, devs[:4])`, `make_mesh(roll_cfg, devs[4:])`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; -1 fills with the devices left over (at most one axis)."""

  data: int = 1
  fsdp: int = 1
  expert: int = 1
  tensor: int = 1

  @classmethod
  def from_config(cls, cfg: Any) -> "MeshConfig":
    """From an `ml_collections.ConfigDict`/dict with any of the axis names (others ignored,
    missing ones 1), a `MeshConfig`, or None (all 1)."""
    if cfg is None:
      return cls()
    if isinstance(cfg, MeshConfig):
      return cfg
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    return cls(**{a: int(d[a]) for a in AXES if a in d})

  @property
  def sizes(self) -> dict[str, int]:
    return {a: getattr(self, a) for a in AXES}

  @property
  def is_trivial(self) -> bool:
    return all(s == 1 for s in self.sizes.values())

  def resolve(self, num_devices: int) -> "MeshConfig":
    """The config with -1 filled in for `num_devices` devices; errors name the problem."""
    sizes = self.sizes
    bad = {a: s for a, s in sizes.items() if s == 0 or s < -1}
    if bad:
      raise ValueError(f"mesh axis sizes must be positive or -1 (fill), got {bad}")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
      raise ValueError(f"at most one mesh axis may be -1 (fill), got {fill}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if fill:
      if num_devices % fixed:
        raise ValueError(f"mesh {sizes}: {num_devices} devices do not divide by the fixed axes' "
                         f"product {fixed}")
      sizes[fill[0]] = num_devices // fixed
    elif fixed > num_devices:
      raise ValueError(f"mesh {sizes} needs {fixed} devices, only {num_devices} available")
    return MeshConfig(**sizes)


def make_mesh(cfg: MeshConfig | Any = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default `jax.devices()`: every process's devices) with the axes of
  `cfg` whose size is > 1, in the order data, fsdp, expert, tensor (tensor innermost: its
  collectives are the most frequent, so its devices are neighbours). A config that uses fewer
  devices than given takes the first ones."""
  cfg = MeshConfig.from_config(cfg)
  devices = list(jax.devices() if devices is None else devices)
  cfg = cfg.resolve(len(devices))
  names = tuple(a for a in AXES if getattr(cfg, a) > 1) or ("data",)
  shape = tuple(getattr(cfg, a) for a in names)
  n = math.prod(shape)
  grid = np.asarray(devices[:n], dtype=object).reshape(shape)
  return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def axis_size(mesh: Mesh, axis: str) -> int:
  """Size of `axis` in `mesh` (1 when it vanished)."""
  return int(mesh.shape.get(axis, 1))
