"""Picks the implementation of the verification-attention contract (and of RoPE's rotation).

One operation, one meaning (see :mod:`pallas_kernels.paged_verify_attention`): ``q_lens[b]``
new query rows whose K/V are already in the pages, ``kv_lens[b]`` keys including them, row t at
absolute position ``kv_lens[b] - q_lens[b] + t`` sees keys at positions <= its own; padding
rows (t >= q_lens[b]) come out as zeros.

Implementations:
    reference  plain jnp over every page of the block table (gather, mask, softmax): the oracle
    xla        plain jnp, online softmax over blocks of pages in a loop that stops at the longest
               live sequence: cost follows the live context, not the table width (the CPU path)
    cpu        a C++ kernel through XLA's FFI that reads the pages in place
               (pallas_kernels.cpu.paged_attention; float32 queries over float32, float16,
               bfloat16 or 8-bit float pages, built at first use) for up to CPU_KERNEL_MAX_ROWS query rows;
               xla elsewhere (long prefill chunks, other dtypes, no compiler, tree masks, and
               the options of Gemma's layers: a sliding window, soft-capped scores, a score scale)
    pallas     the Pallas Triton kernel, compiled for the GPU (CUDA or ROCm); 16- and 32-bit pages
    interpret  the same Pallas kernel in interpret mode (CPU tests)
    auto       pallas on a GPU backend; on the CPU, cpu where the kernels are built, else xla

:func:`rotate` is RoPE's rotation of the queries and keys the contract reads: on the CPU the C++
op, elsewhere the same formula in ``jnp``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from jspec.errors import ConfigError
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu import layer_tail
from pallas_kernels.cpu.paged_attention import paged_attention_cpu
from pallas_kernels.paged_verify_attention import tree_mask_visible

ATTENTION_IMPLS = ("auto", "xla", "cpu", "reference", "pallas", "interpret")
# Keys per loop iteration of the xla path. 512 made a decode step at 1,000 tokens of context
# cheaper (1.10-1.15x one at 100, against 1.20-1.28x), but generation on short prompts slower
# (batch 1 6-19%, batch 8 ~25%: one trip of 512 keys where ~180 are live); measured 2026-12-02.
BLOCK_KEYS = 256
# Query rows per sequence up to which the cpu implementation runs the C++ kernel: decode,
# verification and short prefill chunks. Longer prefill chunks run the xla path, which was
# faster there (256 rows: 3.7 vs 4.2 ms a layer at 256 keys, 16 vs 23 at 1,024; at 64 rows the
# kernel took 0.38 ms against 1.2; measured 2026-12-02).
CPU_KERNEL_MAX_ROWS = 64


def resolve(impl: str = "auto", backend: str | None = None) -> str:
    """Map ``auto`` to a concrete implementation for ``backend`` (default: jax's default)."""
    if impl not in ATTENTION_IMPLS:
        raise ConfigError(f"attention must be one of {ATTENTION_IMPLS}, got {impl!r}")
    backend = backend or jax.default_backend()
    on_gpu = backend in ("gpu", "cuda", "rocm")
    if impl == "pallas" and not on_gpu:
        raise ConfigError(f"attention 'pallas' compiles for a GPU and the backend is {backend!r}; "
                          "use 'xla' or 'reference' on this machine")
    if impl != "auto":
        return impl
    return "pallas" if on_gpu else ("cpu" if backend == "cpu" and cpu_kernels.preferred("attention") else "xla")


def paged_attention_xla(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [KVH, P, S, D]
    v_pages: jax.Array,  # [KVH, P, S, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    kv_lens: jax.Array,  # int32 [B]
    q_lens: Optional[jax.Array] = None,  # int32 [B]
    *,
    block_keys: int = BLOCK_KEYS,
    tree_mask: Optional[jax.Array] = None,  # int32 [B, T]
    sm_scale: Optional[float] = None,
    soft_cap: Optional[float] = None,
    sliding_window: Optional[int] = None,
) -> jax.Array:  # [B, T, Hq, D]
    """The contract with an online softmax over blocks of ``block_keys`` keys; the loop runs
    ``ceil(max(kv_lens) / block_keys)`` times (a while loop: no recompilation as contexts grow).
    ``sm_scale``, ``soft_cap``, ``sliding_window``: as the reference
    (:mod:`pallas_kernels.paged_verify_attention`)."""
    b, t, hq, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    g = hq // kvh
    width = block_tables.shape[1]
    bp = max(1, min(block_keys // page_size, width))  # pages per block (no wider than the table)
    n = bp * page_size
    tables = jnp.pad(block_tables, ((0, 0), (0, (-width) % bp)))  # padded slots are masked out
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    q_pos = kv_lens[:, None] - q_lens[:, None] + jnp.arange(t)[None, :]  # [B, T]
    qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32) * (d ** -0.5 if sm_scale is None else sm_scale)
    num_blocks = (jnp.max(kv_lens) + n - 1) // n

    def body(j, carry):
        m, l, acc = carry  # [B, KVH, G, T], [B, KVH, G, T], [B, KVH, G, T, D]
        tbl = jax.lax.dynamic_slice_in_dim(tables, j * bp, bp, axis=1)  # [B, bp]
        k = k_pages[:, tbl].reshape(kvh, b, n, d).astype(jnp.float32)
        v = v_pages[:, tbl].reshape(kvh, b, n, d).astype(jnp.float32)
        pos = j * n + jnp.arange(n)  # [n]
        live = pos[None, :] < kv_lens[:, None]  # [B, n]
        v = jnp.where(live[None, :, :, None], v, 0.0)  # stale or NaN slots cannot leak through 0 * NaN
        s = jnp.einsum("btkgd,kbnd->bkgtn", qg, k)  # [B, KVH, G, T, n]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = (pos[None, None, :] <= q_pos[:, :, None]) & live[:, None, :]  # [B, T, n]
        if sliding_window is not None:
            visible &= pos[None, None, :] > q_pos[:, :, None] - sliding_window
        if tree_mask is not None:
            visible &= tree_mask_visible(pos[None, None, :], (kv_lens - q_lens)[:, None, None], tree_mask[:, :, None])
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - safe)  # exp(-inf) = 0 on the first block
        p = jnp.exp(s - safe[..., None])
        l = l * alpha + jnp.sum(p, axis=-1)
        acc = acc * alpha[..., None] + jnp.einsum("bkgtn,kbnd->bkgtd", p, v)
        return m_new, l, acc

    init = (jnp.full((b, kvh, g, t), -jnp.inf, jnp.float32), jnp.zeros((b, kvh, g, t), jnp.float32),
            jnp.zeros((b, kvh, g, t, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_blocks, body, init)
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [B, KVH, G, T, D]
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(b, t, hq, d)
    valid_row = jnp.arange(t)[None, :] < q_lens[:, None]
    return jnp.where(valid_row[:, :, None, None], o, 0.0).astype(q.dtype)


def paged_attention_cpu_or_xla(q, k_pages, v_pages, block_tables, kv_lens, q_lens=None, *, tree_mask=None,
                               **options):
    """The cpu implementation: the C++ kernel for up to :data:`CPU_KERNEL_MAX_ROWS` query rows
    per sequence (float32 queries; float32, float16, bfloat16 or 8-bit float pages), the xla path
    otherwise (a tree verification and Gemma's ``options`` included: the kernel knows the plain
    causal contract only)."""
    options = {k: v for k, v in options.items() if v is not None}
    if tree_mask is not None or options:
        return paged_attention_xla(q, k_pages, v_pages, block_tables, kv_lens, q_lens, tree_mask=tree_mask,
                                   **options)
    if q.shape[1] > CPU_KERNEL_MAX_ROWS:
        return paged_attention_xla(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    return paged_attention_cpu(q, k_pages, v_pages, block_tables, kv_lens, q_lens, fallback=paged_attention_xla)


@functools.lru_cache(maxsize=None)
def get(impl: str = "auto") -> Callable:
    """The attention function for ``impl``, with the signature
    ``fn(q, k_pages, v_pages, block_tables, kv_lens, q_lens, *, tree_mask=None, sm_scale=None,
    soft_cap=None, sliding_window=None) -> out``."""
    impl = resolve(impl)
    if impl == "xla":
        return paged_attention_xla
    if impl == "cpu":
        return paged_attention_cpu_or_xla
    if impl == "reference":
        from pallas_kernels.paged_verify_attention import paged_verify_attention_reference

        return paged_verify_attention_reference
    from pallas_kernels.paged_verify_attention import paged_verify_attention

    return functools.partial(paged_verify_attention, interpret=(impl == "interpret"))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of ``x`` [..., heads, D] with ``cos`` / ``sin`` [..., D] of each row's
    position: ``x cos + rotate_half(x) sin``. On the CPU (float32, kernels built) the C++ op
    ``pallas_kernels.cpu.layer_tail.rotate``, which rounds each product before the sum in every
    compiled step (XLA contracted the elementwise formula to FMAs in some steps and not in others,
    so a row's K moved by an ulp between a step with drafts and one without, and speculative
    output parted from plain decoding); elsewhere the formula in ``jnp``."""
    return layer_tail.rotate(x, cos, sin)
