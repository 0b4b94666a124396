"""The MoE transformer: cached decode equals the full forward, FP4 modes, routing replay, TRACE
guidance through the whole model, router auxiliaries."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import quant as tq

CFG = M.tiny(num_layers=3, vocab_size=64)
apply = jax.jit(M.apply, static_argnums=(2, 3))


@functools.lru_cache(maxsize=None)
def _params(seed=0):
  p = M.init_params(CFG, jax.random.key(seed))
  # std 0.1 instead of 0.02: logits and routing that depend visibly on every weight.
  return jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, p)


def _batch():
  """Two left-padded prompts (5 and 8 real tokens) and 4 continuation tokens each."""
  rng = np.random.default_rng(0)
  toks = rng.integers(0, CFG.vocab_size, size=(2, 12))
  mask = np.ones((2, 12), bool)
  mask[0, :3] = False
  toks[0, :3] = 0
  return jnp.asarray(toks, jnp.int32), jnp.asarray(mask)


def _decode(params, ctx, kv_format, tokens, mask, n_prompt=8):
  """Prefill the prompt, then decode the continuation one token at a time."""
  cache = M.init_cache(CFG, tokens.shape[0], 16, kv_format)
  pos = M.default_positions(tokens, mask)
  out = apply(params, tokens[:, :n_prompt], CFG, ctx, positions=pos[:, :n_prompt],
              token_mask=mask[:, :n_prompt], cache=cache, cache_index=0)
  logits, routes, records, cache = [out.logits], [out.routes], [out.records], out.cache
  for s in range(n_prompt, tokens.shape[1]):
    out = apply(params, tokens[:, s:s + 1], CFG, ctx, positions=pos[:, s:s + 1],
                token_mask=mask[:, s:s + 1], cache=cache, cache_index=s)
    logits.append(out.logits)
    routes.append(out.routes)
    records.append(out.records)
    cache = out.cache
  return (jnp.concatenate(logits, 1), jnp.concatenate(routes, 2),
          M.concat_records(records) if records[0] else {}, cache)


def test_decode_with_cache_equals_full_forward():
  tokens, mask = _batch()
  full = apply(_params(), tokens, CFG, M.QuantContext(), token_mask=mask)
  logits, routes, _, cache = _decode(_params(), M.QuantContext(), None, tokens, mask)
  valid = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(full.logits)[valid],
                             atol=2e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(routes)[:, valid], np.asarray(full.routes)[:, valid])
  np.testing.assert_array_equal(np.asarray(cache.valid)[:, :12], valid)


def test_left_padding_does_not_change_a_sequence():
  tokens, mask = _batch()
  full = apply(_params(), tokens, CFG, M.QuantContext(), token_mask=mask)
  alone = apply(_params(), tokens[:1, 3:], CFG, M.QuantContext())
  np.testing.assert_allclose(np.asarray(full.logits)[0, 3:], np.asarray(alone.logits)[0],
                             atol=2e-5, rtol=0)


@functools.lru_cache(maxsize=None)
def _one_layer():
  """A one-layer model: the per-row cache rule is per layer, and its compiles stay cheap."""
  cfg = M.tiny(num_layers=1)
  p = M.init_params(cfg, jax.random.key(0))
  return cfg, jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, p)


@pytest.mark.parametrize("preset", [None, pytest.param("paper", marks=pytest.mark.slow)])
def test_per_row_cache_index_equal_indices_is_the_scalar_path_bitwise(preset):
  """A decode step with cache_index [s, s] is the scalar-index step, bit for bit (bf16 cache,
  and the FP4 KV cache of the packed "paper" rollout: slow, and also covered end to end by
  tests/rollout/test_slots.py, whose FP4 slot rows must match the engine's scalar-index decode)."""
  cfg, params = _one_layer()
  tokens, mask = _batch()
  if preset is None:
    ctx, kv = M.QuantContext(), None
  else:
    policy = tq.make_policy(preset, "nvfp4")
    params = jax.jit(functools.partial(M.quantize_params, policy=policy))(params)
    ctx, kv = M.QuantContext(policy, "rollout"), policy.kv_format
  pos = M.default_positions(tokens, mask)
  cache = M.init_cache(cfg, 2, 8, kv)
  for s in range(6):  # fill the cache token by token (the one compiled scalar step)
    step = dict(positions=pos[:, s:s + 1], token_mask=mask[:, s:s + 1], cache=cache)
    scalar = apply(params, tokens[:, s:s + 1], cfg, ctx, cache_index=s, **step)
    cache = scalar.cache
  rows = apply(params, tokens[:, 5:6], cfg, ctx, cache_index=jnp.asarray([5, 5]), **step)
  for a, b in zip(jax.tree_util.tree_leaves((scalar.logits, scalar.cache)),
                  jax.tree_util.tree_leaves((rows.logits, rows.cache))):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_per_row_cache_index_decodes_rows_of_different_lengths():
  """Rows at different cache positions (prompts of 5 and 8 tokens at slots 0.., right-padded in
  the prefill) decode together with one write position per row and give the full forward."""
  cfg, params = _one_layer()
  rng = np.random.default_rng(1)
  lens, cont = np.asarray([5, 8]), 3
  seqs = rng.integers(0, cfg.vocab_size, size=(2, 8 + cont))
  full_mask = np.arange(8 + cont)[None] < (lens + cont)[:, None]  # right-padded sequences
  full = apply(params, jnp.asarray(seqs), cfg, M.QuantContext(),
               token_mask=jnp.asarray(full_mask))
  prompt_mask = jnp.asarray(np.arange(8)[None] < lens[:, None])
  out = apply(params, jnp.asarray(seqs[:, :8]), cfg, M.QuantContext(),
              token_mask=prompt_mask, cache=M.init_cache(cfg, 2, 16, None), cache_index=0)
  cache, got = out.cache, []
  for j in range(cont):
    idx = lens + j
    tok = jnp.asarray(seqs[np.arange(2), idx])[:, None]
    out = apply(params, tok, cfg, M.QuantContext(), positions=jnp.asarray(idx)[:, None],
                cache=cache, cache_index=jnp.asarray(idx, jnp.int32))
    cache = out.cache
    got.append(np.asarray(out.logits[:, 0]))
  for j in range(cont):
    want = np.asarray(full.logits)[np.arange(2), lens + j]
    np.testing.assert_allclose(got[j], want, atol=2e-5, rtol=0)
  np.testing.assert_array_equal(np.asarray(cache.valid)[:, :8 + cont], full_mask)
  with pytest.raises(ValueError, match="one index per row"):
    M.apply(params, tok, cfg, cache=cache, cache_index=jnp.asarray([1, 2, 3]))


# w4a16's weights are a subset of paper's (and its fused q|k|v: test_fused_qkv_projection_...),
# all_linear's FP4 attention weights go through the dense path the kernel tests cover: both
# slow, so the default suite stays under its 10 minutes; CI runs them
@pytest.mark.parametrize("preset", [pytest.param("w4a16", marks=pytest.mark.slow), "paper",
                                    pytest.param("all_linear", marks=pytest.mark.slow)])
def test_fp4_modes_close_to_bf16_deterministic_and_one_code_path(preset):
  tokens, mask = _batch()
  policy = tq.make_policy(preset, "nvfp4")
  ref = apply(_params(), tokens, CFG, M.QuantContext(), token_mask=mask).logits
  qparams = M.quantize_params(_params(), policy)
  rollout_ctx = M.QuantContext(policy, "rollout")
  a = apply(qparams, tokens, CFG, rollout_ctx, token_mask=mask).logits
  b = apply(qparams, tokens, CFG, rollout_ctx, token_mask=mask).logits
  np.testing.assert_array_equal(a, b)  # deterministic
  rel = float(jnp.mean(jnp.abs(a - ref)) / jnp.mean(jnp.abs(ref)))
  # Stated tolerance: mean |FP4 - BF16| logit difference under 40% of mean |logit| on this
  # deliberately large-weight random model (FP4 noise compounds over 3 layers), and a small
  # fraction of what an unrelated model differs by.
  other = apply(_params(1), tokens, CFG, M.QuantContext(), token_mask=mask).logits
  control = float(jnp.mean(jnp.abs(other - ref)) / jnp.mean(jnp.abs(ref)))
  print(f"{preset}: rel diff {rel:.3f}, unrelated model {control:.3f}")
  assert 0 < rel < 0.4 and rel < 0.35 * control, (rel, control)
  # QAT (fake-quant of the float master weights) is the same function as the packed rollout.
  qat = apply(_params(), tokens, CFG, M.QuantContext(policy, "qat"), token_mask=mask).logits
  np.testing.assert_array_equal(qat, a)


def test_rollout_weights_are_real_qarrays():
  q = M.quantize_params(_params(), tq.make_policy("paper", "mxfp4"))
  experts = q["layers_0"]["moe"]["experts"]
  assert isinstance(experts["gate_up_proj"], tq.QArray)
  assert experts["gate_up_proj"].fmt.name == "mxfp4" and experts["gate_up_proj"].axis == 1
  assert not isinstance(q["layers_0"]["attn"]["q_proj"]["kernel"], tq.QArray)
  bf16_bytes = experts["gate_up_proj"].size * 2
  assert experts["gate_up_proj"].nbytes / bf16_bytes == pytest.approx(4.25 / 16, rel=0.01)


@pytest.mark.slow  # ~20 s on 2 cores; the engine's FP4-KV decode test checks the same per bit
def test_trace_guidance_reproduces_decode_codes_in_parallel_forward():
  tokens, mask = _batch()
  policy = tq.make_policy("paper", "nvfp4")
  qparams = M.quantize_params(_params(), policy)
  roll_ctx = M.QuantContext(policy, "rollout", record_guidance=True)
  logits, routes, records, _ = _decode(qparams, roll_ctx, "nvfp4", tokens, mask)
  assert set(records) == {1, 2}  # the deeper half of 3 layers
  assert set(records[2]) == {"kv/k", "kv/v", "experts/in", "experts/down_in"}
  assert records[2]["experts/down_in"].shape == (2, 12, CFG.num_experts_per_tok,
                                                 CFG.moe_ffn_size)
  # Trainer: parallel QAT forward guided by the rollout, replaying its routes.
  train_ctx = M.QuantContext(policy, "qat", record_codes=True)
  out = apply(_params(), tokens, CFG, train_ctx, token_mask=mask, guidance=records, routes=routes)
  np.testing.assert_array_equal(np.asarray(out.routes), np.asarray(routes))
  valid = np.asarray(mask)
  for layer, sites in records.items():
    for site, g in sites.items():
      roll_codes = np.asarray(tq.make_guidance  # noqa: B018 - compare full codes via guidance
                              and _codes_from_guidance(g))
      train = out.records[layer]["codes:" + site]
      got = np.asarray(train.unpacked_codes()) & 1
      np.testing.assert_array_equal(got[valid], roll_codes[valid], err_msg=f"{layer}/{site}")
  np.testing.assert_allclose(np.asarray(out.logits)[valid], np.asarray(logits)[valid],
                             atol=1e-4, rtol=0)


def _codes_from_guidance(g):
  """Mantissa bits of a compact guidance, in its logical shape."""
  bits = g.blocked_payload()
  return tq.qarray.from_blocks(bits, g.axis, g.shape[g.axis])


def test_routing_replay_forces_experts_and_router_still_learns():
  tokens, mask = _batch()
  ctx = M.QuantContext()
  routes = apply(_params(0), tokens, CFG, ctx, token_mask=mask).routes
  other = _params(1)
  free = apply(other, tokens, CFG, ctx, token_mask=mask).routes
  assert np.mean(np.asarray(free) != np.asarray(routes)) > 0.2
  replayed = apply(other, tokens, CFG, ctx, token_mask=mask, routes=routes).routes
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(routes))

  def loss(p):
    out = M.apply(p, tokens, CFG, ctx, token_mask=mask, routes=routes)
    return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0])

  grads = jax.jit(jax.grad(loss))(other)
  for i in range(CFG.num_layers):
    g = np.asarray(grads[f"layers_{i}"]["moe"]["router"]["kernel"])
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-6, i
  with pytest.raises(ValueError, match="replayed routes have shape"):
    M.apply(other, tokens, CFG, ctx, routes=routes[:, :, :5])


