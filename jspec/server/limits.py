"""What one client may hold of the server: the bounds of ``jspec serve`` (flags of the same
names), in a module that imports nothing heavy, so that ``jspec serve --help`` shows them."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Limits:
    max_waiting_requests: Optional[int] = 256  # queued for a slot; past it 429 (None: no bound)
    body_timeout: float = 30.0  # seconds for the whole request body to arrive (408 after)
    header_timeout: float = 10.0  # seconds for a request's headers (the connection is closed after)
    drain_timeout: float = 30.0  # SIGTERM: seconds requests in flight get before they are aborted
    public_metrics: bool = False  # /metrics open even when an API key is set


__all__ = ["Limits"]
