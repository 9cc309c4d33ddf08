"""Wall-clock timing with JAX's compilation time taken out.

JAX reports tracing, lowering and backend compilation through ``jax.monitoring``; a listener
sums them, so a timed region can report its run time apart from its compile time without
running anything twice.
"""

from __future__ import annotations

import threading
import time

import jax

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_lock = threading.Lock()
_compile_total = [0.0]


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        with _lock:
            _compile_total[0] += duration


jax.monitoring.register_event_duration_secs_listener(_listener)


def compile_seconds() -> float:
    """Seconds JAX has spent tracing, lowering and compiling in this process so far."""
    with _lock:
        return _compile_total[0]


class Stopwatch:
    """``elapsed()`` = wall time since start minus compilation time since start."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.c0 = compile_seconds()

    def compile_s(self) -> float:
        return compile_seconds() - self.c0

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return max(0.0, self.wall_s() - self.compile_s())
