"""`QuantPolicy`: which weights, activation sites and K/V get which format, and where TRACE
guidance is recorded.

Weights are matched by regex on their pytree path ("/"-joined keys, e.g.
`layers_3/moe/experts/gate_proj`); activation sites by regex on the site name the model uses
(`attn/in`, `attn/o_in`, `experts/in`, `experts/down_in`, `shared/in`, `shared/down_in`,
`mlp/in`, `mlp/down_in`). The first matching rule wins; a rule whose format is None keeps the
tensor in high precision (bf16). K/V have their own format. Guided layers default to the deeper
half, as in the paper.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

from trace_jax.quant import formats as F

# Model layout names the rules refer to (trace_jax.models uses exactly these).
ROUTED_EXPERT_WEIGHTS = r"(^|/)moe/experts/"
ALL_LINEAR_WEIGHTS = r"(^|/)(attn/[qkvo]_proj|moe/experts|moe/shared|mlp)/"
ROUTED_EXPERT_SITES = r"^experts/"
ALL_LINEAR_SITES = r"^(attn|experts|shared|mlp)/"

Rule = tuple[str, str | None]


@dataclasses.dataclass(frozen=True)
class QuantPolicy:
  """Static, hashable description of what is quantized (safe as a jit static argument)."""

  name: str = "bf16"
  weight_rules: tuple[Rule, ...] = ()
  activation_rules: tuple[Rule, ...] = ()
  kv_format: str | None = None
  # Fraction of layers (the deepest ones) whose activation/KV sites record guidance, or an
  # explicit tuple of layer indices.
  guided_layers: float | tuple[int, ...] = 0.5
  guidance_compact: bool = True

  def __post_init__(self):
    for pattern, fmt in self.weight_rules + self.activation_rules:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"QuantPolicy {self.name!r}: bad regex {pattern!r}: {e}") from None
      if fmt is not None:
        F.get_format(fmt)
    if self.kv_format is not None:
      F.get_format(self.kv_format)
    if isinstance(self.guided_layers, float) and not 0.0 <= self.guided_layers <= 1.0:
      raise ValueError(f"guided_layers fraction must be in [0, 1], got {self.guided_layers}")

  @staticmethod
  def _match(rules: Sequence[Rule], name: str) -> F.Format | None:
    for pattern, fmt in rules:
      if re.search(pattern, name):
        return None if fmt is None else F.get_format(fmt)
    return None

  def weight_format(self, path: str) -> F.Format | None:
    """Format of the weight at `path`, or None to keep it in high precision."""
    return self._match(self.weight_rules, path)

  def activation_format(self, site: str) -> F.Format | None:
    """Format of the activation entering `site`, or None."""
    return self._match(self.activation_rules, site)

  @property
  def kv(self) -> F.Format | None:
    return None if self.kv_format is None else F.get_format(self.kv_format)

  @property
  def quantizes_anything(self) -> bool:
    return bool(any(f for _, f in self.weight_rules + self.activation_rules) or self.kv_format)

  def is_guided_layer(self, layer: int, num_layers: int) -> bool:
    """Whether `layer` (0-based) records/uses TRACE guidance."""
    if isinstance(self.guided_layers, tuple):
      return layer in self.guided_layers
    n = math.floor(self.guided_layers * num_layers + 0.5)
    return layer >= num_layers - n

  def replace(self, **kw) -> "QuantPolicy":
    return dataclasses.replace(self, **kw)


def make_policy(preset: str, fmt: str = "nvfp4", **overrides) -> QuantPolicy:
  """Build a preset policy with FP4 format `fmt` ("nvfp4" or "mxfp4").

  bf16:       nothing quantized.
  kv8:        K/V in MXFP8 only.
  kv4:        K/V in FP4 only.
  w4a16:      all linear layers' weights FP4 (router, embeddings, lm_head, norms stay bf16).
  w4a4:       all linear layers' weights and input activations FP4.
  paper:      routed experts W4A4 + KV4, everything else bf16 (the TRACE paper's default).
  all_linear: all linear layers W4A4 + KV4.
  """
  F.get_format(fmt)
  presets = {
      "bf16": dict(),
      "kv8": dict(kv_format="mxfp8"),
      "kv4": dict(kv_format=fmt),
      "w4a16": dict(weight_rules=((ALL_LINEAR_WEIGHTS, fmt),)),
      "w4a4": dict(weight_rules=((ALL_LINEAR_WEIGHTS, fmt),),
                   activation_rules=((ALL_LINEAR_SITES, fmt),)),
      "paper": dict(weight_rules=((ROUTED_EXPERT_WEIGHTS, fmt),),
                    activation_rules=((ROUTED_EXPERT_SITES, fmt),), kv_format=fmt),
      "all_linear": dict(weight_rules=((ALL_LINEAR_WEIGHTS, fmt),),
                         activation_rules=((ALL_LINEAR_SITES, fmt),), kv_format=fmt),
  }
  if preset not in presets:
    raise ValueError(f"unknown policy preset {preset!r}; known presets: {sorted(presets)}")
  name = preset if preset == "bf16" else f"{preset}_{fmt}"
  return QuantPolicy(name=name, **{**presets[preset], **overrides})


PRESETS = ("bf16", "kv8", "kv4", "w4a16", "w4a4", "paper", "all_linear")
