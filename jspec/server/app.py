"""The FastAPI application: OpenAI's completions, chat completions and models endpoints over an
:class:`~jspec.server.worker.EngineWorker`, plus ``/health`` and ``/metrics``.

Handlers only validate, hand the request to the engine thread and await their own asyncio
queue; they never call the engine. Every error reaches the client as an OpenAI error object
(``{"error": {"message", "type", "param", "code"}}``): 400 for bad input (invalid JSON, a field
of the wrong type, an out-of-range value, a prompt that does not fit, an unknown model), 401
without the API key, 404 for an unknown route, 408 for a body that does not arrive in time, 413
for one too large, 429 past the waiting-queue bound, 500 for a request the engine failed (that
request alone), 503 while draining.

A client that disconnects (streaming or not) has its requests aborted at once: the response
listens for ``http.disconnect`` while it waits for tokens, so the pages are freed within a
burst, not at the next write. While draining (SIGTERM, see :mod:`jspec.server.serve`) requests
in flight run to the end and new ones get 503.

Work is bounded before it is accepted (:class:`Limits`): the body must arrive within
``body_timeout`` (408 otherwise); a text prompt longer than ``max_model_len`` times the
tokenizer's longest token, in characters, cannot fit and is refused before it is tokenized;
prompts are tokenized on a thread of their own, never on the engine's, and one that does not fit
the context is refused there (400), so the engine never sees it; past ``max_waiting_requests``
queued requests a new one gets 429 with ``Retry-After``. With an API key, ``/metrics`` and
``/openapi.json`` need it too (unless ``public_metrics``); ``/health`` never does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import json
import math
import time
from typing import AsyncIterator, Optional, Union

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from jspec.errors import JspecError
from jspec.server import protocol as api
from jspec.server.limits import Limits
from jspec.server.metrics import CONTENT_TYPE, ServerMetrics
from jspec.server.worker import EngineWorker, Event, Submission, prompt_ids


@dataclasses.dataclass
class ServerState:
    worker: EngineWorker
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    api_key: Optional[str] = None
    limits: Limits = Limits()
    max_prompt_chars: Optional[int] = None  # longer text cannot fit max_model_len tokens
    tokenize_pool: Optional[concurrent.futures.Executor] = None
    rejected: dict = dataclasses.field(default_factory=dict)  # requests refused before the engine, by reason
    draining: bool = False
    inflight: int = 0  # generation requests past the gate and not yet answered


def longest_token_bytes(tokenizer) -> Optional[int]:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry (special tokens included): no
    token covers more characters of a text than that, so a text of more than ``n`` times as
    many characters has more than ``n`` tokens. None when the vocabulary cannot be read."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(str(t).encode("utf-8")) for t in vocab) if vocab else None
    except Exception:
        return None


def create_app(worker: EngineWorker, model_name: str, *, api_key: Optional[str] = None,
               metrics: Optional[ServerMetrics] = None, limits: Limits = Limits()) -> FastAPI:
    """The ASGI app. Its lifespan starts the worker's thread and, at shutdown, closes it."""
    metrics = metrics or ServerMetrics(lambda: worker.snapshot, model_name)
    if worker.on_finished is None:
        worker.on_finished = metrics.observe
    tokenizer = worker.engine.tokenizer
    longest = longest_token_bytes(tokenizer) if tokenizer is not None else None
    max_len = worker.engine.max_model_len
    # one thread: tokenizers are not all safe to call from several threads at once
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jspec-tokenize")
    state = ServerState(worker, model_name, max_len, metrics, api_key, limits,
                        None if longest is None else max_len * longest, pool, metrics.rejected)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        await asyncio.to_thread(worker.close, 30.0)
        pool.shutdown(wait=False, cancel_futures=True)

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
            return _error(503, "the engine thread is not running", "service_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return api.models_body(model_name, state.max_model_len)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, api.CompletionRequest, state)
        _check_model(state, body.model)
        body.check()
        params, fill = body.sampling_params(default_max_tokens=16)
        prompts = body.prompts()
        rid, created = api.new_id("cmpl"), int(time.time())
        ids = await _prompt_ids(state, rid, [(p, None) for p in prompts], params, fill)
        gen = await _Generation.start(state, rid, ids, params, fill)
        if body.stream:
            return _EventStream(_completion_chunks(gen, rid, model_name, created, body.include_usage), gen.abort)
        results = await gen.collect(request)
        if results is None:
            return Response(status_code=499)  # the client closed the connection; nobody reads this
        choices = [api.completion_choice(i, r.text, r.finish_reason) for i, r in enumerate(results)]
        return api.completion_body(rid, model_name, created, choices, gen.usage())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, api.ChatCompletionRequest, state)
        _check_model(state, body.model)
        body.check()
        params, fill = body.sampling_params(default_max_tokens=None)
        rid, created = api.new_id("chatcmpl"), int(time.time())
        ids = await _prompt_ids(state, rid, [(None, body.template_messages())], params, fill)
        gen = await _Generation.start(state, rid, ids, params, fill)
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
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

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


