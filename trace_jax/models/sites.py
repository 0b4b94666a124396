"""Quantization sites: where the forward quantizes weights, activations and K/V, and how.

`QuantContext` (static) says which forward this is:
* "bf16": nothing is quantized;
* "qat": the trainer's forward — weights and activation/KV sites fake-quantized per policy with
  straight-through gradients; where a `Guidance` for a site is given, TRACE guided rounding
  replaces round-to-nearest;
* "rollout": the quantized inference forward — weights arrive as real `QArray`s (see
  `quantize_params`), activations and K/V are quantized for real, and at the policy's guided
  layers what TRACE needs is recorded.

All activation and K/V quantization is row-local (NVFP4 second-level scale per row), so a
token's codes depend only on its own values: a parallel training forward reproduces what
token-by-token decode computed.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import quant as tq
from trace_jax.kernels import PackedWeight

Mode = Literal["bf16", "qat", "rollout"]


@dataclasses.dataclass(frozen=True)
class QuantContext:
  policy: tq.QuantPolicy = tq.QuantPolicy()
  mode: Mode = "bf16"
  # Rollout: record Guidance (compact per policy) at guided layers' quantized sites.
  record_guidance: bool = False
  # Record this forward's own codes (a QArray) at every quantized site, e.g. for code agreement.
  record_codes: bool = False

  def __post_init__(self):
    if self.mode not in ("bf16", "qat", "rollout"):
      raise ValueError(f"unknown forward mode {self.mode!r}; use 'bf16', 'qat' or 'rollout'")

  def weight_format(self, path: str) -> tq.Format | None:
    return None if self.mode == "bf16" else self.policy.weight_format(path)

  def activation_format(self, site: str) -> tq.Format | None:
    if self.mode == "bf16":
      return None
    if site.startswith("kv/"):
      return self.policy.kv
    return self.policy.activation_format(site)


def weight_quant_layout(ndim: int) -> tuple[int, tq.qarray.SecondLevel]:
  """(block axis, second-level scope) of a weight: dense `[K, N]` blocks along K with one fp32
  scale per tensor; stacked experts `[E, K, N]` along K with one per expert (each expert is its
  own tensor, as in per-expert checkpoints)."""
  if ndim == 2:
    return 0, "tensor"
  if ndim == 3:
    return 1, (0,)
  raise ValueError(f"no quantization layout for a {ndim}-d weight")


def apply_weight(w, path: str, ctx: QuantContext, dtype):
  """The weight as the matmul sees it: a `QArray` or kernel-layout `PackedWeight` passes
  through (rollout), QAT fake-quantizes per policy, otherwise a cast to the compute dtype."""
  if isinstance(w, (tq.QArray, PackedWeight)):
    return w
  fmt = ctx.weight_format(path)
  if fmt is not None and ctx.mode == "qat":
    axis, scope = weight_quant_layout(w.ndim)
    w = tq.fake_quant(w, fmt, axis=axis, second_level=scope, validate=False)
  return w.astype(dtype)


def codes_key(site: str) -> str:
  """Records key under which a forward keeps its own codes at `site` (next to guidance)."""
  return f"codes:{site}"


def activation_site(x: jax.Array, site: str, guided_layer: bool, ctx: QuantContext,
                    guidance: dict | None, records: dict):
  """Quantize the activation entering `site` (blocks along the last axis, row-local).

  Records: `records[site]` = Guidance (rollout, guided layers); `records[codes_key(site)]` =
  this forward's codes as a QArray (when `ctx.record_codes`), for code-agreement metrics."""
  fmt = ctx.activation_format(site)
  if fmt is None:
    return x
  g = None if guidance is None else guidance.get(site)
  if g is not None:
    if g.fmt != fmt:
      raise ValueError(f"guidance for site {site!r} was recorded as {g.fmt.name}, but the "
                       f"policy quantizes it as {fmt.name}")
    if ctx.record_codes:
      records[codes_key(site)] = tq.guided_quantize(jax.lax.stop_gradient(x), g)
    return tq.guided_fake_quant(x, g)
  if ctx.mode == "rollout":
    # the value comes from the unpacked codes: sites that record nothing never pack nibbles;
    # on the GPU the row quantization kernel where it applies (`kernels.quantize_rows`)
    fused = kernels.quantize_rows(x, fmt)
    q, value = fused if fused is not None else tq.quantize_with_value(
        x, fmt, second_level="row", validate=False)
    record_quantized(q, site, guided_layer, ctx, records)
    return value
  if ctx.record_codes:
    records[codes_key(site)] = tq.quantize(jax.lax.stop_gradient(x), fmt, second_level="row",
                                           validate=False)
  return tq.fake_quant(x, fmt, second_level="row", validate=False)


