"""benchmarks/kernel_bars.py: issues 7 and 8's kernel figures judged against their bars from a
run's rows (peers from the same run, floors from the bytes)."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def _dense(b, var, us_call, us_kernel, tb=3.0):
  return dict(name=f"ffn_8192x28672_B{b}_{var}", kind="dense", K=8192, N=28672, B=b,
              variant=var, us_call=us_call, us_kernel=us_kernel, TBps_kernel=tb,
              floor_us=31.0, relerr_f32=2e-6, relerr_bf16=1.7e-3)


def _grouped(m, var, us_call, us_kernel=None, tb=3.0, **kw):
  return dict(name=f"moe_gateup_E128_K2048_N1536_M{m}_{var}", kind="grouped", K=2048, N=1536,
              M=m, variant=var, us_call=us_call, us_kernel=us_kernel or us_call, TBps_kernel=tb,
              floor_us=48.3, **kw)


def _by(figures, what, shape):
  got = [f for f in figures if f["figure"] == what and f["shape"] == shape]
  assert len(got) == 1, (what, shape, figures)
  return got[0]


def test_product_figures_take_their_peers_from_the_same_run():
  import kernel_bars  # noqa: PLC0415
  rows = [_dense(1, "xla_bf16", 106.0, 105.0), _dense(1, "nvfp4", 40.0, 36.9, tb=3.58),
          _dense(64, "xla_bf16", 110.0, 109.0), _dense(64, "nvfp4", 56.0, 55.0, tb=2.4),
          _grouped(256, "tokamax_bf16", 190.0), _grouped(256, "nvfp4_auto", 62.0, 54.0,
                                                         tb=3.64, relerr_bf16=5e-3),
          _grouped(512, "nvfp4_auto", 70.0, tb=2.5),  # tokamax's row errored: no peer
          dict(_grouped(512, "tokamax_bf16", 200.0), error="Traceback"),
          _grouped(2208, "tokamax_bf16", 300.0), _grouped(2208, "nvfp4_auto", 92.0, tb=3.3),
          _grouped(32768, "xla_bf16", 35500.0), _grouped(32768, "tokamax_bf16", 917.0),
          _grouped(32768, "nvfp4_auto", 594.0, 441.0)]
  figs = kernel_bars.product_bars({"read_ceiling_TBps": 4.27, "rows": rows})
  x = _by(figs, "FP4 dense vs XLA bf16, by call", "8192x28672 B1")
  assert abs(x["measured"] - 106.0 / 40.0) < 1e-3 and x["met"] is False
  assert x["peer_us_call"] == 106.0
  assert _by(figs, "FP4 GEMV kernel", "8192x28672 B1")["met"] is True  # 36.9 <= 37
  gemv = _by(figs, "FP4 GEMV kernel", "8192x28672 B1")
  assert abs(gemv["kernel_over_floor"] - 36.9 / 31.0) < 1e-3
  assert _by(figs, "FP4 dense, TB/s (kernel)", "8192x28672 B1")["met"] is True
  # B 64 is past the decode shapes (B <= 16): shown, not judged
  assert _by(figs, "FP4 dense, TB/s (kernel)", "8192x28672 B64")["met"] is None
  share = _by(figs, "grouped FP4, share of read ceiling (kernel)", "K2048 N1536 M256")
  assert abs(share["measured"] - 3.64 / 4.27) < 1e-3 and share["met"] is True
  t = _by(figs, "grouped FP4 vs tokamax bf16, by call", "K2048 N1536 M256")
  assert abs(t["measured"] - 190.0 / 62.0) < 1e-3 and t["met"] is True
  bf16_err = _by(figs, "grouped FP4 output vs reference, relerr_bf16", "K2048 N1536 M256")
  assert bf16_err["met"] is False  # 5e-3 > 4e-3
  assert _by(figs, "grouped FP4 vs tokamax bf16, by call", "K2048 N1536 M512")["met"] \
      == "no peer"
  assert _by(figs, "grouped FP4, share of read ceiling (kernel)", "K2048 N1536 M512")["met"] \
      is False  # 2.5 / 4.27 < 0.6
  # 2,208 rows: neither a decode size nor the prefill's, shown and not judged
  assert _by(figs, "grouped FP4 vs tokamax bf16, by call", "K2048 N1536 M2208")["met"] is None
  pre = _by(figs, "grouped FP4 vs tokamax bf16, by call", "K2048 N1536 M32768")
  assert abs(pre["measured"] - 917.0 / 594.0) < 1e-3 and pre["met"] is True  # >= 0.8x
  xla = _by(figs, "grouped FP4 vs XLA ragged_dot, by call", "K2048 N1536 M32768")
  assert abs(xla["measured"] - 35500.0 / 594.0) < 1e-2 and xla["met"] is True


def test_attention_figures_and_the_script_end_to_end(tmp_path, capsys):
  import kernel_bars  # noqa: PLC0415
  kv = 100_000_000
  rows = [dict(name="B16_S8192_bf16", kv="bf16", batch=16, context=8192, kv_bytes=4 * kv,
               us_call=100.0, us_kernel=95.0, relerr_max=0.0),
          dict(name="B16_S8192_nvfp4_mosaic_kvwords", kv="nvfp4_mosaic_kvwords", batch=16,
               context=8192, kv_bytes=kv, us_call=40.0, us_kernel=36.0, relerr_max=0.005),
          dict(name="B16_S1024_nvfp4_mosaic_kvwords", kv="nvfp4_mosaic_kvwords", batch=16,
               context=1024, kv_bytes=kv // 8, us_call=9.0, us_kernel=8.0, relerr_max=0.02)]
  aj = {"read_ceiling_TBps": 4.27, "rows": rows}
  figs = kernel_bars.attention_bars(aj)
  assert {f["shape"] for f in figs} == {"B16 S8192"}  # 1k context: outside the bar's 8k-32k
  share = _by(figs, "FP4-KV attention, share of read ceiling (call)", "B16 S8192")
  floor_us = kv / 4.27e12 * 1e6
  assert abs(share["measured"] - floor_us / 40.0) < 1e-3 and share["met"] is False
  x = _by(figs, "FP4-KV attention vs bf16 KV, by call", "B16 S8192")
  assert x["measured"] == 2.5 and x["met"] is False
  kpath, apath, out = tmp_path / "k.json", tmp_path / "a.json", tmp_path / "bars.json"
  kpath.write_text(json.dumps({"read_ceiling_TBps": 4.27, "device": "test", "rows": [
      _dense(1, "xla_bf16", 120.0, 119.0), _dense(1, "nvfp4", 39.0, 36.5, tb=3.6)]}))
  apath.write_text(json.dumps(aj))
  assert kernel_bars.main(["--kernels", str(kpath), "--attention", str(apath),
                           "--out", str(out)]) == 0
  printed = capsys.readouterr().out
  assert "| FP4 dense vs XLA bf16, by call | 8192x28672 B1 | 3.077 | >= 3x | yes |" in printed
  saved = json.loads(out.read_text())
  assert saved["device"] == "test" and len(saved["figures"]) == len(
      kernel_bars.product_bars(json.loads(kpath.read_text()))) + len(figs)
  # the GEMV's 5 figures met (TB/s, ratio, kernel us, both outputs); the attention's error met,
  # its share and ratio not
  assert printed.strip().endswith("6 of 8 judged figures meet their bar")


def test_latest_takes_each_figure_from_the_newest_run_that_measured_it(tmp_path, capsys):
  import kernel_bars  # noqa: PLC0415
  new = [_dense(1, "nvfp4", 39.0, 36.9, tb=3.6)]  # newer run: no XLA row, so no peer
  old = [_dense(1, "xla_bf16", 106.0, 105.0), _dense(1, "nvfp4", 40.0, 37.5, tb=3.5),
         _grouped(256, "tokamax_bf16", 190.0), _grouped(256, "nvfp4_auto", 62.0, 54.0)]
  paths = []
  for name, rows in (("new", new), ("old", old)):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"read_ceiling_TBps": 4.27, "rows": rows}))
    paths += ["--kernels", str(path)]
  out = tmp_path / "bars.json"
  assert kernel_bars.main([*paths, "--out", str(out)]) == 0
  figs = json.loads(out.read_text())["figures"]
  gemv = _by(figs, "FP4 GEMV kernel", "8192x28672 B1")
  assert gemv["measured"] == 36.9 and gemv["source"].endswith("new.json")  # newest first
  ratio = _by(figs, "FP4 dense vs XLA bf16, by call", "8192x28672 B1")
  # the newer run had no peer: the older run's ratio, its own call against its own peer
  assert ratio["source"].endswith("old.json") and abs(ratio["measured"] - 106 / 40) < 1e-3
  assert _by(figs, "grouped FP4 vs tokamax bf16, by call", "K2048 N1536 M256")["source"] \
      .endswith("old.json")
  assert len(figs) == len({(f["figure"], f["shape"]) for f in figs})
  assert "| run |" in capsys.readouterr().out.splitlines()[0]
