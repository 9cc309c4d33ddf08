"""A progress bar for long runs (vLLM's ``use_tqdm``): finished requests out of all, with the
output tokens per second and, when speculating, the share of drafted tokens accepted, both
counted from the bar's start. ``LLM.generate`` and ``jspec generate`` show it on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, engine, total: int, file=None):
        from tqdm import tqdm

        self._stats = engine.stats
        self._t0 = time.perf_counter()
        self._drafted0, self._accepted0 = self._stats.num_draft_tokens, self._stats.num_accepted_tokens
        self._tokens = 0
        self.bar = tqdm(total=total, desc="requests", unit="req", file=file if file is not None else sys.stderr,
                        dynamic_ncols=True)

    def finished(self, num_tokens: int) -> None:
        """One more request finished, with ``num_tokens`` output tokens."""
        self._tokens += num_tokens
        s = self._stats
        postfix = {"out tok/s": f"{self._tokens / max(time.perf_counter() - self._t0, 1e-9):.1f}"}
        drafted = s.num_draft_tokens - self._drafted0
        if drafted:
            postfix["accepted"] = f"{(s.num_accepted_tokens - self._accepted0) / drafted:.2f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
