"""Run the app under uvicorn on an already bound socket, with a draining SIGTERM.

SIGTERM does not stop uvicorn at once (its own handling would close the listening socket, so
new clients would see refused connections, and it re-raises the signal at the end so the process
dies by it). Here the first SIGTERM starts a drain: new generation requests get 503 (the
socket stays open to say so), ``/health`` answers 503, requests in flight run to their end;
when none is left uvicorn shuts down and :func:`run` returns 0. A second SIGTERM, or SIGINT,
stops at once (uvicorn's own handling).
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from typing import Optional

import uvicorn

from jspec.server.app import ServerState

log = logging.getLogger("jspec.server")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: Optional[float]):
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining and not self.should_exit:
            self.state.draining = True
            threading.Thread(target=self._drain, name="jspec-drain", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        st = self.state
        log.info("SIGTERM: draining (%d request(s) in flight); new requests get 503", st.inflight)
        deadline = None if self.drain_timeout is None else time.monotonic() + self.drain_timeout
        while (st.inflight > 0 or st.worker.num_unfinished > 0) and not self.should_exit:
            if deadline is not None and time.monotonic() > deadline:
                log.warning("drain timeout: stopping with %d request(s) in flight", st.inflight)
                break
            time.sleep(0.05)
        log.info("drained; shutting down")
        self.should_exit = True


def run(app, sock: socket.socket, *, log_level: str = "info", drain_timeout: Optional[float] = None) -> int:
    """Serve ``app`` on ``sock`` until SIGTERM has drained it (returns 0) or SIGINT."""
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("debug", "info"),
                            timeout_graceful_shutdown=30, lifespan="on")
    server = _DrainingServer(config, app.state.jspec, drain_timeout)
    server.run(sockets=[sock])
    return 0


__all__ = ["run"]
