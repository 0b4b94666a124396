"""The RL loop killed mid-run resumes from its last checkpoint with identical metrics (its own file
so that pytest-xdist's --dist loadfile runs it beside, not after, the other long loop test)."""

from tests.rl.loop_configs import _comparable, _small_config
from trace_jax.metrics import read_metrics
from trace_jax.rl import loop


def test_killed_run_resumes_with_identical_metrics(tmp_path):
  cfg = _small_config()
  loop.run(cfg, str(tmp_path / "a"), log=lambda *_: None)
  # Killed after 3 steps: the last checkpoint is step 2, so step 3 is redone on restart.
  loop.run(cfg, str(tmp_path / "b"), log=lambda *_: None, stop_after=3)
  assert len(read_metrics(str(tmp_path / "b"))) == 4  # steps 0..3 written before the "kill"
  loop.run(cfg, str(tmp_path / "b"), log=lambda *_: None)
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert [r["step"] for r in b] == list(range(7))
  assert _comparable(a) == _comparable(b)
  assert "eval/pass_rate" in a[3] and "mismatch/k3_kl" in a[1]
