"""What a load or a run will allocate, compared with what the machine has, before allocating.

A checkpoint or an option can ask for any size; the loaders and the engine estimate the bytes
first and call :func:`check_fits`, which refuses with one line naming both numbers
(:class:`InsufficientMemoryError`) instead of letting the process run out of memory.

Available host memory is the smallest of: ``MemAvailable`` from ``/proc/meminfo`` (or
``os.sysconf`` pages), the headroom under the process's address-space limit
(``RLIMIT_AS`` minus the current ``VmSize``), and the cgroup v2 limit (``memory.max`` minus
``memory.current``). For an accelerator, a device's ``memory_stats()`` (``bytes_limit -
bytes_in_use``) is used when it reports one; the CPU backend's memory is the host's.

Estimates (bytes):
    :func:`weights_bytes`    parameters in the model's dtype
    :func:`weights_bytes_per_device`  one device's share of them under tensor parallelism
    :func:`activation_bytes`  a step's transient memory for a number of token rows
    :func:`kv_cache_bytes`   K and V pages of every layer for ``num_tokens`` token slots
    :func:`token_buffer_bytes`  the int32 token buffer of a batch
"""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any, Optional

from jspec.config import ModelConfig
from jspec.errors import InsufficientMemoryError

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


def itemsize(dtype: Any) -> int:
    """Bytes per element of a dtype name (``"bfloat16"``) or dtype object."""
    name = str(getattr(dtype, "name", dtype))
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    import numpy as np

    return int(np.dtype(dtype).itemsize)


def weights_bytes(config: ModelConfig, dtype: Any = None) -> int:
    """Parameters of ``config`` in ``dtype`` (default: the config's)."""
    return config.num_params() * itemsize(dtype or config.dtype)


def kv_cache_bytes(config: ModelConfig, num_tokens: int, dtype: Any = None) -> int:
    """K and V of every layer for ``num_tokens`` token slots (pages x page_size, summed over
    the batch): ``2 * num_layers * num_kv_heads * head_dim * num_tokens * itemsize``."""
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * int(num_tokens) * itemsize(dtype or config.dtype)


def weights_bytes_per_device(config: ModelConfig, tp: int = 1, dtype: Any = None) -> int:
    """One device's share of the parameters under ``tp``-way tensor parallelism: every matrix and
    the embedding are split over the devices (jspec.parallel's rules), the norms (Qwen3's q/k
    gains too) are copied.
    ``config`` is the one-device config; heads copied to fill ``tp`` (fewer KV heads than
    devices) count on each device."""
    if tp == 1:
        return weights_bytes(config, dtype)
    from jspec.models.tensor_parallel import tp_config  # here: it imports JAX, which this module does not

    c = tp_config(config, tp)
    per_layer = 4 if c.is_gemma else 2
    norms = (per_layer * c.num_layers + 1) * c.hidden_size + (2 * c.num_layers * c.head_dim if c.qk_norm else 0)
    return -(-(c.num_params() - norms) // tp) * itemsize(dtype or c.dtype) + norms * itemsize(dtype or c.dtype)


def activation_bytes(config: ModelConfig, rows: int, tp: int = 1) -> int:
    """An estimate of one step's transient memory on one device for ``rows`` token rows: the
    float32 logits (vocabulary split over ``tp``) and one layer's widest intermediates (the
    residual, the QKV projection, gate and up), which the next layer reuses."""
    c, size = config, itemsize(config.dtype)
    per_row = 4 * c.vocab_size // tp + size * (3 * c.hidden_size + (c.q_size + 2 * c.kv_size + 2 * c.intermediate_size) // tp)
    return int(rows) * per_row


def token_buffer_bytes(batch: int, width: int) -> int:
    """The int32 ``[batch, width]`` token buffer."""
    return 4 * int(batch) * int(width)


# ----------------------------------------------------------------------------- what is there

def _meminfo_available() -> Optional[int]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_headroom() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(0, soft - int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return soft


def _cgroup_headroom() -> Optional[int]:
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def host_available_bytes() -> Optional[int]:
    """Host memory this process can still allocate (None when nothing can be read)."""
    values = [v for v in (_meminfo_available(), _address_space_headroom(), _cgroup_headroom()) if v is not None]
    return min(values) if values else None


def available_bytes(device: Any = None) -> Optional[int]:
    """Free memory of ``device`` (an accelerator reporting ``memory_stats()``), else the host's."""
    if device is not None and getattr(device, "platform", "cpu") != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # not every backend implements it
            stats = {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return host_available_bytes()


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} EiB"  # not reached


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"192GiB"``, ``"80 GB"``, ``"1.5TiB"``, ``"123456"`` -> bytes (ValueError otherwise)."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 192GiB, 80GB, 64000000000)")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not 0 < n < 1 << 62:
        raise ValueError(f"not a size: {text!r} (must be positive)")
    return int(n)


def check_fits(nbytes: int, what: str, *, device: Any = None, available: Optional[int] = None) -> None:
    """Refuse (:class:`InsufficientMemoryError`) when ``nbytes`` exceed the available memory.

    ``what`` names the allocation (``"the KV cache for 4 x 8192 tokens"``); ``device`` picks the
    memory pool (default: the host's); ``available`` overrides the measurement (tests). Does
    nothing when the available memory cannot be read.
    """
    avail = available_bytes(device) if available is None else available
    if avail is not None and nbytes > avail:
        where = "" if device is None or getattr(device, "platform", "cpu") == "cpu" else f" on {device}"
        raise InsufficientMemoryError(
            f"{what} needs {format_bytes(nbytes)} ({nbytes} bytes), but only {format_bytes(avail)} "
            f"is available{where}")


__all__ = ["activation_bytes", "available_bytes", "check_fits", "format_bytes", "host_available_bytes", "itemsize",
           "kv_cache_bytes", "parse_bytes", "token_buffer_bytes", "weights_bytes", "weights_bytes_per_device"]
