"""An OpenAI-compatible HTTP server around the engine (FastAPI + uvicorn): ``retrofit serve``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the tokenizer's chat template),
streaming with server-sent events (``"stream": true``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text: queue length, running requests, rows in flight, tokens/s, mean
depth d̄, KV blocks in use). Every response's ``usage`` adds the request's ``mean_depth`` (exit depth of
the steps that produced its tokens) and ``flops`` (``retrofit.model.flops``) to the OpenAI fields.

Beyond OpenAI's parameters a request may set ``top_k``, ``ignore_eos`` and the exit control of
``generate``: ``exit_policy`` (``decider``, ``fixed``, ``kl``, ``state``), ``exit_threshold``, ``depth``,
``step_schedule`` (``unit``, ``taps``) — with the ``openai`` client, through ``extra_body``.

A bad request gets a 4xx answer with an OpenAI-style JSON error (``{"error": {"message", "type",
"param", "code"}}``) and the server keeps serving; a streaming client that disconnects cancels its
request (its rows and KV blocks are freed); SIGTERM stops uvicorn gracefully and then the engine.
"""

# no `from __future__ import annotations`: FastAPI reads the route functions' annotations (Request)
import asyncio
import json
import logging
import signal
import threading
import time
import uuid

from .engine import Engine
from .kv import KVBudgetError
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _error_body(status: int, message: str, param=None, code=None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _number(body: dict, name: str, default, kind=float, lo=None, hi=None, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    if not ok:
        raise APIError(400, f"'{name}' must be {'an integer' if kind is int else 'a number'}, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise APIError(400, f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise APIError(400, f"'{name}' must be <= {hi}, got {v!r}", name)
    return kind(v)


def _metrics_registry(engine: Engine):
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            m = engine.metrics()
            gauges = {
                "queue_length": ("requests waiting in the queue", m["queue_length"]),
                "running_requests": ("requests being generated", m["running"]),
                "rows_in_flight": ("tokens in the core (rows of the depth-wise batch)", m["rows_in_flight"]),
                "tokens_per_second": ("generated tokens per second over the last 10 s", m["tokens_per_second"]),
                "mean_depth": ("mean exit depth of the generated tokens (d̄)", m["mean_depth"]),
                "kv_blocks_in_use": ("KV blocks allocated", m["kv_blocks_in_use"]),
                "kv_blocks_total": ("KV blocks in the budget", m["kv_blocks_total"]),
                "kv_bytes_in_use": ("bytes of the KV blocks allocated", m["kv_bytes_in_use"]),
            }
            for name, (doc, value) in gauges.items():
                g = GaugeMetricFamily(f"retrofit_{name}", doc)
                g.add_metric([], float(value))
                yield g
            for name, doc, value in (
                ("generated_tokens", "tokens generated", m["tokens_total"]),
                ("requests_finished", "requests finished", m["requests_finished"]),
                ("engine_steps", "engine steps", m["steps_total"]),
            ):
                c = CounterMetricFamily(f"retrofit_{name}", doc)
                c.add_metric([], float(value))
                yield c

    reg = CollectorRegistry(auto_describe=False)
    reg.register(Collector())
    return reg


def create_app(engine: Engine, tokenizer, model_name: str):
    """The FastAPI application serving ``engine`` under the name ``model_name``; its lifespan starts the
    engine's thread and, at shutdown (after uvicorn's graceful wait), stops it."""
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="retrofit serve", lifespan=lifespan)
    registry = _metrics_registry(engine)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(_error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(404)
    async def _not_found(request, exc):
        return JSONResponse(_error_body(404, f"no route {request.method} {request.url.path}"), status_code=404)

    @app.exception_handler(405)
    async def _not_allowed(request, exc):
        return JSONResponse(
            _error_body(405, f"method {request.method} not allowed on {request.url.path}"), status_code=405
        )

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "retrofit",
                    "max_model_len": engine.max_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def parse(body, chat: bool):
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model != model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this server serves {model_name!r}", "model", "model_not_found"
            )
        if chat:
            msgs = body.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                raise APIError(400, "'messages' must be a non-empty list of {role: str, content: str}", "messages")
            if getattr(tokenizer, "chat_template", None) is None:
                raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False).input_ids
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise APIError(400, f"'prompt' must be a string, got {type(prompt).__name__}", "prompt")
            ids = tokenizer(prompt).input_ids
        if not ids:
            raise APIError(400, "the prompt is empty", "prompt" if not chat else "messages")
        P = len(ids)
        if P >= engine.max_len:
            raise APIError(
                400,
                f"the prompt has {P} tokens but the context is {engine.max_len} tokens (prompt + max_tokens must fit)",
                "prompt" if not chat else "messages",
                "context_length_exceeded",
            )
        key = "max_completion_tokens" if (chat and body.get("max_completion_tokens") is not None) else "max_tokens"
        default_max = (engine.max_len - P) if chat else 16
        max_tokens = _number(body, key, default_max, int, lo=1)
        if P + max_tokens > engine.max_len:
            raise APIError(
                400,
                f"prompt ({P} tokens) + {key} ({max_tokens}) exceeds the context of {engine.max_len} tokens",
                key,
                "context_length_exceeded",
            )
        if _number(body, "n", 1, int, lo=1) != 1:
            raise APIError(400, "only n = 1 is supported", "n")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a string or a list of non-empty strings", "stop")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise APIError(400, f"'seed' must be an integer, got {seed!r}", "seed")
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0, float, lo=0, hi=2),
            top_p=_number(body, "top_p", 1.0, float, lo=0, hi=1, lo_open=True),
            top_k=max(0, _number(body, "top_k", 0, int, lo=-1)),
            max_tokens=max_tokens,
            stop=stop,
            seed=seed,
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
        exit_kw = {k: body.get(k) for k in ("exit_policy", "exit_threshold", "depth", "step_schedule")}
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        return ids, params, exit_kw, stream, include_usage

    async def handle(request: Request, chat: bool):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        ids, params, exit_kw, stream, include_usage = parse(body, chat)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            req = engine.add_request(
                ids,
                params,
                request_id=rid,
                on_event=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                **exit_kw,
            )
        except KVBudgetError as e:
            raise APIError(400, str(e)) from None
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())

        def choice(text, finish, delta: bool):
            if chat:
                key = "delta" if delta else "message"
                msg = {"role": "assistant", "content": text} if (not delta or text is not None) else {}
                return {"index": 0, key: msg, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        if stream:

            async def events():
                finished = False
                try:
                    while True:
                        ev = await queue.get()
                        if ev["type"] == "token":
                            if not ev["text"]:
                                continue
                            chunk = {
                                "id": rid,
                                "object": obj + (".chunk" if chat else ""),
                                "created": now,
                                "model": model_name,
                                "choices": [choice(ev["text"], None, True)],
                            }
                        else:
                            finished = True
                            reason = ev["reason"]
                            if reason == "error":
                                yield (
                                    "data: "
                                    + json.dumps(_error_body(500, "the engine failed on this request"))
                                    + "\n\n"
                                )
                                break
                            chunk = {
                                "id": rid,
                                "object": obj + (".chunk" if chat else ""),
                                "created": now,
                                "model": model_name,
                                "choices": [choice("" if not chat else None, reason, True)],
                            }
                            if not include_usage:
                                chunk["usage"] = ev["usage"]
                            yield "data: " + json.dumps(chunk) + "\n\n"
                            if include_usage:
                                u = {
                                    "id": rid,
                                    "object": obj + (".chunk" if chat else ""),
                                    "created": now,
                                    "model": model_name,
                                    "choices": [],
                                    "usage": ev["usage"],
                                }
                                yield "data: " + json.dumps(u) + "\n\n"
                            yield "data: [DONE]\n\n"
                            break
                        yield "data: " + json.dumps(chunk) + "\n\n"
                finally:
                    if not finished:  # the client went away: free the request's rows and KV blocks
                        engine.cancel(rid)

            return StreamingResponse(
                events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": rid}
            )

        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    if await request.is_disconnected():
                        engine.cancel(rid)
                        return Response(status_code=499)
                    continue
                if ev["type"] == "finish":
                    break
        except asyncio.CancelledError:
            engine.cancel(rid)
            raise
        if ev["reason"] == "error":
            raise APIError(500, "the engine failed on this request")
        return {
            "id": rid,
            "object": obj,
            "created": now,
            "model": model_name,
            "choices": [choice(req.text, ev["reason"], False)],
            "usage": ev["usage"],
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def serve(
    engine: Engine, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Run the server until SIGTERM/SIGINT: uvicorn shuts down gracefully, then the engine stops."""
    import uvicorn

    app = create_app(engine, tokenizer, model_name)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    main = threading.current_thread() is threading.main_thread()
    # uvicorn handles SIGTERM itself (graceful shutdown, then the lifespan stops the engine) and re-raises
    # the signal afterwards; by then everything has stopped, so the re-raised SIGTERM may end us normally
    prev = signal.signal(signal.SIGTERM, lambda signum, frame: None) if main else None
    try:
        server.run()
    finally:
        if main:
            signal.signal(signal.SIGTERM, prev)
        engine.shutdown()