def test_router_auxiliaries_for_a_uniform_router():
  p = jax.tree_util.tree_map(lambda a: a, _params())
  for i in range(CFG.num_layers):
    p[f"layers_{i}"]["moe"]["router"]["kernel"] = jnp.zeros_like(
        p[f"layers_{i}"]["moe"]["router"]["kernel"])
  tokens, mask = _batch()
  out = apply(p, tokens, CFG, M.QuantContext(), token_mask=mask)
  # Uniform probabilities: load-balancing loss E * sum_e f_e / E = 1; z-loss log(E)^2.
  np.testing.assert_allclose(float(out.aux_loss), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(out.z_loss), np.log(CFG.num_experts) ** 2, rtol=1e-6)


def test_nan_weights_are_named():
  p = jax.tree_util.tree_map(lambda a: a, _params())
  p["layers_1"]["attn"]["v_proj"]["kernel"] = p["layers_1"]["attn"]["v_proj"]["kernel"].at[0, 0].set(
      jnp.nan)
  with pytest.raises(ValueError, match=r"'layers_1/attn/v_proj/kernel'.*NaN"):
    M.check_params_finite(p)


def test_shared_experts_wiring():
  cfg = CFG.replace(shared_ffn_size=16, shared_expert_gate=True)
  p = M.init_params(cfg, jax.random.key(3))
  assert p["layers_0"]["moe"]["shared"]["gate_proj"]["kernel"].shape == (64, 16)
  tokens, mask = _batch()
  with_shared = apply(p, tokens, cfg, M.QuantContext(), token_mask=mask).logits
  # Zeroing the shared expert's output projection must give exactly the model without it.
  p0 = jax.tree_util.tree_map(lambda a: a, p)
  for i in range(cfg.num_layers):
    p0[f"layers_{i}"]["moe"]["shared"]["down_proj"]["kernel"] *= 0
  without = {k: v for k, v in p0.items()}
  for i in range(cfg.num_layers):
    without[f"layers_{i}"] = dict(p0[f"layers_{i}"])
    without[f"layers_{i}"]["moe"] = {k: v for k, v in p0[f"layers_{i}"]["moe"].items()
                                     if k not in ("shared", "shared_gate")}
  a = apply(p0, tokens, cfg, M.QuantContext(), token_mask=mask).logits
  b = apply(without, tokens, CFG.replace(), M.QuantContext(), token_mask=mask).logits
  np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
  assert float(jnp.max(jnp.abs(with_shared - a))) > 1e-3


