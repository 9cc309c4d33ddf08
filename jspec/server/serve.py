"""Run the app under uvicorn on an already bound socket, with a draining SIGTERM.

SIGTERM does not stop uvicorn at once (its own handling would close the listening socket, so
new clients would see refused connections, and it re-raises the signal at the end so the process
dies by it). Here the first SIGTERM starts a drain: new generation requests get 503 (the
socket stays open to say so), ``/health`` answers 503, requests in flight run to their end;
when none is left uvicorn shuts down and :func:`run` returns 0. The drain lasts at most
``drain_timeout`` seconds: then the requests still in flight are aborted (their clients get
finish reason ``"abort"``) and the server stops anyway. A second SIGTERM, or SIGINT, stops at
once (uvicorn's own handling).

A client cannot hold a connection open without sending: a request's headers must arrive within
``header_timeout`` seconds of the connection (or of the previous response on a kept-alive
one), else the connection is closed; the body has its own limit in the app.

Before the server runs (loading, compiling) there is nothing to drain: a SIGTERM then ends the
process with exit 0 (:class:`~jspec.server.startup.StartupSignals`); :func:`run` hands a
SIGTERM that arrived as the server started to the drain.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jspec.server.app import ServerState
from jspec.server.startup import StartupSignals

log = logging.getLogger("jspec.server")

GRACEFUL_SHUTDOWN_S = 1.0  # after the drain: open connections get this long to close


def _timed_h11(header_timeout: float):
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    class TimedH11(H11Protocol):
        _deadline = None

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _headers_late(self) -> None:
            self._deadline = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()  # nothing or only part of a request came: a slow or idle client

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # a request's headers are in; the body has the app's own limit

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._arm()

    return TimedH11


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, startup: Optional[StartupSignals]):
        super().__init__(config)
        self.state, self.signals = state, startup

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            if self.signals is not None:  # uvicorn's handlers are in: SIGTERM is the drain's from here
                self.signals.serving()
                if self.signals.pending:
                    self.handle_exit(signal.SIGTERM, None)
            yield

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining and not self.should_exit:
            self.state.draining = True
            threading.Thread(target=self._drain, name="jspec-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        st = self.state
        log.warning("SIGTERM: draining (%d request(s) in flight, at most %g s); new requests get 503", st.inflight,
                    st.limits.drain_timeout)
        deadline = time.monotonic() + st.limits.drain_timeout
        while (st.inflight > 0 or st.worker.num_unfinished > 0) and not self.should_exit:
            if time.monotonic() > deadline:
                log.warning("drain timeout: aborting %d request(s) in flight", st.inflight)
                st.worker.abort_all()
                end = time.monotonic() + 0.5  # their clients get "abort"; then stop regardless
                while st.inflight > 0 and time.monotonic() < end:
                    time.sleep(0.05)
                break
            time.sleep(0.05)
        log.info("drained; shutting down")
        self.should_exit = True


def run(app, sock: socket.socket, *, log_level: str = "info", startup: Optional[StartupSignals] = None) -> int:
    """Serve ``app`` on ``sock`` (bound; it starts listening here) until SIGTERM has drained it
    (returns 0) or SIGINT."""
    limits = app.state.jspec.limits
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "info"),
                            http=_timed_h11(limits.header_timeout), timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            lifespan="on")
    server = _DrainingServer(config, app.state.jspec, startup)
    server.run(sockets=[sock])
    return 0


__all__ = ["run"]
