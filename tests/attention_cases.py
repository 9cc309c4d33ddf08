"""Cases of the verification-attention contract shared by the kernel tests (the Pallas kernel in
interpret mode, the CPU kernel): shuffled pages, and poisoned inputs for the kernel beside
clean ones for the reference (see tests/pallas_kernels/test_paged_verify_attention.py)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

TOL = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@dataclasses.dataclass(frozen=True)
class Case:
    t: int  # query rows per sequence (T)
    group: int  # Hq / KVH
    head_dim: int
    page_size: int
    kv_lens: tuple[int, ...]
    q_lens: Optional[tuple[int, ...]] = None
    kv_heads: int = 2
    dtype: type = jnp.float32
    cache_dtype: Optional[type] = None  # default: dtype
    max_pages: Optional[int] = None  # block-table width; default: what the longest needs + 1
    garbage: str = "invalid"  # unused table slots: "invalid" ids, or "mixed" with real ones
    tiles: tuple = ()  # explicit static tile arguments, as (name, value) pairs
    sm_scale: Optional[float] = None
    soft_cap: Optional[float] = None
    sliding_window: Optional[int] = None


def make_inputs(case: Case, seed: int = 0):
    """(poisoned kernel inputs, clean reference inputs); pages shuffled over the pool."""
    rng = np.random.default_rng(seed)
    b = len(case.kv_lens)
    kv_lens = np.array(case.kv_lens, np.int32)
    need = -(-kv_lens // case.page_size)  # pages each sequence owns
    max_pages = case.max_pages or int(need.max()) + 1
    num_pages = int(need.sum()) + 3  # 3 pages nobody owns
    hq = case.kv_heads * case.group
    shape = (case.kv_heads, num_pages, case.page_size, case.head_dim)
    q = rng.standard_normal((b, case.t, hq, case.head_dim)).astype(np.float32)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)

    perm = rng.permutation(num_pages)
    table = np.zeros((b, max_pages), np.int32)  # clean: unused slots point at page 0
    bad_table = np.where(rng.random((b, max_pages)) < 0.5, -1, 1 << 30).astype(np.int32)
    if case.garbage == "mixed":  # also real page ids: NaN pages and other sequences' pages
        real = rng.integers(0, num_pages, (b, max_pages), dtype=np.int32)
        bad_table = np.where(rng.random((b, max_pages)) < 0.6, real, bad_table)
    owned = np.zeros((num_pages, case.page_size), bool)  # which cache slots hold real keys
    start = 0
    for i in range(b):
        ids = perm[start:start + need[i]]
        start += need[i]
        table[i, :need[i]] = bad_table[i, :need[i]] = ids
        for j, page in enumerate(ids):
            owned[page, : min(case.page_size, kv_lens[i] - j * case.page_size)] = True

    clean_k = np.where(owned[None, :, :, None], k, 0.0)
    clean_v = np.where(owned[None, :, :, None], v, 0.0)
    bad_k = np.where(owned[None, :, :, None], k, np.nan)
    bad_v = np.where(owned[None, :, :, None], v, np.nan)
    q_lens = None if case.q_lens is None else jnp.array(case.q_lens, jnp.int32)
    q = jnp.asarray(q, case.dtype)
    cache = lambda x: jnp.asarray(x, case.cache_dtype or case.dtype)  # noqa: E731
    kernel_args = (q, cache(bad_k), cache(bad_v), jnp.asarray(bad_table), jnp.asarray(kv_lens), q_lens)
    ref_args = (q, cache(clean_k), cache(clean_v), jnp.asarray(table), jnp.asarray(kv_lens), q_lens)
    return kernel_args, ref_args