@pytest.mark.slow  # the benchmarks' init, a jit per leaf shape (~17 s on 2 cores)
def test_random_params_match_init_params_shapes_and_distributions():
  """The benchmarks' leaf-by-leaf init: init_params' tree, shapes and dtype; norm scales 1;
  weights normal with std 0.02 (checked on the large leaves); the forward runs on them."""
  cfg = M.tiny(num_layers=2, vocab_size=64, attention_bias=True)
  ref = M.init_params(cfg, jax.random.key(0), "bfloat16")
  got = M.random_params(cfg, jax.random.key(1), "bfloat16")
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                          jax.tree_util.tree_leaves(ref), strict=True):
    assert a.shape == b.shape and a.dtype == b.dtype == jnp.bfloat16, path
    name = path[-1].key
    x = np.asarray(a, np.float32)
    if name in ("scale", "bias"):
      np.testing.assert_array_equal(x, np.asarray(b, np.float32), err_msg=str(path))
    elif x.size >= 4096:
      assert abs(x.std() / 0.02 - 1) < 0.05 and abs(x.mean()) < 0.002, (path, x.std())
  # leaves of one shape draw from their own keys
  attn = got["layers_0"]["attn"]
  assert attn["k_proj"]["kernel"].shape == attn["v_proj"]["kernel"].shape
  assert not np.array_equal(np.asarray(attn["k_proj"]["kernel"], np.float32),
                            np.asarray(attn["v_proj"]["kernel"], np.float32))
  tokens = jnp.asarray(np.arange(8).reshape(1, 8) % cfg.vocab_size, jnp.int32)
  out = M.apply(got, tokens, cfg)
  assert np.isfinite(np.asarray(out.logits, np.float32)).all()


