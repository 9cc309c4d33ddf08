"""Block-paged verification attention.

The contract (one meaning everywhere; see DESIGN.md):

    sequence b has ``q_lens[b]`` new query tokens whose K/V are already written into its pages;
    ``kv_lens[b]`` counts them. Query row ``t < q_lens[b]`` sits at absolute position
    ``kv_lens[b] - q_lens[b] + t`` and attends to every key at a position <= its own. Rows
    ``t >= q_lens[b]`` return zeros.

Decode is q_len = 1, speculative verification q_len = k + 1, chunked prefill q_len = chunk.

A token tree's verification (``tree_mask`` int32 [B, T]) changes only what the rows among the new
ones see: row t still sits at storage position ``start + t`` (start = ``kv_lens[b] - q_lens[b]``)
and sees every key before start (the cached prefix), and the key of new row j exactly when bit j
of ``tree_mask[b, t]`` is set (its ancestors and itself; T <= 32). A chain's mask,
``(1 << (t + 1)) - 1`` for row t, is the causal contract. ``tree_mask_visible`` states it once.

Options of a model's attention layer (Gemma's), the same in every implementation:
``sliding_window`` W (a local layer: row at position p sees keys at positions > p - W, W keys
itself included, as Hugging Face's sliding-window mask), ``soft_cap`` c (scores become
``c * tanh(score / c)`` after scaling) and ``sm_scale`` (the score scale; default D ** -0.5).
A tree verification with a sliding window is not defined (its rows' positions differ from
their storage positions); callers refuse the pair.

Implementations here: ``paged_verify_attention`` (the Pallas Triton kernel; ``interpret=True``
runs it on the CPU) and ``paged_verify_attention_reference`` (plain jnp, the oracle). The
kernel's design is described above ``_paged_verify_kernel``; its tiles come from
:mod:`pallas_kernels.tuning`.

Shapes and dtypes:
    q             [B, T, Hq, D]                  float32, bfloat16 or float16
    k_pages       [KVH, num_pages, page_size, D] float32, bfloat16 or float16 (read as q's dtype)
    v_pages       [KVH, num_pages, page_size, D] k_pages' dtype
    block_tables  int32 [B, max_pages_per_seq]   page ids of sequence b, in order; slots past
                                                 its pages may hold anything (never read)
    kv_lens       int32 [B]                      keys of sequence b, new tokens included
    q_lens        int32 [B] or None (= T)
    tree_mask     int32 [B, T] or None (causal)  bit j of row t: row t sees new row j (T <= 32)
    sliding_window  int or None                  a local layer's window (keys, itself included)
    result        [B, T, Hq, D] in q's dtype
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import tuning

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# 8-bit float pages (OCP E4M3 and E5M2, vLLM's "fp8" KV caches): the reference, the xla path and
# the CPU kernels read them; the Triton kernel does not (paged_verify_attention).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
PAGE_DTYPES = FLOAT_DTYPES + FP8_DTYPES


def check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens=None, *,
                            page_dtypes=PAGE_DTYPES, tree_mask=None, sliding_window=None) -> None:
    """Raise ``ValueError`` naming the offending argument when shapes or dtypes are wrong
    (``page_dtypes``: the pages' dtypes the caller reads)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [KVH, num_pages, page_size, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    b, _, hq, d = q.shape
    kvh, _, _, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"k_pages head_dim {dk} must equal q head_dim {d}")
    if q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if k_pages.dtype not in page_dtypes:
        names = ", ".join(str(d) for d in page_dtypes)
        raise ValueError(f"k_pages must be one of {names}, got {k_pages.dtype}")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    if hq % kvh:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_pages heads ({kvh})")
    if block_tables.ndim != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, max_pages_per_seq], got shape {block_tables.shape}")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if kv_lens.shape != (b,):
        raise ValueError(f"kv_lens must be [B={b}], got shape {kv_lens.shape}")
    if kv_lens.dtype != jnp.int32:
        raise ValueError(f"kv_lens must be int32, got {kv_lens.dtype}")
    if q_lens is not None:
        if q_lens.shape != (b,):
            raise ValueError(f"q_lens must be [B={b}], got shape {q_lens.shape}")
        if q_lens.dtype != jnp.int32:
            raise ValueError(f"q_lens must be int32, got {q_lens.dtype}")
    if tree_mask is not None:
        if tree_mask.shape != (b, q.shape[1]) or tree_mask.dtype != jnp.int32:
            raise ValueError(f"tree_mask must be int32 [B={b}, T={q.shape[1]}], got {tree_mask.dtype} {tree_mask.shape}")
        if q.shape[1] > MAX_TREE_ROWS:
            raise ValueError(f"a tree verification has at most {MAX_TREE_ROWS} rows, got T={q.shape[1]}")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise ValueError(f"sliding_window must be an integer >= 1 or None, got {sliding_window!r}")
        if tree_mask is not None:
            raise ValueError("a tree verification with a sliding window is not defined")
    _check_concrete_lens(kv_lens, q_lens, q.shape[1], block_tables.shape[1] * k_pages.shape[2])


