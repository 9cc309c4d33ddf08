"""A ``jspec serve`` subprocess for the server tests: start it, wait until ``/health`` answers
200 (its URL read from the line it prints when it listens), stop it with SIGTERM, and open
connections that send part of a request and stall."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """``python -m jspec serve ARGS`` from the checkout, its output in ``log``."""
    env = dict(os.environ, JSPEC_COMPILE_CACHE="0", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "jspec", "serve", *args], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    """The server's base URL once ``/health`` answers 200; AssertionError (with the log) if it
    exits or is not ready within ``timeout`` seconds."""
    deadline, url = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"jspec serve exited with {proc.returncode}:\n{log.read_text()}")
        if url is None:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise AssertionError(f"jspec serve not ready after {timeout}s:\n{log.read_text()}")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if it has not exited within a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def stalled_body(host: str, port: int, key: str, length: int, start: bytes, timeout: float = 60) -> socket.socket:
    """A connection that sends a POST's headers (``Content-Length: length``) and the first bytes
    of its body, then nothing."""
    s = socket.create_connection((host, port), timeout=timeout)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
              + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n" + start)
    return s
