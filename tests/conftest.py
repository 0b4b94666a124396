"""Test setup: 8 fake CPU devices for sharding tests (set before JAX initializes a backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
  flags += " --xla_force_host_platform_device_count=8"
# The suite is compile-bound on 2 cores: cheaper backend optimization cuts compile time ~35%.
if "xla_backend_optimization_level" not in flags:
  flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402

try:
  jax.config.update("jax_num_cpu_devices", 8)
except Exception:  # noqa: BLE001 - older/newer jax without the option: XLA_FLAGS above covers it
  pass
