"""Compile time is taken out of measured run time, counting nested spans once."""

import time

import jax
import jax.numpy as jnp

from jspec.timing import Stopwatch, compile_seconds


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
