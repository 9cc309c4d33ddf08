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

They are tuned for CPUs with AVX-512 or AVX2 + FMA (:func:`vector_extensions`). On such a CPU
they are compiled together, at first use, with the machine's C++ compiler (``$CXX`` or ``c++``)
and ``-march=native``, into one library cached under ``$JSPEC_KERNEL_CACHE`` (default
``~/.cache/jspec/kernels``), keyed by the sources, the compiler, jax and the CPU's flags. The
build:

- says so, in one logged warning ("jspec: compiling the CPU kernels ..."): it takes ~30 s, once
  per key, and Python's logging shows nothing below a warning unless it is configured;
- holds a lock (``flock`` on ``jspec-cpu-KEY.lock`` beside the library), so processes that start
  together compile once: the others wait, then load the same library;
- writes the library aside and renames it, so a cache never holds half a build;
- remembers a failure: a compiler error is written to ``jspec-cpu-KEY.failed`` and no later
  process tries that key again (another compiler, jax, CPU or source does);
  ``JSPEC_KERNEL_RETRY=1`` or :func:`retry` tries again.

``JSPEC_CPU_KERNELS=0`` switches them off; ``1`` builds and uses them on any CPU; unset (or
``auto``) builds them only on a CPU they are tuned for. Where they are switched off, the CPU is
not one they serve, there is no compiler, or the build fails, :func:`available` is False (a
failure with one logged warning) and every caller runs its plain-XLA reference instead.
:func:`status` says which, without building anything (``jspec info`` prints it).

