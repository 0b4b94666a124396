"""The rollout engine against full forwards of the same model."""

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import (CapacityError, RolloutEngine, SamplingParams, bytes_per_sequence,
                               filter_logits, guidance_bytes_per_token, plan_capacity)
from trace_jax.rollout.engine import prefill_program

CFG = M.tiny(num_layers=3)
PROMPTS = [[5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
full = jax.jit(M.apply, static_argnums=(2, 3))


@functools.lru_cache(maxsize=None)
def _params():
  p = M.init_params(CFG, jax.random.key(0))
  return jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, p)


@functools.lru_cache(maxsize=None)
def _engine(preset="bf16", max_new=6):
  eng = RolloutEngine(CFG, tq.make_policy(preset, "nvfp4"), max_new_tokens=max_new)
  eng.sync(_params())
  return eng


def _recomputed_logprobs(ro, ctx, temperature=1.0, **kw):
  out = full(_params(), ro.tokens, CFG, ctx, positions=ro.positions, token_mask=ro.token_mask,
             **kw)
  p = ro.prompt_len
  logp = jax.nn.log_softmax(out.logits[:, p - 1:-1] / temperature, axis=-1)
  return jnp.take_along_axis(logp, ro.tokens[:, p:, None], axis=-1)[..., 0], out


def test_greedy_is_argmax_of_full_forward_and_logprobs_match():
  ro = _engine().generate(PROMPTS, sampling=SamplingParams(temperature=0.0))
  out = full(_params(), ro.tokens, CFG, M.QuantContext(), positions=ro.positions,
             token_mask=ro.token_mask)
  p = ro.prompt_len
  argmax = np.asarray(jnp.argmax(out.logits[:, p - 1:-1], axis=-1))
  np.testing.assert_array_equal(np.asarray(ro.completion), argmax)
  lp, _ = _recomputed_logprobs(ro, M.QuantContext())
  np.testing.assert_allclose(np.asarray(lp), np.asarray(ro.logprobs), atol=1e-5)


def test_sampled_logprobs_at_temperature_and_routes():
  ro = _engine().generate(PROMPTS, n=3, sampling=SamplingParams(temperature=0.7), seed=1)
  assert ro.tokens.shape[0] == 6
  lp, out = _recomputed_logprobs(ro, M.QuantContext(), temperature=0.7)
  mask = np.asarray(ro.completion_mask)
  np.testing.assert_allclose(np.asarray(lp)[mask], np.asarray(ro.logprobs)[mask], atol=1e-5)
  # Recorded expert choices equal the full forward's at every real token.
  tm = np.asarray(ro.token_mask)
  np.testing.assert_array_equal(np.asarray(ro.routes)[:, tm], np.asarray(out.routes)[:, tm])
  # Samples of one prompt differ from each other (independent keys).
  comp = np.asarray(ro.completion)
  assert len({tuple(r) for r in comp[:3]}) > 1


def test_fp4_kv_decode_equals_full_forward_with_fake_quant_and_guidance_reproduces_codes():
  eng = _engine("paper")
  ro = eng.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=1.0), seed=3)
  qat = M.QuantContext(eng.policy, "qat", record_codes=True)
  lp, _ = _recomputed_logprobs(ro, qat)
  mask = np.asarray(ro.completion_mask)
  np.testing.assert_allclose(np.asarray(lp)[mask], np.asarray(ro.logprobs)[mask], atol=1e-4)
  # The trainer's guided forward reproduces every recorded mantissa bit at guided sites.
  _, out = _recomputed_logprobs(ro, qat, guidance=ro.guidance, routes=ro.routes)
  tm = np.asarray(ro.token_mask)
  assert set(ro.guidance) == {1, 2}
  for layer, sites in ro.guidance.items():
    for site, g in sites.items():
      want = np.asarray(tq.qarray.from_blocks(g.blocked_payload(), g.axis, g.shape[g.axis]))
      got = np.asarray(out.records[layer]["codes:" + site].unpacked_codes()) & 1
      np.testing.assert_array_equal(got[tm], want[tm], err_msg=f"{layer}/{site}")
  assert ro.guidance_bytes_per_token() > 0


def test_same_prompt_same_tokens_whatever_the_batch():
  eng = _engine()
  s = SamplingParams(temperature=1.0, top_k=20)
  alone = eng.generate([PROMPTS[0]], n=2, sampling=s, seed=7)
  mixed = eng.generate([[1, 2, 3], PROMPTS[0], PROMPTS[1]], n=2, sampling=s, seed=7)
  np.testing.assert_array_equal(np.asarray(alone.completion), np.asarray(mixed.completion)[2:4])
  np.testing.assert_allclose(np.asarray(alone.logprobs), np.asarray(mixed.logprobs)[2:4],
                             atol=1e-5)


