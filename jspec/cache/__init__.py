"""Paged KV cache: the pytree, writes, rollback and page allocation."""

from jspec.cache.paged import PagedKVCache, init_cache, write_kv
from jspec.cache.allocator import PageAllocator, OutOfPagesError

__all__ = ["PagedKVCache", "init_cache", "write_kv", "PageAllocator", "OutOfPagesError"]
