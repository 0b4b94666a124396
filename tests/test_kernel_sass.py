"""benchmarks/kernel_sass.py's reading of a SASS listing (the compile itself needs the CUDA
plugin line and is exercised by hand, see its docstring)."""

import collections
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import kernel_sass  # noqa: E402

# nvdisasm's layout with control codes: an outer loop around an inner one that holds the wgmma,
# a predicated branch, and a second loop without any wgmma (shorter: must not be chosen)
_SASS = """
        .text.k:
   -:-:-:Y:01        /*0000*/                   MOV R1, 0x1 ;
.L_x_0:
   -:-:-:Y:01        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_1:
   -:-:-:Y:01        /*0020*/                   PRMT R3, R4, 0x9180, R4 ;
   -:-:-:Y:01        /*0030*/                   HGMMA.64x8x16.F32.BF16 R24, R36, gdesc[UR16], RZ ;
   -:-:-:Y:01        /*0040*/               @!P1 BRA `(.L_x_2) ;
   -:-:-:Y:01        /*0050*/                   UIADD3 UR4, UR4, 0x1, URZ ;
.L_x_2:
   -:-:-:Y:01        /*0060*/                @P2 BRA `(.L_x_1) ;
   -:-:-:Y:01        /*0070*/                @P3 BRA `(.L_x_0) ;
.L_x_3:
   -:-:-:Y:01        /*0080*/                   FADD R5, R5, R6 ;
   -:-:-:Y:01        /*0090*/                @P4 BRA `(.L_x_3) ;
"""


def test_main_loop_is_the_shortest_loop_with_a_wgmma():
  loop = kernel_sass.main_loop(_SASS)
  body = [t for t in loop if not t.endswith(":")]
  assert loop[0] == ".L_x_1:" and body[-1].startswith("@P2 BRA")
  ops = collections.Counter(kernel_sass.opcode(t) for t in body)
  assert ops == {"PRMT": 1, "HGMMA": 1, "BRA": 2, "UIADD3": 1}
  # a tile's own path: up to the last wgmma (and the waits after it), not the tail
  assert [kernel_sass.opcode(t) for t in kernel_sass.through_last_wgmma(loop)] == ["PRMT",
                                                                                 "HGMMA"]
  waited = loop[:3] + ["WARPGROUP.DEPBAR.LE gsb0, 0x0"] + loop[3:]
  assert len(kernel_sass.through_last_wgmma(waited)) == 3


def test_report_carries_ptxas_performance_warnings(tmp_path):
  """ptxas's serialization warnings (which no instruction count shows) come back with the loop's
  counts; the register line is not taken for one."""
  sass = tmp_path / "k.sass_ctrl"
  sass.write_text(_SASS)
  warn = ("(C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
          "to program dependence on compiler-inserted WG.DP in divergent path")
  (tmp_path / "k.ptxas").write_text(
      f"ptxas info    : Used 96 registers, used 16 barriers\nptxas info    : {warn}\n")
  got = kernel_sass.report(str(sass), listing=False)
  assert got["instructions"] == 5 and got["to_last_wgmma"] == 2
  assert got["ptxas_warnings"] == [warn]
  (tmp_path / "k.ptxas").write_text("ptxas info    : Used 96 registers\n")
  assert kernel_sass.report(str(sass), listing=False)["ptxas_warnings"] == []


def test_wide_chunks_keep_their_wgmma_unserialized():
  """ptxas (deviceless H200 compile) serializes no wgmma of the grouped kernel at 32-row chunks
  (2,208 rows of 30B-A3B's gate+up) with one product left in flight a tile
  (`fp4_mgpu.WGMMA_IN_FLIGHT` "one", the default), and does with "all" (the loop before).
  Needs the CUDA plugin line and nvdisasm (`kernel_sass.py`); skipped without them."""
  pytest.importorskip("jax_cuda13_plugin")
  if shutil.which("nvdisasm", path=kernel_sass.cuda_tools_path()) is None:
    pytest.skip("no nvdisasm")
  env = dict(os.environ, TRACE_JAX_GROUPED_STREAM_K="off")
  script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "kernel_sass.py")
  warned = {}
  for mode in ("one", "all"):
    out = subprocess.run(
        [sys.executable, script, "grouped", "--experts", "128", "--n", "1536", "--k", "2048",
         "--rows", "2208"], env=dict(env, TRACE_JAX_WGMMA_IN_FLIGHT=mode), capture_output=True,
        text=True, timeout=600, check=True).stdout
    assert "main loop" in out, out[-2000:]
    warned[mode] = "C7512" in out
  assert warned == {"one": False, "all": True}