def test_stop_tokens_and_max_lengths():
  eng = _engine()
  greedy = SamplingParams(temperature=0.0)
  free = np.asarray(eng.generate(PROMPTS, sampling=greedy).completion)
  stop = int(free[0, 2])  # the token prompt 0 emits third becomes its stop token
  ro = eng.generate(PROMPTS, sampling=greedy, stop_tokens=[stop], max_new_tokens=[6, 2])
  comp, mask = np.asarray(ro.completion), np.asarray(ro.completion_mask)
  first = list(free[0]).index(stop)
  assert mask[0].sum() == first + 1 and comp[0, first] == stop
  assert np.all(comp[0, first + 1:] == 0)
  assert mask[1].sum() == min(2, (list(free[1]).index(stop) + 1) if stop in free[1] else 2)
  np.testing.assert_array_equal(comp[1, :mask[1].sum()], free[1, :mask[1].sum()])


def test_top_k_top_p_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 2, 1.0))[0],
                                [True, True, False, False])
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 0, 0.7))[0],
                                [True, True, False, False])
  np.testing.assert_array_equal(np.isfinite(filter_logits(logits, 0, 0.4))[0],
                                [True, False, False, False])


def test_bad_requests_and_capacity():
  eng = _engine()
  with pytest.raises(ValueError, match="outside the vocabulary"):
    eng.generate([[1, 999]])
  with pytest.raises(ValueError, match="empty"):
    eng.generate([[1], []])
  tight = RolloutEngine(CFG, tq.make_policy("bf16"), max_new_tokens=6,
                        device_bytes=_engine().weight_bytes * 2)
  tight.sync(_params())
  cap = tight.capacity(16 + 6)
  with pytest.raises(CapacityError, match=r"do not fit: at most \d+ fit"):
    tight.generate([[1, 2]] * (cap + 1))
  with pytest.raises(RuntimeError, match="before sync"):
    RolloutEngine(CFG).generate([[1]])


def test_capacity_counts_what_the_device_already_holds(monkeypatch):
  """On a measured device (no device_bytes given) the planner sets sequences beside everything
  the allocator holds, e.g. a colocated trainer's state, not just the rollout weights; a
  batch past that limit is a CapacityError naming the held bytes. (The CPU backend keeps no
  in-use count: patched here.)"""
  from trace_jax.rollout import engine as E
  eng = RolloutEngine(CFG, tq.make_policy("bf16"), max_new_tokens=6)
  eng.sync(_params())
  monkeypatch.setattr(E, "device_memory_bytes", lambda device=None: 64 * 2**20)
  monkeypatch.setattr(E, "device_bytes_in_use", lambda device=None: None)
  alone = eng.capacity(16 + 6)
  monkeypatch.setattr(E, "device_bytes_in_use", lambda device=None: eng.weight_bytes // 2)
  assert eng.capacity(16 + 6) == alone  # less than the weights: the weights count
  held = eng.weight_bytes + 24 * 2**20
  monkeypatch.setattr(E, "device_bytes_in_use", lambda device=None: held)
  beside = eng.capacity(16 + 6)
  per = E.bytes_per_sequence(CFG, eng.policy, 16 + 6, eng.ctx.record_guidance)
  assert beside == int((0.9 * 64 * 2**20 - held) // per) < alone
  with pytest.raises(CapacityError, match="already held on the device"):
    eng.generate([[1, 2]] * (beside + 1))
  pinned = RolloutEngine(CFG, tq.make_policy("bf16"), max_new_tokens=6,
                         device_bytes=64 * 2**20)  # a given budget: the weights alone
  pinned.sync(_params())
  assert pinned.capacity(16 + 6) == alone


def test_fp4_kv_lets_more_sequences_fit():
  # 12-layer 30B-A3B shape on a 140 GiB device at 8k context: bf16 weights 16 GiB, paper-policy
  # weights (FP4 experts) about 5 GiB; KV4 stores 4.5 bits + a row scale instead of 16 bits.
  from trace_jax.rollout import plan_capacity
  cfg = M.qwen3_30b_a3b(12)
  gib = 140 * 2**30
  n_bf16 = plan_capacity(cfg, tq.make_policy("bf16"), 8192, weight_bytes=16 * 2**30,
                         device_bytes=gib, record_guidance=False)
  n_fp4 = plan_capacity(cfg, tq.make_policy("paper"), 8192, weight_bytes=5 * 2**30,
                        device_bytes=gib, record_guidance=False)
  print(f"sequences at 8k: bf16 {n_bf16}, fp4 {n_fp4}")
  assert n_fp4 >= 3 * n_bf16 > 0


@pytest.mark.slow  # an engine compile (~22 s on 2 cores); the layout's decode: test_kernels_cpu
def test_kernel_layout_weights_give_the_same_rollout():
  """Rollout weights in the GPU kernels' layout (`PackedWeight`) decode to the same values: on
  CPU the dispatch runs the reference on them, so tokens and logprobs must match the QArrays'."""
  plain = _engine("paper")
  packed = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6,
                         use_kernels=True)
  packed.sync(_params())
  # The tiny model's matrices are below the kernels' validated sizes: convert them explicitly.
  from trace_jax import kernels
  packed.params = kernels.prepare_tree(packed.params)
  from trace_jax.kernels import PackedWeight
  assert isinstance(packed.params["layers_0"]["moe"]["experts"]["gate_up_proj"], PackedWeight)
  s = SamplingParams(temperature=0.0)
  a = plain.generate(PROMPTS, sampling=s)
  b = packed.generate(PROMPTS, sampling=s)
  np.testing.assert_array_equal(np.asarray(a.completion), np.asarray(b.completion))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-4)


