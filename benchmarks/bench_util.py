"""Helpers shared by the GPU benchmark scripts (imported as a sibling module: the scripts run as
`python benchmarks/<name>.py`, which puts this folder on `sys.path`)."""

from __future__ import annotations

import os
import threading
import time

READ_CEILING_TBPS = 4.27  # measured XLA bf16 GEMV read stream on the H200 (BENCHMARKS.md)
L2_BYTES = 60e6  # H200 L2: timed inputs rotate through copies larger than this


def start_watchdog(state: dict, hang_s: float, rows: list, save, log) -> None:
  """End the process (exit code 3) when the variant in `state` ("name", started at "t"; "t"
  None between variants) runs past `hang_s`, after recording it in `rows` and saving: a hung
  Mosaic GPU kernel stalls the whole GPU job otherwise."""

  def watch():
    while True:
      time.sleep(2)
      if state.get("t") and time.time() - state["t"] > hang_s:
        log("WATCHDOG: hung in", state.get("name"))
        rows.append(dict(name=state.get("name"), error="HUNG (watchdog)"))
        save()
        os._exit(3)

  threading.Thread(target=watch, daemon=True).start()


def abstract_h200():
  """Context for lowering Triton-lowered Pallas kernels for CUDA on a machine without a GPU
  (`--dry`): the Triton lowering asks the device for its compute capability."""
  import jax
  dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                  abstract_device=dev))
