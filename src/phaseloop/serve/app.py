"""The OpenAI-compatible API: Starlette routes over the decode loop (``engine``).

Routes: ``GET /health`` (no key needed), ``GET /metrics`` (Prometheus text),
``GET /v1/models`` (+ ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (a 400 when the tokenizer has no chat template). With an
API key every route but ``/health`` wants ``Authorization: Bearer KEY`` (else 401).

Every refusal is OpenAI's error object with the status a client's library maps to its
exception: 400 an invalid field (``schema``, ``options``), 401 the key, 404 another model
or route, 408 past the per-request timeout, 413 a body over the limit, 429 the queue is
full. A request only names prompts, numbers and options: nothing in it is a path, and the
server opens no file after start. A client that disconnects cancels its sequences.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
from dataclasses import dataclass

from phaseloop.serve import options, responses, schema
from phaseloop.serve.engine import Engine, QueueFull, request_id
from phaseloop.serve.loading import Served
from phaseloop.serve.metrics import Metrics
from phaseloop.serve.schema import APIError, Limits
from phaseloop.serve.sequence import Sampling, Sequence
from phaseloop.serve.web import ClientDisconnect, HTTPException, Request, Response, Route, Starlette, StreamingResponse


def json_response(data: dict, status: int = 200) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json")


class Disconnected(Exception):
    """The client went away before its answer was ready."""


@dataclass
class Server:
    served: Served
    engine: Engine
    limits: Limits
    metrics: Metrics
    api_key: str | None = None
    timeout: float = 600.0

    # -------------------------------------------------------------- request plumbing
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:] if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), self.api_key.encode()):
            raise APIError(401, "a missing or wrong API key: send the header Authorization: Bearer KEY "
                           "(the key phaseloop serve was started with)", code="invalid_api_key")

    async def json_body(self, request: Request) -> dict:
        limit = self.limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body has {declared} bytes; at most {limit} (--max-body-bytes)")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise APIError(413, f"the request body is over {limit} bytes (--max-body-bytes)")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not JSON") from None
        except RecursionError:
            raise APIError(400, "the request body is not JSON this server reads: nested too deeply") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:  # a \ud800-style escape decodes to a lone surrogate, which no tokenizer encodes
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "the request body holds a lone surrogate escape (e.g. \\ud800), which is not "
                           "text; send valid UTF-8") from None
        model = body.get("model")
        if isinstance(model, str) and model != self.served.name:
            raise APIError(404, f"the model {model!r} does not exist here; this server serves "
                           f"{self.served.name!r} (GET /v1/models)", "model", code="model_not_found")
        return body

    def sequences(self, req: schema.Request, settings) -> tuple[list[Sequence], asyncio.Queue]:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        deadline = time.monotonic() + self.timeout
        sampling = Sampling(req.temperature, req.top_k, req.top_p, req.seed, req.logprobs)
        seqs = []
        for prompt in req.prompts:
            for j in range(req.n):
                k = len(seqs)
                seqs.append(Sequence(prompt, req.max_tokens, sampling, settings, self.served.vocab,
                                     lambda ev, k=k: loop.call_soon_threadsafe(queue.put_nowait, (k, ev)),
                                     req.stop, self.served.eos_id, req.stream,
                                     req.logprobs if req.echo and req.logprobs is not None else None,
                                     deadline, index=j))
        return seqs, queue

    def failed(self, s: Sequence) -> APIError | None:
        if s.finish == "timeout":
            return APIError(408, f"the request ran past the server's timeout of {self.timeout:g} s (--timeout); "
                            "ask for fewer tokens or retry", type="timeout_error", code="timeout")
        if s.finish == "cancelled":
            return APIError(503, "the server is shutting down", type="server_error")
        if s.finish == "error":
            return APIError(500, "generation failed inside the server (its log has the traceback)", type="server_error")
        return None

    async def generate(self, request: Request, req: schema.Request):
        settings = options.resolve(self.served.twin, req.phaseloop, self.served.defaults)
        seqs, queue = self.sequences(req, settings)
        if len(seqs) > self.engine.max_queue:
            raise schema.bad("n", f"{len(seqs)} sequences (prompts x n) is more than the queue holds "
                             f"({self.engine.max_queue}, --max-queue)")
        try:
            self.engine.submit(seqs)
        except QueueFull as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        rid, name, decode = request_id("chatcmpl" if req.chat else "cmpl"), self.served.name, self.served.vocab
        if req.stream:
            return StreamingResponse(self.stream(request, req, seqs, queue, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            pending = set(range(len(seqs)))
            while pending:
                try:
                    k, ev = await asyncio.wait_for(queue.get(), 0.25)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise Disconnected() from None
                    continue
                if ev.finish is not None:
                    pending.discard(k)
        finally:
            self.engine.cancel([s for s in seqs if s.finish is None])
        err = next((e for e in map(self.failed, seqs) if e is not None), None)
        if err is not None:
            raise err
        return json_response(responses.body(req, seqs, rid, name, decode))

    async def stream(self, request: Request, req: schema.Request, seqs: list[Sequence], queue, rid: str):
        name, decode, t0, status = self.served.name, self.served.vocab, time.monotonic(), "200"
        try:
            started, pending, track = set(), set(range(len(seqs))), {}
            while pending:
                k, ev = await queue.get()
                if ev.finish is not None:
                    pending.discard(k)
                    err = self.failed(seqs[k])
                    if err is not None:
                        status = str(err.status)
                        yield responses.sse(err.body())
                        return
                if k not in started:
                    started.add(k)
                    track[k] = responses.tracker(req, seqs[k], k, decode)
                    if req.echo:
                        yield responses.sse(responses.echo_chunk(req, seqs[k], rid, name, k, decode))
                    first = True
                else:
                    first = False
                if ev.text or ev.finish or first or req.logprobs is not None:
                    yield responses.sse(responses.chunk(req, rid, name, k, ev, decode, first=first and req.chat,
                                                        track=track[k]))
            if req.include_usage:
                yield responses.sse({"id": rid, "object": "chat.completion.chunk" if req.chat else "text_completion",
                                     "created": int(time.time()), "model": name, "choices": [],
                                     "usage": responses.usage(req, seqs)})
            yield responses.sse("[DONE]")
        except BaseException:
            status = "499"  # the client went away (the response task was cancelled)
            raise
        finally:
            self.engine.cancel([s for s in seqs if s.finish is None])
            self.record("chat" if req.chat else "completions", status, t0)

    def record(self, route: str, status: str, t0: float) -> None:
        self.metrics.requests.labels(route, status).inc()
        self.metrics.latency.labels(route).observe(time.monotonic() - t0)

    # -------------------------------------------------------------- the routes
    async def completions(self, request: Request):
        body = await self.json_body(request)
        return await self.generate(request, schema.completion(body, self.served.encode, self.limits))

    async def chat(self, request: Request):
        body = await self.json_body(request)
        if self.served.render is None:
            raise APIError(400, "this model's tokenizer has no chat template, so /v1/chat/completions cannot "
                           "build a prompt; use /v1/completions, or start the server with --chat-template FILE",
                           "messages", code="no_chat_template")
        try:
            req = schema.chat(body, self.served.render, self.served.encode, self.limits)
        except APIError:
            raise
        except Exception as e:  # the template refused the conversation (raise_exception, a TemplateError)
            raise APIError(400, f"the chat template cannot render these messages: {str(e).splitlines()[0][:200]}",
                           "messages") from None
        return await self.generate(request, req)

    async def models(self, request: Request):
        return json_response({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request):
        if request.path_params["model"] != self.served.name:
            raise APIError(404, f"the model {request.path_params['model']!r} does not exist here; this server "
                           f"serves {self.served.name!r}", "model", code="model_not_found")
        return json_response(self.model_card())

    def model_card(self) -> dict:
        return {"id": self.served.name, "object": "model", "created": int(self.served.info.get("created", 0)),
                "owned_by": "phaseloop", "max_model_len": self.limits.max_context,
                "phaseloop": {**self.served.info, "defaults": self.served.defaults.label(),
                              "chat_template": self.served.render is not None}}

    async def health(self, request: Request):
        return json_response({"status": "ok", "queue": len(self.engine.waiting), "running": self.engine.running})

    async def prometheus(self, request: Request):
        text, ctype = self.metrics.text()
        return Response(text, media_type=ctype)


def _route(server: Server, path: str, name: str, fn, methods: list[str], auth: bool = True) -> Route:
    """``path`` served by ``fn``; ``name``: its label in the request metrics (a stream's is the
    same: Server.stream records "completions" or "chat" at its end)."""

    async def endpoint(request: Request) -> Response:
        t0, status, response = time.monotonic(), 500, None
        try:
            if auth:
                server.check_key(request)
            response = await fn(request)
            status = response.status_code
            return response
        except APIError as e:
            status = e.status
            return json_response(e.body(), e.status)
        except (Disconnected, ClientDisconnect):
            status = 499
            return Response(status_code=499)
        except Exception:  # a bug: the client gets an error object, the log the traceback
            traceback.print_exc(file=sys.stderr)
            return json_response(APIError(500, "internal error (the server's log has the traceback)",
                                          type="server_error").body(), 500)
        finally:
            if not isinstance(response, StreamingResponse):  # a stream records itself at its end
                server.record(name, str(status), t0)

    return Route(path, endpoint, methods=methods)


def create_app(server: Server) -> Starlette:
    routes = [_route(server, "/health", "health", server.health, ["GET"], auth=False),
              _route(server, "/metrics", "metrics", server.prometheus, ["GET"]),
              _route(server, "/v1/models", "models", server.models, ["GET"]),
              _route(server, "/v1/models/{model:path}", "model", server.model, ["GET"]),
              _route(server, "/v1/completions", "completions", server.completions, ["POST"]),
              _route(server, "/v1/chat/completions", "chat", server.chat, ["POST"])]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; the routes are "
                       "/v1/completions, /v1/chat/completions, /v1/models, /health and /metrics",
                       type="invalid_request_error" if exc.status_code < 500 else "server_error")
        return json_response(err.body(), exc.status_code)

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.server = server
    return app