@pytest.mark.slow  # two engine compiles; the fusion's numerics: test_transformer, test_kernels_cpu
@pytest.mark.parametrize("weights", ["fp4", "bf16"])
def test_fused_projections_give_the_same_rollout(monkeypatch, weights):
  """The engine's weight sync puts an attention layer's q, k and v kernels side by side
  (`kernels.fuse_projections`): FP4 ones where they are in the kernel layout
  (TRACE_JAX_FUSE_PROJECTIONS), bf16 ones (the `paper` policy's, a new array beside the
  master's) unless TRACE_JAX_BF16_DENSE=xla. The rollout equals the one with three
  projections (greedy tokens; logprobs to float32 summation order), and a re-sync (which
  donates the fused weight) gives it again."""
  from trace_jax.kernels import dispatch
  from trace_jax.rollout import engine as engine_mod
  if weights == "fp4":
    module, name, settings, policy, dtype = engine_mod, "FUSE_PROJECTIONS", ("on", "off"), \
        "w4a16", "float32"
  else:
    module, name, settings, policy, dtype = dispatch, "BF16_DENSE", ("kernel", "xla"), \
        "paper", "bfloat16"
  cfg = M.tiny(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64,
               dtype=dtype)
  params = M.init_params(cfg, jax.random.key(0))
  if weights == "bf16":  # bf16 masters: the rollout shares the unfused ones
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  s = SamplingParams(temperature=0.0)
  outs = []
  for setting in settings:
    monkeypatch.setattr(module, name, setting)
    eng = RolloutEngine(cfg, tq.make_policy(policy, "nvfp4"), max_new_tokens=6,
                        use_kernels=True)
    eng.sync(params)
    fused = setting == settings[0]
    attn = eng.params["layers_0"]["attn"]
    assert (attn["k_proj"]["kernel"] is None) == fused
    assert attn["q_proj"]["kernel"].shape == (256, 768 if fused else 256)
    outs.append(eng.generate(PROMPTS, sampling=s))
    if fused:
      own = [x for x in jax.tree_util.tree_leaves(eng.params)
             if not any(x is m for m in jax.tree_util.tree_leaves(params))]
      eng.sync(jax.tree_util.tree_map(lambda a: a * 1, params))
      # the old laid-out weights are donated to the new ones (the layout's program)
      assert own and all(x.is_deleted() for x in own)
      again = eng.generate(PROMPTS, sampling=s)
      np.testing.assert_array_equal(np.asarray(again.logprobs), np.asarray(outs[0].logprobs))
  np.testing.assert_array_equal(np.asarray(outs[0].completion), np.asarray(outs[1].completion))
  np.testing.assert_allclose(np.asarray(outs[0].logprobs), np.asarray(outs[1].logprobs),
                             atol=1e-4)


def test_sync_shares_unchanged_master_arrays():
  """Weights the rollout uses as they are (not quantized, already in the compute dtype) are the
  master's arrays, not copies; quantized ones are the engine's own. A re-sync donates only the
  engine's own arrays (the old master's stay alive) and gives the rollout of a fresh engine;
  master arrays deleted after a sync (a donating train step) stop generate with a clear error."""
  master = _params()
  m_leaves = jax.tree_util.tree_leaves(master)
  eng = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6)
  eng.sync(master)
  flat = jax.tree_util.tree_structure(master).flatten_up_to(eng.params)
  quantized = [isinstance(p, tq.QArray) for p in flat]
  assert any(quantized) and not all(quantized)
  for m, p, q in zip(m_leaves, flat, quantized):
    assert (p is m) != q  # shared exactly where not quantized
  # master values changed (a train step's result): new arrays, the old ones survive the re-sync,
  # while the engine's own old weights are donated to the new ones
  own = jax.tree_util.tree_leaves([p for p, q in zip(flat, quantized) if q])
  master2 = jax.tree_util.tree_map(lambda a: a * 0.9, master)
  eng.sync(master2)
  assert not any(a.is_deleted() for a in m_leaves)
  assert own and all(a.is_deleted() for a in own)
  fresh = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6)
  fresh.sync(master2)
  s = SamplingParams(temperature=0.0)
  a, b = eng.generate(PROMPTS, sampling=s), fresh.generate(PROMPTS, sampling=s)
  np.testing.assert_array_equal(np.asarray(a.completion), np.asarray(b.completion))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  # a float32 master under a bf16 compute dtype is cast: nothing shared
  cfg16 = M.tiny(num_layers=3, dtype="bfloat16")
  e16 = RolloutEngine(cfg16, tq.make_policy("bf16", "nvfp4"), max_new_tokens=6)
  e16.sync(master)
  assert not any(p is m for p, m in zip(jax.tree_util.tree_leaves(e16.params), m_leaves))
  master2["final_norm"]["scale"].delete()
  with pytest.raises(RuntimeError, match="deleted since the last sync"):
    eng.generate(PROMPTS, sampling=s)