MAX_TREE_ROWS = 32  # one bit per row in an int32


def tree_mask_visible(key_pos, start, bits):
    """Whether a key at ``key_pos`` is visible to a tree row whose segment's new rows start at
    ``start`` and whose mask is ``bits`` (broadcasting arrays): the prefix (key_pos < start)
    always, new row j (key_pos = start + j) when bit j is set."""
    rel = key_pos - start  # the key's row among the new rows
    shift = jnp.clip(rel, 0, 31)
    bit = jnp.bitwise_and(lax.shift_right_arithmetic(bits, shift.astype(jnp.int32)), 1) == 1
    return (rel < 0) | ((rel < 32) & bit)


def _check_concrete_lens(kv_lens, q_lens, t, capacity) -> None:
    """Value checks, only where the lengths are concrete (not traced inside jit). A tracer is
    recognised by its type, not by the error converting it raises: JAX builds that error's
    message by walking the whole trace so far, which made tracing a model quadratic in its
    layers (an 80-layer decode step took 8.4 s to trace instead of 2.4 s)."""
    if isinstance(kv_lens, jax.core.Tracer) or isinstance(q_lens, jax.core.Tracer):
        return
    kv = np.asarray(jax.device_get(kv_lens))
    ql = None if q_lens is None else np.asarray(jax.device_get(q_lens))
    if (kv > capacity).any():
        raise ValueError(f"kv_lens {kv.tolist()} exceed the block table capacity {capacity}")
    if ql is not None:
        if (ql < 0).any() or (ql > t).any():
            raise ValueError(f"q_lens {ql.tolist()} must lie in [0, T={t}]")
        if (kv < ql).any():
            raise ValueError(f"kv_lens {kv.tolist()} must be >= q_lens {ql.tolist()}")
    elif (kv < t).any():
        raise ValueError(f"kv_lens {kv.tolist()} must be >= q_lens (= T = {t})")


def write_kv(
    pages: jax.Array,  # [KVH, P, S, D]
    new: jax.Array,  # [B, T, KVH, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    start: jax.Array,  # int32 [B]: position of row 0
    q_lens: jax.Array,  # int32 [B]: rows t < q_lens[b] are written, the rest dropped
) -> jax.Array:
    """Scatter ``new[b, t]`` to position ``start[b] + t`` of sequence b's pages: the K/V write the
    contract assumes has happened before attention (jspec.cache.paged.write_kv; the CPU decoder-layer
    kernel, pallas_kernels.cpu.layer_tail, does the same in place). A slot past the table or a row
    t >= q_lens[b] is dropped."""
    _, num_pages, page_size, _ = pages.shape
    t = new.shape[1]
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    slot = pos // page_size
    page = jnp.take_along_axis(block_tables, slot, axis=1, mode="clip")
    keep = (jnp.arange(t)[None, :] < q_lens[:, None]) & (slot < block_tables.shape[1])
    page = jnp.where(keep, page, num_pages)  # out of range: dropped
    vals = jnp.transpose(new, (2, 0, 1, 3))  # [KVH, B, T, D]
    if pages.dtype in FP8_DTYPES:  # saturated, as vLLM's fp8 writes are (E4M3 has no infinity)
        big = float(jnp.finfo(pages.dtype).max)
        vals = jnp.clip(vals, -big, big)
    vals = vals.astype(pages.dtype)
    return pages.at[:, page, pos % page_size].set(vals, mode="drop")


