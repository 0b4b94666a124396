"""Where served weights come from (a trainer checkpoint), arm configs, the chat template."""

import jax
import numpy as np
import pytest

from configs import serve_compare
from trace_jax import models as M
from trace_jax.checkpoint import Checkpointer
from trace_jax.rl import loop
from trace_jax.serving import arm_config, backend, render_chat
from trace_jax.tasks import CharTokenizer


def test_arm_config_sets_the_rollout_policy():
  config = serve_compare.get_config()
  config.candidate.policy = "w4a16"
  base, cand = loop.build(arm_config(config, "baseline")), loop.build(
      arm_config(config, "candidate"))
  assert not base.policy.quantizes_anything
  assert cand.policy.quantizes_anything and cand.policy.name.startswith("w4a16")
  assert config.rollout.precision == "fp4"  # the input config is left as it was
  with pytest.raises(loop.ConfigError, match="arm must be one of"):
    arm_config(config, "both")


def test_trainer_checkpoint_params_are_served(tmp_path):
  config = serve_compare.get_config()
  setup = loop.build(config)
  params = M.init_params(setup.model_config, jax.random.key(5))
  with Checkpointer(tmp_path / "checkpoints") as ckpt:
    ckpt.save(3, {"train": {"params": params, "step": 3}, "data": {"step": 1}}, force=True)
    ckpt.wait()
  config.serve.trainer_checkpoint = str(tmp_path)
  config.serve.load_dtype = "float32"
  got = backend.load_params(config, setup)
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)
  assert "trainer checkpoint" in backend.weights_source(config)
  config.serve.trainer_checkpoint = str(tmp_path / "nowhere")
  with pytest.raises(loop.ConfigError, match="no checkpoints/ directory"):
    backend.load_params(config, setup)


def test_hf_checkpoint_is_loaded_into_host_memory_and_served(tmp_path):
  """An HF checkpoint's weights stay in host memory (numpy leaves equal to what was saved); the
  engine's sync of them gives the rollout weights of the device-held weights bit for bit."""
  from trace_jax import quant as tq
  from trace_jax.models import hf
  from trace_jax.rollout import RolloutEngine
  config = serve_compare.get_config()
  cfg = loop.build(config).model_config
  params = M.init_params(cfg, jax.random.key(5))
  hf.save_hf_checkpoint(str(tmp_path / "hf"), params, cfg)
  config.init_checkpoint = str(tmp_path / "hf")
  config.serve.load_dtype = "float32"
  setup = loop.build(config)
  got = backend.load_params(config, setup)
  assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(got))
  jax.tree_util.tree_map(np.testing.assert_array_equal, got, params)
  made = []
  for master in (got, params):
    eng = RolloutEngine(setup.rollout_config, tq.make_policy("paper", "nvfp4"),
                        max_new_tokens=2)
    eng.sync(master)
    made.append(jax.tree_util.tree_leaves(eng.params))
  for a, b in zip(*made):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_char_chat_template_joins_contents():
  tok = CharTokenizer()
  assert render_chat(tok, [{"role": "user", "content": "1+2="}]) == "1+2="
  assert render_chat(tok, [{"role": "system", "content": "add"},
                           {"role": "user", "content": "1+2="}]) == "add 1+2="
