"""The OpenAI-compatible HTTP front end: a Starlette ASGI app over a `ServingModel`.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `"stream": true` for
server-sent events in OpenAI's format, ending with `data: [DONE]`), `GET /v1/models`,
`GET /health` (no key needed). Run it with uvicorn (`launch/serve.py`).

Request fields honoured: `model` (must be the served name), `prompt` (a string, a list of one
string, or a list of token ids) / `messages`, `max_tokens` (chat: also
`max_completion_tokens`; default 16), `temperature` (default 1), `top_p`, `top_k` (extension),
`seed`, `stop` (strings; the text is cut before the first one), `n` (only 1), `stream`, and
`return_token_ids` (extension, non-streaming: the generated token ids in `choices[0].token_ids`).

Streaming: with the slot scheduler (`scheduler.SlotScheduler`, the default) tokens reach the
host every decode chunk and each one is sent as an event as soon as it arrives, so the first
event comes after the request's prefill, long before the answer ends. Text that could still be
the start of a `stop` string is held back until it cannot. (With the request-level
`BatchScheduler` all tokens arrive when the batch ends and are then sent one event per token.)

Every bad request gets a 4xx JSON error `{"error": {"message", "type", "param", "code"}}` and the
server keeps serving the rest: 400 malformed JSON or fields, too-long prompt, max_tokens out of
range; 401 missing or wrong API key (when one is set); 404 unknown model or route; 413 body over
`max_body_bytes`; 429 queue full. Engine failures on a batch answer 500 to that batch's requests.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from trace_jax.rollout import SamplingParams
from trace_jax.serving.backend import ServingModel
from trace_jax.serving.scheduler import GenerationRequest, QueueFullError, SchedulerClosedError
from trace_jax.settings import declare

API_KEY_ENV = declare("TRACE_JAX_API_KEY", "", "a key",
                      "the API key `launch/serve.py` requires when `--api_key` is not given",
                      shapes_programs=False)

DEFAULT_MAX_TOKENS = 16


class HTTPError(Exception):
  """An error answered to the client: status, message, OpenAI error type, offending param."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.code = (status, message, kind, param,
                                                                   code)

  def response(self) -> JSONResponse:
    return JSONResponse({"error": {"message": self.message, "type": self.kind,
                                   "param": self.param, "code": self.code}},
                        status_code=self.status)


def _check_key(request: Request, api_key: str | None) -> None:
  if not api_key:
    return
  header = request.headers.get("authorization", "")
  scheme, _, token = header.partition(" ")
  if scheme.lower() != "bearer" or not token:
    raise HTTPError(401, "missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error", code="missing_api_key")
  if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
    raise HTTPError(401, "invalid API key", "authentication_error", code="invalid_api_key")


async def _read_json(request: Request, max_body_bytes: int) -> dict:
  declared = request.headers.get("content-length")
  if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
    raise HTTPError(413, f"request body of {declared} bytes exceeds the limit of "
                    f"{max_body_bytes} bytes", code="body_too_large")
  body = bytearray()
  async for chunk in request.stream():  # also bounds chunked bodies without a content-length
    body += chunk
    if len(body) > max_body_bytes:
      raise HTTPError(413, f"request body exceeds the limit of {max_body_bytes} bytes",
                      code="body_too_large")
  try:
    data = json.loads(bytes(body))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise HTTPError(400, f"request body is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise HTTPError(400, f"request body must be a JSON object, got {type(data).__name__}")
  return data


def _number(data: dict, key: str, default, kind=float, lo=None, hi=None):
  v = data.get(key, default)
  if v is None:
    v = default
  if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and
                                                                 not float(v).is_integer()):
    raise HTTPError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}, "
                    f"got {v!r}", param=key)
  v = kind(v)
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    raise HTTPError(400, f"'{key}' must be in [{lo}, {hi}], got {v}", param=key)
  return v


def _stops(data: dict) -> list[str]:
  stop = data.get("stop")
  if stop is None:
    return []
  if isinstance(stop, str):
    stop = [stop]
  if (not isinstance(stop, list) or len(stop) > 4
      or not all(isinstance(s, str) and s for s in stop)):
    raise HTTPError(400, "'stop' must be a non-empty string or a list of at most 4 of them",
                    param="stop")
  return stop