def test_fused_qkv_projection_equals_three():
  """The rollout's q|k|v in one kernel-layout weight (`kernels.fuse_projections`: one GEMV a
  decode step, not three) gives the logits of the three projections (on CPU both run the
  reference; float32 summation order only)."""
  from trace_jax import kernels
  cfg = M.tiny(num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=4, head_dim=64)
  policy = tq.make_policy("w4a16", "nvfp4")
  params = M.init_params(cfg, jax.random.key(0))
  packed = kernels.prepare_tree(jax.jit(functools.partial(M.quantize_params, policy=policy))(
      params))
  fused = kernels.fuse_projections(packed)
  attn = fused["layers_0"]["attn"]
  assert attn["q_proj"]["kernel"].shape == (128, 768) and attn["k_proj"]["kernel"] is None
  tokens, _ = _batch()
  ctx = M.QuantContext(policy, "rollout")
  a = apply(packed, tokens, cfg, ctx).logits
  b = apply(fused, tokens, cfg, ctx).logits
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
  # bf16 q, k and v (`paper` keeps attention weights bf16; fused unless TRACE_JAX_BF16_DENSE=
  # xla): the fused weight is taken, and gives the three projections' logits
  paper = tq.make_policy("paper", "nvfp4")
  rollout = jax.jit(functools.partial(M.quantize_params, policy=paper))(params)
  rollout = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if isinstance(a, jax.Array) else a,
                         rollout, is_leaf=lambda a: isinstance(a, tq.QArray))
  fused_b = kernels.fuse_projections(rollout, bf16=True)
  assert fused_b["layers_0"]["attn"]["q_proj"]["kernel"].shape == (128, 768)
  ctx_b = M.QuantContext(paper, "rollout")
  a = apply(rollout, tokens, cfg, ctx_b).logits
  b = apply(fused_b, tokens, cfg, ctx_b).logits
  np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_combine_rows_sums_slots_in_order_and_its_derivative_is_autodiffs():
  """The MoE's weighted sum (`combine_rows`): the bf16 value is numpy's products rounded to bf16,
  summed in float32 slot after slot, the sum rounded; its hand-written derivative equals JAX's
  autodiff of the per-slot rule (`combine_experts`) in float32 (no roundings there)."""
  import ml_dtypes  # noqa: PLC0415
  from trace_jax.models import transformer as T  # noqa: PLC0415
  rng = np.random.default_rng(0)
  y = rng.standard_normal((6, 4, 32)).astype(np.float32)
  w = rng.uniform(0, 1, (6, 4)).astype(np.float32)
  yb, bf = y.astype(ml_dtypes.bfloat16), ml_dtypes.bfloat16
  got = np.asarray(T.combine_rows(jnp.asarray(yb), jnp.asarray(w), jnp.bfloat16))
  prods = (yb.astype(np.float32) * w.astype(bf).astype(np.float32)[..., None]).astype(bf)
  acc = prods[:, 0].astype(np.float32)
  for j in range(1, 4):
    acc = acc + prods[:, j].astype(np.float32)
  np.testing.assert_array_equal(got.view(np.uint16), acc.astype(bf).view(np.uint16))

  def loss(f):
    return lambda y, w: jnp.sum(jnp.sin(f(y, w)))
  want = jax.grad(loss(lambda y, w: T.combine_experts(T.expert_slots(y, w), jnp.float32)),
                  argnums=(0, 1))(y, w)
  grads = jax.grad(loss(lambda y, w: T.combine_rows(y, w, jnp.float32)), argnums=(0, 1))(y, w)
  for g, ww in zip(grads, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(ww), rtol=1e-6, atol=1e-7)


