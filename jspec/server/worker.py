"""The engine thread: the one place that touches the :class:`~jspec.engine.engine.LLMEngine`.

The engine is not thread-safe, and ``step()`` blocks for a whole burst. So one daemon thread
owns it: it takes commands (add a request, abort one, stop) from a thread-safe queue between
bursts, runs bursts while any request is unfinished, and hands each request's new text to that
request's ``sink`` (a callable; the HTTP layer passes one that puts into an asyncio queue with
``loop.call_soon_threadsafe``). HTTP handlers never wait on the engine, only on their queue.

A request is accepted or refused through ``Submission.accepted`` (a ``concurrent.futures``
future): the engine's own checks (prompt too long for the context or the page pool, bad token
ids) run in this thread, so a bad request is refused before a streaming response starts. The
HTTP layer tokenizes prompts on its own thread and sends token ids, so nothing a client sends
makes this thread do work in proportion to its size before the engine's checks.

A request's failure is that request's: a request the engine finishes with reason ``"error"``
gets an error event, and so do the requests of a burst that raised (logged with their ids); the
thread goes on serving the rest and every later request.

Text is streamed in pieces whose concatenation is the engine's final text: a piece holds back
a trailing partial UTF-8 character (decoded as U+FFFD) and any suffix that could be the start of
a stop string, until the next tokens decide it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence, Union

from jspec.config import SamplingParams
from jspec.engine.engine import LLMEngine, encode_prompt
from jspec.engine.request import Request
from jspec.errors import PromptError

log = logging.getLogger("jspec.server")


@dataclasses.dataclass
class Event:
    """What a request's sink receives: new text, and at the end a finish reason or an error."""

    text: str = ""
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" on the last event
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[str] = None  # the engine failed on this request: it ends without a result

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclasses.dataclass
class Submission:
    """One request for the engine thread. ``messages`` (chat) go through the chat template;
    otherwise ``prompt`` is text or token ids. ``fill_max_tokens``: the budget is what the
    context leaves after the prompt (OpenAI's chat default)."""

    request_id: str
    prompt: Union[str, list[int], None]
    params: SamplingParams
    sink: Callable[[Event], None]
    messages: Optional[list[dict]] = None
    fill_max_tokens: bool = False
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    accepted: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)


@dataclasses.dataclass
class _Stream:
    sub: Submission
    sent: int = 0  # characters of the request's text already handed to the sink