class _Handler:
  """Turns parsed OpenAI requests into scheduler requests and results into responses."""

  def __init__(self, model: ServingModel):
    self.model = model

  def check_model(self, data: dict) -> None:
    name = data.get("model")
    if not isinstance(name, str) or not name:
      raise HTTPError(400, "'model' is required", param="model")
    if name != self.model.name:
      raise HTTPError(404, f"model {name!r} does not exist; this server serves "
                      f"{self.model.name!r}", param="model", code="model_not_found")

  def prompt_ids(self, data: dict, chat: bool) -> list[int]:
    tok = self.model.tokenizer
    if chat:
      msgs = data.get("messages")
      if (not isinstance(msgs, list) or not msgs or not all(
          isinstance(m, dict) and isinstance(m.get("role"), str)
          and isinstance(m.get("content"), str) for m in msgs)):
        raise HTTPError(400, "'messages' must be a non-empty list of {\"role\": str, "
                        "\"content\": str}", param="messages")
      text = self.model.chat_prompt(msgs)
    else:
      prompt = data.get("prompt")
      if isinstance(prompt, list) and prompt and all(
          isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
      if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
      if not isinstance(prompt, str):
        raise HTTPError(400, "'prompt' must be a string, a list of one string or a list of "
                        "token ids", param="prompt")
      text = prompt
    try:
      return tok.encode(text)
    except ValueError as e:
      raise HTTPError(400, f"cannot tokenize the prompt: {e}",
                      param="messages" if chat else "prompt") from None

  def request(self, data: dict, chat: bool) -> tuple[GenerationRequest, list[str]]:
    self.check_model(data)
    if _number(data, "n", 1, int) != 1:
      raise HTTPError(400, "only n=1 is supported", param="n")
    ids = self.prompt_ids(data, chat)
    sched = self.model.scheduler
    key = "max_completion_tokens" if chat and "max_completion_tokens" in data else "max_tokens"
    max_tokens = _number(data, key, min(DEFAULT_MAX_TOKENS, sched.max_tokens), int)
    if not 1 <= max_tokens <= sched.max_tokens:
      raise HTTPError(400, f"'{key}' must be in [1, {sched.max_tokens}], got {max_tokens}",
                      param=key)
    if len(ids) > sched.max_prompt_tokens:
      raise HTTPError(400, f"the prompt has {len(ids)} tokens, more than this server's limit of "
                      f"{sched.max_prompt_tokens}", param="messages" if chat else "prompt",
                      code="context_length_exceeded")
    temperature = _number(data, "temperature", 1.0, float, 0.0, 2.0)
    top_p = _number(data, "top_p", 1.0, float, 0.0, 1.0)
    if top_p == 0:
      raise HTTPError(400, "'top_p' must be > 0", param="top_p")
    top_k = _number(data, "top_k", 0, int, 0)
    seed = _number(data, "seed", 0, int, 0, 2**31 - 1)
    req = GenerationRequest(tuple(ids), max_tokens, SamplingParams(temperature, top_k, top_p),
                            seed, self.model.stop_tokens)
    try:
      sched.validate(req)
    except ValueError as e:
      raise HTTPError(400, str(e)) from None
    return req, _stops(data)

  def submit(self, req: GenerationRequest):
    """The request's `TokenStream` (429 queue full, 503 closed)."""
    try:
      return self.model.scheduler.submit_stream(req)
    except QueueFullError as e:
      raise HTTPError(429, str(e), "rate_limit_error", code="queue_full") from None
    except SchedulerClosedError as e:
      raise HTTPError(503, str(e), "server_error") from None

  async def run(self, req: GenerationRequest):
    fut = self.submit(req).future
    try:
      return await asyncio.wrap_future(fut)
    except Exception as e:  # noqa: BLE001 - an engine failure on this batch
      raise _failed(e) from None


def _failed(e: BaseException) -> HTTPError:
  return HTTPError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")


class _Text:
  """The text of a growing list of generated tokens, cut before the first `stop` string.

  `add(ids)` returns the new text that is safe to send: pieces come from decoding growing
  prefixes (multi-token characters stay whole), and a tail that could still begin a stop string
  is held back until it cannot; `finish()` returns what is left. `stopped`: a stop string cut
  the text (nothing more is returned)."""

  def __init__(self, tokenizer, stops: list[str]):
    self.tok, self.stops = tokenizer, stops
    self.ids: list[int] = []
    self.full, self.prev, self.sent, self.stopped = "", "", 0, False

  def add(self, ids) -> str:
    for i in ids:
      self.ids.append(int(i))
      cur = self.tok.decode(self.ids)
      if cur.startswith(self.prev):
        self.full += cur[len(self.prev):]
        self.prev = cur
      else:
        self.full += cur
        self.prev += cur
    if self.stopped:
      return ""
    cut = min((self.full.find(s) for s in self.stops if s in self.full), default=-1)
    if cut >= 0:
      self.stopped = True
      return self._send(cut)
    hold = max((k for s in self.stops for k in range(1, len(s)) if self.full.endswith(s[:k])),
               default=0)
    return self._send(len(self.full) - hold)

  def _send(self, end: int) -> str:
    out = self.full[self.sent:max(end, self.sent)]
    self.sent = max(end, self.sent)
    return out

  def finish(self) -> str:
    return "" if self.stopped else self._send(len(self.full))


def build_app(model: ServingModel, *, api_key: str | None = None,
              max_body_bytes: int = 1 << 20) -> Starlette:
  """The ASGI app serving `model`; `api_key` set: every /v1 route needs `Bearer <api_key>`."""
  handler = _Handler(model)

  async def generate(request: Request, chat: bool):
    try:
      _check_key(request, api_key)
      data = await _read_json(request, max_body_bytes)
      req, stops = handler.request(data, chat)
      stream = data.get("stream", False)
      if not isinstance(stream, bool):
        raise HTTPError(400, "'stream' must be true or false", param="stream")
      if not stream:
        result = await handler.run(req)
      else:
        token_stream = handler.submit(req)
    except HTTPError as e:
      return e.response()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    def usage(completion_tokens: int) -> dict:
      return {"prompt_tokens": len(req.prompt), "completion_tokens": completion_tokens,
              "total_tokens": len(req.prompt) + completion_tokens}

    if not stream:
      cutter = _Text(model.tokenizer, stops)
      text = cutter.add(result.tokens) + cutter.finish()
      reason = "stop" if cutter.stopped else result.finish_reason
      choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
      if chat:
        choice["message"] = {"role": "assistant", "content": text}
      else:
        choice["text"] = text
      if data.get("return_token_ids") is True:  # extension: the generated ids, before stop cuts
        choice["token_ids"] = list(result.tokens)
      return JSONResponse({"id": rid, "object": obj, "created": created, "model": model.name,
                           "choices": [choice], "usage": usage(len(result.tokens))})

    def event(delta_text: str | None, finish: str | None, first: bool = False,
              n_tokens: int = 0) -> str:
      choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
      if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if delta_text is not None:
          delta["content"] = delta_text
        choice["delta"] = delta
      else:
        choice["text"] = delta_text or ""
      chunk = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
               "model": model.name, "choices": [choice]}
      if finish is not None:
        chunk["usage"] = usage(n_tokens)
      return f"data: {json.dumps(chunk)}\n\n"

    async def events():
      try:
        async for item in _events():
          yield item
      finally:  # a stop string ended the text, or the client went away: free its slot
        token_stream.cancel()

    async def _events():
      if chat:
        yield event("", None, first=True)
      text = _Text(model.tokenizer, stops)
      try:
        async for token, _ in token_stream:  # each token as soon as it reaches the host
          piece = text.add([token])
          if piece:
            yield event(piece, None)
          if text.stopped:  # a stop string: the answer ends here
            break
        if not text.stopped:
          rest = text.finish()
          if rest:
            yield event(rest, None)
          reason = (await asyncio.wrap_future(token_stream.future)).finish_reason
        else:
          reason = "stop"
      except Exception as e:  # noqa: BLE001 - headers are sent: report it in the stream
        err = _failed(e)
        yield "data: " + json.dumps({"error": {"message": err.message, "type": err.kind,
                                               "param": None, "code": None}}) + "\n\n"
        yield "data: [DONE]\n\n"
        return
      yield event(None, reason, n_tokens=len(text.ids))
      yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})

  async def completions(request: Request):
    return await generate(request, chat=False)

  async def chat_completions(request: Request):
    return await generate(request, chat=True)

  async def models(request: Request):
    try:
      _check_key(request, api_key)
    except HTTPError as e:
      return e.response()
    return JSONResponse({"object": "list", "data": [
        {"id": model.name, "object": "model", "created": 0, "owned_by": "trace_jax",
         "max_prompt_tokens": model.scheduler.max_prompt_tokens,
         "max_tokens": model.scheduler.max_tokens}]})

  async def health(request: Request):
    return JSONResponse({"status": "ok", "queue": model.scheduler.queue_length})

  async def not_found(request: Request, exc):
    return HTTPError(404, f"no route {request.method} {request.url.path}",
                     code="not_found").response()

  async def method_not_allowed(request: Request, exc):
    return HTTPError(405, f"method {request.method} not allowed on {request.url.path}",
                     code="method_not_allowed").response()

  routes = [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"])]
  return Starlette(routes=routes, exception_handlers={404: not_found, 405: method_not_allowed})