def paged_verify_attention_reference(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [KVH, P, S, D]
    v_pages: jax.Array,  # [KVH, P, S, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    kv_lens: jax.Array,  # int32 [B]
    q_lens: Optional[jax.Array] = None,  # int32 [B]
    *,
    sm_scale: Optional[float] = None,
    soft_cap: Optional[float] = None,
    tree_mask: Optional[jax.Array] = None,  # int32 [B, T]
    sliding_window: Optional[int] = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Plain-jnp oracle of the contract: gather every page of each sequence, mask, softmax."""
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, tree_mask=tree_mask,
                            sliding_window=sliding_window)
    b, t, hq, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    group = hq // kvh
    n = block_tables.shape[1] * page_size
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    scale = d**-0.5 if sm_scale is None else sm_scale

    k = k_pages[:, block_tables].reshape(kvh, b, n, d)  # [KVH, B, N, D]
    v = v_pages[:, block_tables].reshape(kvh, b, n, d)
    if k.dtype in FP8_DTYPES:  # 8-bit floats take part in no implicit promotion
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    # Slots past kv_len hold stale data (rolled-back drafts, other sequences' pages, anything):
    # zero them so even a NaN there cannot leak through 0 * NaN.
    live = (jnp.arange(n)[None, :] < kv_lens[:, None])[None, :, :, None]  # [1, B, N, 1]
    v = jnp.where(live, v, jnp.zeros((), v.dtype))
    qg = q.reshape(b, t, kvh, group, d)
    s = jnp.einsum("btkgd,kbnd->bkgtn", qg, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST) * scale  # [B, KVH, G, T, N]
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)

    q_pos = kv_lens[:, None] - q_lens[:, None] + jnp.arange(t)[None, :]  # [B, T]
    visible = jnp.arange(n)[None, None, :] <= q_pos[:, :, None]  # [B, T, N]
    if sliding_window is not None:
        visible &= jnp.arange(n)[None, None, :] > q_pos[:, :, None] - sliding_window
    if tree_mask is not None:
        start = (kv_lens - q_lens)[:, None, None]
        visible &= tree_mask_visible(jnp.arange(n)[None, None, :], start, tree_mask[:, :, None])
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows that see nothing (padding) stay finite
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    o = jnp.einsum("bkgtn,kbnd->btkgd", p, v.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)  # [B, T, KVH, G, D]
    valid_row = jnp.arange(t)[None, :] < q_lens[:, None]  # [B, T]
    o = jnp.where(valid_row[:, :, None, None, None], o, 0.0)
    return o.reshape(b, t, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# Pallas Triton kernel.
#
# Grid (B, KVH, q blocks, splits). A program owns every query row of one KV head of one
# sequence -- the T*G rows (G = Hq / KVH), row r = t*G + g, padded to a power of two >= 16 --
# so each K/V page of that head is read once per call. T*G <= 256 (T = 17 = 16 drafts + 1 at G = 8
# included) is one q block; only larger T*G (chunked prefill) gets several, each re-reading.
#
# Splits are sized per sequence, in the kernel: each sequence's live keys (kv_len; none when
# q_len = 0) are cut into pieces of keys_per_split(kv_len) keys, one per split program, so a
# short sequence in a wide block table uses few splits and the surplus programs return at once.
#
# Loads: q is gathered in place from [B, T, Hq, D] (rows t < q_len only: no XLA transpose or
# pad); page ids are read from the block table one step ahead and carried through the loop, so a
# step's K/V addresses never wait on a table load of the same step; K and V are gathered with
# masked loads. Nothing at or past the split's end, kv_len, or the last position a row of the
# program can see is loaded, and block-table slots past those keys are never read.
#
# Softmax: online, in base 2 (log2(e) folded into the score scale; exp2), with the running max
# m, sum l and unnormalised output o in float32; rows that have seen nothing stay inf-free.
#
# Output: with one split a program normalises and writes its rows of the [B, T, Hq, D] result
# in q's dtype (rows t >= q_len as zeros): a single launch. With several, a program writes f32
# (o, m, l) only for the valid rows that see one of its keys, and `_merge_splits` (XLA) combines
# them.
#
# Only what the Triton lowering supports on both CUDA and ROCm is used: power-of-two block
# shapes, dots with every side >= 16, masked pointer gathers and scatters, scf.for and scf.if;
# no inline asm, no atomics, no TMA / wgmma / warp specialisation.
# ---------------------------------------------------------------------------------------------

LOG2E = 1.4426950408889634


def _iota(n: int) -> jax.Array:
    return lax.broadcasted_iota(jnp.int32, (n,), 0)


def _paged_verify_kernel(
    kv_len_ref,  # int32 [1]
    q_len_ref,  # int32 [1]
    table_ref,  # int32 [max_pages_per_seq]       this sequence's row of the block table
    q_ref,  # [T, Hq, D]                         this sequence's queries, read in place
    k_ref,  # [num_pages, page_size, D]          this KV head's pages
    v_ref,  # [num_pages, page_size, D]
    *refs,  # with ``tree``: tree_ref int32 [T] (this sequence's tree_mask row) first; then the outputs:
    # one split: out [T, Hq, D] in q's dtype; else o f32 [T, Hq, D], m, l f32 [T, Hq]
    group: int,
    head_dim: int,
    page_size: int,
    block_q: int,
    head_dim_padded: int,
    block_k: int,
    num_splits: int,
    min_keys_per_split: int,
    sm_scale: float,
    soft_cap: Optional[float],
    tree: bool = False,
    sliding_window: Optional[int] = None,
):
    tree_ref, out_refs = (refs[0], refs[1:]) if tree else (None, refs)
    t_len = q_ref.shape[0]
    dp = head_dim_padded
    kv_len = kv_len_ref[0]
    q_len = q_len_ref[0]
    kv_head = pl.program_id(1)
    q_block = pl.program_id(2)
    split = pl.program_id(3)

    # Row r = t * G + g of this program is query token t of query head kv_head * G + g. Rows
    # t >= q_len (padding and the rows past T) get position -1: they see no key.
    row = q_block * block_q + _iota(block_q)
    t = lax.div(row, jnp.int32(group))
    head = kv_head * group + (row - t * group)
    valid = t < q_len
    q_pos = jnp.where(valid, kv_len - q_len + t, -1)  # [block_q]

    # This program's keys: its split of the sequence's live keys (from the first one a row can
    # see: all of them, or a local layer's window), cut at the last position any of its rows can
    # see (and empty when none of its rows is valid).
    first, live, per_split = _split_keys(kv_len, q_len, num_splits, block_k, min_keys_per_split, sliding_window)
    key_start = first + split * per_split
    t_first = lax.div(q_block * block_q, jnp.int32(group))
    t_last = jnp.minimum(lax.div(q_block * block_q + block_q - 1, jnp.int32(group)), q_len - 1)
    key_end = jnp.minimum(jnp.minimum(key_start + per_split, live), kv_len - q_len + t_last + 1)
    key_end = jnp.where(t_first < q_len, key_end, key_start)
    # A local layer's rows see nothing before the window of the block's first row: the page loop
    # starts there (a split wholly below it runs no step and stores m = -inf, which the merge
    # weighs as zero).
    key_begin = key_start
    if sliding_window is not None:
        key_begin = jnp.maximum(key_start, kv_len - q_len + t_first - sliding_window + 1)
    num_steps = lax.div(jnp.maximum(key_end - key_begin, 0) + (block_k - 1), jnp.int32(block_k))

    d = _iota(dp)[None, :]  # [1, Dp]
    d_ok = d < head_dim if dp != head_dim else None  # padding lanes of a head_dim like 80

    def tile_mask(rows_ok):  # [n] -> [n, Dp]
        mask = rows_ok[:, None] if d_ok is None else rows_ok[:, None] & d_ok
        return jnp.broadcast_to(mask, (rows_ok.shape[0], dp))

    def page_ids(step):  # [block_k] page id of each key of loop step `step` (0 where masked)
        k_pos = key_begin + step * block_k + _iota(block_k)
        slot = lax.div(k_pos, jnp.int32(page_size))
        return plgpu.load(table_ref.at[slot], mask=k_pos < key_end, other=0)

    def attend():
        q = plgpu.load(q_ref.at[t[:, None], head[:, None], d], mask=tile_mask(valid), other=0)
        bits = plgpu.load(tree_ref.at[t], mask=valid, other=0) if tree else None  # [block_q]

        def step(i, carry):
            o, m, l, pages = carry
            next_pages = page_ids(i + 1)  # prefetch: consumed by the next step
            k_pos = key_begin + i * block_k + _iota(block_k)
            k_ok = k_pos < key_end
            offset = lax.rem(k_pos, jnp.int32(page_size))
            idx = (pages[:, None], offset[:, None], d)  # -> [block_k, Dp]
            k = plgpu.load(k_ref.at[idx], mask=tile_mask(k_ok), other=0).astype(q.dtype)
            v = plgpu.load(v_ref.at[idx], mask=tile_mask(k_ok), other=0).astype(q.dtype)

            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)  # [block_q, block_k]
            if soft_cap is None:
                s = s * (sm_scale * LOG2E)  # scores in base 2
            else:
                s = jnp.tanh(s * (sm_scale / soft_cap)) * (soft_cap * LOG2E)
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if tree:
                visible &= tree_mask_visible(k_pos[None, :], kv_len - q_len, bits[:, None])
            if sliding_window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - sliding_window
            s = jnp.where(visible, s, -jnp.inf)

            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that saw nothing yet
            alpha = jnp.exp2(m - m_safe)  # 0 while m == -inf
            p = jnp.exp2(s - m_safe[:, None])  # 0 where not visible
            l = alpha * l + jnp.sum(p, axis=1)
            pv = lax.dot_general(p.astype(q.dtype), v, (((1,), (0,)), ((), ())),
                                 precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32)  # [block_q, Dp]
            return alpha[:, None] * o + pv, m_new, l, next_pages

        init = (jnp.zeros((block_q, dp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
                jnp.zeros((block_q,), jnp.float32), page_ids(0))
        o, m, l, _ = lax.fori_loop(0, num_steps, step, init)

        idx = (t[:, None], head[:, None], d)
        if num_splits == 1:
            [out_ref] = out_refs
            out = o * jnp.where(l > 0, 1.0 / l, 0.0)[:, None]  # rows that saw nothing -> 0
            plgpu.store(out_ref.at[idx], out.astype(out_ref.dtype), mask=tile_mask(t < t_len))
        else:
            o_ref, m_ref, l_ref = out_refs
            seen = valid & (q_pos >= key_start)  # rows that see at least one key of this split
            plgpu.store(o_ref.at[idx], o, mask=tile_mask(seen))
            plgpu.store(m_ref.at[t, head], m, mask=seen)
            plgpu.store(l_ref.at[t, head], l, mask=seen)

    if num_splits == 1:
        attend()  # always writes its rows, zeros included
    else:
        pl.when(key_end > key_start)(attend)  # a split with no live keys writes nothing


def _split_keys(kv_len, q_len, num_splits: int, block_k: int, min_keys_per_split: int,
                sliding_window: Optional[int]):
    """(first key, live end, keys per split) of a sequence (scalars or arrays [B]): the splits
    share the keys from the first one its first row can see (0, or with a sliding window the
    start of that row's window) to ``kv_len`` (0 when ``q_len`` is 0), so a local layer's splits
    divide its window, not the whole context."""
    live = jnp.where(q_len > 0, kv_len, 0)
    first = jnp.zeros_like(live)
    if sliding_window is not None:
        first = jnp.clip(kv_len - q_len - sliding_window + 1, 0, live)
    return first, live, tuning.keys_per_split(live - first, num_splits, block_k, min_keys_per_split)


def _merge_splits(o, m, l, kv_lens, q_lens, plan: tuning.TilePlan, sliding_window: Optional[int] = None):
    """Combine the split partials o f32 [S, B, T, Hq, D], m, l f32 [S, B, T, Hq] (base-2 max)
    into [B, T, Hq, D]. Only (split, row) pairs the kernel wrote are read: valid rows whose
    position reaches the split's first key; every other slot may hold anything."""
    num_splits, _, t, _, _ = o.shape
    first, _, per_split = _split_keys(kv_lens, q_lens, num_splits, plan.block_k, plan.min_keys_per_split,
                                      sliding_window)
    rows = jnp.arange(t, dtype=jnp.int32)
    pos = kv_lens[:, None] - q_lens[:, None] + rows[None, :]  # [B, T]
    first_key = first[None, :, None] + jnp.arange(num_splits, dtype=jnp.int32)[:, None, None] * per_split[None, :, None]
    seen = (rows[None, None, :] < q_lens[None, :, None]) & (first_key <= pos[None])  # [S, B, T]
    seen = seen[..., None]  # [S, B, T, 1]
    m = jnp.where(seen, m, -jnp.inf)
    m_max = jnp.max(m, axis=0)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.where(seen, jnp.exp2(m - m_max), 0.0)  # [S, B, T, Hq]
    denom = jnp.sum(w * jnp.where(seen, l, 0.0), axis=0)  # [B, T, Hq]
    num = jnp.sum(w[..., None] * jnp.where(seen[..., None], o, 0.0), axis=0)  # [B, T, Hq, D]
    return num * jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)[..., None]


def plan_for(q, k_pages, block_tables, *, entry: Optional[tuning.TileConfig] = None,
             block_q: Optional[int] = None, block_k: Optional[int] = None,
             num_splits: Optional[int] = None, num_warps: Optional[int] = None,
             num_stages: Optional[int] = None) -> tuning.TilePlan:
    """The :class:`~pallas_kernels.tuning.TilePlan` a call with these shapes (arrays or
    ``jax.ShapeDtypeStruct``) gets; ``entry`` defaults to :func:`tuning.current`."""
    b, t, hq, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    return tuning.plan_tiles(
        batch=b, kv_heads=kvh, rows=t * (hq // kvh), head_dim=d,
        capacity=block_tables.shape[1] * page_size, itemsize=jnp.dtype(q.dtype).itemsize,
        entry=tuning.current() if entry is None else entry, block_q=block_q, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


def paged_verify_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [KVH, P, S, D]
    v_pages: jax.Array,  # [KVH, P, S, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    kv_lens: jax.Array,  # int32 [B]
    q_lens: Optional[jax.Array] = None,  # int32 [B]
    *,
    sm_scale: Optional[float] = None,
    soft_cap: Optional[float] = None,
    interpret: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    num_splits: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    tree_mask: Optional[jax.Array] = None,  # int32 [B, T]
    sliding_window: Optional[int] = None,
) -> jax.Array:  # [B, T, Hq, D]
    """Verification attention over a block-paged KV cache (the contract in the module doc).

    Tile arguments left as ``None`` come from :func:`pallas_kernels.tuning.plan_tiles` with the
    entry :func:`~pallas_kernels.tuning.current` picks (the ambient abstract device when
    lowering ahead of time, else the first device):
        block_q     query rows per program (power of two >= 16); T*G rows above it form
                    several q blocks, each reading the pages again (chunked prefill only)
        block_k     keys per page-loop step (power of two >= 16)
        num_splits  programs sharing one sequence's keys (split-k); 1 writes the result in
                    the kernel, more write partials merged by XLA afterwards
        num_warps, num_stages   Triton launch parameters
    """
    # 1-byte pages are refused here: besides the fp8 format split between vendors (OCP E4M3 on
    # NVIDIA, E4M3FNUZ on gfx942), the Triton lowering switches to 64-bit offsets only above 2^32
    # bytes, so a 1-byte cache of 2-4 GiB (>= 2^31 elements) would overflow 32-bit element offsets.
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, page_dtypes=FLOAT_DTYPES,
                            tree_mask=tree_mask, sliding_window=sliding_window)
    return _paged_verify_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, tree_mask, sm_scale=sm_scale,
        soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret, block_q=block_q, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "sliding_window", "interpret", "block_q", "block_k", "num_splits",
                     "num_warps", "num_stages"),
)
def _paged_verify_attention(
    q: jax.Array,  # [B, T, Hq, D]
    k_pages: jax.Array,  # [KVH, P, S, D]
    v_pages: jax.Array,  # [KVH, P, S, D]
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    kv_lens: jax.Array,  # int32 [B]
    q_lens: Optional[jax.Array] = None,  # int32 [B]
    tree_mask: Optional[jax.Array] = None,  # int32 [B, T]
    *,
    sm_scale: Optional[float] = None,
    soft_cap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    interpret: bool = False,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    num_splits: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> jax.Array:  # [B, T, Hq, D]
    """The jitted body of :func:`paged_verify_attention` (arguments already checked).

    Offsets: Triton's lowering computes element offsets in int64 for any operand above 2^32
    bytes, which for the 2- and 4-byte dtypes accepted here covers every array that could pass
    2^31 elements (tests/pallas_kernels checks the IR of a > 2^31-element cache)."""
    b, t, hq, d = q.shape
    kvh, num_pages, page_size, _ = k_pages.shape
    max_pages = block_tables.shape[1]
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    entry = tuning.current()
    plan = plan_for(q, k_pages, block_tables, entry=entry, block_q=block_q, block_k=block_k,
                    num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)
    ns = plan.num_splits

    kernel = functools.partial(
        _paged_verify_kernel, group=hq // kvh, head_dim=d, page_size=page_size,
        block_q=plan.block_q, head_dim_padded=plan.head_dim_padded, block_k=plan.block_k,
        num_splits=ns, min_keys_per_split=plan.min_keys_per_split,
        sm_scale=d**-0.5 if sm_scale is None else float(sm_scale), soft_cap=soft_cap,
        tree=tree_mask is not None, sliding_window=sliding_window)
    in_specs = [
        pl.BlockSpec((1,), lambda i, h, j, s: (i,)),  # kv_lens
        pl.BlockSpec((1,), lambda i, h, j, s: (i,)),  # q_lens
        pl.BlockSpec((None, max_pages), lambda i, h, j, s: (i, 0)),  # block_tables
        pl.BlockSpec((None, t, hq, d), lambda i, h, j, s: (i, 0, 0, 0)),  # q, in place
        pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, j, s: (h, 0, 0, 0)),  # k
        pl.BlockSpec((None, num_pages, page_size, d), lambda i, h, j, s: (h, 0, 0, 0)),  # v
    ]
    operands = [kv_lens, q_lens, block_tables, q, k_pages, v_pages]
    if tree_mask is not None:
        in_specs.append(pl.BlockSpec((None, t), lambda i, h, j, s: (i, 0)))  # tree_mask row
        operands.append(tree_mask)
    if ns == 1:
        out_specs = pl.BlockSpec((None, t, hq, d), lambda i, h, j, s: (i, 0, 0, 0))
        out_shape = jax.ShapeDtypeStruct((b, t, hq, d), q.dtype)
    else:
        out_specs = [
            pl.BlockSpec((None, None, t, hq, d), lambda i, h, j, s: (s, i, 0, 0, 0)),  # o
            pl.BlockSpec((None, None, t, hq), lambda i, h, j, s: (s, i, 0, 0)),  # m
            pl.BlockSpec((None, None, t, hq), lambda i, h, j, s: (s, i, 0, 0)),  # l
        ]
        out_shape = [jax.ShapeDtypeStruct((ns, b, t, hq, d), jnp.float32),
                     jax.ShapeDtypeStruct((ns, b, t, hq), jnp.float32),
                     jax.ShapeDtypeStruct((ns, b, t, hq), jnp.float32)]

    with jax.named_scope("paged_verify_attention"):
        result = pl.pallas_call(
            kernel,
            grid=plan.grid,
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=plgpu.CompilerParams(num_warps=plan.num_warps,
                                                 num_stages=plan.num_stages),
            interpret=interpret,
            # The tile entry and plan in the kernel name show in profiles and lowered HLO.
            name=(f"paged_verify_attention_{entry.name.replace('-', '_')}_bq{plan.block_q}"
                  f"_bk{plan.block_k}_s{ns}_w{plan.num_warps}_st{plan.num_stages}"),
        )(*operands)
    if ns == 1:
        return result
    with jax.named_scope("paged_verify_attention_merge"):
        return _merge_splits(*result, kv_lens, q_lens, plan, sliding_window).astype(q.dtype)
