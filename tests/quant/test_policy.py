"""QuantPolicy presets: which weights, sites and layers are quantized and guided."""

import pytest

from trace_jax import quant as tq

PATHS = {
    "layers_0/attn/q_proj/kernel": "attn",
    "layers_0/attn/o_proj/kernel": "attn",
    "layers_0/moe/router/kernel": "router",
    "layers_0/moe/experts/gate_proj": "experts",
    "layers_0/moe/experts/down_proj": "experts",
    "layers_0/moe/shared/up_proj/kernel": "shared",
    "layers_1/mlp/down_proj/kernel": "mlp",
    "embed/embedding": "embed",
    "lm_head/kernel": "lm_head",
    "final_norm/scale": "norm",
    "layers_0/input_norm/scale": "norm",
}
LINEAR = {"attn", "experts", "shared", "mlp"}


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_presets(fmt):
  paper = tq.make_policy("paper", fmt)
  for path, kind in PATHS.items():
    assert (paper.weight_format(path) is not None) == (kind == "experts"), path
    w = tq.make_policy("w4a16", fmt).weight_format(path)
    assert (w is not None) == (kind in LINEAR), path
    assert w is None or w.name == fmt
  assert paper.activation_format("experts/in").name == fmt
  assert paper.activation_format("experts/down_in").name == fmt
  assert paper.activation_format("attn/in") is None
  assert paper.kv.name == fmt
  assert tq.make_policy("w4a16", fmt).activation_format("experts/in") is None
  assert tq.make_policy("w4a16", fmt).kv is None
  assert tq.make_policy("w4a4", fmt).activation_format("attn/o_in").name == fmt
  assert tq.make_policy("all_linear", fmt).kv.name == fmt
  assert tq.make_policy("kv8").kv.name == "mxfp8"
  bf16 = tq.make_policy("bf16")
  assert not bf16.quantizes_anything and paper.quantizes_anything
  assert all(bf16.weight_format(p) is None for p in PATHS)


def test_guided_layers_default_deeper_half():
  p = tq.make_policy("paper")
  assert [l for l in range(40) if p.is_guided_layer(l, 40)] == list(range(20, 40))
  assert [l for l in range(3) if p.is_guided_layer(l, 3)] == [1, 2]
  p5 = p.replace(guided_layers=(3, 4))
  assert [l for l in range(6) if p5.is_guided_layer(l, 6)] == [3, 4]
  assert not any(p.replace(guided_layers=0.0).is_guided_layer(l, 8) for l in range(8))


def test_policy_errors_and_hashable():
  with pytest.raises(ValueError, match="unknown policy preset"):
    tq.make_policy("w2a2")
  with pytest.raises(ValueError, match="unknown quantization format"):
    tq.make_policy("paper", "int4")
  with pytest.raises(ValueError, match="bad regex"):
    tq.QuantPolicy(weight_rules=(("([", "nvfp4"),))
  with pytest.raises(ValueError, match="guided_layers"):
    tq.QuantPolicy(guided_layers=1.5)
  assert hash(tq.make_policy("paper")) == hash(tq.make_policy("paper"))
  custom = tq.QuantPolicy("mine", weight_rules=((r"lm_head", "mxfp4"), (r".*", None)))
  assert custom.weight_format("lm_head/kernel").name == "mxfp4"
  assert custom.weight_format("layers_0/moe/experts/gate_proj") is None
