"""The slot decoder against the rollout engine: requests that join a running batch at different
times (different prompt lengths and buckets, budgets, a stop token, two requests prefilled
together) get the engine's tokens and logprobs for the same prompt, seed and sampling, in BF16
and under the FP4 "paper" policy (FP4 experts + FP4 KV cache). Per-row sampling settings are
checked against the batch-wide rule in test_sampling.py."""

import functools

import jax
import numpy as np
import pytest

from trace_jax import models as M
from trace_jax import quant as tq
from trace_jax.rollout import RolloutEngine, SamplingParams, SlotDecoder, SlotRequest

CFG = M.tiny(num_layers=1)
HOT = SamplingParams(0.8, top_k=20, top_p=0.9)


@functools.lru_cache(maxsize=None)
def _engine(preset):
  p = M.init_params(CFG, jax.random.key(0))
  p = jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, p)
  eng = RolloutEngine(CFG, tq.make_policy(preset, "nvfp4"), max_new_tokens=8,
                      record_guidance=False, record_routes=False)
  eng.sync(p)
  return eng


def _reference(eng, r: SlotRequest):
  ro = eng.generate([list(r.prompt)], sampling=r.sampling, seed=r.seed,
                    stop_tokens=r.stop_tokens, max_new_tokens=r.max_tokens)
  m = np.asarray(ro.completion_mask)[0]
  return np.asarray(ro.completion)[0][m].tolist(), np.asarray(ro.logprobs)[0][m]


@pytest.mark.parametrize("preset", [pytest.param("bf16", marks=pytest.mark.slow), "paper"])
def test_staggered_requests_decode_the_engines_tokens(preset):
  eng = _engine(preset)
  stop_prompt = (1, 2, 3)
  free = _reference(eng, SlotRequest(stop_prompt, 8, HOT, 2))[0]
  stop = free[2]  # the token it emits third becomes its stop token
  reqs = [SlotRequest((5, 6, 7, 8, 9), 8, HOT, 3),
          SlotRequest(stop_prompt, 8, HOT, 2, (stop,)),
          SlotRequest((9, 8, 7, 6), 6, HOT, 1),
          SlotRequest((4, 4, 2, 9, 1, 1, 7), 7, HOT, 5)]
  arrive = [0, 1, 2, 2]  # decode chunk before which each request arrives
  if preset == "bf16":  # (one more engine program and prefill: only here)
    reqs.append(SlotRequest(tuple(range(3, 21)), 5, HOT, 4))  # 18 tokens: the 32-token bucket
    arrive.append(1)
  dec = SlotDecoder(eng, slots=4, chunk=3, max_prompt_tokens=32, prefill_sizes=(2, 4))
  got = {i: ([], []) for i in range(len(reqs))}
  live, waiting, chunk, prefills = {}, [], 0, []
  while chunk == 0 or live or waiting or chunk <= max(arrive):
    waiting += [i for i in range(len(reqs)) if arrive[i] == chunk]
    free_slots = [s for s in range(dec.slots) if s not in live]
    admit, waiting = waiting[:len(free_slots)], waiting[len(free_slots):]
    by_bucket: dict = {}
    for i in admit:
      by_bucket.setdefault(dec.bucket(reqs[i]), []).append(i)
    for group in by_bucket.values():
      slots, free_slots = free_slots[:len(group)], free_slots[len(group):]
      before = jax.tree.leaves(dec.state.cache)
      tok, lp, done = dec.prefill([reqs[i] for i in group], slots)
      assert all(x.is_deleted() for x in before)  # (donated, as at decode)
      prefills.append(len(group))
      for i, s, t, l, d in zip(group, slots, tok, lp, done):
        got[i][0].append(int(t))
        got[i][1].append(float(l))
        if not d:
          live[s] = i
    if live:
      before = jax.tree.leaves(dec.state.cache)
      tok, lp, emitted, done = dec.decode()
      # the slots' KV cache is donated to the program: a leaf it did not read would keep its
      # buffer beside the new one (jit drops unread arguments, donation included). (Only the
      # cache: on the CPU `done` reaches numpy without a copy, and a buffer numpy still views is
      # not donated.)
      assert all(x.is_deleted() for x in before)
      for s, i in list(live.items()):
        got[i][0].extend(tok[s][emitted[s]].tolist())
        got[i][1].extend(lp[s][emitted[s]].tolist())
        if done[s]:
          del live[s]
    chunk += 1
  assert max(prefills) == 2  # the two requests arriving together joined in one prefill
  for i, r in enumerate(reqs):
    want_tok, want_lp = _reference(eng, r)
    assert got[i][0] == want_tok, (i, r)
    # Logprobs agree to float32 rounding: XLA's CPU matmuls round differently at another batch
    # size (the engine itself differs by ~1e-6 between batches of 1 and 4).
    np.testing.assert_allclose(got[i][1], want_lp, rtol=1e-6, atol=1e-6)
  assert got[1][0][-1] == stop and len(got[1][0]) == free.index(stop) + 1
  assert [len(got[i][0]) for i in (0, 2, 3)] == [8, 6, 7]


def test_bad_requests_are_named():
  dec = SlotDecoder(_engine("bf16"), slots=2, chunk=2, max_prompt_tokens=20)
  for req, words in ((SlotRequest((), 1), "empty"),
                     (SlotRequest((1,) * 21, 1), "more than the limit of 20"),
                     (SlotRequest((1,), 9), r"max_tokens must be in \[1, 8\]"),
                     (SlotRequest((1, 99), 1), "outside the vocabulary"),
                     (SlotRequest((1,), 1, stop_tokens=(1, 2, 3, 4, 5)), "at most 4 stop")):
    with pytest.raises(ValueError, match=words):
      dec.prefill([req], [0])
  with pytest.raises(ValueError, match="share a prompt bucket"):
    dec.prefill([SlotRequest((1,), 1), SlotRequest((1,) * 17, 1)], [0, 1])
  with pytest.raises(ValueError, match="distinct"):
    dec.prefill([SlotRequest((1,), 1), SlotRequest((2,), 1)], [1, 1])
