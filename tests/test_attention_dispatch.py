"""jspec uses the verification-attention implementations interchangeably."""

import pytest

import jspec
from helpers import tiny_config, tiny_model
from jspec import attention
from pallas_kernels.cpu import build as cpu_kernels


def test_auto_is_the_cpu_kernel_on_cpu_and_pallas_needs_a_gpu():
    assert attention.resolve("auto", "cpu") == ("cpu" if cpu_kernels.preferred("attention") else "xla")
    assert attention.resolve("auto", "gpu") == "pallas"
    assert attention.resolve("auto", "rocm") == "pallas"
    with pytest.raises(jspec.ConfigError, match="GPU"):
        attention.resolve("pallas", "cpu")
    with pytest.raises(jspec.ConfigError):
        attention.resolve("flash")


@pytest.mark.parametrize("impl", [
    "interpret",  # the Pallas kernel in interpret mode
    pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler")),
])
def test_generation_through_a_kernel_matches_reference(impl):
    """Decode (q_len 1), verification (q_len k + 1) and prefill through the kernel."""
    model = tiny_model(tiny_config(num_layers=2), scale=4.0)
    prompts = [[5, 9, 3, 17, 2, 44, 8, 5, 9, 3], [7, 7, 8]]
    sp = jspec.SamplingParams(max_tokens=6, ignore_eos=True)
    ref = jspec.generate(model, prompts, sp, attention="reference")
    for spec in [jspec.SpecConfig(), jspec.SpecConfig("ngram", 3, ngram_min=1)]:
        got = jspec.generate(model, prompts, sp, spec=spec, attention=impl)
        assert got.token_ids == ref.token_ids


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels are not built")
def test_the_cpu_implementation_leaves_long_prefill_chunks_to_xla():
    import jax
    import jax.numpy as jnp

    fn = attention.get("cpu")
    pages = jnp.zeros((1, 4, 16, 16))
    table, lens = jnp.zeros((1, 4), jnp.int32), jnp.full((1,), 64, jnp.int32)
    for rows, kernel in ((1, True), (attention.CPU_KERNEL_MAX_ROWS, True), (attention.CPU_KERNEL_MAX_ROWS + 1, False)):
        q = jnp.zeros((1, rows, 2, 16))
        text = jax.jit(fn).lower(q, pages, pages, table, jnp.maximum(lens, rows), jnp.full((1,), rows, jnp.int32)).as_text()
        assert ("jspec_paged_attention" in text) == kernel, rows
