"""Pure-functional Flax MoE transformer (Qwen3-MoE family) with FP4 quantization per policy.

`forward(params, tokens, config, ...) -> logits` and `apply(...) -> ModelOutput` run a whole
sequence or a cached decode step; `load_hf_checkpoint` / `save_hf_checkpoint` exchange weights
with Hugging Face `transformers` (Qwen3-MoE, Mixtral, OLMoE layouts).
"""

from trace_jax.models.config import ModelConfig, from_hf_config, preset, qwen3_30b_a3b, tiny, to_hf_config
from trace_jax.models.kv_cache import KVCache, LayerKV, cache_bytes_per_token, init_cache
from trace_jax.models.sites import (QuantContext, check_params_finite, codes_key, concat_records,
                                    param_name, quantize_params, quantize_weight)
from trace_jax.models.transformer import (ModelOutput, Transformer, apply, default_positions,
                                          forward, init_params, random_params)

__all__ = [
    "KVCache", "LayerKV", "ModelConfig", "ModelOutput", "QuantContext", "Transformer", "apply",
    "cache_bytes_per_token", "check_params_finite", "codes_key", "concat_records",
    "default_positions",
    "forward",
    "from_hf_config", "init_cache", "init_params", "load_hf_checkpoint", "param_name", "preset",
    "quantize_params", "quantize_weight", "qwen3_30b_a3b", "random_params", "save_hf_checkpoint",
    "tiny", "to_hf_config",
]


def __getattr__(name):
  # hf.py imports safetensors lazily-on-use; keep `import trace_jax.models` light.
  if name in ("load_hf_checkpoint", "save_hf_checkpoint"):
    from trace_jax.models import hf
    return getattr(hf, name)
  raise AttributeError(name)
