"""Building the CPU kernels at first use: cached per source and machine, written whole, compiled
once by processes that start together (a lock), a failed build remembered and falling back to
plain XLA everywhere (the small-row product and attention), no build on a CPU the kernels do not
serve, and their status (``jspec info``) read without building them.

Most tests here compile nothing: a fake compiler (a shell script as ``$CXX``) counts its runs and
writes an empty library, or fails."""

import pathlib
import threading
import time

import jax
import numpy as np
import pytest

from jspec import attention
from jspec.cli import main as cli_main
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.small_rows import small_rows_matmul, small_rows_matmul_reference


def test_a_failed_build_falls_back_to_xla(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("JSPEC_KERNEL_CACHE", str(tmp_path))  # nothing cached there
    monkeypatch.setenv("CXX", "no-such-compiler-jspec")
    cpu_kernels._load.cache_clear()
    try:
        assert not cpu_kernels.available()
        assert "unavailable" in caplog.text
        assert attention.resolve("auto", "cpu") == "xla"
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((4, 32), dtype=np.float32), rng.standard_normal((8, 32), dtype=np.float32)
        assert "jspec_small_rows" not in jax.jit(small_rows_matmul).lower(x, w).as_text()
        np.testing.assert_allclose(small_rows_matmul(x, w), small_rows_matmul_reference(x, w), rtol=1e-6)
        assert not list(tmp_path.iterdir())  # nothing half-written
    finally:
        monkeypatch.undo()
        cpu_kernels._load.cache_clear()
        cpu_kernels.available()  # registers the targets again, as the other tests expect


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    assert attention.resolve("auto", "cpu") == "xla"


def test_the_build_is_cached_per_source_and_written_whole(tmp_path, monkeypatch):
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("JSPEC_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.suffix == ".so"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, first.with_suffix(".lock").name])
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt


@pytest.mark.parametrize("flags,mode,rows_used,attention_used", [
    ("fpu sse2 avx avx2 fma avx512f avx512bw", None, True, True),  # tuned for AVX-512: both on
    ("fpu sse2 avx avx2 fma", None, True, True),  # AVX2 + FMA: both kernels' AVX2 tiles
    ("fpu sse2 avx avx2 fma", "auto", True, True),
    ("fpu sse2 avx avx2", None, False, False),  # no FMA: neither
    ("fpu sse2 avx", "1", True, True),  # asked for on any CPU
    ("fpu sse2 avx avx2 fma avx512f", "0", False, False),  # switched off
])
def test_the_model_uses_each_kernel_only_on_cpus_it_is_tuned_for(monkeypatch, flags, mode, rows_used,
                                                                  attention_used):
    """Both kernels are tuned for AVX-512 and for AVX2 + FMA (before their AVX2 tiles each
    measured slower than XLA there): the model's small-row products and "auto" attention use
    them only on those CPUs, unless JSPEC_CPU_KERNELS asks otherwise; elsewhere they are not
    available at all, so a direct kernel call runs the reference too."""
    if not cpu_kernels.available():
        pytest.skip("no C++ compiler")
    from jspec.models.cpu_path import small_rows_apply

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: " + flags)
    if mode is None:
        monkeypatch.delenv("JSPEC_CPU_KERNELS", raising=False)
    else:
        monkeypatch.setenv("JSPEC_CPU_KERNELS", mode)
    assert cpu_kernels.preferred("small_rows") is rows_used
    assert cpu_kernels.preferred("attention") is attention_used
    assert attention.resolve("auto", "cpu") == ("cpu" if attention_used else "xla")
    assert small_rows_apply(np.float32) is rows_used
    x, w = np.ones((2, 32), np.float32), np.ones((8, 32), np.float32)
    lowered = jax.jit(lambda a, b: small_rows_matmul(a, b)).lower(x, w)  # a new function: traced afresh
    assert ("jspec_small_rows" in lowered.as_text()) is rows_used


def test_an_unknown_kernel_name_is_a_value_error():
    with pytest.raises(ValueError, match="kernel must be one of"):
        cpu_kernels.tuned_for_this_cpu("softmax")


FAKE_CXX = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "fake-c++ ${FAKE_CXX_VERSION:-1}"; exit 0; fi
echo run >> "%(runs)s"
while [ ! -e "%(go)s" ]; do sleep 0.02; done
%(body)s
"""
WRITE_OUTPUT = """out=""; prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done
: > "$out"
"""
FAIL = """echo "small_rows.cc:1:1: error: no kernels today" >&2
exit 1
"""


class FakeCompiler:
    """A shell script as $CXX: answers --version, counts its compiles, waits for :meth:`go`
    (created at once unless ``gated``), then writes an empty library or fails."""

    def __init__(self, where: pathlib.Path, fails=False, gated=False):
        self.runs, self.gate = where / "runs", where / "go"
        self.path = where / "fake-cxx"
        self.path.write_text(FAKE_CXX % {"runs": self.runs, "go": self.gate, "body": FAIL if fails else WRITE_OUTPUT})
        self.path.chmod(0o755)
        if not gated:
            self.go()

    def go(self):
        self.gate.touch()

    @property
    def count(self) -> int:
        return len(self.runs.read_text().splitlines()) if self.runs.exists() else 0


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty kernel cache, a CPU the kernels serve, and this process's answer forgotten; the
    real kernels registered again afterwards, as the other tests expect."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("JSPEC_KERNEL_CACHE", str(cache))
    monkeypatch.delenv("JSPEC_CPU_KERNELS", raising=False)
    monkeypatch.delenv(cpu_kernels.RETRY_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx avx2 fma")
    cpu_kernels._load.cache_clear()
    yield cache
    monkeypatch.undo()
    cpu_kernels._load.cache_clear()
    cpu_kernels.available()


def test_builds_that_start_together_compile_once(fresh_cache, tmp_path, monkeypatch, caplog):
    """The first build holds the lock while its compiler runs; the second waits on it (each
    thread opens the lock file itself, so flock serializes them as it does processes), then
    finds the library and does not compile."""
    cxx = FakeCompiler(tmp_path, gated=True)
    monkeypatch.setenv("CXX", str(cxx.path))
    results = []
    first = threading.Thread(target=lambda: results.append(cpu_kernels.build()))
    first.start()
    deadline = time.monotonic() + 30
    while cxx.count == 0 and time.monotonic() < deadline:  # the first is compiling, the lock held
        time.sleep(0.02)
    assert cxx.count == 1
    assert cpu_kernels.status().state == "building"
    second = threading.Thread(target=lambda: results.append(cpu_kernels.build()))
    second.start()
    time.sleep(0.5)  # the second reaches the lock and waits
    cxx.go()
    first.join(30)
    second.join(30)
    assert cxx.count == 1
    assert len(results) == 2 and results[0] == results[1] and results[0].exists()
    assert caplog.text.count("jspec: compiling the CPU kernels (first use on this machine") == 1
    assert "waiting for another process compiling the CPU kernels" in caplog.text
    assert cpu_kernels.status().state == "built"


def test_a_failed_build_is_remembered_and_not_tried_again(fresh_cache, tmp_path, monkeypatch, caplog):
    cxx = FakeCompiler(tmp_path, fails=True)
    monkeypatch.setenv("CXX", str(cxx.path))
    with pytest.raises(cpu_kernels.BuildError, match="no kernels today"):
        cpu_kernels.build()
    with pytest.raises(cpu_kernels.BuildError, match="not tried again.*no kernels today"):
        cpu_kernels.build()  # as another process would: the marker, not the compiler
    assert not cpu_kernels.available()  # a third, through the fallback
    assert "no kernels today" in caplog.text
    assert cxx.count == 1
    [marker] = fresh_cache.glob("*.failed")
    assert "error: no kernels today" in marker.read_text()
    s = cpu_kernels.status()
    assert (s.state, s.path) == ("unavailable", marker)
    assert "the build failed" in s.reason and "small_rows.cc:1:1: error: no kernels today" in s.reason

    monkeypatch.setenv("FAKE_CXX_VERSION", "2")  # another compiler: another key, tried again
    with pytest.raises(cpu_kernels.BuildError, match="fake-cxx failed"):
        cpu_kernels.build()
    assert cxx.count == 2
    monkeypatch.delenv("FAKE_CXX_VERSION")
    monkeypatch.setenv(cpu_kernels.RETRY_ENV, "1")  # asked to try again
    with pytest.raises(cpu_kernels.BuildError, match="fake-cxx failed"):
        cpu_kernels.build()
    assert cxx.count == 3
    monkeypatch.delenv(cpu_kernels.RETRY_ENV)
    assert not cpu_kernels.retry()  # forgets the marker and tries once more
    assert cxx.count == 4


def test_a_retry_that_succeeds_removes_the_marker(fresh_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(FakeCompiler(tmp_path, fails=True).path))
    with pytest.raises(cpu_kernels.BuildError):
        cpu_kernels.build()
    assert len(list(fresh_cache.glob("*.failed"))) == 1
    fixed = FakeCompiler(tmp_path)  # the same path and version (the same key), now working
    monkeypatch.setenv(cpu_kernels.RETRY_ENV, "1")
    assert cpu_kernels.build().exists() and fixed.count == 2
    assert not list(fresh_cache.glob("*.failed"))


def test_no_build_on_a_cpu_the_kernels_do_not_serve(fresh_cache, tmp_path, monkeypatch):
    cxx = FakeCompiler(tmp_path)
    monkeypatch.setenv("CXX", str(cxx.path))
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: "flags\t\t: fpu sse2 avx avx2")  # no FMA
    assert not cpu_kernels.available()
    with pytest.raises(cpu_kernels.BuildError, match="neither AVX-512 nor AVX2 \\+ FMA"):
        cpu_kernels.build()
    assert cxx.count == 0 and not fresh_cache.exists()
    s = cpu_kernels.status()
    assert s.state == "unavailable" and "neither AVX-512 nor AVX2 + FMA" in s.reason and s.path is None
    assert "JSPEC_CPU_KERNELS=1" in s.reason

    monkeypatch.setenv("JSPEC_CPU_KERNELS", "1")  # asked for: built anyway
    assert cpu_kernels.status().state == "not built yet"
    assert cpu_kernels.build().exists() and cxx.count == 1
    assert "JSPEC_CPU_KERNELS=1" in cpu_kernels.status().reason


def test_status_reads_without_building(fresh_cache, tmp_path, monkeypatch):
    cxx = FakeCompiler(tmp_path)
    monkeypatch.setenv("CXX", str(cxx.path))
    s = cpu_kernels.status()
    assert s.state == "not built yet" and s.path.parent == fresh_cache and "first use" in s.reason
    assert cxx.count == 0 and not fresh_cache.exists()
    library = cpu_kernels.build()
    assert cpu_kernels.status() == cpu_kernels.KernelStatus("built", "tuned for AVX2 + FMA", library)
    assert str(cpu_kernels.status()) == f"built (tuned for AVX2 + FMA): {library}"

    library.unlink()
    fresh_cache.mkdir(exist_ok=True)
    with cpu_kernels._locked(library.with_suffix(".lock")):  # as a process that is compiling holds it
        assert cpu_kernels.status().state == "building"
    assert cpu_kernels.status().state == "not built yet"

    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    assert cpu_kernels.status() == cpu_kernels.KernelStatus("unavailable", "switched off by JSPEC_CPU_KERNELS=0")
    monkeypatch.delenv("JSPEC_CPU_KERNELS")
    monkeypatch.setenv("CXX", "no-such-compiler-jspec")
    assert cpu_kernels.status() == cpu_kernels.KernelStatus("unavailable", "no C++ compiler (set CXX or install g++)")
    assert cxx.count == 1
    with pytest.raises(ValueError, match="state must be one of"):
        cpu_kernels.KernelStatus("broken", "")


@pytest.mark.parametrize("setting,line", [
    ({"JSPEC_CPU_KERNELS": "0"}, "cpu kernels unavailable (switched off by JSPEC_CPU_KERNELS=0)"),
    ({}, "cpu kernels not built yet (compiled at first use, ~30 s): "),
    ({"CXX": "no-such-compiler-jspec"}, "cpu kernels unavailable (no C++ compiler (set CXX or install g++))"),
])
def test_jspec_info_reports_the_kernels(fresh_cache, tmp_path, monkeypatch, capsys, setting, line):
    cxx = FakeCompiler(tmp_path)
    monkeypatch.setenv("CXX", str(cxx.path))
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    assert cli_main(["info"]) == 0
    [reported] = [out for out in capsys.readouterr().out.splitlines() if out.startswith("cpu kernels")]
    assert reported.startswith(line)
    assert cxx.count == 0  # info never builds
