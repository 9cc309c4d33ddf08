"""The FastAPI application: OpenAI's completions, chat completions and models endpoints over an
:class:`~jspec.server.worker.EngineWorker`, plus ``/health`` and ``/metrics``.

Handlers only validate, hand the request to the engine thread and await their own asyncio
queue; they never call the engine. Every error reaches the client as an OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``): 400 for bad input (invalid JSON, a field
of the wrong type, an out-of-range value, a prompt that does not fit, an unknown model), 401
without the API key, 404 for an unknown route, 503 while draining or after an engine failure.

A client that disconnects (streaming or not) has its requests aborted at once: the response
listens for ``http.disconnect`` while it waits for tokens, so the pages are freed within a
burst, not at the next write. While draining (SIGTERM, see :mod:`jspec.server.serve`) requests
in flight run to the end and new ones get 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import time
from typing import AsyncIterator, Optional

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jspec.errors import JspecError
from jspec.server import protocol as api
from jspec.server.metrics import CONTENT_TYPE, ServerMetrics
from jspec.server.worker import EngineWorker, Event, Submission


@dataclasses.dataclass
class ServerState:
    worker: EngineWorker
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: Optional[str] = None
    draining: bool = False
    inflight: int = 0  # generation requests past the gate and not yet answered


def create_app(worker: EngineWorker, model_name: str, *, api_key: Optional[str] = None,
               metrics: Optional[ServerMetrics] = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the worker's thread and, at shutdown, closes it."""
    metrics = metrics or ServerMetrics(lambda: worker.snapshot, model_name)
    if worker.on_finished is None:
        worker.on_finished = metrics.observe
    state = ServerState(worker, model_name, worker.engine.max_model_len, metrics, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.close, 30.0)

    app = FastAPI(title="jspec", description="OpenAI-compatible server over jspec's engine", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.jspec = state
    app.add_middleware(_Gate, state=state)
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if state.draining:
            return _error(503, "the server is shutting down", "service_unavailable")
        if not worker.alive:
            return _error(503, f"the engine failed: {worker.error}", "service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return api.models_body(model_name, state.max_model_len)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, api.CompletionRequest)
        _check_model(state, body.model)
        body.check()
        params, fill = body.sampling_params(default_max_tokens=16)
        prompts = body.prompts()
        rid, created = api.new_id("cmpl"), int(time.time())
        gen = await _Generation.start(worker, rid, [dict(prompt=p) for p in prompts], params, fill)
        if body.stream:
            return _EventStream(_completion_chunks(gen, rid, model_name, created, body.include_usage), gen.abort)
        results = await gen.collect(request)
        if results is None:
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        choices = [api.completion_choice(i, r.text, r.finish_reason) for i, r in enumerate(results)]
        return api.completion_body(rid, model_name, created, choices, gen.usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, api.ChatCompletionRequest)
        _check_model(state, body.model)
        body.check()
        params, fill = body.sampling_params(default_max_tokens=None)
        rid, created = api.new_id("chatcmpl"), int(time.time())
        gen = await _Generation.start(worker, rid, [dict(prompt=None, messages=body.template_messages())], params,
                                      fill)
        if body.stream:
            return _EventStream(_chat_chunks(gen, rid, model_name, created, body.include_usage), gen.abort)
        results = await gen.collect(request)
        if results is None:
            return Response(status_code=499)
        choices = [api.chat_choice(i, r.text, r.finish_reason) for i, r in enumerate(results)]
        return api.chat_body(rid, model_name, created, choices, gen.usage())

    return app


# ---------------------------------------------------------------------- errors
def _error(status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
           code: Optional[str] = None, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(api.error_body(message, type, param, code), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(api.APIError)
    async def api_error(request, e: api.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        message, param = api.validation_message(list(e.errors()))
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request, e: Exception):
        return _error(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


async def _parse(request: Request, schema):
    """The JSON body validated against ``schema`` (whatever the Content-Type: ``curl -d``
    sends form-encoded headers); APIError 400 / 413 otherwise."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > api.MAX_BODY_BYTES:
            raise api.APIError(f"the request body is larger than {api.MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    try:
        return schema.model_validate_json(b"".join(chunks))
    except pydantic.ValidationError as e:
        message, param = api.validation_message(e.errors(include_url=False))
        raise api.APIError(message, param=param) from None


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise api.APIError(f"model: the model {model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")


class _Gate:
    """Pure ASGI middleware (it never touches ``receive``, so disconnects reach the handlers):
    the API key on ``/v1/*``, 503 for new generation requests while draining, and the count of
    generation requests in flight that draining waits for."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        st = self.state
        if st.api_key is not None and not _authorized(scope, st.api_key):
            response = _error(401, "missing or wrong API key (send the header 'Authorization: Bearer KEY')",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if st.draining or not st.worker.alive:
            why = "the server is shutting down" if st.draining else f"the engine failed: {st.worker.error}"
            return await _error(503, why, "service_unavailable")(scope, receive, send)
        st.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            st.inflight -= 1


def _authorized(scope, key: str) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
    return False


# ---------------------------------------------------------------------- generation
@dataclasses.dataclass
class _Result:
    text: str = ""
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Generation:
    """The engine requests of one HTTP request (one per prompt) and the queue their events
    arrive on, as (index, Event) pairs."""

    def __init__(self, worker: EngineWorker, ids: list[str]):
        self.worker, self.ids = worker, ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.open = set(range(len(ids)))
        self.results = [_Result() for _ in ids]

    @classmethod
    async def start(cls, worker: EngineWorker, rid: str, prompts: list[dict], params, fill: bool) -> "_Generation":
        """Submit every prompt and wait until the engine took them all (or refused one: then
        none runs, and the refusal is raised as an APIError)."""
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        gen = cls(worker, ids)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        futures = []
        for i, p in enumerate(prompts):
            sink = functools.partial(_put, loop, gen.queue, i)
            futures.append(worker.submit(Submission(ids[i], p["prompt"], params, sink, messages=p.get("messages"),
                                                    fill_max_tokens=fill, arrival_time=now)))
        ok = False
        try:
            results = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
            errors = [e for e in results if isinstance(e, BaseException)]
            if errors:
                e = errors[0]
                if isinstance(e, JspecError):
                    raise api.engine_error(e)
                raise api.APIError(f"the engine could not take the request: {type(e).__name__}: {e}", 500,
                                   "internal_server_error")
            for i, n in enumerate(results):
                gen.results[i].prompt_tokens = n
            ok = True
            return gen
        finally:
            if not ok:  # refused, or the client left while waiting: none of them runs
                gen.abort()

    def abort(self) -> None:
        for i in self.open:
            self.worker.abort(self.ids[i])

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        while self.open:
            i, ev = await self.queue.get()
            r = self.results[i]
            r.text += ev.text
            r.prompt_tokens = ev.prompt_tokens or r.prompt_tokens
            r.completion_tokens = ev.completion_tokens
            if ev.finished:
                self.open.discard(i)
                r.finish_reason = ev.finish_reason
            yield i, ev

    async def collect(self, request: Request) -> Optional[list[_Result]]:
        """Every result; None (and the requests aborted) if the client disconnected first."""
        async def drain():
            async for _, ev in self.events():
                if ev.error is not None:
                    raise api.APIError(f"the engine failed: {ev.error}", 500, "internal_server_error")

        done_task = asyncio.ensure_future(drain())
        gone_task = asyncio.ensure_future(_wait_disconnect(request.receive))
        try:
            await asyncio.wait({done_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone_task.cancel()
            if not done_task.done():
                done_task.cancel()
            self.abort()  # a no-op for finished requests
        if done_task.cancelled():
            return None
        done_task.result()  # raises the engine's failure
        return self.results

    def usage(self) -> dict:
        return api.usage(sum(r.prompt_tokens for r in self.results), sum(r.completion_tokens for r in self.results))


def _put(loop: asyncio.AbstractEventLoop, q: asyncio.Queue, index: int, event: Event) -> None:
    loop.call_soon_threadsafe(q.put_nowait, (index, event))


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events that stop, and abort their requests, as soon as the client
    disconnects. (Starlette's own response, under ASGI spec 2.4, notices a disconnect only at
    its next write.)"""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as tg:
                async def stream():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()


async def _completion_chunks(gen: _Generation, rid: str, model: str, created: int, include_usage: bool):
    async for i, ev in gen.events():
        if ev.error is not None:
            yield _sse(api.error_body(f"the engine failed: {ev.error}", "internal_server_error"))
            break
        last = ev.finished and not gen.open
        choice = api.completion_choice(i, ev.text, ev.finish_reason)
        yield _sse(api.completion_body(rid, model, created, [choice], gen.usage() if last else None, chunk=True))
    if include_usage:
        yield _sse(api.completion_body(rid, model, created, [], gen.usage(), chunk=True))
    yield "data: [DONE]\n\n"


async def _chat_chunks(gen: _Generation, rid: str, model: str, created: int, include_usage: bool):
    yield _sse(api.chat_body(rid, model, created, [api.chat_delta(0, {"role": "assistant", "content": ""}, None)],
                             None, chunk=True))
    async for i, ev in gen.events():
        if ev.error is not None:
            yield _sse(api.error_body(f"the engine failed: {ev.error}", "internal_server_error"))
            break
        if ev.text:
            yield _sse(api.chat_body(rid, model, created, [api.chat_delta(i, {"content": ev.text}, None)], None,
                                     chunk=True))
        if ev.finished:
            usage = gen.usage() if not gen.open else None
            yield _sse(api.chat_body(rid, model, created, [api.chat_delta(i, {}, ev.finish_reason)], usage,
                                     chunk=True))
    if include_usage:
        yield _sse(api.chat_body(rid, model, created, [], gen.usage(), chunk=True))
    yield "data: [DONE]\n\n"


__all__ = ["ServerState", "create_app"]
