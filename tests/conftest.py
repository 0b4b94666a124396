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

# Files whose tests take longest on 2 cores (session-20 durations: each 45-130 s, compile-bound),
# collected first: pytest-xdist's --dist loadfile hands whole files to the 2 workers in
# collection order, so the long ones run while short files fill the gaps, instead of one of
# them starting last beside an idle worker.
LONGEST_FILES = ("rollout/test_engine.py", "parallel/test_train.py", "models/test_transformer.py",
                 "rl/test_train_step.py", "kernels/test_kernels_cpu.py",
                 "kernels/test_attention_cpu.py", "quant/test_fake_quant.py",
                 "rl/test_loop_resume.py")


def pytest_collection_modifyitems(items):
  def rank(item):
    path = item.nodeid.split("::")[0]
    return next((i for i, f in enumerate(LONGEST_FILES) if path.endswith(f)),
                len(LONGEST_FILES))
  items.sort(key=rank)  # stable: within a file, and among the rest, the usual order
