"""Test setup: 8 fake CPU devices for sharding tests (set before JAX initializes a backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # noqa: BLE001 - older/newer jax without the option: XLA_FLAGS above covers it
  pass
