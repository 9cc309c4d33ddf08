"""Wall-clock timing with JAX's compilation time taken out.

JAX reports tracing, lowering and backend compilation through ``jax.monitoring`` when each
finishes. Those spans nest (tracing an outer ``jit`` traces the inner ones too), so the
listener keeps each span as an interval ending "now" and a timed region subtracts the length of
the *union* of the intervals inside it: run time and compile time come apart without running
anything twice.
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
_intervals: list[tuple[float, float]] = []


def _listener(event: str, duration: float, **kwargs) -> None:
    if event in _COMPILE_EVENTS:
        end = time.perf_counter()
        with _lock:
            _intervals.append((end - duration, end))


jax.monitoring.register_event_duration_secs_listener(_listener)


def compile_seconds(since: float = float("-inf"), until: float = float("inf")) -> float:
    """Seconds of tracing/lowering/compiling between two ``perf_counter`` times (nested spans
    counted once)."""
    with _lock:
        spans = sorted((max(a, since), min(b, until)) for a, b in _intervals if b > since and a < until)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


class Stopwatch:
    """``elapsed()`` = wall time since start minus compilation time since start."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def compile_s(self) -> float:
        return compile_seconds(self.t0, time.perf_counter())

    def wall_s(self) -> float:
        return time.perf_counter() - self.t0

    def elapsed(self) -> float:
        now = time.perf_counter()
        return max(0.0, (now - self.t0) - compile_seconds(self.t0, now))


def describe_machine() -> str:
    """CPU model and vector extensions (which of jspec's CPU kernels' tiles apply: AVX-512 or
    AVX2 + FMA), core count, Python and jax versions, backend: the line benchmarks record."""
    import os
    import platform

    from pallas_kernels.cpu.build import vector_extensions

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cpu += f" ({vector_extensions()})"
    devices = ", ".join(sorted({getattr(d, "device_kind", d.platform) for d in jax.devices()}))
    return (f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, jax {jax.__version__} "
            f"({jax.default_backend()}: {devices})")
