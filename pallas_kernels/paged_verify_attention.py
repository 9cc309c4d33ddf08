"""Block-paged verification attention.

The contract (one meaning everywhere; see DESIGN.md):

    sequence b has ``q_lens[b]`` new query tokens whose K/V are already written into its pages;
    ``kv_lens[b]`` counts them. Query row ``t < q_lens[b]`` sits at absolute position
    ``kv_lens[b] - q_lens[b] + t`` and attends to every key at a position <= its own. Rows
    ``t >= q_lens[b]`` return zeros.

Decode is q_len = 1, speculative verification q_len = k + 1, chunked prefill q_len = chunk.

Implementations here: ``paged_verify_attention`` (the Pallas Triton kernel; ``interpret=True``
runs it on the CPU) and ``paged_verify_attention_reference`` (plain jnp, the oracle). The
kernel's design is described above ``_paged_verify_kernel``; its tiles come from
:mod:`pallas_kernels.tuning`.

Shapes:
    q             [B, T, Hq, D]
    k_pages       [KVH, num_pages, page_size, D]
    v_pages       [KVH, num_pages, page_size, D]
    block_tables  int32 [B, max_pages_per_seq]   page ids of sequence b, in order
    kv_lens       int32 [B]                       keys of sequence b, new tokens included
    q_lens        int32 [B] or None (= T)
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


def check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens=None) -> None:
    """Raise ``ValueError`` naming the offending argument when shapes or dtypes are wrong."""
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
    _check_concrete_lens(kv_lens, q_lens, q.shape[1], block_tables.shape[1] * k_pages.shape[2])


def _check_concrete_lens(kv_lens, q_lens, t, capacity) -> None:
    """Value checks, only where the lengths are concrete (not traced inside jit)."""
    try:
        # np.asarray raises for tracers (jax.device_get returns them unchanged under jit).
        kv = np.asarray(jax.device_get(kv_lens))
        ql = None if q_lens is None else np.asarray(jax.device_get(q_lens))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return
    if (kv > capacity).any():
        raise ValueError(f"kv_lens {kv.tolist()} exceed the block table capacity {capacity}")
    if ql is not None:
        if (ql < 0).any() or (ql > t).any():
            raise ValueError(f"q_lens {ql.tolist()} must lie in [0, T={t}]")
        if (kv < ql).any():
            raise ValueError(f"kv_lens {kv.tolist()} must be >= q_lens {ql.tolist()}")
    elif (kv < t).any():
        raise ValueError(f"kv_lens {kv.tolist()} must be >= q_lens (= T = {t})")


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
) -> jax.Array:  # [B, T, Hq, D]
    """Plain-jnp oracle of the contract: gather every page of each sequence, mask, softmax."""
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    b, t, hq, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    group = hq // kvh
    n = block_tables.shape[1] * page_size
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    scale = d**-0.5 if sm_scale is None else sm_scale

    k = k_pages[:, block_tables].reshape(kvh, b, n, d)  # [KVH, B, N, D]
    v = v_pages[:, block_tables].reshape(kvh, b, n, d)
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
# Grid: (batch, kv_head, q_block, split). One program owns every query row of one KV head of one
# sequence -- the T * G rows (G = Hq / KVH) laid out t-major, padded to a power of two >= 16 --
# so each K/V page of that head is read from memory once per verification, not once per query
# token or per query head. (T * G above the tile table's max_block_q is cut into q blocks; that
# only happens for chunked prefill.) The program walks its share of the sequence's keys in
# steps of block_k keys: the page of each key comes from the block table, K and V are gathered
# with masked loads (nothing past kv_len is read), and an online softmax keeps the running row
# max m, row sum l and unnormalised output o in float32. Long contexts are split over `split`
# programs ("split-k" / flash-decoding); their (m, l, o) are merged afterwards in plain jnp.
#
# Only what the Triton lowering supports on both CUDA and ROCm is used: power-of-two block
# shapes, dots with every side >= 16, pointer gathers with masks, no inline asm, no TMA/wgmma.
# ---------------------------------------------------------------------------------------------


def _paged_verify_kernel(
    kv_len_ref,  # int32 [1]
    q_len_ref,  # int32 [1]
    table_ref,  # int32 [max_pages_per_seq]      this sequence's row of the block table
    q_ref,  # [block_q, Dp]                      rows r = t * G + g of this q block
    k_ref,  # [num_pages, page_size, D]         this KV head's pages
    v_ref,  # [num_pages, page_size, D]
    o_ref,  # f32 [block_q, Dp]                 unnormalised output of this split
    m_ref,  # f32 [block_q]                     running max of this split (-inf: saw nothing)
    l_ref,  # f32 [block_q]                     running sum of exp(s - m)
    *,
    group: int,
    head_dim: int,
    page_size: int,
    capacity: int,
    block_k: int,
    keys_per_split: int,
    sm_scale: float,
    soft_cap: Optional[float],
):
    block_q, dp = q_ref.shape
    q_block = pl.program_id(2)
    split = pl.program_id(3)
    kv_len = kv_len_ref[0]
    q_len = q_len_ref[0]

    # Absolute position of each query row; -1 for rows past q_len and padding rows, which
    # then see no key and come out as zeros.
    row = q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    t = lax.div(row, jnp.int32(group))
    q_pos = jnp.where(t < q_len, kv_len - q_len + t, -1)  # [block_q]

    # This program's key range: its split, cut at the last key any of its rows can see.
    t_first = lax.div(q_block * block_q, group)
    t_last = jnp.minimum(lax.div(q_block * block_q + block_q - 1, group), q_len - 1)
    key_start = split * keys_per_split
    key_end = jnp.minimum(key_start + keys_per_split, kv_len - q_len + t_last + 1)
    key_end = jnp.minimum(key_end, capacity)
    key_end = jnp.where(t_first < q_len, key_end, key_start)  # no valid row: no work
    num_steps = lax.div(jnp.maximum(key_end - key_start, 0) + block_k - 1, block_k)

    q = q_ref[...]  # [block_q, Dp]
    d_idx = lax.broadcasted_iota(jnp.int32, (1, dp), 1)  # [1, Dp]
    d_ok = d_idx < head_dim if dp != head_dim else None  # padding lanes of an odd head_dim

    def step(i, carry):
        o, m, l = carry
        k_pos = key_start + i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        k_ok = k_pos < key_end  # [block_k]
        slot = lax.div(k_pos, jnp.int32(page_size))
        page = plgpu.load(table_ref.at[slot], mask=k_ok, other=0)  # [block_k] page ids
        offset = k_pos - slot * page_size
        idx = (page[:, None], offset[:, None], d_idx)  # -> [block_k, Dp]
        kv_ok = jnp.broadcast_to(k_ok[:, None] if d_ok is None else k_ok[:, None] & d_ok,
                                 (block_k, dp))
        k = plgpu.load(k_ref.at[idx], mask=kv_ok, other=0)
        v = plgpu.load(v_ref.at[idx], mask=kv_ok, other=0)

        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32) * sm_scale  # [block_q, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = jnp.where(visible, s, -jnp.inf)

        # Online softmax; m_safe keeps rows that have seen nothing yet free of inf - inf.
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)  # 0 when m == -inf
        p = jnp.exp(s - m_safe[:, None])  # 0 where not visible
        l = alpha * l + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)  # [block_q, Dp]
        o = alpha[:, None] * o + pv
        return o, m_new, l

    o = jnp.zeros((block_q, dp), jnp.float32)
    m = jnp.full((block_q,), -jnp.inf, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    o, m, l = lax.fori_loop(0, num_steps, step, (o, m, l))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _merge_splits(o, m, l):
    """Combine per-split softmax partials: o [..., S, M, D], m and l [..., S, M] -> [..., M, D]."""
    m_max = jnp.max(m, axis=-2, keepdims=True)  # [..., 1, M]
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)  # [..., S, M]; 0 for splits that saw nothing
    denom = jnp.sum(w * l, axis=-2)  # [..., M]
    num = jnp.sum(w[..., None] * o, axis=-3)  # [..., M, D]
    return num / jnp.where(denom > 0, denom, 1.0)[..., None]  # rows that saw nothing -> 0


def plan_tiles(
    *,
    batch: int,
    kv_heads: int,
    rows: int,
    head_dim: int,
    capacity: int,
    itemsize: int,
    entry: tuning.TileConfig,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    num_splits: Optional[int] = None,
) -> dict:
    """Static tile sizes for one call: explicit arguments win, the rest come from ``entry``.

    rows = T * G query rows per (sequence, KV head); capacity = max_pages_per_seq * page_size.
    """
    if block_q is None:
        block_q = min(max(16, _next_pow2(rows)), entry.max_block_q)
    if block_q < 16 or block_q & (block_q - 1):
        raise ValueError(f"block_q must be a power of two >= 16, got {block_q}")
    dp = max(16, _next_pow2(head_dim))
    if block_k is None:
        block_k = tuning.fit_block_k(entry, block_q, dp, itemsize)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    num_q_blocks = -(-rows // block_q)
    steps_total = max(1, -(-capacity // block_k))  # block_k steps covering the whole table
    if num_splits is None:
        # Enough programs for a few per core, but no split shorter than min_keys_per_split.
        programs = batch * kv_heads * num_q_blocks
        want = -(-entry.num_cores * entry.programs_per_core // programs)
        most = max(1, capacity // entry.min_keys_per_split)
        num_splits = max(1, min(want, most))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    num_splits = min(num_splits, steps_total)
    keys_per_split = -(-steps_total // num_splits) * block_k
    num_splits = -(-capacity // keys_per_split) if capacity else 1  # drop empty trailing splits
    return dict(block_q=block_q, block_k=block_k, head_dim_padded=dp,
                num_q_blocks=num_q_blocks, num_splits=max(1, num_splits),
                keys_per_split=keys_per_split)


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
) -> jax.Array:  # [B, T, Hq, D]
    """Verification attention over a block-paged KV cache (the contract in the module doc).

    Tile arguments left as ``None`` come from :func:`pallas_kernels.tuning.current` (the
    ambient abstract device when lowering ahead of time, else the first device):
        block_q     query rows per program (power of two >= 16); T*G rows above it form
                    several q blocks, each reading the pages again (chunked prefill only)
        block_k     keys per inner-loop step (power of two >= 16)
        num_splits  programs sharing one sequence's keys (split-k), merged afterwards
        num_warps, num_stages   Triton launch parameters
    """
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    return _paged_verify_attention(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, sm_scale=sm_scale,
        soft_cap=soft_cap, interpret=interpret, block_q=block_q, block_k=block_k,
        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "soft_cap", "interpret", "block_q", "block_k", "num_splits",
                     "num_warps", "num_stages"),
)
def _paged_verify_attention(
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
) -> jax.Array:  # [B, T, Hq, D]
    """The jitted body of :func:`paged_verify_attention` (arguments already checked)."""
    b, t, hq, d = q.shape
    kvh, _, page_size, _ = k_pages.shape
    group = hq // kvh
    rows = t * group
    capacity = block_tables.shape[1] * page_size
    if q_lens is None:
        q_lens = jnp.full((b,), t, jnp.int32)
    scale = d**-0.5 if sm_scale is None else float(sm_scale)

    entry = tuning.current()
    plan = plan_tiles(batch=b, kv_heads=kvh, rows=rows, head_dim=d, capacity=capacity,
                      itemsize=jnp.dtype(q.dtype).itemsize, entry=entry, block_q=block_q,
                      block_k=block_k, num_splits=num_splits)
    bq, bk, dp = plan["block_q"], plan["block_k"], plan["head_dim_padded"]
    nq, ns = plan["num_q_blocks"], plan["num_splits"]
    m_rows = nq * bq

    with jax.named_scope("paged_verify_attention"):
        # [B, T, KVH, G, D] -> [B, KVH, T*G, D]: all query rows of one KV head together.
        qr = q.reshape(b, t, kvh, group, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
        qr = jnp.pad(qr, ((0, 0), (0, 0), (0, m_rows - rows), (0, dp - d)))

        kernel = functools.partial(
            _paged_verify_kernel, group=group, head_dim=d, page_size=page_size,
            capacity=capacity, block_k=bk, keys_per_split=plan["keys_per_split"],
            sm_scale=scale, soft_cap=soft_cap)
        max_pages = block_tables.shape[1]
        num_pages = k_pages.shape[1]
        o, m, l = pl.pallas_call(
            kernel,
            grid=(b, kvh, nq, ns),
            in_specs=[
                pl.BlockSpec((1,), lambda i, h, j, s: (i,)),  # kv_lens
                pl.BlockSpec((1,), lambda i, h, j, s: (i,)),  # q_lens
                pl.BlockSpec((None, max_pages), lambda i, h, j, s: (i, 0)),  # block_tables
                pl.BlockSpec((None, None, bq, dp), lambda i, h, j, s: (i, h, j, 0)),  # q
                pl.BlockSpec((None, num_pages, page_size, d),
                             lambda i, h, j, s: (h, 0, 0, 0)),  # k_pages
                pl.BlockSpec((None, num_pages, page_size, d),
                             lambda i, h, j, s: (h, 0, 0, 0)),  # v_pages
            ],
            out_specs=[
                pl.BlockSpec((None, None, None, bq, dp), lambda i, h, j, s: (i, h, s, j, 0)),
                pl.BlockSpec((None, None, None, bq), lambda i, h, j, s: (i, h, s, j)),
                pl.BlockSpec((None, None, None, bq), lambda i, h, j, s: (i, h, s, j)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((b, kvh, ns, m_rows, dp), jnp.float32),  # o
                jax.ShapeDtypeStruct((b, kvh, ns, m_rows), jnp.float32),  # m
                jax.ShapeDtypeStruct((b, kvh, ns, m_rows), jnp.float32),  # l
            ],
            compiler_params=plgpu.CompilerParams(
                num_warps=entry.num_warps if num_warps is None else num_warps,
                num_stages=entry.num_stages if num_stages is None else num_stages),
            interpret=interpret,
            # The tile entry's name in the kernel name shows in profiles and lowered HLO.
            name=f"paged_verify_attention_{entry.name.replace('-', '_')}_bq{bq}_bk{bk}_s{ns}",
        )(kv_lens, q_lens, block_tables, qr, k_pages, v_pages)

    with jax.named_scope("paged_verify_attention_merge"):
        out = _merge_splits(o, m, l)  # [B, KVH, M, Dp]
        out = out[:, :, :rows, :d].reshape(b, kvh, t, group, d)
        return out.transpose(0, 2, 1, 3, 4).reshape(b, t, hq, d).astype(q.dtype)
