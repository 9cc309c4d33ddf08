"""Compile time is taken out of measured run time, counting nested spans once."""

import time

import jax
import jax.numpy as jnp

from jspec.timing import Stopwatch, compile_seconds, describe_machine
from pallas_kernels.cpu.build import vector_extensions


def test_nested_compilation_counted_once():
    @jax.jit
    def inner(x):
        return jnp.sin(x) * 2

    @jax.jit
    def outer(x):
        for _ in range(3):
            x = inner(x) + 1
        return x

    w = Stopwatch()
    outer(jnp.ones(8)).block_until_ready()
    compiled = w.compile_s()
    assert 0 < compiled <= w.wall_s()  # union of nested spans cannot exceed the wall time
    w2 = Stopwatch()
    time.sleep(0.05)
    outer(jnp.ones(8)).block_until_ready()  # cached: nothing compiles
    assert w2.compile_s() == 0.0 and w2.elapsed() >= 0.05
    assert compile_seconds(0.0, 0.0) == 0.0


def test_the_machine_line_names_the_vector_extensions_the_kernels_use():
    assert vector_extensions({"sse2", "avx2", "fma", "avx512f"}) == "AVX-512"
    assert vector_extensions({"sse2", "avx2", "fma"}) == "AVX2 + FMA"
    assert vector_extensions({"sse2", "avx2"}) == "neither AVX-512 nor AVX2 + FMA"  # no FMA: no tiles
    line = describe_machine()
    assert f"jax {jax.__version__}" in line
    try:
        flags = next(set(l.split(":", 1)[1].split()) for l in open("/proc/cpuinfo") if l.startswith("flags"))
    except (OSError, StopIteration):
        return
    assert f"({vector_extensions(flags)})" in line
