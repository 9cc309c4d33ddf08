"""SIGTERM while ``jspec serve`` starts (imports, loading, compiling): exit 0, promptly.

Python runs signal handlers in the main thread between bytecodes, so a handler cannot run while
the main thread is inside a long native call (an XLA compilation), and a ``SystemExit`` raised
by one can land inside a garbage-collection callback, where it is discarded. So the handler here
only records the signal; Python's C-level handler also writes it to a wakeup pipe, which a
watcher thread reads. This module imports nothing heavy: ``jspec serve`` installs it first.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


_active = None


def active() -> "StartupSignals | None":
    """The installed :class:`StartupSignals`, if any."""
    return _active


class StartupSignals:
    """SIGTERM during start-up exits 0 within ``grace`` seconds, whatever the main thread does:
    the watcher gives the main thread ``grace`` seconds to notice (at :meth:`check`), then ends
    the process itself. Once :meth:`serving` is called, uvicorn's handlers own SIGTERM and the
    watcher ignores it; a SIGTERM that arrived just before is handed to the server
    (:attr:`pending`). Other signals' wakeup bytes go on to the wakeup pipe that was there
    before (the CLI's SIGINT watcher, :mod:`jspec.cli.guard`)."""

    def __init__(self, grace: float = 2.0):
        self.grace = grace
        self.pending = False
        self._serving = False
        self._closed = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous_handler = signal.signal(signal.SIGTERM, self._record)
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="jspec-startup-signals", daemon=True)
        self._watcher.start()

    @classmethod
    def install(cls) -> "StartupSignals | None":
        """Install (from the main thread; elsewhere signals cannot be handled: None) and keep
        it as :func:`active` until :meth:`close`."""
        global _active
        if threading.current_thread() is not threading.main_thread():
            return None
        if _active is None:
            _active = cls()
        return _active

    def _record(self, signum, frame) -> None:
        self.pending = True

    def check(self) -> None:
        """Exit 0 (normally, from the main thread) if SIGTERM arrived."""
        if self.pending and not self._serving:
            raise SystemExit(0)

    def serving(self) -> None:
        self._serving = True

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:
                return
            others = bytes(b for b in data if b != signal.SIGTERM)
            if others and self._previous_fd >= 0:
                try:
                    os.write(self._previous_fd, others)
                except OSError:
                    pass
            if signal.SIGTERM in data and not self._serving:
                deadline = time.monotonic() + self.grace
                while time.monotonic() < deadline and threading.main_thread().is_alive():
                    time.sleep(0.05)
                if not self._serving:
                    print("jspec serve: SIGTERM during start-up; exiting", file=sys.stderr, flush=True)
                    os._exit(0)

    def close(self) -> None:
        global _active
        if self._closed:
            return
        self._closed = True
        if _active is self:
            _active = None
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(signal.SIGTERM, self._previous_handler)
        os.close(self._write_fd)  # the watcher reads end-of-file and returns
        self._watcher.join(1.0)
        os.close(self._read_fd)


__all__ = ["StartupSignals", "active"]
