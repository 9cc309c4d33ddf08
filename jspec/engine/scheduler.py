"""The scheduler: plain host Python between jitted bursts.

Each burst it decides, in this order:

1. **Pages for running requests.** Every running slot gets pages for the tokens the next burst
   can write (``steps * (k + 1)`` ahead). When the pool runs short, the burst is shortened;
   when even one step does not fit, the newest request is **preempted by recomputation**: its
   pages go back (shared prefix pages only lose a reference), and it returns to the front of
   the queue to be prefilled again from its prompt and the tokens it already produced.
2. **Admission** of waiting requests into free slots, first come first served, while their
   prompt pages fit. Full prompt pages found in the **prefix cache** are shared read-only
   (their K/V, and a drafter's, are already there); only the rest is prefilled.
3. **Prefill chunks** of the oldest slots still prefilling, one row each: a width from
   ``prefill_shapes`` (the one with the least cost per prompt token for the oldest one's
   remaining prompt: ``Scheduler.chunk_width``), then the shape of that width that prefills
   the most prompt for its cost (few compiled shapes), run in the same forward as everyone's
   decode step. A width's widest shapes are **packed**: more rows than their tokens hold at
   full width, the real tokens packed into the first rows of the forward, so a step prefills
   many short prompts (vLLM's packed prefill) instead of padding each one to the width.
4. **Burst length**: a step with a prefill chunk runs alone (the running slots decode one token
   in it), else up to ``max_burst_steps`` steps; with requests waiting, the burst also stops as
   soon as a slot finishes.

Invariants (checked by :meth:`check`): every page is free or held, reference counts equal the
number of holders, a request is in the queue or in exactly one slot.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Optional

import numpy as np

from jspec.cache import NULL_PAGE, PageAllocator, page_keys
from jspec.engine.request import Request, Status


@dataclasses.dataclass
class Chunk:
    request: Request
    start: int  # first position of the chunk
    length: int  # real tokens
    width: int  # padded width (one of the chunk widths)


@dataclasses.dataclass
class Prefill:
    chunks: list[Chunk]  # one per row, oldest request first
    shape: PrefillShape  # the segment: the chunks' rows, then padding


@dataclasses.dataclass
class Plan:
    prefill: Optional[Prefill]
    num_steps: int
    stop_on_finish: bool
    k: int


class PrefillShape(NamedTuple):
    """A compiled prefill segment: ``rows`` x ``width`` grid positions and ``tokens`` rows of the
    forward (``rows * width``; fewer for a packed segment, whose real tokens fill its rows)."""

    rows: int
    width: int
    tokens: int

    @property
    def packed(self) -> bool:
        return self.tokens < self.rows * self.width


PACKED_GRID = 4  # a packed segment's grid holds up to this many times its rows of tokens


def prefill_shapes(budget: int, max_rows: int, widths: tuple[int, ...]) -> tuple[PrefillShape, ...]:
    """The prefill segments a step may carry: for each width, row counts 1, 4, 16, ... that fit
    ``rows * width <= budget`` and ``max_rows`` (at least one row); then, where ``max_rows``
    allows more rows, packed shapes of the most rows (up to ``PACKED_GRID x budget`` grid
    positions, ``max_rows``) over a quarter, a half and all of the budget in tokens, each where
    its tokens hold four rows of the width and its grid is at least twice its tokens."""
    shapes = []
    for w in widths:
        p = 1
        shapes.append(PrefillShape(p, w, w))
        while p < max_rows and 4 * p * w <= budget:
            p *= 4
            shapes.append(PrefillShape(p, w, p * w))
        rows = min(max_rows, PACKED_GRID * budget // w)
        shapes += [PrefillShape(rows, w, t) for t in (budget // 4, budget // 2, budget)
                   if 4 * w <= t and rows * w >= 2 * t and rows > p]
    return tuple(shapes)


class Scheduler:
    def __init__(self, *, num_slots: int, table_width: int, allocator: PageAllocator,
                 shapes: tuple[PrefillShape, ...], max_burst_steps: int, prefix_caching: bool, salt: bytes = b"",
                 step_overhead_tokens: Optional[float] = None, prefill_k: int = 0):
        self.allocator = allocator
        self.prefill_k = prefill_k  # the k of the step that carries prefill: its decode rows cost too
        # what one step costs beside its tokens, in tokens of prefill compute (None: tokens cost
        # nothing next to a step, so the smallest width that holds the prompt is best)
        self.step_overhead_tokens = step_overhead_tokens
        self.page_size = allocator.page_size
        self.table_width = table_width
        self.shapes = shapes
        self.widths = tuple(sorted({s.width for s in shapes}))
        self.max_burst_steps = max_burst_steps
        self.prefix_caching = prefix_caching
        self.salt = salt
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Optional[Request]] = [None] * num_slots
        self.admitted: list[Request] = []  # since the last plan: the engine writes their slots
        self.released: list[int] = []  # slots the device must stop running
        self.num_preemptions = 0
        self._keys: dict[int, list[bytes]] = {}  # id(request) -> page keys of its current prompt

    # ------------------------------------------------------------------ queries
    @property
    def running(self) -> list[Request]:
        return sorted((r for r in self.slots if r is not None and r.status is Status.RUNNING), key=lambda r: r.order)

    @property
    def prefilling(self) -> list[Request]:
        return sorted((r for r in self.slots if r is not None and r.status is Status.PREFILLING),
                      key=lambda r: r.order)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    def tables(self) -> np.ndarray:
        t = np.full((len(self.slots), self.table_width), NULL_PAGE, np.int32)
        for i, r in enumerate(self.slots):
            if r is not None:
                t[i, :len(r.pages)] = r.pages
        return t

    # ------------------------------------------------------------------ planning
    def plan(self, k: int) -> Plan:
        steps = self._reserve(self.max_burst_steps, k)
        self._admit()
        prefill = self._prefill()
        if prefill is not None:
            steps = 1  # a step carrying prefill chunks runs alone
        elif any(not r.output_ids for r in self.running):
            steps = 1  # a request just prefilled: its first token out at once (time to first token)
        return Plan(prefill, steps, bool(self.waiting), k)

    def _reserve(self, steps: int, k: int) -> int:
        """Pages for ``steps`` steps of every running request (fewer steps, then preemption,
        when the pool is short); returns the number of steps reserved for."""
        while True:
            want = {id(r): self._pages_needed(r, steps, k) for r in self.running}
            if sum(want.values()) <= self.allocator.num_free:
                for r in self.running:
                    if want[id(r)]:
                        r.pages += self.allocator.allocate_pages(want[id(r)])
                return steps
            if steps > 1:
                steps = max(1, steps // 2)
                continue
            victim = max((r for r in self.slots if r is not None), key=lambda r: r.order)
            self.preempt(victim)

    def _pages_needed(self, r: Request, steps: int, k: int) -> int:
        tokens = min(len(r.all_ids) + steps * (k + 1), r.max_len + k + 1)
        return max(0, self.allocator.pages_for(tokens) - len(r.pages))

    def _admit(self) -> None:
        while self.waiting and None in self.slots:
            r = self.waiting[0]
            ids = r.all_ids
            keys = page_keys(ids, self.page_size, self.salt, len(ids) - 1) if self.prefix_caching else []
            hits = []
            for key in keys:
                page = self.allocator.lookup(key)
                if page is None:
                    break
                hits.append(page)
            need = self.allocator.pages_for(len(ids)) - len(hits)
            if need > self.allocator.num_free:
                self.allocator.free(hits)
                return  # first come first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            r.pages = hits + self.allocator.allocate_pages(need)
            r.slot = self.slots.index(None)
            self.slots[r.slot] = r
            r.registered = len(hits)
            r.computed = len(hits) * self.page_size
            r.status = Status.PREFILLING if r.computed < len(ids) - 1 else Status.RUNNING
            self._keys[id(r)] = keys
            if r.metrics.num_preemptions == 0:
                r.metrics.num_cached_tokens = r.computed
            self.admitted.append(r)

    def _prefill(self) -> Optional[Prefill]:
        pre = self.prefilling
        if not pre:
            return None
        remaining = lambda r: (len(r.all_ids) - 1) - r.computed  # noqa: E731
        width = self.chunk_width(remaining(pre[0]))
        allowed = [s for s in self.shapes if s.width == width]
        best = None
        for shape in allowed:
            chunks, total = [], 0
            for r in pre[:shape.rows]:
                n = min(remaining(r), width, shape.tokens - total)
                if n <= 0:
                    break
                chunks.append(Chunk(r, r.computed, n, width))
                total += n
            if self.step_overhead_tokens is None:  # tokens are cheap: the most prompt per step
                key = (-total, shape.tokens, shape.rows)
            else:  # the least cost per prompt token: a step costs its rows, every slot's decode rows
                # and the overhead
                overhead = self.step_overhead_tokens + len(self.slots) * (self.prefill_k + 1)
                key = ((shape.tokens + overhead) / total, -total, shape.rows)
            if best is None or key < best[0]:
                best = (key, Prefill(chunks, shape))
        return best[1]

    def chunk_width(self, remaining: int) -> int:
        """The prefill width for a prompt with ``remaining`` tokens to prefill: the one with the
        least cost per prompt token it prefills, a step costing (width + step_overhead_tokens).
        Where compute is dear (the CPU) a 110-token prompt then takes two 64-wide chunks rather
        than one 256-wide chunk that is mostly padding; with no overhead given, the smallest
        width that holds the prompt (or the largest)."""
        if self.step_overhead_tokens is None:
            return next((w for w in self.widths if w >= remaining), self.widths[-1])
        return min(self.widths, key=lambda w: ((w + self.step_overhead_tokens) / min(w, remaining), -w))

    # ------------------------------------------------------------------ after a burst
    def prefilled(self, r: Request, length: int) -> None:
        """``length`` more prompt tokens of ``r`` are in the cache: full pages become findable."""
        r.computed += length
        r.metrics.num_prefilled_tokens += length
        keys = self._keys.get(id(r), [])
        full = min(r.computed // self.page_size, len(keys))
        for i in range(r.registered, full):
            self.allocator.register(r.pages[i], keys[i])
        r.registered = max(r.registered, full)
        if r.computed >= len(r.all_ids) - 1:
            r.status = Status.RUNNING

    def finish(self, r: Request, device_running: bool) -> None:
        """Give back the request's pages and slot (``device_running``: the device still runs
        the slot, as after a stop string, and must be told to stop)."""
        self.allocator.free(r.pages)
        r.pages = []
        if r.slot is not None:
            self.slots[r.slot] = None
            if device_running:
                self.released.append(r.slot)
        r.slot = None
        r.status = Status.FINISHED
        self._keys.pop(id(r), None)

    def abort(self, r: Request) -> None:
        if r.status is Status.WAITING:
            self.waiting.remove(r)
            r.status = Status.FINISHED
        elif r.status is not Status.FINISHED:
            self.finish(r, device_running=True)

    def preempt(self, r: Request) -> None:
        """Recompute later: free everything, requeue at the front with the output so far."""
        self.allocator.free(r.pages)
        r.pages = []
        self.slots[r.slot] = None
        self.released.append(r.slot)
        r.slot = None
        r.status = Status.WAITING
        r.computed = r.registered = 0
        r.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._keys.pop(id(r), None)
        self.waiting.appendleft(r)

    def check(self) -> None:
        """Assert the page and slot bookkeeping (tests call this after every step)."""
        held = [r.pages for r in self.slots if r is not None]
        self.allocator.check(held)
        queued = {id(r) for r in self.waiting}
        for i, r in enumerate(self.slots):
            if r is not None:
                assert r.slot == i and id(r) not in queued, "a request is in a slot and the queue"
                assert len(r.pages) <= self.table_width
        assert len(queued) == len(self.waiting), "a request is queued twice"