Each kernel call is a ``jax.lax.platform_dependent`` choice (:func:`on_cpu`): the C++ op where
the program is lowered for the CPU, the plain-XLA reference for any other platform. Both
branches are traced, and the reference of the whole-stack call is the whole model, so a caller
that traces for the CPU only (jspec's CPU model path, chosen for a CPU backend) says so with
:func:`tracing_for_cpu` and the reference is not traced (SmolLM2-135M's decode and prefill steps:
1.8 s less tracing, measured 2026-12-07). A program traced so holds the CPU op whatever it is
lowered for: it is a CPU program.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Iterator, Optional

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
# What the log line promises: one build took 24 and 39 s on a 2-core AVX-512 development machine
# (the kernel cache's file times, 2026-12-06).
TYPICAL_BUILD_S = 30
COMPILE_TIMEOUT_S = 600
RETRY_ENV = "JSPEC_KERNEL_RETRY"

KERNELS = ("small_rows", "attention")
NO_TILES = "neither AVX-512 nor AVX2 + FMA"
STATES = ("built", "building", "unavailable", "not built yet")


class BuildError(RuntimeError):
    """The kernels are not built here: not wanted on this CPU, no compiler, or the compiler failed
    (now or in an earlier build with the same key)."""


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Where the CPU kernels stand, read without building them (:func:`status`).

    state: "built" (the library is in the cache), "building" (another process or thread holds the
        build's lock), "unavailable" (``reason`` says why: switched off, a CPU they do not serve,
        no compiler, a failed build) or "not built yet" (they compile at first use).
    reason: one line for a person.
    path: the library (built, building, not built yet: where it goes), the failed build's marker
        with the compiler's whole error, or None.
    """

    state: str
    reason: str
    path: Optional[pathlib.Path] = None

    def __post_init__(self):
        if self.state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {self.state!r}")

    def __str__(self) -> str:
        return f"{self.state} ({self.reason})" + (f": {self.path}" if self.path else "")


_FOR_CPU = contextvars.ContextVar("pallas_kernels_cpu_tracing_for_cpu", default=False)


@contextlib.contextmanager
def tracing_for_cpu() -> Iterator[None]:
    """Inside, :func:`on_cpu` traces the CPU branch alone: for code traced only for the CPU."""
    token = _FOR_CPU.set(True)
    try:
        yield
    finally:
        _FOR_CPU.reset(token)


def tracing_for_cpu_only() -> bool:
    """Whether the code being traced now is inside :func:`tracing_for_cpu` (a cache of traced
    programs keys on it: a program traced inside holds the CPU ops alone)."""
    return _FOR_CPU.get()


def on_cpu(*args, cpu, default):
    """``cpu(*args)`` where the program is lowered for the CPU, ``default(*args)`` elsewhere
    (``jax.lax.platform_dependent``); inside :func:`tracing_for_cpu`, ``cpu(*args)`` alone."""
    if _FOR_CPU.get():
        return cpu(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


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


def vector_extensions(flags=None) -> str:
    """Which vector extensions the kernels have tiles for this CPU has (or a CPU with ``flags``,
    /proc/cpuinfo's names): "AVX-512", "AVX2 + FMA" or :data:`NO_TILES`."""
    flags = set(_cpu_flags().split() if flags is None else flags)
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2 + FMA" if {"avx2", "fma"} <= flags else NO_TILES


def _refusal() -> Optional[str]:
    """Why the kernels are not wanted here, or None where they are: switched off, or a CPU
    without the vectors they are tuned for (where XLA's own code is as fast or faster)."""
    mode = os.environ.get("JSPEC_CPU_KERNELS", "auto")
    if mode == "0":
        return "switched off by JSPEC_CPU_KERNELS=0"
    if mode != "1" and vector_extensions() == NO_TILES:
        return f"this CPU has {NO_TILES}, the vectors they are tuned for; JSPEC_CPU_KERNELS=1 builds them anyway"
    return None


@dataclasses.dataclass(frozen=True)
class _Build:
    """One build's compiler and files, named by its key (sources, compiler, flags, jax, CPU)."""

    cxx: str
    include: str
    key: str
    cache: pathlib.Path

    @property
    def library(self) -> pathlib.Path:
        return self.cache / f"jspec-cpu-{self.key}.so"

    @property
    def lock(self) -> pathlib.Path:
        return self.cache / f"jspec-cpu-{self.key}.lock"

    @property
    def failure(self) -> pathlib.Path:  # the compiler's error, where this key's build failed
        return self.cache / f"jspec-cpu-{self.key}.failed"


def _plan() -> _Build:
    """This machine's build: the compiler and the key (runs ``$CXX --version``, compiles nothing)."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        raise BuildError("no C++ compiler (set CXX or install g++)")
    include = jax.ffi.include_dir()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{cxx} --version failed ({e})") from e
    key = hashlib.sha256("\0".join([*(p.read_text() for p in SOURCES + HEADERS), cxx, version, " ".join(FLAGS),
                                    jax.__version__, include, _cpu_flags()]).encode()).hexdigest()[:16]
    return _Build(cxx, include, key, _cache_dir())


def _remembered_failure(b: _Build) -> Optional[str]:
    """The compiler's error from an earlier build with this key (None if none, or if retrying)."""
    if os.environ.get(RETRY_ENV) == "1":
        return None
    try:
        return b.failure.read_text()
    except FileNotFoundError:
        return None


def _raise_remembered(b: _Build) -> None:
    error = _remembered_failure(b)
    if error is not None:
        raise BuildError(f"an earlier build of these sources with this compiler failed and is not tried again "
                         f"({b.failure}; {RETRY_ENV}=1 tries again): {error}")


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    """Hold ``path``'s exclusive flock (processes, and threads: each opens its own descriptor)."""
    with open(path, "a") as f:  # closing it releases the lock, also when the process dies
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("jspec: waiting for another process compiling the CPU kernels (~%d s)...", TYPICAL_BUILD_S)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _held(path: pathlib.Path) -> bool:
    """Whether someone holds ``path``'s lock: a build is under way. A shared lock taken and
    dropped at once; a builder arriving in that instant waits for it, no more."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _compile(b: _Build) -> None:
    """Compile into a temporary file and rename it to the library; on a failure, write the
    marker (whole, by a rename too) and raise. The caller holds the lock."""
    log.warning("jspec: compiling the CPU kernels (first use on this machine, ~%d s)...", TYPICAL_BUILD_S)
    with tempfile.TemporaryDirectory(dir=b.cache) as tmp:
        part = pathlib.Path(tmp) / b.library.name
        command = [b.cxx, *FLAGS, f"-I{b.include}", f"-I{HERE}", *map(str, SOURCES), "-o", str(part)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            error = None if done.returncode == 0 else f"{b.cxx} failed: {done.stderr.strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            error = f"{b.cxx} ran past {COMPILE_TIMEOUT_S} s"
        if error is not None:
            marker = pathlib.Path(tmp) / b.failure.name
            marker.write_text(error)
            os.replace(marker, b.failure)
            raise BuildError(error)
        os.replace(part, b.library)
    b.failure.unlink(missing_ok=True)  # a retry that succeeded


def build() -> pathlib.Path:
    """Compile the kernels (once per sources, compiler, jax and CPU) and return the library.

    Processes and threads that call it together compile once: the others wait on the lock and
    return the same library. Raises :class:`BuildError` where the kernels are not wanted
    (``JSPEC_CPU_KERNELS=0``, or a CPU they do not serve without ``JSPEC_CPU_KERNELS=1``), there
    is no compiler, or the compiler fails, now or in an earlier build with the same key (then it
    is not run again unless ``JSPEC_KERNEL_RETRY=1``)."""
    refusal = _refusal()
    if refusal is not None:
        raise BuildError(f"not built: {refusal}")
    b = _plan()
    if b.library.exists():
        return b.library
    _raise_remembered(b)
    b.cache.mkdir(parents=True, exist_ok=True)
    with _locked(b.lock):
        if b.library.exists():  # built by the process this one waited for
            return b.library
        _raise_remembered(b)  # or failed there
        _compile(b)
    return b.library


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
    """Whether the kernels are wanted here, built and registered with XLA's CPU backend (builds
    them once per process at the first call, or loads the cached library)."""
    return _refusal() is None and _load()


def retry() -> bool:
    """Forget this key's failed build and this process's answer, and try again: :func:`available`."""
    try:
        _plan().failure.unlink(missing_ok=True)
    except BuildError:
        pass
    _load.cache_clear()
    return available()


def _first_error(error: str) -> str:  # the line of a compiler's output that names the problem
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line), lines[-1] if lines else "no output")


def status() -> KernelStatus:
    """Where the kernels stand on this machine, without building them (it runs ``$CXX --version``
    to find the build's key): see :class:`KernelStatus`."""
    refusal = _refusal()
    if refusal is not None:
        return KernelStatus("unavailable", refusal)
    try:
        b = _plan()
    except BuildError as e:
        return KernelStatus("unavailable", str(e))
    if b.library.exists():
        if _load.cache_info().currsize and not _load():  # this process loaded it already, and failed
            return KernelStatus("unavailable", "built, but loading it failed (see the logged warning)", b.library)
        ext = vector_extensions()
        served = f"tuned for {ext}" if ext != NO_TILES else f"asked for by JSPEC_CPU_KERNELS=1 on a CPU with {NO_TILES}"
        return KernelStatus("built", served, b.library)
    if _held(b.lock):
        return KernelStatus("building", "another process is compiling them", b.library)
    error = _remembered_failure(b)
    if error is not None:
        return KernelStatus("unavailable", f"the build failed, {RETRY_ENV}=1 tries again: {_first_error(error)}",
                            b.failure)
    return KernelStatus("not built yet", f"compiled at first use, ~{TYPICAL_BUILD_S} s", b.library)


def tuned_for_this_cpu(kernel: str) -> bool:
    """Whether ``kernel`` ("small_rows" or "attention") has code tuned for this CPU's vectors:
    AVX-512F (32 registers of 16 floats), or AVX2 + FMA (16 registers of 8 floats), where both
    kernels have tiles of their own (``JSPEC_AVX2_TILES`` in ``cpu_common.h``). Before those
    existed, the AVX-512 code compiled for AVX2 kept its accumulators in memory and ran slower than
    XLA: the small-row product 133 ms against 47 for 30 layers of projections at 5 rows, the
    attention 55 ms against 31 for 30 layers at q_len 5 and 1,000 keys (measured
    2026-12-03/04). Elsewhere (no FMA, or another architecture) XLA's own code runs."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return vector_extensions() != NO_TILES


def preferred(kernel: str) -> bool:
    """Whether jspec's model ("small_rows") and attention ("auto" -> "attention") use ``kernel``:
    built, and the CPU is one it is tuned for (:func:`tuned_for_this_cpu`). ``JSPEC_CPU_KERNELS=1``
    uses them on any CPU, ``0`` on none; unset (or ``auto``) decides by the CPU. A direct call
    of a kernel's function (or ``attention="cpu"``) runs it wherever it is :func:`available`,
    which on a CPU it is not tuned for takes ``JSPEC_CPU_KERNELS=1`` too."""
    return available() and (os.environ.get("JSPEC_CPU_KERNELS") == "1" or tuned_for_this_cpu(kernel))
