"""The rollout glue kernels inside the model (`kernels.append_kv`: the decode step's K/V cache
write; `kernels.quantize_rows`: activation-site quantization; `kernels.add_rms_norm`: the
decode step's residual add and the MoE's input norm), run in Pallas interpret mode in
place of the dispatch's choice: a one-layer model with the FP4 "paper" policy (expert sites
W4A4, NVFP4 KV) gives the same logits, cache and guidance records, bit for bit, as the XLA
paths, over a prompt and decode steps."""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from trace_jax import kernels
from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.kernels import add_norm, kv_append, row_quant


def prompt_and_steps(params, cfg, ctx, batch):
  """Logits and records of a 3-token prompt and 3 decode steps over random tokens, and the
  cache after them."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, 6)),
                       jnp.int32)
  step = jax.jit(lambda p, t, c, i: M.apply(p, t, cfg, ctx, cache=c, cache_index=i))
  out = step(params, tokens[:, :3], M.init_cache(cfg, batch, 8, ctx.policy.kv_format), 0)
  outs = [(out.logits, out.records)]
  for s in range(3, tokens.shape[1]):  # then decode steps
    out = step(params, tokens[:, s:s + 1], out.cache, s)
    outs.append((out.logits, out.records))
  return outs, out.cache


def expert_kernel_model(batch: int = 40):
  """`prompt_and_steps` of a one-layer bf16 model with FP4 kernel-layout experts (hidden 256, 16
  experts of 256, top-8; FP4 "paper" policy, NVFP4 KV, guidance recorded), for GPU tests."""
  from trace_jax.rollout import engine  # noqa: PLC0415
  cfg = M.tiny(num_layers=1, vocab_size=256, hidden_size=256, num_heads=4, num_kv_heads=2,
               head_dim=64, num_experts=16, num_experts_per_tok=8, moe_ffn_size=256,
               dtype="bfloat16")
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = engine._kernel_layout(M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy))
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  return functools.partial(prompt_and_steps, params, cfg, ctx, batch)


PATCHES = {
    "append_kv": lambda kc, vc, k, v, i: kv_append.append(kc, vc, k, v, i, interpret=True),
    "quantize_rows": lambda x, fmt: row_quant.quantize_rows(x, fmt, interpret=True),
    "add_rms_norm": lambda x, h, s, eps: add_norm.add_rms_norm(x, h, s, eps, interpret=True),
}


# slow-marked (CI runs them; ~20 s each on 2 cores): the kernels' own tests (test_kv_append,
# test_row_quant) stay in the default suite
@pytest.mark.parametrize("names", [pytest.param(("append_kv",), marks=pytest.mark.slow),
                                   pytest.param(("quantize_rows",), marks=pytest.mark.slow),
                                   pytest.param(("append_kv", "quantize_rows"),
                                                marks=pytest.mark.slow),
                                   pytest.param(("add_rms_norm",), marks=pytest.mark.slow)],
                         ids=["kv_append", "row_quant", "both", "add_norm"])
def test_model_with_kernels_is_bitwise_the_xla_path(monkeypatch, names):
  cfg = M.tiny(num_layers=1)
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  run = functools.partial(prompt_and_steps, params, cfg, ctx, 2)
  want = run()
  calls = {name: 0 for name in names}

  def counted(name):
    def fn(*args):
      calls[name] += 1
      return PATCHES[name](*args)
    return fn

  for name in names:
    monkeypatch.setattr(kernels, name, counted(name))
  got = run()
  assert all(calls.values()), calls  # each kernel took part
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.gpu
def test_expert_input_kernels_in_model_on_gpu(monkeypatch):
  """The expert input kernels on the GPU (`quantize_rows_to_operand`: the experts' input laid
  out as the gate/up kernel's operand; `swiglu_quantize_rows`: the down input from the gate/up
  kernel's rows): a one-layer model with FP4 kernel-layout experts (hidden 256, 16 experts of
  256, top-8; 40 sequences: 320 (token, slot) rows a decode step, past the grouped stream-K
  sizes) gives the same logits, cache and records, bit for bit, with them and with the XLA
  ops they replace, over a prompt and decode steps."""
  if jax.default_backend() != "gpu":
    pytest.skip("needs a GPU backend")
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  run = expert_kernel_model()
  used = {"quantize_rows_to_operand": 0, "swiglu_quantize_rows": 0}

  def counted(name):
    fn = getattr(kernels, name)

    def wrapper(*args, **kw):
      out = fn(*args, **kw)
      used[name] += out is not None
      return out
    return wrapper

  for name in used:
    monkeypatch.setattr(kernels, name, counted(name))
  got = run()
  assert all(used.values()), used  # each kernel took part (prompt and decode programs)
  monkeypatch.setattr(dispatch, "_SWIGLU_QUANT", "xla")
  monkeypatch.setattr(dispatch, "_ROW_QUANT_OPERAND", "xla")
  jax.clear_caches()
  want = run()
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_o_projection_k_parts_through_the_add_norm_kernel(monkeypatch):
  """The decode step's o projection as float32 K parts (`kernels.KParts`, as the bf16 dense
  kernel leaves them with `TRACE_JAX_BF16_DENSE_KSPLIT=on`; here its jnp model, 4 parts):
  the add + norm kernel (interpret mode) adding them gives the logits, records and cache of the
  model's own ops adding them (`KParts.value`), bit for bit; the kernel saw the parts after
  attention in every decode step; the prompt's rows take no parts (the rule's 129-256 rows)."""
  from trace_jax.kernels import bf16_mgpu  # noqa: PLC0415
  cfg = M.tiny(num_layers=2, head_dim=64, dtype="bfloat16")  # o: K 256 in 4 parts, N 64
  policy = tq.make_policy("paper", "nvfp4", guided_layers=1.0)
  params = M.quantize_params(M.init_params(cfg, jax.random.key(0)), policy)
  ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  matmul = kernels.matmul

  def with_parts(x, w, out_dtype=None, *, keep_parts=False, **kw):
    if not keep_parts or x.shape[1] != 1:  # a decode step's rows only
      return matmul(x, w, out_dtype, **kw)
    y = bf16_mgpu.dense_matmul(x.reshape(-1, x.shape[-1]), w, bm=128, wgs=1, kb=1, splits=4,
                               kernel_fn=bf16_mgpu.emulate_chunked_matmul, keep_parts=True)
    return kernels.KParts(y.parts.reshape(4, *x.shape[:-1], -1))

  monkeypatch.setattr(kernels, "matmul", with_parts)
  seen = []

  def kernel(x, h, scale, eps):
    seen.append(type(h).__name__)
    return add_norm.add_rms_norm(x, h, scale, eps, interpret=True)

  run = functools.partial(prompt_and_steps, params, cfg, ctx, 2)
  monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: None)  # the model's ops
  jax.clear_caches()
  want = run()
  monkeypatch.setattr(kernels, "add_rms_norm", kernel)
  jax.clear_caches()
  got = run()
  # the decode step traced once: each layer's post-attention norm takes the parts, the norms
  # after its MLP (the next layer's input norm, the final norm) an array
  assert [name == "KParts" for name in seen] == [True, False] * cfg.num_layers
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
