"""Paged verification attention on the CPU: the contract of
:mod:`pallas_kernels.paged_verify_attention`, as a C++ kernel (``paged_attention_cpu.cc``)
called through XLA's FFI.

XLA's CPU code for the contract (``jspec.attention.paged_attention_xla``) gathers every page of
a block of keys into a copy before its products, and that gather is most of a decode step's
growth with the context (measured 2026-12-01). The kernel reads the pages in place, only
those a row can see. The file keeps the kernels' shape: the kernel, a validated wrapper
(:func:`paged_attention_cpu`) and the reference (:func:`paged_attention_cpu_reference`, the
contract's plain-jnp oracle).

The wrapper lowers to the kernel on the CPU only, for float32 queries over pages of float32,
float16, bfloat16 or 8-bit floats (each element widened to float32 as it is read), when the kernels are built
(:func:`pallas_kernels.cpu.build.available`); elsewhere it lowers to ``fallback`` (default: the
reference). Results equal the reference's up to float rounding.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from pallas_kernels.cpu.build import available, on_cpu
from pallas_kernels.paged_verify_attention import (PAGE_DTYPES, check_paged_verify_args,
                                                   paged_verify_attention_reference)

TARGET = "jspec_paged_attention"
paged_attention_cpu_reference = paged_verify_attention_reference


def _kernel(q, k_pages, v_pages, block_tables, kv_lens, q_lens):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens)


def applies(q: jax.Array, k_pages: jax.Array) -> bool:
    """Whether these operands can run on the kernel (float32 queries, pages of float32, float16,
    bfloat16 or 8-bit floats, head_dim <= 256, kernels built)."""
    return (q.dtype == jnp.float32 and k_pages.dtype in PAGE_DTYPES and q.shape[-1] <= 256
            and available())


def paged_attention_cpu(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [KVH, P, S, D]
    v_pages: jax.Array,  # [KVH, P, S, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    kv_lens: jax.Array,  # int32 [B]
    q_lens: Optional[jax.Array] = None,  # int32 [B]
    *,
    fallback: Callable = paged_attention_cpu_reference,
) -> jax.Array:  # [B, T, Hq, D]
    """The verification-attention contract on the CPU kernel where it applies, ``fallback``
    (same signature) elsewhere: other platforms, dtypes, or no kernels."""
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    if q_lens is None:
        q_lens = jnp.full(kv_lens.shape, q.shape[1], jnp.int32)
    if not applies(q, k_pages):
        return fallback(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    return on_cpu(q, k_pages, v_pages, block_tables, kv_lens, q_lens, cpu=_kernel, default=fallback)
