"""Picks the implementation of the verification-attention contract.

One operation, one meaning (see :mod:`pallas_kernels.paged_verify_attention`): ``q_lens[b]``
new query rows whose K/V are already in the pages, ``kv_lens[b]`` keys including them, row t at
absolute position ``kv_lens[b] - q_lens[b] + t`` sees keys at positions <= its own.

Implementations:
    reference  plain jnp (gather pages, mask, softmax): the oracle and the CPU path
    pallas     the Pallas Triton kernel, compiled for the GPU (CUDA or ROCm)
    interpret  the same Pallas kernel in interpret mode (CPU tests)
    auto       pallas on a GPU backend, reference elsewhere
"""

from __future__ import annotations

import functools
from typing import Callable

import jax

from jspec.errors import ConfigError

ATTENTION_IMPLS = ("auto", "reference", "pallas", "interpret")


def resolve(impl: str = "auto", backend: str | None = None) -> str:
    """Map ``auto`` to a concrete implementation for ``backend`` (default: jax's default)."""
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if impl == "pallas" and not on_gpu:
        raise ConfigError(f"attention 'pallas' compiles for a GPU and the backend is {backend!r}; "
                          "use 'reference' (or 'interpret' to run the kernel in interpret mode)")
    if impl != "auto":
        return impl
    return "pallas" if on_gpu else "reference"


@functools.lru_cache(maxsize=None)
def get(impl: str = "auto") -> Callable:
    """The attention function for ``impl``, with the signature
    ``fn(q, k_pages, v_pages, block_tables, kv_lens, q_lens) -> out``."""
    impl = resolve(impl)
    if impl == "reference":
        from pallas_kernels.paged_verify_attention import paged_verify_attention_reference

        return paged_verify_attention_reference
    from pallas_kernels.paged_verify_attention import paged_verify_attention

    return functools.partial(paged_verify_attention, interpret=(impl == "interpret"))
