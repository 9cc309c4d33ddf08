"""Building the CPU kernels at first use: cached per source and machine, written whole, and a
failed build falls back to plain XLA everywhere (the small-row product and attention)."""

import jax
import numpy as np
import pytest

from jspec import attention
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
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
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
    them only on those CPUs, unless JSPEC_CPU_KERNELS asks otherwise. A direct kernel call still
    runs them."""
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
    assert ("jspec_small_rows" in lowered.as_text()) is (mode != "0")


def test_an_unknown_kernel_name_is_a_value_error():
    with pytest.raises(ValueError, match="kernel must be one of"):
        cpu_kernels.tuned_for_this_cpu("softmax")