def releasable(text: str, sent: int, stops: Sequence[str], finished: bool) -> int:
    """How far into ``text`` may be sent now (never before ``sent``)."""
    if finished:
        return len(text)
    end = len(text)
    while end > sent and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
        end -= 1
    hold = 0
    for s in stops:
        for n in range(min(len(s) - 1, end), hold, -1):
            if text.startswith(s[:n], end - n):
                hold = n
                break
    return max(sent, end - hold)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template, ready for the reply."""
    if tokenizer is None:
        raise PromptError("this model has no tokenizer, so no chat template")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own checks (jinja raise_exception), or a template bug
        raise PromptError(f"messages: the chat template refused them ({type(e).__name__}: {e})") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prompt_ids(tokenizer, prompt: Union[str, list[int], None], messages: Optional[list[dict]] = None) -> list[int]:
    """The token ids of one submission's prompt: ``messages`` through the chat template, text
    through the tokenizer, token ids as they are. The HTTP layer calls it on its own thread."""
    if messages is not None:
        return chat_ids(tokenizer, messages)
    return encode_prompt(tokenizer, prompt)


class EngineWorker:
    def __init__(self, engine: LLMEngine, on_finished: Optional[Callable[[Request], None]] = None):
        self.engine = engine
        self.on_finished = on_finished  # called in the engine thread with each finished request
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="jspec-engine", daemon=True)
        self.finished_by_reason = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.failed_bursts = 0  # engine.step() calls that raised (each failed the requests in flight)
        self.last_error: Optional[str] = None
        self.mean_latency = 1.0  # seconds from arrival to finish, smoothed over finished requests
        self._queued = 0  # submitted requests the engine thread has not taken yet
        self.snapshot: dict = {}
        self._publish()

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        """Start the engine thread (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def submit(self, sub: Submission) -> concurrent.futures.Future:
        """Queue ``sub``; its future resolves (to the prompt's token count) once the engine took
        it, or raises the engine's refusal (a JspecError) or the engine's failure."""
        self._queued += 1
        self._commands.put(("add", sub))
        return sub.accepted

    def abort(self, request_id: str) -> None:
        """Abort a request (its pages are freed at once); a no-op once it finished."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in flight (their clients get finish reason "abort")."""
        self._commands.put(("abort_all", None))

    def close(self, timeout: Optional[float] = None) -> None:
        """Abort what is left and stop the thread."""
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """The engine thread runs (before ``start`` and after ``close`` it does not)."""
        return self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return self.snapshot.get("unfinished", 0)

    @property
    def num_waiting(self) -> int:
        """Requests not yet in an engine slot: queued for this thread, or waiting in the engine."""
        return self._queued + self.snapshot.get("waiting", 0)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        try:
            while True:
                if not self._take_commands(block=not self.engine.has_unfinished_requests()):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        finally:
            for rid in list(self._streams):
                self._abort(rid)
            self._publish()

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False on stop."""
        try:
            cmd = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, arg = cmd
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "abort_all":
                for rid in list(self._streams):
                    self._abort(rid)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, sub: Submission) -> None:
        self._queued -= 1
        if not sub.accepted.set_running_or_notify_cancel():
            return  # the client left before the engine saw it
        try:
            prompt = prompt_ids(self.engine.tokenizer, sub.prompt, sub.messages)
            params = sub.params
            if sub.fill_max_tokens:
                # what the context, and the whole page pool, leave after the prompt
                room = self.engine.layout.max_request_tokens - len(prompt)
                params = dataclasses.replace(params, max_tokens=max(1, room))
            r = self.engine.add_request(sub.request_id, prompt, params, arrival_time=sub.arrival_time)
        except Exception as e:  # JspecError: the client's fault (400); anything else: ours (500)
            sub.accepted.set_exception(e)
            return
        self._streams[sub.request_id] = _Stream(sub)
        sub.accepted.set_result(len(r.prompt_ids))

    def _abort(self, request_id: str) -> None:
        st = self._streams.get(request_id)
        if st is None:
            return
        if self.engine.abort_request(request_id) is not None:
            r = self.engine.requests[request_id]
            self._emit(st, r, finished=True)
        else:  # finished already (its last event went out) or unknown: nothing to free
            self._streams.pop(request_id, None)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            # step() raises only on what it could not recover from (it fails single requests and
            # failed device calls itself): a bug, logged loudly. The requests in flight fail with
            # it rather than hang their clients; the thread serves the next ones.
            self.failed_bursts += 1
            self.last_error = f"{type(e).__name__}: {e}"
            log.exception("engine.step() raised; failing the requests in flight: %s", sorted(self._streams))
            for rid, st in list(self._streams.items()):
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    log.exception("request %s could not be aborted after the failure", rid)
                self.engine.requests.pop(rid, None)
                self._send(st, Event(error=self.last_error))
                self.finished_by_reason["error"] += 1
            self._streams.clear()
            return
        for out in outs:
            st = self._streams.get(out.request_id)
            r = self.engine.requests.get(out.request_id)
            if st is not None and r is not None:
                self._emit(st, r, out.finished)

    def _emit(self, st: _Stream, r: Request, finished: bool) -> None:
        if finished and r.finish_reason == "error":  # the engine failed this request alone
            self._send(st, Event(error=r.error or "the engine failed on this request",
                                 prompt_tokens=len(r.prompt_ids), completion_tokens=len(r.output_ids)))
        else:
            end = releasable(r.text, st.sent, r.params.stop, finished)
            piece, st.sent = r.text[st.sent:end], max(st.sent, end)
            if piece or finished:
                self._send(st, Event(piece, r.finish_reason if finished else None, len(r.prompt_ids),
                                     len(r.output_ids)))
        if finished:
            self._streams.pop(r.request_id, None)
            self.engine.requests.pop(r.request_id, None)
            reason = r.finish_reason or "abort"
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            m = r.metrics
            if reason in ("stop", "length") and m.finished_time is not None:
                self.mean_latency += 0.1 * (m.finished_time - m.arrival_time - self.mean_latency)
            if self.on_finished is not None:
                try:
                    self.on_finished(r)
                except Exception:
                    log.exception("recording finished request %s failed", r.request_id)

    @staticmethod
    def _send(st: _Stream, event: Event) -> None:
        try:
            st.sub.sink(event)
        except Exception:  # the HTTP side is gone (its event loop closed)
            pass

    def _publish(self) -> None:
        """A consistent copy of what /metrics reports, read by other threads without locks."""
        e = self.engine
        s = e.stats
        slots = e.scheduler.slots
        running = sum(r is not None for r in slots)
        self.snapshot = {
            "running": running, "waiting": len(e.scheduler.waiting), "unfinished": len(self._streams),
            "free_pages": e.allocator.num_free, "usable_pages": e.allocator.num_usable,
            "stats": dataclasses.replace(s, num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos)),
            "finished": dict(self.finished_by_reason), "failed_bursts": self.failed_bursts,
        }


__all__ = ["EngineWorker", "Event", "Submission", "chat_ids", "prompt_ids", "releasable"]