def test_moe_dispatch_passes_each_tokens_copies_to_take_copies(monkeypatch):
  """The MoE layer gives its dispatch the routing's inverse (`kernels.take_copies`): on real
  routes (an eager forward, concrete arrays) rows[inverse] lists every token k times in token
  order, once a MoE layer; and the parameters' gradient equals the plain gather's (autodiff's
  scatter-add), float32 rounding apart."""
  from trace_jax.kernels import dispatch  # noqa: PLC0415
  cfg = CFG.replace(num_experts_per_tok=3)
  params, (tokens, mask) = _params(0), _batch()
  real, seen = dispatch.take_copies, []

  def spy(x, rows, inverse):
    seen.append((x.shape[0], np.asarray(rows), np.asarray(inverse)))
    return real(x, rows, inverse)

  monkeypatch.setattr(dispatch, "take_copies", spy)
  with jax.disable_jit():  # (the model jits some of its calls)
    M.apply(params, tokens, cfg, token_mask=mask)
  assert len(seen) == cfg.num_layers
  for n, rows, inverse in seen:
    np.testing.assert_array_equal(rows[inverse].reshape(n, 3), np.arange(n)[:, None].repeat(3, 1))

  def loss(p):
    return jnp.mean(jax.nn.log_softmax(M.apply(p, tokens, cfg, token_mask=mask).logits)[..., 1])

  monkeypatch.setattr(dispatch, "take_copies", real)
  ours = jax.jit(jax.grad(loss))(params)
  monkeypatch.setattr(dispatch, "take_copies", lambda x, rows, inverse: x[rows])
  plain = jax.jit(jax.grad(loss))(params)
  flat_ours, flat_plain = jax.tree.leaves(ours), jax.tree.leaves(plain)
  assert any(np.abs(np.asarray(g)).max() > 1e-6 for g in flat_ours)
  for a, b in zip(flat_ours, flat_plain, strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
