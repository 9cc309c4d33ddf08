"""Host-side page allocation: a free list of page ids.

The allocator hands out pages to sequences and builds the ``block_tables`` rows; it never
touches device memory. Unused table entries point at page 0 (never read: attention masks by
length, and writes past a sequence's length are dropped).
"""

from __future__ import annotations

import numpy as np

from jspec.errors import JspecError


class OutOfPagesError(JspecError, MemoryError):
    """The page pool cannot hold the requested tokens."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, *, shuffle_seed: int | None = None):
        self.num_pages = num_pages
        self.page_size = page_size
        order = np.arange(num_pages)
        if shuffle_seed is not None:  # random page permutation: tests that paging is real
            order = np.random.default_rng(shuffle_seed).permutation(num_pages)
        self._free = list(order[::-1])  # pop() hands out pages in `order`

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_tokens: int) -> list[int]:
        n = self.pages_for(num_tokens)
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages for {num_tokens} tokens, {len(self._free)} free")
        return [int(self._free.pop()) for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def block_tables(self, token_counts: list[int], max_pages_per_seq: int | None = None) -> np.ndarray:
        """Allocate for each sequence and return int32 ``[B, max_pages_per_seq]`` tables."""
        rows = [self.allocate(n) for n in token_counts]
        width = max_pages_per_seq or max(len(r) for r in rows)
        table = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            if len(r) > width:
                raise OutOfPagesError(f"sequence {i} needs {len(r)} pages, table holds {width}")
            table[i, : len(r)] = r
        return table
