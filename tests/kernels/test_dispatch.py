"""Which devices take the kernels (`dispatch.kernels_allowed`, `kernels_on`): NVIDIA Hopper GPUs
by default, no other device, whatever TRACE_JAX_KERNELS asks for."""

import itertools

import jax
import pytest

from trace_jax import kernels
from trace_jax.kernels import dispatch

CUDA = "PJRT C API\ncuda 12090"
ROCM = "PJRT C API\nrocm 60400"


@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_kernels_allowed_by_enumeration(setting):
  """Every (backend, platform, capability) of the table against the rule written out: "off"
  never, "on" on any GPU, "auto" on a CUDA GPU of compute capability 9.0 exactly (H100, H200,
  GH200) and on no Ampere (8.0, 8.6), Ada (8.9), Blackwell (10.0, 12.0) or ROCm device."""
  backends = ("gpu", "cpu", "tpu")
  platforms = (CUDA, ROCM, "")
  capabilities = ("9.0", "8.0", "8.6", "8.9", "10.0", "12.0", "9.1", "gfx90a", None, "")
  for backend, platform, capability in itertools.product(backends, platforms, capabilities):
    want = (setting == "on" and backend == "gpu") or (
        setting == "auto" and backend == "gpu" and platform == CUDA and capability == "9.0")
    got = dispatch.kernels_allowed(setting, backend, platform, capability)
    assert got == want, (setting, backend, platform, capability)


def test_kernels_off_on_this_cpu():
  if jax.default_backend() != "cpu":
    pytest.skip("a CPU backend's answer")
  assert kernels.kernels_on() is False


@pytest.mark.gpu
def test_kernels_on_on_a_hopper_gpu():
  """On the H100 / H200 the kernels were built for, `kernels_on` reads the device as Hopper
  (its PJRT platform version names CUDA, its compute capability is 9.0)."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  device = jax.devices()[0]
  assert "cuda" in device.client.platform_version.lower(), device.client.platform_version
  assert device.compute_capability == "9.0", device.compute_capability
  assert kernels.kernels_on() is True
