"""Building the CPU kernels at first use: cached per source and machine, written whole, and a
failed build falls back to plain XLA everywhere (the small-row product and attention)."""

import jax
import numpy as np
import pytest

from jspec import attention
from pallas_kernels import cpu_kernels
from pallas_kernels.small_rows import small_rows_matmul, small_rows_matmul_reference


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
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp  # not rebuilt