def _same_leaves(a, b):
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b) and la
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_sync_from_host_master_equals_device_sync():
  """A master of numpy leaves (`load_hf_checkpoint(on_host=True)`, `random_params(on_host=True)`)
  is synced part by part; the rollout weights are bit for bit those of a device master's sync
  (quantized and cast leaves alike), nothing of the master is shared, and the rollout matches."""
  master = _params()
  host = jax.tree_util.tree_map(np.array, master)
  dev = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6)
  dev.sync(master)
  eng = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6)
  eng.sync(host)
  _same_leaves(eng.params, dev.params)
  flat = jax.tree_util.tree_leaves(eng.params)
  assert all(isinstance(x, jax.Array) for x in flat)
  assert not any(p is m for p, m in zip(flat, jax.tree_util.tree_leaves(master)))
  s = SamplingParams(temperature=1.0)
  a, b = eng.generate(PROMPTS, sampling=s, seed=3), dev.generate(PROMPTS, sampling=s, seed=3)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  # a re-sync from a changed host master replaces the weights, as a device re-sync does
  eng.sync(jax.tree_util.tree_map(lambda x: x * np.float32(0.9), host))
  dev.sync(jax.tree_util.tree_map(lambda x: x * 0.9, master))
  _same_leaves(eng.params, dev.params)
  # a device sync after a host one donates the host-made weights it makes anew (the quantized
  # ones; the copies of leaves it then shares with the master are dropped), and its weights are
  # a device-synced engine's
  made = jax.tree_util.tree_leaves([p for p in jax.tree_util.tree_structure(master)
                                    .flatten_up_to(eng.params) if isinstance(p, tq.QArray)])
  eng.sync(jax.tree_util.tree_map(lambda x: x * 0.8, master))
  assert made and all(a.is_deleted() for a in made)
  dev.sync(jax.tree_util.tree_map(lambda x: x * 0.8, master))
  _same_leaves(eng.params, dev.params)


def test_sync_from_host_master_in_kernel_layout():
  """The kernel layout (FP4 weights pre-shuffled, q/k/v side by side) made per layer from a
  host master equals the one made from the whole device master, bit for bit."""
  cfg = M.tiny(num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64,
               dtype="bfloat16")
  master = jax.tree.map(lambda a: a.astype(jnp.bfloat16), M.init_params(cfg, jax.random.key(0)))
  engines = []
  for m in (master, jax.tree_util.tree_map(np.array, master)):
    eng = RolloutEngine(cfg, tq.make_policy("w4a16", "nvfp4"), max_new_tokens=6,
                        use_kernels=True)
    eng.sync(m)
    engines.append(eng)
  assert engines[1].params["layers_0"]["attn"]["k_proj"]["kernel"] is None  # fused
  _same_leaves(engines[1].params, engines[0].params)


