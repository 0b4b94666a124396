"""Execute every notebook so it cannot rot (a cell that raises fails the test)."""

import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


# fp4_formats (~25 s on 2 cores, its content the quant tests' own) runs in the slow tier
SLOW = {"fp4_formats.ipynb"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW
                                  else p for p in NOTEBOOKS], ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend emits PNGs
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                   resources={"metadata": {"path": str(tmp_path)}})
  client.execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})]
  assert images, "the notebook should show its plots"