def records_guidance(fmt, guided_layer: bool, ctx: QuantContext) -> bool:
  """Whether a rollout site quantized in `fmt` records guidance: guided layers, FP4 formats,
  `ctx.record_guidance`."""
  return bool(ctx.record_guidance and guided_layer and fmt is not None and fmt.is_fp4)


def wants_guidance_bits(fmt, guided_layer: bool, ctx: QuantContext) -> bool:
  """Whether a kernel that quantizes a rollout site should write its compact guidance bits
  (the payload `record_quantized` takes): the site records guidance (`records_guidance`) and
  the policy keeps it compact."""
  return records_guidance(fmt, guided_layer, ctx) and ctx.policy.guidance_compact


def record_quantized(q: tq.QArray, site: str, guided_layer: bool, ctx: QuantContext,
                     records: dict, payload=None) -> None:
  """A rollout site's records from its quantized activation q: its guidance
  (`records_guidance`; payload: its compact bits where the kernel that made q wrote them) and
  its codes (`ctx.record_codes`)."""
  if records_guidance(q.fmt, guided_layer, ctx):
    records[site] = tq.make_guidance(q, compact=ctx.policy.guidance_compact, payload=payload)
  if ctx.record_codes:
    records[codes_key(site)] = q


def param_name(path) -> str:
  """A parameter's name from its tree path ("layers_3/attn/q_proj/kernel"): what the policy's
  weight rules match."""
  return "/".join(str(getattr(k, "key", k)) for k in path)


def quantize_weight(w, fmt: tq.Format | None):
  """A master weight in the format the policy gives its name (`weight_format`; None, or a
  weight already a `QArray`: kept as given): the one quantization rule of weight sync, however
  the sync walks the weights."""
  if fmt is None or isinstance(w, tq.QArray):
    return w
  axis, scope = weight_quant_layout(w.ndim)
  return tq.quantize(w, fmt, axis=axis, second_level=scope, validate=False)


def quantize_params(params, policy: tq.QuantPolicy):
  """Rollout weights: every weight the policy names becomes a `QArray`, quantized once (at weight
  sync) from the very master values the trainer holds; every other leaf is kept as given."""
  return jax.tree_util.tree_map_with_path(
      lambda path, w: quantize_weight(w, policy.weight_format(param_name(path))), params,
      is_leaf=lambda x: isinstance(x, tq.QArray))


def check_params_finite(params) -> None:
  """Eager validation of weights: name the first tensor holding NaN/Inf."""
  for path, w in jax.tree_util.tree_leaves_with_path(params):
    if hasattr(w, "dtype") and jnp.issubdtype(w.dtype, jnp.floating):
      if not bool(jnp.all(jnp.isfinite(w))):
        name = param_name(path)
        raise ValueError(f"weight {name!r} (shape {tuple(w.shape)}) holds NaN or Inf")


def concat_records(steps: list[dict], axis: int = 1) -> dict:
  """Join per-step records `{layer: {site: Guidance | QArray}}` along time (decode steps)."""
  out = {}
  for layer in steps[0]:
    out[layer] = {site: tq.concatenate([s[layer][site] for s in steps], axis)
                  for site in steps[0][layer]}
  return out