def test_chunked_decode_moves_guidance_to_host_and_changes_nothing_else(monkeypatch):
  """decode_chunk=4 with 6 new tokens: windows of 4 and 2 (+2 past the end), guidance moved to
  host memory per window (copied async, or through pinned host memory: `GUIDANCE_COPY`),
  landed inline or on a landing thread (`GUIDANCE_LANDING`), the last window whole or in pieces
  of one step (`GUIDANCE_TAIL`: 4 + 1 + 1 steps). Same tokens, logprobs, routes and guidance
  bits as the one-program engine, also when every row stops early (a window left out) and with
  GRPO samples."""
  from trace_jax.rollout import engine as engine_module
  one = _engine("paper")
  chunked = RolloutEngine(CFG, tq.make_policy("paper", "nvfp4"), max_new_tokens=6,
                          decode_chunk=4)
  chunked.sync(_params())
  s = SamplingParams(temperature=1.0)
  assert (chunked.guidance_copy, chunked.guidance_landing) == ("async", "inline")  # defaults
  assert chunked.guidance_tail >= 4  # (the default leaves windows of 4 whole)
  default_tail = chunked.guidance_tail
  # Each window's carry (the KV cache among it) is donated whole to the next: a leaf the
  # program did not read would keep its buffer beside the new one (jit drops unread arguments,
  # donation included).
  windows_run, programs = [], chunked._chunk_programs
  def checked_programs(key):
    prefill, window = programs(key)
    def checked_window(params, carry, *args):
      before = jax.tree_util.tree_leaves(carry)
      out = window(params, carry, *args)
      windows_run.append(all(x.is_deleted() for x in before))
      return out
    return prefill, checked_window
  monkeypatch.setattr(chunked, "_chunk_programs", checked_programs)
  monkeypatch.setattr(engine_module, "_PINNED", engine_module._PinnedPool())
  pinned_before = False
  for kw, windows, landing, copy, tail in (
      (dict(n=2), 2, "inline", "async", default_tail), (dict(n=2), 2, "thread", "async", 0),
      (dict(n=2, max_new_tokens=[3, 2]), 1, "inline", "pinned", default_tail),
      (dict(n=2, max_new_tokens=[3, 2]), 1, "thread", "async", default_tail),
      (dict(n=2), 2, "thread", "pinned", default_tail),
      (dict(n=2), 2, "inline", "pinned", default_tail),
      (dict(n=2), 3, "inline", "async", 1), (dict(n=2), 3, "thread", "async", 1),
      (dict(n=2, max_new_tokens=[3, 2]), 2, "inline", "pinned", 1)):
    a = one.generate(PROMPTS, sampling=s, seed=3, **kw)
    chunked.guidance_landing, chunked.guidance_copy = landing, copy
    chunked.guidance_tail = tail
    t0 = time.perf_counter()
    b = chunked.generate(PROMPTS, sampling=s, seed=3, **kw)
    wall = time.perf_counter() - t0
    timeline = chunked.last_timeline.as_dict()  # where the host spent the call, by part
    # pinned host memory the guidance took, all released once placed, the most kept for
    # planning (where pinned, as on the CPU backend)
    assert engine_module._PINNED.held == 0
    assert (engine_module._PINNED.peak > 0) == (copy == "pinned" or pinned_before)
    pinned_before = engine_module._PINNED.peak > 0
    assert timeline["windows"] == windows
    # no window launched past the rows' largest limit (no stop tokens here: every row runs to
    # its limit, so none is launched after the last)
    assert timeline["launches"] == windows
    most = max(kw.get("max_new_tokens", [6]))  # the windows launched, first step and steps
    assert timeline["pieces"] == [list(x) for x in engine_module.window_pieces(most, 4, tail)]
    assert {"prefill_launch", "host_arrays", "window_dispatch", "window_wait", "landing",
            "assemble"} <= set(timeline["seconds"])
    assert set(timeline["landing_seconds"]) == {  # within the landing, by part
        "prompt_records_wait", "page_commit_wait", "prompt_copy", "window_records_wait",
        "window_place"}
    assert 0 < timeline["total_s"] <= wall
    # when records and end flags reached host memory, in order, within the call
    marks = timeline["marks"]
    names = [m[0] for m in marks]
    assert names[-1] == "landed" and "prompt records" in names
    assert [f"window {i} records" for i in range(windows)] == [n for n in names if "records" in n
                                                               and "prompt" not in n]
    assert [m[1] for m in marks] == sorted(m[1] for m in marks) and 0 < marks[-1][1] <= wall
    leaves_b = jax.tree_util.tree_leaves(b.guidance)
    assert leaves_b and all(isinstance(x, np.ndarray) for x in leaves_b)
    assert b.guidance_bytes() == a.guidance_bytes() > 0
    # The planners' per-token rule is what the rollout stores, byte for byte.
    assert b.guidance_bytes() == b.tokens.size * guidance_bytes_per_token(CFG, chunked.policy)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), y),
                           a.guidance, b.guidance)
    for f in ("tokens", "token_mask", "positions", "completion_mask", "logprobs", "routes"):
      np.testing.assert_array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)), f)
  assert windows_run and all(windows_run)
  # The pinned memory the runtime keeps counts as host memory the next call's copies can use.
  # (as on a GPU: host memory a budget of its own, read when planning)
  monkeypatch.setattr(chunked, "_on_cpu", lambda: False)
  monkeypatch.setattr(engine_module, "host_memory_bytes", lambda: 64 * 2**20)
  engine_module._PINNED.peak = 0
  host_limit = chunked.capacity_limits(48)[1]
  engine_module._PINNED.peak = 64 * 2**20
  assert 0 < 2 * host_limit <= chunked.capacity_limits(48)[1] <= 2 * host_limit + 1
  monkeypatch.undo()
  chunked.guidance_tail = default_tail
  # A landing's error reaches the caller, from the landing thread too.
  def broken(*args):
    raise RuntimeError("landing failed")
  monkeypatch.setattr(engine_module, "_place_window", broken)
  for landing in ("inline", "thread"):
    chunked.guidance_landing = landing
    with pytest.raises(RuntimeError, match="landing failed"):
      chunked.generate(PROMPTS, sampling=s, seed=3, n=2)
  # Device memory: the prompt's and one window's guidance instead of the whole sequence's.
  cfg = M.qwen3_30b_a3b(12)
  policy = tq.make_policy("paper")
  from trace_jax.rollout import plan_capacity
  whole = plan_capacity(cfg, policy, 8192, 5 * 2**30, 140 * 2**30)
  windowed = plan_capacity(cfg, policy, 8192, 5 * 2**30, 140 * 2**30, guidance_tokens=512 + 256)
  assert windowed > 1.5 * whole
  with pytest.raises(ValueError, match="decode_chunk"):
    RolloutEngine(CFG, decode_chunk=-1)


