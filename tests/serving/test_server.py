"""The HTTP server over a real socket on 127.0.0.1 (uvicorn in a thread, httpx client): tokens
under concurrent load equal the engine's called directly, SSE streaming (the same text as without,
tokens sent while the answer is still being decoded), 4xx for bad requests and API keys, and the
server keeps serving after each."""

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from configs import serve_compare  # noqa: E402
from trace_jax.rollout import SamplingParams  # noqa: E402
from trace_jax.serving import GenerationRequest, build_serving  # noqa: E402
from trace_jax.serving.scheduler import generate_direct  # noqa: E402
from trace_jax.serving.server import _Text, build_app  # noqa: E402

KEY = "s3cret-key"
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


class _Server:
  """uvicorn serving `app` on an ephemeral 127.0.0.1 port in a daemon thread."""

  def __init__(self, app):
    self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    self.sock.bind(("127.0.0.1", 0))
    self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
    self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                   daemon=True)
    self.thread.start()
    deadline = time.time() + 30
    while not self.server.started:
      if time.time() > deadline or not self.thread.is_alive():
        raise RuntimeError("uvicorn did not start")
      time.sleep(0.02)

  def close(self):
    self.server.should_exit = True
    self.thread.join(10)
    self.sock.close()


@pytest.fixture(scope="module")
def served():
  config = serve_compare.get_config()
  # Two slots: prefill sizes 1 and 2 and one decode program (one step per chunk) for the
  # module; 32 new tokens at most, so a long answer streams over many chunks.
  config.serve.update(dict(max_batch=2, max_queue=64, decode_chunk=1, model_name="tiny"))
  config.rollout.max_new_tokens = 32
  model = build_serving(config, "baseline", log=lambda *_: None)
  open_srv = _Server(build_app(model, max_body_bytes=4096))
  keyed = _Server(build_app(model, api_key=KEY))
  yield model, open_srv.url, keyed.url
  open_srv.close()
  keyed.close()
  model.close()


SAMPLED = {"temperature": 1.0, "seed": 3}


def _complete(url, body, **kw):
  with httpx.Client(timeout=TIMEOUT) as c:
    return c.post(url + "/v1/completions", json=body, **kw)


def test_concurrent_requests_return_the_engines_tokens(served):
  model, url, _ = served
  tok = model.tokenizer
  prompts = [f"{a}+{b}=" for a, b in ((12, 34), (5, 77), (40, 9), (1, 1), (63, 28), (8, 50))]
  max_tokens = [4, 2, 4, 3, 4, 1]
  bodies = [dict(model="tiny", prompt=p, max_tokens=m, return_token_ids=True, **SAMPLED)
            for p, m in zip(prompts, max_tokens)]
  with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
    responses = list(pool.map(lambda b: _complete(url, b), bodies))
  assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses]
  reqs = [GenerationRequest(tuple(tok.encode(p)), m, SamplingParams(1.0), 3, model.stop_tokens)
          for p, m in zip(prompts, max_tokens)]
  direct = generate_direct(model.engine, reqs, model.scheduler.max_prompt_tokens)
  for r, want, m in zip(responses, direct, max_tokens):
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want
    assert choice["text"] == tok.decode(want)
    assert choice["finish_reason"] == ("length" if len(want) == m else "stop")
    assert r.json()["usage"]["completion_tokens"] == len(want)


def _sse(response) -> list:
  events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
  assert events[-1] == "[DONE]"
  return [json.loads(e) for e in events[:-1]]


def test_streaming_sends_openai_sse_with_the_same_text(served):
  model, url, _ = served
  body = dict(model="tiny", prompt="21+21=", max_tokens=4, **SAMPLED)
  whole = _complete(url, body).json()["choices"][0]
  with httpx.Client(timeout=TIMEOUT) as c:
    r = c.post(url + "/v1/completions", json=dict(body, stream=True))
  assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
  chunks = _sse(r)
  assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
  assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
  # Chat: the char tokenizer's template is the user message's content, so the same prompt.
  chat = dict(model="tiny", messages=[{"role": "user", "content": "21+21="}], max_tokens=4,
              **SAMPLED)
  with httpx.Client(timeout=TIMEOUT) as c:
    plain = c.post(url + "/v1/chat/completions", json=chat).json()
    streamed = c.post(url + "/v1/chat/completions", json=dict(chat, stream=True))
  assert plain["choices"][0]["message"] == {"role": "assistant", "content": whole["text"]}
  chunks = _sse(streamed)
  assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
  assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == whole["text"]


def test_stream_sends_each_token_as_it_is_generated(served):
  model, url, _ = served
  sched = model.scheduler
  body = dict(model="tiny", prompt="7+8=", max_tokens=sched.max_tokens, temperature=1.0,
              seed=1)
  whole = _complete(url, dict(body, return_token_ids=True)).json()["choices"][0]
  assert len(whole["token_ids"]) >= 16, whole  # a long answer: many decode chunks
  events, chunks_run = [], []
  with httpx.Client(timeout=TIMEOUT) as c:
    with c.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
      for line in r.iter_lines():
        if line.startswith("data: "):
          events.append(line[len("data: "):])
          chunks_run.append(sched.chunks_run)  # decode chunks run when this event arrived
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  texts = [ch["choices"][0]["text"] for ch in chunks]
  assert "".join(texts) == whole["text"] and sum(bool(t) for t in texts) > 1
  assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
  assert chunks[-1]["usage"]["completion_tokens"] == len(whole["token_ids"])
  # The first token reached the client while the answer was still being decoded.
  assert chunks_run[0] < chunks_run[-1]


