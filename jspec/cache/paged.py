"""The paged KV cache pytree.

Per layer, K and V live in pages shaped ``[kv_heads, num_pages, page_size, head_dim]``; a
sequence owns the pages listed in its row of ``block_tables``, in order, so token position
``p`` of sequence ``b`` lives in page ``block_tables[b, p // page_size]`` at slot
``p % page_size``. ``lengths[b]`` counts the tokens whose K/V are valid. Rejected draft tokens
are rolled back by lowering ``lengths``; their stale K/V is overwritten later.

The cache is immutable: writes return a new cache (XLA updates the buffers in place when the
cache is donated to the jitted step).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.paged_verify_attention import write_kv  # noqa: F401  (the cache's write; the kernels' layer owns it)

PAGE_AXES = ("kv_heads", "pages", "page_slots", "head_dim")  # logical axes of a page array (jspec.parallel)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k_pages: tuple[jax.Array, ...]  # per layer: [KVH, num_pages, page_size, D]
    v_pages: tuple[jax.Array, ...]  # per layer: [KVH, num_pages, page_size, D]
    block_tables: jax.Array  # int32 [B, max_pages_per_seq]
    lengths: jax.Array  # int32 [B]: tokens with valid K/V

    SLOT_FIELDS = ("block_tables", "lengths")  # per sequence; the pages are a shared pool

    @property
    def num_layers(self) -> int:
        return len(self.k_pages)

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def capacity(self) -> int:
        """Tokens one sequence can hold: pages per sequence times page size."""
        return self.block_tables.shape[1] * self.page_size

    def replace(self, **kw) -> "PagedKVCache":
        return dataclasses.replace(self, **kw)

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.k_pages + self.v_pages)


def init_cache(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_tables: jax.Array,  # int32 [B, max_pages_per_seq]
    num_pages: int,
    page_size: int,
    dtype=jnp.float32,
    lengths: jax.Array | None = None,  # int32 [B]
) -> PagedKVCache:
    """Zeroed pages for ``num_layers`` layers and the given block tables."""
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    block_tables = jnp.asarray(block_tables, jnp.int32)
    if lengths is None:
        lengths = jnp.zeros((block_tables.shape[0],), jnp.int32)
    return PagedKVCache(
        k_pages=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        v_pages=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
        block_tables=block_tables,
        lengths=jnp.asarray(lengths, jnp.int32),
    )




def move_positions(cache: PagedKVCache, src: jax.Array, dst: jax.Array, count: jax.Array) -> PagedKVCache:
    """Copy each sequence's K/V at positions ``src[b, j]`` to ``dst[b, j]`` for j < ``count[b]``
    (int32 [B, M], [B, M], [B]), in every layer; every read happens before any write, and no
    other position changes. A token tree's accepted path moves this way to consecutive positions."""
    num_pages, page_size = cache.num_pages, cache.page_size
    width = cache.block_tables.shape[1]

    def where(pos):  # (page id, slot) of positions [B, M]
        slot = pos // page_size
        page = jnp.take_along_axis(cache.block_tables, jnp.clip(slot, 0, width - 1), axis=1)
        return page, pos % page_size

    keep = jnp.arange(src.shape[1])[None, :] < count[:, None]
    src_page, src_slot = where(src)
    dst_page, dst_slot = where(dst)
    dst_page = jnp.where(keep & (dst // page_size < width), dst_page, num_pages)  # out of range: dropped

    def move(pages):
        return pages.at[:, dst_page, dst_slot].set(pages[:, src_page, src_slot], mode="drop")

    return cache.replace(k_pages=tuple(move(p) for p in cache.k_pages), v_pages=tuple(move(p) for p in cache.v_pages))
