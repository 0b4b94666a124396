"""Tiny random HF `transformers` models of each layout, saved to disk (the independent
reference for the model tests)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, num_experts_per_tok=2, initializer_range=0.15,
              rms_norm_eps=1e-6, max_position_embeddings=256)

LAYOUTS = {
    # Qwen3-MoE: per-head QK-norm; one dense layer, attention bias, normalized top-k.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=8, moe_intermediate_size=32, intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=True, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    # Qwen3-MoE with tied embeddings and unnormalized top-k.
    "qwen3_moe_tied": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=4, moe_intermediate_size=32, norm_topk_prob=False,
        tie_word_embeddings=True),
    # Mixtral: no QK-norm.
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_local_experts=4, intermediate_size=32),
    # OLMoE: QK-norm over the whole projection, clip_qkv.
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, num_experts=8, intermediate_size=32, clip_qkv=3.0, pad_token_id=0,
        eos_token_id=1, bos_token_id=None),
}


def make_hf_model(layout: str, seed: int = 0):
  torch.manual_seed(seed)
  cfg = LAYOUTS[layout]()
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
  with torch.no_grad():  # norms away from 1 so their mapping is actually checked
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.3 * torch.randn_like(p))
  return model.eval()


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()