def test_stop_strings_cut_streamed_text_as_the_whole_text(served):
  model, _, _ = served
  tok = model.tokenizer
  ids = tok.encode("12+34=5+19")
  streamed = _Text(tok, ["+1"])
  pieces = [streamed.add([i]) for i in ids]
  pieces.append(streamed.finish())
  assert "".join(pieces) == "12+34=5" and streamed.stopped
  assert pieces[7] == ""  # "+" could start the stop string: held back, then never sent
  whole = _Text(tok, ["+1"])
  assert whole.add(ids) + whole.finish() == "12+34=5"
  plain = _Text(tok, [])
  assert "".join(plain.add([i]) for i in ids) + plain.finish() == "12+34=5+19"


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(served):
  model, url, _ = served
  limit = model.scheduler.max_prompt_tokens
  cases = [
      (dict(content=b"{not json"), 400, "not valid JSON"),
      (dict(json=[1, 2]), 400, "JSON object"),
      (dict(json=dict(model="gpt-9", prompt="1+1=")), 404, "does not exist"),
      (dict(json=dict(prompt="1+1=")), 400, "'model' is required"),
      (dict(json=dict(model="tiny", prompt="1" * (limit + 1))), 400, "more than this server"),
      (dict(json=dict(model="tiny", prompt="1+1=", max_tokens=-1)), 400, "max_tokens"),
      (dict(json=dict(model="tiny", prompt="1+1=", max_tokens=10**6)), 400, "max_tokens"),
      (dict(json=dict(model="tiny", prompt="1+1=", temperature="hot")), 400, "temperature"),
      (dict(json=dict(model="tiny", prompt="HELLO")), 400, "cannot tokenize"),
      (dict(json=dict(model="tiny", prompt=[10**6])), 400, "outside the vocabulary"),
      (dict(json=dict(model="tiny", prompt="1+1=", n=2)), 400, "n=1"),
      (dict(content=b'{"model": "tiny", "prompt": "' + b"1" * 5000 + b'"}'), 413, "exceeds"),
  ]
  with httpx.Client(timeout=TIMEOUT) as c:
    for kw, status, words in cases:
      r = c.post(url + "/v1/completions", **kw)
      assert r.status_code == status, (kw, r.text)
      assert words in r.json()["error"]["message"], (words, r.text)
    r = c.post(url + "/v1/chat/completions", json=dict(model="tiny", messages="hi"))
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    assert c.get(url + "/v1/nope").status_code == 404
    assert c.get(url + "/v1/completions").status_code == 405
    ok = c.post(url + "/v1/completions", json=dict(model="tiny", prompt="1+1=", **SAMPLED))
  assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_api_key_is_required_when_set(served):
  _, _, url = served
  body = dict(model="tiny", prompt="2+2=", max_tokens=1, **SAMPLED)
  with httpx.Client(timeout=TIMEOUT) as c:
    missing = c.post(url + "/v1/completions", json=body)
    wrong = c.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    basic = c.post(url + "/v1/completions", json=body, headers={"Authorization": f"Basic {KEY}"})
    models_missing = c.get(url + "/v1/models")
    good = c.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    models = c.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    health = c.get(url + "/health")
  for r, code in ((missing, "missing_api_key"), (wrong, "invalid_api_key"),
                  (basic, "missing_api_key"), (models_missing, "missing_api_key")):
    assert r.status_code == 401 and r.json()["error"]["code"] == code, r.text
  assert good.status_code == 200
  assert [m["id"] for m in models.json()["data"]] == ["tiny"]
  assert health.status_code == 200


def test_client_disconnect_frees_the_slot(served):
  """A streaming client that goes away mid-answer: the server cancels its request and the
  scheduler frees the slot instead of decoding the rest."""
  model, url, _ = served
  sched = model.scheduler
  streams = []
  submit = sched.submit_stream

  def recording_submit(request):  # the real scheduler; only remembers the stream
    streams.append(submit(request))
    return streams[-1]

  sched.submit_stream = recording_submit
  try:
    body = dict(model="tiny", prompt="7+8=", max_tokens=sched.max_tokens, temperature=1.0,
                seed=1, stream=True)
    with httpx.Client(timeout=TIMEOUT) as c:
      with c.stream("POST", url + "/v1/completions", json=body) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))
        with sched.hold():  # the worker pauses at its next chunk boundary
          r.close()  # the client goes away mid-answer
          deadline = time.time() + 10
          while not streams[-1].cancelled and time.time() < deadline:
            time.sleep(0.01)
          assert streams[-1].cancelled, "the server did not cancel the request"
    res = streams[-1].result(timeout=30)
  finally:
    sched.submit_stream = submit
  assert res.finish_reason == "cancelled" and len(res.tokens) < sched.max_tokens