def test_window_pieces_cover_the_rollout_and_split_only_the_last_window():
  """Every (total, chunk, tail): the pieces run each step once, in order; whole windows of
  `chunk` steps up to the last window's start; the last window (the rest) whole when tail is 0
  or it is no longer than tail, else in halves (rounded up) down to at most tail steps."""
  from trace_jax.rollout.engine import window_pieces
  for total in range(1, 41):
    for chunk in range(1, 10):
      for tail in range(0, 6):
        pieces = window_pieces(total, chunk, tail)
        steps = [s for start, n in pieces for s in range(start, start + n)]
        assert steps == list(range(total)) and all(n >= 1 for _, n in pieces)
        last = (total - 1) // chunk * chunk  # the last window's first step
        whole = [x for x in pieces if x[0] < last]
        assert whole == [(s, chunk) for s in range(0, last, chunk)]
        rest, sizes = total - last, [n for start, n in pieces if start >= last]
        if tail == 0 or rest <= tail:
          assert sizes == [rest]
        else:  # each piece half of what was left before it, the final one at most tail
          left = rest
          for n in sizes[:-1]:
            assert n == -(-left // 2) and left > tail
            left -= n
          assert sizes[-1] == left <= tail
  assert window_pieces(256, 256, 32) == [(0, 128), (128, 64), (192, 32), (224, 32)]
  with pytest.raises(ValueError, match="total >= 1"):
    window_pieces(0, 4)


def test_command_buffer_options_are_valid_xla_options():
  """The engine's GPU command-buffer options (`GPU_COMMAND_BUFFERS`) are options XLA accepts (it
  refuses a misspelt value; CPU ignores them). Off by default away from a GPU. The rollout they
  give on the GPU: tests/rollout/test_engine_gpu.py."""
  from trace_jax.rollout.engine import GPU_COMMAND_BUFFERS
  assert int(jax.jit(lambda x: x + 1, compiler_options=GPU_COMMAND_BUFFERS)(1)) == 2
  bad = {**GPU_COMMAND_BUFFERS, "xla_gpu_enable_command_buffer": "FUSION,WHILE_LOOPS"}
  with pytest.raises(Exception, match="not a valid enum value"):
    jax.jit(lambda x: x + 2, compiler_options=bad)(1)
  assert not RolloutEngine(CFG).command_buffers
  assert RolloutEngine(CFG, command_buffers=True).command_buffers


def _rss_bytes() -> int:
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux /proc")
def test_host_guidance_arrays_commit_only_what_is_written():
  """The chunked engine's host arrays (`host_zeros`): zeros, writable, and committed page by
  page as windows land: writing 16 of 2048 time steps of each of 256 rows (2 MiB per row) takes
  about 4 MiB of host memory, not the array's 512 MiB (numpy's huge-page advice committed 2 MiB
  per row at the first write: the whole array)."""
  from trace_jax.rollout.engine import host_zeros
  a = host_zeros((256, 2048, 1024), np.uint8)
  assert a.shape == (256, 2048, 1024) and a.dtype == np.uint8 and a.flags.writeable
  before = _rss_bytes()
  a[:, 100:116] = 7
  grown = _rss_bytes() - before
  assert grown < 64 * 2**20, f"{grown / 2**20:.0f} MiB committed for 4 MiB written"
  assert int(a[:, 100:116].sum()) == 7 * 256 * 16 * 1024 and not a[:, :100].any()
  assert host_zeros((0, 3), np.float32).shape == (0, 3)


def test_host_memory_counts_reclaimable_page_cache_as_free(tmp_path):
  """`host_memory_bytes` from fake /proc and cgroup files: a container's limit less what the
  cgroup holds beyond inactive file pages (a checkpoint's page cache is reclaimable), capped by
  MemAvailable; cgroup v2 and v1; no limit; nothing readable."""
  from trace_jax.rollout.engine import host_memory_bytes
  gib = 2**30
  proc, cg = tmp_path / "proc", tmp_path / "cg"
  (proc).mkdir()
  (proc / "meminfo").write_text(f"MemTotal: {200 * gib // 1024} kB\n"
                                f"MemAvailable: {100 * gib // 1024} kB\n")
  (cg / "memory").mkdir(parents=True)
  assert host_memory_bytes(str(proc), str(cg)) == 100 * gib  # no cgroup files
  (cg / "memory.max").write_text(f"{64 * gib}\n")
  (cg / "memory.current").write_text(f"{60 * gib}\n")
  (cg / "memory.stat").write_text(f"anon {9 * gib}\nfile {51 * gib}\n"
                                  f"inactive_file {50 * gib}\nactive_file {gib}\n")
  assert host_memory_bytes(str(proc), str(cg)) == 54 * gib  # 64 - (60 - 50)
  (cg / "memory.max").write_text(f"{200 * gib}\n")
  assert host_memory_bytes(str(proc), str(cg)) == 100 * gib  # MemAvailable is smaller
  (cg / "memory.max").write_text("max\n")
  assert host_memory_bytes(str(proc), str(cg)) == 100 * gib
  for f in ("memory.max", "memory.current", "memory.stat"):
    (cg / f).unlink()
  (cg / "memory" / "memory.limit_in_bytes").write_text(f"{32 * gib}\n")
  (cg / "memory" / "memory.usage_in_bytes").write_text(f"{8 * gib}\n")
  (cg / "memory" / "memory.stat").write_text(f"inactive_file 1\n"
                                             f"total_inactive_file {4 * gib}\n")
  assert host_memory_bytes(str(proc), str(cg)) == 28 * gib  # v1: 32 - (8 - 4)
  (cg / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1: none
  assert host_memory_bytes(str(proc), str(cg)) == 100 * gib
  assert host_memory_bytes(str(tmp_path / "none"), str(tmp_path / "none")) > 0  # physical


def test_prefill_in_row_passes_writes_each_pass_in_place():
  """3 prompts prefilled 2 rows at a time (passes at rows 0-1 and 1-2, the last redoing row 1),
  each pass with a cache of the prompt's slots: cache, records, routes and next-token logits of
  each row are bit for bit those of a one-pass prefill of the pass that wrote it (a batch's
  float sums may depend on its size, so the reference is the same pass, alone) at the prompt's
  real tokens; GRPO samples repeat them. The planner's capacity with passes. (Rollouts through
  an engine with passes: the slow test after it.)"""
  eng = _engine("paper")
  p, steps, n = 16, 6, 2
  prompts = PROMPTS + [[4, 4, 2]]
  tokens = np.zeros((3, p), np.int32)
  mask = np.zeros((3, p), bool)
  for i, pr in enumerate(prompts):
    tokens[i, p - len(pr):], mask[i, p - len(pr):] = pr, True
  prefill = lambda rows, pass_rows: jax.jit(functools.partial(  # noqa: E731
      prefill_program, config=eng.config, ctx=eng.ctx, n=n, steps=steps,
      kv_format=eng.policy.kv_format, pass_rows=pass_rows))(eng.params, tokens[rows],
                                                            mask[rows])
  records, routes, _, prompt_len, carry = prefill(slice(0, 3), 2)
  leaves = lambda t: [np.asarray(x) for x in jax.tree_util.tree_leaves(t)]  # noqa: E731

  def same(got, want, m):  # prompt slots where m (a padding token's values are never used:
    np.testing.assert_array_equal(got[:, :p][m], want[:, :p][m])  # no key attends to it)
    np.testing.assert_array_equal(got[:, p:], want[:, p:])  # cache slots past the prompt

  for rows, take in ((slice(0, 2), [0, 1]), (slice(1, 3), [2])):
    ref_records, ref_routes, _, _, ref_carry = prefill(rows, None)
    local = [r - rows.start for r in take]
    for got, want in zip(leaves(records), leaves(ref_records), strict=True):
      same(got[take], want[local], mask[take])
    np.testing.assert_array_equal(np.asarray(routes)[:, take][:, mask[take]],
                                  np.asarray(ref_routes)[:, local][:, mask[take]])
    # decode rows: sample j of prompt i is row i * n + j
    drows = [i * n + j for i in take for j in range(n)]
    dlocal = [i * n + j for i in local for j in range(n)]
    for got, want in zip(leaves(carry["cache"]), leaves(ref_carry["cache"]), strict=True):
      same(got[drows], want[dlocal], np.repeat(mask[take], n, axis=0))
    np.testing.assert_array_equal(np.asarray(carry["logits"])[drows],
                                  np.asarray(ref_carry["logits"])[dlocal])
  np.testing.assert_array_equal(np.asarray(prompt_len), np.repeat(mask.sum(1), n))
  passes = RolloutEngine(CFG, eng.policy, max_new_tokens=6, prefill_tokens=2 * p)
  passes.sync(_params())
  assert passes._pass_rows(p) == 2 and eng._pass_rows(p) >= 3
  with pytest.raises(ValueError, match="prefill_tokens"):
    RolloutEngine(CFG, prefill_tokens=0)
  # The planner holds a pass's cache (2 prompts x 16 slots) beside the weights once a batch
  # takes more than one pass, never planning fewer sequences than one pass takes.
  per = bytes_per_sequence(CFG, eng.policy, 16 + 6)
  kv = M.cache_bytes_per_token(CFG, eng.policy.kv_format)
  for seqs in (40, 3.1, 2.5):  # base capacities 40, 3 (held: 2 = one pass) and 2 (one pass)
    device = (passes.weight_bytes + seqs * per) / 0.9
    base = int((0.9 * device - passes.weight_bytes) // per)
    held = int((0.9 * device - passes.weight_bytes - 2 * 16 * kv) // per)
    want = base if base <= 2 else max(held, 2)
    got = plan_capacity(CFG, eng.policy, 16 + 6, passes.weight_bytes, device,
                        prefill_pass=(2, 16))
    assert got == want
  big = RolloutEngine(CFG, eng.policy, max_new_tokens=6, prefill_tokens=2 * p,
                      device_bytes=(passes.weight_bytes + 40 * per) / 0.9)
  big.sync(_params())
  assert big.capacity(16 + 6, 16) == plan_capacity(CFG, eng.policy, 16 + 6, big.weight_bytes,
                                                   big.device_bytes, prefill_pass=(2, 16))


@pytest.mark.slow  # two more engine programs compiled (~20 s on 2 cores)
def test_engine_prefill_in_row_passes_gives_the_one_pass_rollout():
  """Through the engine: greedy rollouts with prefill passes of 2 prompts (3 prompts: passes at
  rows 0-1 and 1-2) agree with one pass (to float rounding in the sums)."""
  eng = _engine("paper")
  prompts = PROMPTS + [[4, 4, 2]]
  passes = RolloutEngine(CFG, eng.policy, max_new_tokens=6, prefill_tokens=2 * 16)
  passes.sync(_params())
  g = SamplingParams(temperature=0.0)
  a, b = eng.generate(prompts, n=2, sampling=g), passes.generate(prompts, n=2, sampling=g)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), atol=1e-5)


def test_chunked_engine_plans_host_memory():
  """The chunked engine's guidance goes to host memory: its capacity is also limited by the host,
  by a hand computation from the tiny model's shapes; a batch over that limit is refused naming
  host memory; with ample host memory the device limit is the one-program planner's."""
  policy = tq.make_policy("paper", "nvfp4")
  # Guidance per token: guided layers 1 and 2 of 3 (guided_layers=0.5); NVFP4 compact rows of
  # L elements hold L/8 payload bytes + L/16 E4M3 scales + a float32 row scale (4 bytes):
  #   experts/in       1 row  x 64: 8 + 4 + 4 = 16
  #   experts/down_in  2 rows x 32: 2 x (4 + 2 + 4) = 20
  #   kv/k, kv/v       2 rows x 16 each: 2 x 2 x (2 + 1 + 4) = 28
  per_token = 2 * (16 + 20 + 28)
  # Prompt bucket 16, 6 new tokens in windows of 4: at the peak the host holds the final arrays
  # (prompt + 6 tokens) and two windows in flight.
  per_seq = per_token * (16 + 6 + 2 * 4)
  assert per_seq == 3840
  host = 5 * 3840  # 0.9 x 5 sequences' worth: 4 fit
  eng = RolloutEngine(CFG, policy, max_new_tokens=6, decode_chunk=4, host_bytes=host,
                      device_bytes=2**40)
  eng.sync(_params())
  on_device, on_host = eng.capacity_limits(16 + 6)
  assert on_host == 4 < on_device and eng.capacity(16 + 6) == 4
  # Host memory the process will still take is left out: 5 sequences' worth less 2 leaves
  # 0.9 x 3 of them, so 2 fit; the device figure does not move.
  assert eng.capacity_limits(16 + 6, host_reserve=2 * 3840) == (on_device, 2)
  assert eng.capacity(16 + 6, host_reserve=2 * 3840) == 2
  ro = eng.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=1.0), seed=3)
  assert ro.num_rows == 4
  with pytest.raises(CapacityError, match=r"6 sequences .* do not fit in host memory: at most 4 "
                     r"fit \(0\.0 MiB .* host memory 0\.0 GiB"):
    eng.generate(PROMPTS + [[1]], n=2)
  # Ample host memory: the device limit is the one-program planner's with the prompt's and two
  # windows' guidance on the device, and the device is what a batch over it is refused for (one
  # prefill pass for any batch here: no pass cache beside the weights).
  roomy = RolloutEngine(CFG, policy, max_new_tokens=6, decode_chunk=4, host_bytes=2**40,
                        device_bytes=eng.weight_bytes * 2, prefill_tokens=2**30)
  roomy.sync(_params())
  cap = plan_capacity(CFG, policy, 16 + 6, roomy.weight_bytes, roomy.device_bytes,
                      guidance_tokens=16 + 2 * 4)
  assert roomy.capacity_limits(16 + 6)[0] == roomy.capacity(16 + 6) == cap > 0
  with pytest.raises(CapacityError, match=r"do not fit: at most \d+ fit next to"):
    roomy.generate([[1, 2]] * (cap + 1))
  # On the CPU backend without host_bytes the device's memory is host RAM: one budget for both.
  if jax.devices()[0].platform == "cpu":
    shared = RolloutEngine(CFG, policy, max_new_tokens=6, decode_chunk=4,
                           device_bytes=roomy.device_bytes, prefill_tokens=2**30)
    shared.sync(_params())
    free = roomy.device_bytes * 0.9 - shared.weight_bytes
    both = bytes_per_sequence(CFG, policy, 22, guidance_tokens=24) + per_seq
    assert shared.capacity_limits(16 + 6) == (cap, int(free // both))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux /proc")
def test_host_guidance_arrays_commit_the_prompt_pages_and_take_its_records():
  """`_host_guidance_arrays` shapes the final host arrays from the prefill's records (rows times
  the samples, prompt + steps along time) and commits the prompt's pages in host threads (about
  the prompt's bytes, not the 136 MiB array); `_host_guidance` then copies each prompt's
  records to its samples' rows, zeros after the prompt."""
  from trace_jax.rollout.engine import _host_guidance, _host_guidance_arrays, _wait_blocks
  rng = np.random.default_rng(0)
  pre = {0: {"x": rng.integers(1, 255, (16, 64, 4096), dtype=np.uint8)},
         3: {"y": rng.standard_normal((16, 64, 2), dtype=np.float32)}}
  before = _rss_bytes()
  arrays, commits = _host_guidance_arrays(pre, 2, 1024)
  _wait_blocks(commits)
  grown = _rss_bytes() - before
  prompt_bytes = 32 * 64 * (4096 + 8)
  assert 0.9 * prompt_bytes <= grown <= 1.5 * prompt_bytes + 2**20, grown
  _host_guidance(arrays, pre, 2)
  for layer, site in ((0, "x"), (3, "y")):
    full, src = arrays[layer][site], pre[layer][site]
    assert full.shape == (32, 64 + 1024) + src.shape[2:] and full.dtype == src.dtype
    np.testing.assert_array_equal(full[:, :64], np.repeat(src, 2, axis=0))
    assert not full[:, 64:].any()
