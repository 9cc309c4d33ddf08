"""Build and register jspec's C++ kernels for XLA's CPU backend (XLA FFI custom calls).

Pallas has no CPU backend outside interpret mode, so the two places where XLA's CPU code is far
from what the bytes cost have kernels of their own, in C++ beside this file:

- ``small_rows.cc``: a product of a few rows by a weight (:mod:`pallas_kernels.cpu.small_rows`), and
  each row's argmax (the greedy pick over the vocabulary);
- ``paged_attention_cpu.cc``: verification attention over the pages, read in place
  (:mod:`pallas_kernels.cpu.paged_attention`);
- ``layer_tail.cc``: both of them for a whole decoder layer (norm, QKV, RoPE, the K/V write,
  attention, o_proj, norm, MLP) in one call, or the part after the K/V write
  (:mod:`pallas_kernels.cpu.layer_tail`).

They are compiled together, at first use, with the machine's C++ compiler (``$CXX`` or ``c++``)
and ``-march=native``, into one library cached under ``$JSPEC_KERNEL_CACHE`` (default
``~/.cache/jspec/kernels``), keyed by the sources, the compiler, jax and the CPU's flags; the
library is built in a temporary file and renamed, so a cache never holds half a build. Where
there is no compiler, the build fails, or ``JSPEC_CPU_KERNELS=0``, :func:`available` is False
(with one logged warning) and every caller runs its plain-XLA reference instead. The model and
"auto" attention use them only where they are faster than XLA (:func:`preferred`): on CPUs
with AVX-512 or AVX2 + FMA.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax

log = logging.getLogger(__name__)

HERE = pathlib.Path(__file__).parent
SOURCES = (HERE / "small_rows.cc", HERE / "paged_attention_cpu.cc", HERE / "layer_tail.cc")
HEADERS = (HERE / "cpu_common.h", HERE / "small_rows.h", HERE / "paged_attention_cpu.h")
TARGETS = {"jspec_small_rows": "JspecSmallRows", "jspec_small_rows_fused": "JspecSmallRowsFused",
           "jspec_paged_attention": "JspecPagedAttention", "jspec_layer_tail": "JspecLayerTail",
           "jspec_decoder_layer": "JspecDecoderLayer", "jspec_row_argmax": "JspecRowArgmax",
           "jspec_rope": "JspecRope", "jspec_decoder_stack": "JspecDecoderStack"}
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")


def _cache_dir() -> pathlib.Path:
    if os.environ.get("JSPEC_KERNEL_CACHE"):
        return pathlib.Path(os.environ["JSPEC_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jspec" / "kernels"


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:  # -march=native: a build is only good for the CPU it was built on; read once
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build() -> pathlib.Path:
    """Compile the kernels (once per sources, compiler, jax and CPU) and return the library."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    include = jax.ffi.include_dir()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([*(p.read_text() for p in SOURCES + HEADERS), cxx, version, " ".join(FLAGS),
                                    jax.__version__, include, _cpu_flags()]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"jspec-cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # built aside, then renamed: never half-written
        part = pathlib.Path(tmp) / out.name
        done = subprocess.run([cxx, *FLAGS, f"-I{include}", f"-I{HERE}", *map(str, SOURCES), "-o", str(part)],
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(part, out)
    return out


@functools.lru_cache(maxsize=None)
def _load() -> bool:
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except Exception as e:  # no compiler, a failed build, an FFI without this API: the references run
        log.warning("jspec: the CPU kernels are unavailable, using plain XLA instead (%s)", e)
        return False
    return True


def available() -> bool:
    """Whether the kernels are built and registered with XLA's CPU backend (builds them once)."""
    return os.environ.get("JSPEC_CPU_KERNELS", "auto") != "0" and _load()


KERNELS = ("small_rows", "attention")
NO_TILES = "neither AVX-512 nor AVX2 + FMA"


def vector_extensions(flags=None) -> str:
    """Which vector extensions the kernels have tiles for this CPU has (or a CPU with ``flags``,
    /proc/cpuinfo's names): "AVX-512", "AVX2 + FMA" or :data:`NO_TILES`."""
    flags = set(_cpu_flags().split() if flags is None else flags)
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2 + FMA" if {"avx2", "fma"} <= flags else NO_TILES


def tuned_for_this_cpu(kernel: str) -> bool:
    """Whether ``kernel`` ("small_rows" or "attention") has code tuned for this CPU's vectors:
    AVX-512F (32 registers of 16 floats), or AVX2 + FMA (16 registers of 8 floats), where both
    kernels have tiles of their own (``JSPEC_AVX2_TILES`` in ``cpu_common.h``). Before those
    existed, the AVX-512 code compiled for AVX2 kept its accumulators in memory and ran slower than
    XLA: the small-row product 133 ms against 47 for 30 layers of projections at 5 rows, the
    attention 55 ms against 31 for 30 layers at q_len 5 and 1,000 keys (BENCHMARKS.md,
    2026-12-03/04). Elsewhere (no FMA, or another architecture) XLA's own code runs."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return vector_extensions() != NO_TILES


def preferred(kernel: str) -> bool:
    """Whether jspec's model ("small_rows") and attention ("auto" -> "attention") use ``kernel``:
    built, and the CPU is one it is tuned for (:func:`tuned_for_this_cpu`). ``JSPEC_CPU_KERNELS=1``
    uses them on any CPU, ``0`` on none; unset (or ``auto``) decides by the CPU. A direct call
    of a kernel's function (or ``attention="cpu"``) runs it wherever it is :func:`available`."""
    return available() and (os.environ.get("JSPEC_CPU_KERNELS") == "1" or tuned_for_this_cpu(kernel))
