"""Checkpointer: round trips of a full training state, retention, mismatch errors, kills."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trace_jax import quant
from trace_jax.checkpoint import Checkpointer, CheckpointMismatchError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_quantize = jax.jit(lambda x: quant.quantize(x, "nvfp4"))


def make_state(seed=0, width=8):
  k = jax.random.key(seed)
  params = {
      "embed": jax.random.normal(k, (16, width), jnp.bfloat16),
      "layers": [{"w": jnp.full((width, width), float(i)), "b": jnp.zeros(width)}
                 for i in range(2)],
  }
  opt = optax.adamw(1e-3)
  opt_state = opt.init(params)
  grads = jax.tree_util.tree_map(jnp.ones_like, params)
  # jit: one compile instead of many eager op compiles (keeps the test fast)
  _, opt_state = jax.jit(opt.update)(grads, opt_state, params)  # non-trivial mu/nu/count
  return {
      "params": params,
      "opt_state": opt_state,
      "rng": jax.random.fold_in(jax.random.key(seed), 5),
      "step": 3 + seed,
      "data": {"position": 1234 + seed, "epoch_frac": 0.25},
      "host": np.arange(5, dtype=np.int16),
      "q": _quantize(jnp.linspace(-3, 3, 128).reshape(2, 64)),
  }


def assert_same(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert type(x) is type(y), (type(x), type(y))
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      assert x.dtype == y.dtype
      np.testing.assert_array_equal(jax.random.key_data(x), jax.random.key_data(y))
    elif isinstance(x, (jax.Array, np.ndarray, np.generic)):
      assert x.dtype == y.dtype and x.shape == y.shape
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      assert x == y


def test_round_trip_with_target(tmp_path):
  state = make_state()
  ckpt = Checkpointer(tmp_path / "ck")
  assert ckpt.latest_step() is None
  assert ckpt.save(3, state)
  ckpt.wait()
  out = Checkpointer(tmp_path / "ck").restore(target=make_state(seed=1))  # a fresh process
  assert_same(out, state)
  # The typed key keeps its impl and yields the same stream after restore.
  np.testing.assert_array_equal(jax.random.uniform(out["rng"], (4,)),
                                jax.random.uniform(state["rng"], (4,)))
  assert isinstance(out["opt_state"][0], optax.ScaleByAdamState)
  np.testing.assert_array_equal(quant.dequantize(out["q"]), quant.dequantize(state["q"]))


def test_plain_restore_without_target(tmp_path):
  state = make_state()
  ckpt = Checkpointer(tmp_path / "ck")
  ckpt.save(1, state)
  out = ckpt.restore()
  assert out["step"] == 3 and isinstance(out["step"], int)
  assert out["data"] == {"position": 1234, "epoch_frac": 0.25}
  assert isinstance(out["params"]["layers"], list) and len(out["params"]["layers"]) == 2
  assert out["params"]["embed"].dtype == jnp.bfloat16
  assert out["opt_state"][0]["count"] == 1  # namedtuple fields come back by name
  np.testing.assert_array_equal(jax.random.key_data(out["rng"]), jax.random.key_data(state["rng"]))
  assert set(out["q"]) == {"codes", "scales", "global_scale"}


def test_keep_prunes_and_latest(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "ck"), keep=2)
  for step in range(1, 6):
    ckpt.save(step, {"x": jnp.full((3,), step), "step": step})
  assert ckpt.latest_step() == 5
  assert ckpt.all_steps() == [4, 5]
  out = ckpt.restore()
  assert out["step"] == 5
  np.testing.assert_array_equal(out["x"], [5, 5, 5])
  assert ckpt.restore(step=4)["step"] == 4
  with pytest.raises(FileNotFoundError, match="step 1"):
    ckpt.restore(step=1)


def test_save_every_force_and_existing_step(tmp_path):
  ckpt = Checkpointer(tmp_path / "ck", keep=None, save_every=3)
  saved = [s for s in range(1, 8) if ckpt.save(s, {"s": s})]
  assert saved == [3, 6]
  assert ckpt.save(7, {"s": 7}, force=True)
  assert not ckpt.save(6, {"s": 60}, force=True)  # already on disk: kept, not overwritten
  assert ckpt.all_steps() == [3, 6, 7]
  assert ckpt.restore(step=6)["s"] == 6


def test_relative_and_home_paths_made_absolute(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert Checkpointer("rel/ck").directory == str(tmp_path / "rel" / "ck")
  monkeypatch.setenv("HOME", str(tmp_path))
  assert Checkpointer("~/home_ck").directory == str(tmp_path / "home_ck")


def test_mismatch_errors_name_the_key(tmp_path):
  ckpt = Checkpointer(tmp_path / "ck")
  ckpt.save(1, {"params": {"a": jnp.zeros(3), "b": jnp.zeros((2, 4))}, "step": 1})
  with pytest.raises(CheckpointMismatchError, match=r"\['params'\]\['c'\].*not in the checkpoint"):
    ckpt.restore(target={"params": {"a": jnp.zeros(3), "b": jnp.zeros((2, 4)),
                                    "c": jnp.zeros(1)}, "step": 0})
  with pytest.raises(CheckpointMismatchError, match=r"\['params'\]\['b'\].*not in the target"):
    ckpt.restore(target={"params": {"a": jnp.zeros(3)}, "step": 0})
  with pytest.raises(CheckpointMismatchError, match=r"\['params'\]\['b'\] has shape \(2, 4\)"):
    ckpt.restore(target={"params": {"a": jnp.zeros(3), "b": jnp.zeros((2, 8))}, "step": 0})


def test_restore_into_sharded_target(tmp_path):
  devs = np.array(jax.devices())
  mesh = jax.sharding.Mesh(devs.reshape(-1), ("x",))
  sh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  x = jax.device_put(jnp.arange(8 * len(devs), dtype=jnp.float32), sh)
  ckpt = Checkpointer(tmp_path / "ck")
  ckpt.save(1, {"x": x, "rng": jax.random.key(1)})
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
            "rng": jax.device_put(jax.random.key(0), rep)}
  out = ckpt.restore(target=target)
  assert out["x"].sharding == sh
  assert out["rng"].sharding == rep
  np.testing.assert_array_equal(out["x"], x)


def test_leftover_tmp_dir_is_ignored_and_cleaned(tmp_path):
  d = tmp_path / "ck"
  ckpt = Checkpointer(d)
  ckpt.save(5, {"x": jnp.ones(3), "step": 5})
  ckpt.close()
  junk = d / "9.orbax-checkpoint-tmp-1700000000"  # what a save killed mid-write leaves
  (junk / "arrays").mkdir(parents=True)
  (junk / "arrays" / "half_written").write_bytes(b"\0" * 10)
  ckpt = Checkpointer(d)
  assert ckpt.latest_step() == 5
  assert ckpt.restore()["step"] == 5
  assert not junk.exists()
  assert ckpt.save(9, {"x": jnp.zeros(3), "step": 9})
  assert ckpt.latest_step() == 9


def test_killed_before_commit_keeps_previous(tmp_path):
  """A process killed after writing step 2's data but before orbax's commit rename."""
  d = tmp_path / "ck"
  script = textwrap.dedent(f"""
      import os, jax.numpy as jnp
      from orbax.checkpoint._src.path import async_path
      from trace_jax.checkpoint import Checkpointer
      ck = Checkpointer({str(d)!r})
      ck.save(1, {{"x": jnp.ones(4), "step": 1}}); ck.wait()
      async def die(*a, **k):
        os._exit(17)  # SIGKILL-like: no cleanup, no finalize
      async_path.rename = die
      ck.save(2, {{"x": jnp.full(4, 2.0), "step": 2}}); ck.wait()
      os._exit(0)
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode == 17, r.stderr[-2000:]
  assert any(".orbax-checkpoint-tmp" in p for p in os.listdir(d))  # step 2 was mid-commit
  ckpt = Checkpointer(d)
  assert ckpt.latest_step() == 1
  out = ckpt.restore(target={"x": jnp.zeros(4), "step": 0})
  assert out["step"] == 1
  np.testing.assert_array_equal(out["x"], np.ones(4))


def test_scalars_only_and_bare_array_states(tmp_path):
  ckpt = Checkpointer(tmp_path / "a")
  state = {"step": 2, "lr": float("inf"), "loss": float("nan"), "name": "run", "ok": True}
  ckpt.save(2, state)
  out = ckpt.restore(target=state)
  assert out["step"] == 2 and out["lr"] == float("inf") and np.isnan(out["loss"])
  assert out["name"] == "run" and out["ok"] is True
  ckpt = Checkpointer(tmp_path / "b")
  ckpt.save(1, jnp.arange(3.0))
  np.testing.assert_array_equal(ckpt.restore(), [0.0, 1.0, 2.0])
  np.testing.assert_array_equal(ckpt.restore(target=jnp.zeros(3)), [0.0, 1.0, 2.0])