async def _parse(request: Request, schema, state: ServerState):
    """The JSON body validated against ``schema`` (whatever the Content-Type: ``curl -d``
    sends form-encoded headers); APIError 400 / 413, or 408 when it does not arrive in time."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(state.limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > api.MAX_BODY_BYTES:
                    raise api.APIError(f"the request body is larger than {api.MAX_BODY_BYTES} bytes", 413)
                chunks.append(chunk)
    except TimeoutError:
        state.rejected["body_timeout"] += 1
        raise api.APIError(f"the request body did not arrive within {state.limits.body_timeout:g} s", 408,
                           code="timeout", headers={"Connection": "close"}) from None
    body = b"".join(chunks)
    del chunks
    try:
        return schema.model_validate_json(body)
    except pydantic.ValidationError as e:
        message, param = api.validation_message(e.errors(include_url=False))
        raise api.APIError(message, param=param) from None


def _too_long(state: ServerState, message: str) -> api.APIError:
    state.rejected["prompt_too_long"] += 1
    return api.APIError(message, param="prompt", code="context_length_exceeded")


async def _prompt_ids(state: ServerState, rid: str,
                      prompts: list[tuple[Union[str, list[int], None], Optional[list[dict]]]], params,
                      fill: bool) -> list[list[int]]:
    """Token ids of each (prompt, messages) pair, or a 400 for one that cannot fit: text longer
    than ``max_prompt_chars`` is refused unread; the rest is tokenized on the tokenizer thread
    and checked against the engine's limits (``LLMEngine.check_length``) before the engine sees it."""
    cap = state.max_prompt_chars
    for prompt, messages in prompts:
        chars = (len(prompt) if isinstance(prompt, str) else 0) + sum(len(m["content"]) for m in messages or ())
        if cap is not None and chars > cap:
            raise _too_long(state, f"prompt: {chars} characters exceeds max_model_len={state.max_model_len} "
                                   f"(no text of more than {cap} characters fits)")
    engine = state.worker.engine
    loop = asyncio.get_running_loop()
    out = []
    for i, (prompt, messages) in enumerate(prompts):
        try:
            ids = await loop.run_in_executor(state.tokenize_pool, prompt_ids, engine.tokenizer, prompt, messages)
        except JspecError as e:
            raise api.engine_error(e) from None
        try:
            engine.check_length(rid if len(prompts) == 1 else f"{rid}-{i}", len(ids),
                                1 if fill else params.max_tokens)
        except JspecError as e:
            raise _too_long(state, str(e)) from None
        out.append(ids)
    if params.structured_outputs is not None:  # compiled (and cached) here, not on the engine's thread
        try:
            await loop.run_in_executor(state.tokenize_pool, engine.check_constraint, params)
        except JspecError as e:
            raise api.APIError(str(e), param="response_format") from None
    return out


def _check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise api.APIError(f"model: the model {model!r} does not exist; this server serves {state.model_name!r}",
                           param="model", code="model_not_found")


class _Gate:
    """Pure ASGI middleware (it never touches ``receive``, so disconnects reach the handlers):
    the API key on ``/v1/*`` (and ``/metrics``, ``/openapi.json``), 503 for new generation
    requests while draining, and the count of generation requests in flight that draining waits
    for."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.keyed = ("/openapi.json",) + (() if state.limits.public_metrics else ("/metrics",))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st, path = self.state, scope["path"]
        v1 = path.startswith("/v1/")
        if st.api_key is not None and (v1 or path in self.keyed) and not _authorized(scope, st.api_key):
            response = _error(401, "missing or wrong API key (send the header 'Authorization: Bearer KEY')",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        if not v1 or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        if st.draining or not st.worker.alive:
            why = "the server is shutting down" if st.draining else "the engine thread is not running"
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
    async def start(cls, state: ServerState, rid: str, prompts: list[list[int]], params, fill: bool) -> "_Generation":
        """Submit every prompt (token ids) and wait until the engine took them all (or refused
        one: then none runs, and the refusal is raised as an APIError). Past the waiting-queue
        bound nothing is submitted: 429."""
        worker, bound = state.worker, state.limits.max_waiting_requests
        if bound is not None and worker.num_waiting + len(prompts) > bound:
            state.rejected["queue_full"] += 1
            # about when a slot frees up: the queue ahead, at the recent request latency per slot
            wait = worker.num_waiting * worker.mean_latency / max(1, len(worker.engine.scheduler.slots))
            raise api.APIError(f"the server is overloaded: {worker.num_waiting} requests are waiting (at most "
                               f"{bound}); retry later", 429, "rate_limit_error", code="queue_full",
                               headers={"Retry-After": str(min(60, max(1, math.ceil(wait))))})
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        gen = cls(worker, ids)
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        futures = []
        for i, p in enumerate(prompts):
            sink = functools.partial(_put, loop, gen.queue, i)
            futures.append(worker.submit(Submission(ids[i], p, params, sink, fill_max_tokens=fill,
                                                    arrival_time=now)))
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
                    raise api.APIError(f"the engine failed on this request: {ev.error}", 500,
                                       "internal_server_error")

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
            yield _sse(api.error_body(f"the engine failed on this request: {ev.error}", "internal_server_error"))
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
            yield _sse(api.error_body(f"the engine failed on this request: {ev.error}", "internal_server_error"))
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


__all__ = ["Limits", "ServerState", "create_app", "longest_token_bytes"]
