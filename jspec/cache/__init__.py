"""Paged KV cache: the pytree, writes and rollback; page allocation with reference counts and a
prefix cache of full pages."""

from jspec.cache.paged import PagedKVCache, init_cache, write_kv
from jspec.cache.allocator import NULL_PAGE, OutOfPagesError, PageAllocator
from jspec.cache.prefix import page_keys

__all__ = ["PagedKVCache", "init_cache", "write_kv", "PageAllocator", "OutOfPagesError", "NULL_PAGE", "page_keys"]
