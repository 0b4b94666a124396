"""HF checkpoint import/export: logits equal `transformers`, clear errors for bad checkpoints."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from tests.models import hf_fixtures as fx
from trace_jax import models as M
from trace_jax.models import hf

TOKENS = np.random.default_rng(0).integers(0, 96, size=(2, 11))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Each layout saved by transformers (sharded, with an index file) + its HF logits."""
  out = {}
  for layout in fx.LAYOUTS:
    model = fx.make_hf_model(layout)
    path = str(tmp_path_factory.mktemp(layout))
    model.save_pretrained(path, max_shard_size="100KB")
    out[layout] = (path, fx.hf_logits(model, TOKENS))
  return out


@pytest.mark.parametrize("layout", list(fx.LAYOUTS))
def test_logits_equal_transformers(saved, layout):
  path, want = saved[layout]
  assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))  # sharded
  cfg, params = M.load_hf_checkpoint(path)
  got = np.asarray(M.forward(params, jnp.asarray(TOKENS), cfg))
  assert np.abs(want).max() > 0.5  # logits are not trivially small
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  print(f"{layout}: max |logit diff| = {np.abs(got - want).max():.2e}")


@pytest.mark.parametrize("layout", ["qwen3_moe", "mixtral", "olmoe"])
def test_save_loads_back_in_transformers(saved, layout, tmp_path):
  path, want = saved[layout]
  cfg, params = M.load_hf_checkpoint(path)
  out = str(tmp_path / "export")
  hf.save_hf_checkpoint(out, params, cfg, max_shard_bytes=64 << 10)
  model = fx.transformers.AutoModelForCausalLM.from_pretrained(out, dtype=fx.torch.float32)
  np.testing.assert_allclose(fx.hf_logits(model, TOKENS), want, atol=1e-5, rtol=0)
  cfg2, params2 = M.load_hf_checkpoint(out)
  assert cfg2 == cfg


def test_bf16_load(saved):
  path, want = saved["qwen3_moe"]
  cfg, params = M.load_hf_checkpoint(path, dtype=jnp.bfloat16)
  assert params["layers_0"]["moe"]["experts"]["gate_up_proj"].dtype == jnp.bfloat16
  got = np.asarray(M.forward(params, jnp.asarray(TOKENS), cfg))
  # bf16 activations: rounding-level agreement on average (a rare routing flip moves a few).
  assert np.mean(np.abs(got - want)) < 0.03 * np.mean(np.abs(want))


def _copy_checkpoint(src, dst, mutate):
  """Rewrite a checkpoint as one file after `mutate(tensors)`."""
  where = hf._open_checkpoint(src)
  tensors = {n: np.array(st.get(n)) for n, st in where.items()}
  mutate(tensors)
  os.makedirs(dst)
  hf.write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
  with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
    g.write(f.read())
  return dst


def test_on_host_load_is_numpy_and_syncs_like_the_device_load(saved):
  """on_host: every leaf a numpy array (nothing on the device) equal to the device load's; the
  engine's sync of it gives the device load's FP4 rollout weights bit for bit."""
  import jax

  from trace_jax import quant as tq
  from trace_jax.rollout import RolloutEngine
  path, _ = saved["qwen3_moe"]
  cfg, dev = M.load_hf_checkpoint(path, dtype=jnp.bfloat16)
  cfg2, host = M.load_hf_checkpoint(path, dtype=jnp.bfloat16, on_host=True)
  assert cfg2 == cfg
  assert jax.tree_util.tree_structure(host) == jax.tree_util.tree_structure(dev)
  for h, d in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(dev)):
    assert isinstance(h, np.ndarray) and not isinstance(h, jax.Array)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(d))
  made = []
  for master in (dev, host):
    eng = RolloutEngine(cfg, tq.make_policy("paper", "nvfp4"), max_new_tokens=2)
    eng.sync(master)
    made.append(jax.tree_util.tree_leaves(eng.params))
  for a, b in zip(*made):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"),
     r"missing tensors: model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"),
    (lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}),
     r"unexpected tensors: model\.layers\.0\.extra\.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.zeros((8, 64), np.float32)}),
     r"wrong shapes: model\.layers\.1\.self_attn\.k_proj\.weight is \(8, 64\), config implies "
     r"\(32, 64\)"),
    (lambda t: t["model.layers.0.mlp.gate.weight"].__setitem__((0, 0), np.nan),
     r"'model\.layers\.0\.mlp\.gate\.weight' holds NaN"),
])
def test_bad_checkpoints_name_the_tensor(saved, tmp_path, mutate, match):
  path = _copy_checkpoint(saved["qwen3_moe"][0], str(tmp_path / "bad"), mutate)
  with pytest.raises(hf.CheckpointError, match=match):
    M.load_hf_checkpoint(path)


def test_bad_config_and_directory(tmp_path):
  with pytest.raises(hf.CheckpointError, match="no config.json"):
    M.load_hf_checkpoint(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
    M.load_hf_checkpoint(str(tmp_path))
