"""`ModelConfig`: the shape and conventions of a Qwen3-MoE-family transformer, with presets and
conversion from/to Hugging Face `config.json` (Qwen3-MoE, Mixtral, OLMoE layouts)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

Layout = Literal["qwen3_moe", "mixtral", "olmoe"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Frozen and hashable: it is a static argument of every jitted forward."""

  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_ffn_size: int
  # Layers that use a dense SwiGLU MLP of `dense_ffn_size` instead of the MoE block.
  dense_layers: tuple[int, ...] = ()
  dense_ffn_size: int = 0
  # Shared experts (Qwen2-MoE style): an always-on SwiGLU of `shared_ffn_size`, optionally
  # scaled by sigmoid(x @ shared_gate).
  shared_ffn_size: int = 0
  shared_expert_gate: bool = False
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  # "head": RMSNorm over head_dim per head (Qwen3); "full": over the whole q/k projection
  # (OLMoE); "none" (Mixtral).
  qk_norm: Literal["none", "head", "full"] = "head"
  clip_qkv: float | None = None
  attention_bias: bool = False
  tie_embeddings: bool = False
  norm_topk_prob: bool = True
  max_seq_len: int = 4096
  dtype: str = "bfloat16"  # activation/compute dtype; params are kept in float32
  layout: Layout = "qwen3_moe"  # which HF layout import/export uses
  # Expert parallelism (`trace_jax.parallel.expert`), used when the mesh set by `jax.set_mesh`
  # has an `expert` axis > 1: "off" (GSPMD over the dropless dispatch), "fixed" (all_to_all with
  # a fixed capacity), "ragged" (ragged_all_to_all, GPU), "auto" (ragged on GPU, else fixed).
  expert_parallel: Literal["off", "auto", "fixed", "ragged"] = "off"
  # Fixed capacity per (source, target) shard pair, as a multiple of the even share of local
  # (token, slot) pairs; <= 0: room for all of them (never drops).
  expert_capacity_factor: float = 0.0

  def __post_init__(self):
    problems = []
    if self.num_heads % self.num_kv_heads:
      problems.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                      f"{self.num_kv_heads}")
    if not 0 < self.num_experts_per_tok <= self.num_experts:
      problems.append(f"num_experts_per_tok {self.num_experts_per_tok} must be in "
                      f"[1, num_experts={self.num_experts}]")
    if self.head_dim % 2:
      problems.append(f"head_dim {self.head_dim} must be even for RoPE")
    if self.dense_layers and self.dense_ffn_size <= 0:
      problems.append("dense_layers are set but dense_ffn_size is 0")
    if any(not 0 <= l < self.num_layers for l in self.dense_layers):
      problems.append(f"dense_layers {self.dense_layers} out of range for {self.num_layers}")
    if self.expert_parallel not in ("off", "auto", "fixed", "ragged"):
      problems.append(f"expert_parallel {self.expert_parallel!r} must be one of 'off', 'auto', "
                      "'fixed', 'ragged'")
    if problems:
      raise ValueError("invalid ModelConfig: " + "; ".join(problems))

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  def is_moe_layer(self, layer: int) -> bool:
    return layer not in self.dense_layers

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    d, hd = self.hidden_size, self.head_dim
    attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads)
    moe = self.num_experts * 3 * d * self.moe_ffn_size + d * self.num_experts
    moe += 3 * d * self.shared_ffn_size
    dense = 3 * d * self.dense_ffn_size
    n_dense = len(self.dense_layers)
    per_layers = self.num_layers * attn + (self.num_layers - n_dense) * moe + n_dense * dense
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return per_layers + emb


def tiny(**overrides) -> ModelConfig:
  """The CPU model of the tests and the default job: ~0.3M parameters."""
  base = dict(vocab_size=64, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
              head_dim=16, num_experts=8, num_experts_per_tok=2, moe_ffn_size=32,
              rope_theta=10000.0, max_seq_len=256, dtype="float32")
  return ModelConfig(**{**base, **overrides})


def qwen3_30b_a3b(num_layers: int = 48, **overrides) -> ModelConfig:
  """Qwen3-30B-A3B shape (BENCHMARKS.md reference shape)."""
  base = dict(vocab_size=151936, hidden_size=2048, num_layers=num_layers, num_heads=32,
              num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
              moe_ffn_size=768, rms_norm_eps=1e-6, rope_theta=1e6, qk_norm="head",
              norm_topk_prob=True, max_seq_len=40960, dtype="bfloat16")
  return ModelConfig(**{**base, **overrides})


PRESETS = {"tiny": tiny, "qwen3_30b_a3b": qwen3_30b_a3b,
           "qwen3_30b_a3b_12l": lambda **kw: qwen3_30b_a3b(num_layers=12, **kw)}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  return PRESETS[name](**overrides)


