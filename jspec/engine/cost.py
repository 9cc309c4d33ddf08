"""Dynamic k: how many drafts per step, chosen per burst from measured costs and acceptance.

The verification forward of a step costs more as k grows, and how much more depends on the
machine and the batch: on a CPU or a small GPU batch the k + 1 rows ride almost free on the
weight reads, at a large batch they do not. So the engine measures, on this machine, the time
of a step at each candidate k (an average over the bursts that ran at that k, compile time
excluded), and estimates, per request, what a step at k would yield from that request's own
running acceptance:

    E_b(k) = 1 + r_b * (a_b + a_b^2 + ... + a_b^k)

with a_b the request's per-token acceptance (accepted / proposed drafts, with a prior) and r_b
the share of its steps that had a proposal at all (n-gram lookup finds none on some). The burst
runs at the k with the most expected tokens per second, sum_b E_b(min(k, cap_b)) / t(k); k = 0
(no speculation) is a candidate, so speculation turns itself off when it stops paying.
Candidates never measured are tried once first.
"""

from __future__ import annotations

from typing import Iterable, Optional


class CostModel:
    def __init__(self, candidates: Iterable[int], prior_acceptance: float = 0.5, prior_weight: float = 8.0,
                 smoothing: float = 0.3, refresh_every: int = 64):
        self.candidates = tuple(sorted(set(candidates)))
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.smoothing = smoothing
        self.refresh_every = refresh_every
        self.step_seconds: dict[int, Optional[float]] = {k: None for k in self.candidates}
        self.chosen = 0
        self._since: dict[int, int] = {k: 0 for k in self.candidates}

    def observe(self, k: int, steps: int, seconds: float) -> None:
        if steps <= 0 or seconds <= 0 or k not in self.step_seconds:
            return
        per = seconds / steps
        old = self.step_seconds[k]
        self.step_seconds[k] = per if old is None else (1 - self.smoothing) * old + self.smoothing * per
        self._since[k] = 0

    def expected_tokens(self, k: int, accepted: int, proposed: int, drafted_steps: int, steps: int) -> float:
        """E(k) for one request from its counters (see the module docstring)."""
        if k == 0:
            return 1.0
        a = (accepted + self.prior_acceptance * self.prior_weight) / (proposed + self.prior_weight)
        a = min(max(a, 0.0), 0.999)
        r = (drafted_steps + self.prior_weight) / (steps + self.prior_weight)
        return 1.0 + r * sum(a ** j for j in range(1, k + 1))

    def choose(self, requests: list[tuple[int, int, int, int, int]]) -> int:
        """``requests``: per running request (cap, accepted, proposed, drafted steps, steps)."""
        if not requests:
            return self.chosen
        for k in self.candidates:
            self._since[k] += 1
        stale = [k for k in self.candidates if self.step_seconds[k] is None or self._since[k] > self.refresh_every]
        if stale:
            self.chosen = stale[0]
            return self.chosen
        best, best_rate = self.candidates[0], -1.0
        for k in self.candidates:
            tokens = sum(self.expected_tokens(min(k, cap), *counts) for cap, *counts in requests)
            rate = tokens / self.step_seconds[k]
            if rate > best_rate:
                best, best_rate = k, rate
        self.chosen = best
        return best
