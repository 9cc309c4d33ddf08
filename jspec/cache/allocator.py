"""Host-side page allocation: reference-counted pages and a prefix cache of full pages.

The allocator hands out page ids and never touches device memory. Each page has a reference
count (the sequences whose block tables hold it). A full page whose tokens are known can be
registered under a key (:mod:`jspec.cache.prefix`: a hash of its tokens and of every token
before them); a later sequence with the same prefix takes the page read-only instead of
recomputing it. A page whose count drops to 0 goes to the end of the free queue but keeps its
key, so it can still be hit until it is handed out again (least recently freed first), the
way vLLM's block pool evicts.

Page 0 is reserved as the null page when ``reserve_null`` is set: block-table slots that no
sequence owns point at it, so a stray write lands there instead of in someone's page.
"""

from __future__ import annotations

import collections
from typing import Hashable, Optional

import numpy as np

from jspec.errors import JspecError


class OutOfPagesError(JspecError, MemoryError):
    """The page pool cannot hold the requested tokens."""


NULL_PAGE = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, shuffle_seed: int | None = None,
                 reserve_null: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.reserved = 1 if reserve_null else 0
        order = np.arange(self.reserved, num_pages)
        if shuffle_seed is not None:  # random page permutation: tests that paging is real
            order = np.random.default_rng(shuffle_seed).permutation(order)
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict((int(p), None) for p in order)
        self._refs = np.zeros((num_pages,), np.int64)
        self._key_of: dict[int, Hashable] = {}
        self._page_of: dict[Hashable, int] = {}

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (cached pages nobody holds included)."""
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - self.reserved

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ allocation
    def allocate(self, num_tokens: int) -> list[int]:
        return self.allocate_pages(self.pages_for(num_tokens))

    def allocate_pages(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        out = []
        for _ in range(n):
            page, _ = self._free.popitem(last=False)
            key = self._key_of.pop(page, None)  # evict a cached page that nobody holds
            if key is not None:
                del self._page_of[key]
            self._refs[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages nobody holds become free (keeping their key)."""
        for page in pages:
            if self._refs[page] <= 0:
                raise AssertionError(f"page {page} freed more often than it was taken")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[int(page)] = None

    # ------------------------------------------------------------------ prefix cache
    def register(self, page: int, key: Hashable) -> None:
        """Make a full, held page findable under ``key`` (first registration wins)."""
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page's key (vLLM's ``reset_prefix_cache``), so later prompts
        prefill from scratch: for benchmarks that repeat a run, and after weights change. Only
        when no page is held (a held page's key is what running requests share); returns
        whether the cache was reset."""
        if self._refs[self.reserved:].any():
            return False
        self._key_of.clear()
        self._page_of.clear()
        return True

    def lookup(self, key: Hashable) -> Optional[int]:
        """The cached page for ``key``, with a reference taken; None on a miss."""
        page = self._page_of.get(key)
        if page is None:
            return None
        if self._refs[page] == 0:
            del self._free[page]
        self._refs[page] += 1
        return page

    # ------------------------------------------------------------------ checks and tables
    def check(self, owned: list[list[int]]) -> None:
        """Assert the bookkeeping matches ``owned`` (each sequence's pages): every count equals
        the number of holders, free pages are held by nobody, nothing is lost."""
        counts = np.zeros_like(self._refs)
        for pages in owned:
            for p in pages:
                counts[p] += 1
        assert (counts == self._refs).all(), "reference counts differ from the holders"
        free = set(self._free)
        assert all(self._refs[p] == 0 for p in free), "a free page is held"
        held = {p for p in range(self.reserved, self.num_pages) if self._refs[p] > 0}
        assert len(free) + len(held) == self.num_usable, "a page is neither free nor held"

    def block_tables(self, token_counts: list[int], max_pages_per_seq: int | None = None) -> np.ndarray:
        """Allocate for each sequence and return int32 ``[B, max_pages_per_seq]`` tables."""
        rows = [self.allocate(n) for n in token_counts]
        width = max_pages_per_seq or max(len(r) for r in rows)
        table = np.full((len(rows), width), NULL_PAGE, np.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise OutOfPagesError(f"sequence {i} needs {len(r)} pages, table holds {width}")
            table[i, : len(r)] = r
        return table