# --------------------------------------------------------------------------- HF config.json

def _rope_theta(hf: dict[str, Any], default: float) -> float:
  rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if rp and rp.get("rope_type", rp.get("type", "default")) not in ("default", None):
    raise ValueError(f"unsupported RoPE scaling {rp!r}: only the default RoPE is implemented")
  return float(rp.get("rope_theta", hf.get("rope_theta", default)))


def from_hf_config(hf: dict[str, Any], dtype: str = "bfloat16") -> ModelConfig:
  """Build a `ModelConfig` from a parsed HF `config.json`."""
  mt = hf.get("model_type")
  if mt not in ("qwen3_moe", "mixtral", "olmoe"):
    raise ValueError(f"unsupported model_type {mt!r}; supported: qwen3_moe, mixtral, olmoe")
  needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_experts_per_tok"]
  missing = [k for k in needed if k not in hf]
  if missing:
    raise ValueError(f"config.json for {mt} lacks {missing}")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  common = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=heads,
                num_kv_heads=hf.get("num_key_value_heads", heads), head_dim=head_dim,
                num_experts_per_tok=hf["num_experts_per_tok"],
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_seq_len=hf.get("max_position_embeddings", 4096), dtype=dtype)
  if mt == "qwen3_moe":
    step = hf.get("decoder_sparse_step", 1)
    only = set(hf.get("mlp_only_layers") or [])
    n_exp = hf.get("num_experts", hf.get("num_local_experts"))
    dense = tuple(l for l in range(hf["num_hidden_layers"])
                  if l in only or not (n_exp > 0 and (l + 1) % step == 0))
    return ModelConfig(num_experts=n_exp, moe_ffn_size=hf["moe_intermediate_size"],
                       dense_layers=dense, dense_ffn_size=hf.get("intermediate_size", 0) if dense
                       else 0, rope_theta=_rope_theta(hf, 1e6), qk_norm="head",
                       attention_bias=bool(hf.get("attention_bias", False)),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       layout="qwen3_moe", **common)
  if mt == "mixtral":
    return ModelConfig(num_experts=hf["num_local_experts"], moe_ffn_size=hf["intermediate_size"],
                       rope_theta=_rope_theta(hf, 1e6), qk_norm="none", norm_topk_prob=True,
                       layout="mixtral", **common)
  if mt == "olmoe":
    return ModelConfig(num_experts=hf["num_experts"], moe_ffn_size=hf["intermediate_size"],
                       rope_theta=_rope_theta(hf, 1e4), qk_norm="full",
                       clip_qkv=hf.get("clip_qkv"),
                       attention_bias=bool(hf.get("attention_bias", False)),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)), layout="olmoe",
                       **common)
  raise ValueError(f"unsupported model_type {mt!r}; supported: qwen3_moe, mixtral, olmoe")


def to_hf_config(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """The HF `config.json` dict for `cfg` in its layout."""
  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                num_experts_per_tok=cfg.num_experts_per_tok, rms_norm_eps=cfg.rms_norm_eps,
                tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_seq_len,
                rope_parameters=dict(rope_type="default", rope_theta=cfg.rope_theta),
                rope_theta=cfg.rope_theta, hidden_act="silu", dtype=torch_dtype)
  if cfg.shared_ffn_size:
    raise ValueError("shared experts have no HF export layout among qwen3_moe/mixtral/olmoe")
  if cfg.layout == "qwen3_moe":
    if cfg.qk_norm != "head":
      raise ValueError("the qwen3_moe layout has per-head QK-norm")
    return dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                num_experts=cfg.num_experts, moe_intermediate_size=cfg.moe_ffn_size,
                intermediate_size=cfg.dense_ffn_size or cfg.moe_ffn_size,
                mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1,
                norm_topk_prob=cfg.norm_topk_prob, attention_bias=cfg.attention_bias, **common)
  if cfg.layout == "mixtral":
    if cfg.qk_norm != "none" or cfg.dense_layers or not cfg.norm_topk_prob:
      raise ValueError("the mixtral layout has no QK-norm, no dense layers, normalized top-k")
    return dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
                num_local_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_size, **common)
  if cfg.layout == "olmoe":
    if cfg.qk_norm != "full" or cfg.dense_layers:
      raise ValueError("the olmoe layout has full-projection QK-norm and no dense layers")
    return dict(model_type="olmoe", architectures=["OlmoeForCausalLM"],
                num_experts=cfg.num_experts, intermediate_size=cfg.moe_ffn_size,
                norm_topk_prob=cfg.norm_topk_prob, clip_qkv=cfg.clip_qkv,
                attention_bias=cfg.attention_bias, **common)
  raise ValueError(f"unknown layout {cfg.layout!r}")
