"""Dynamic k: how many drafts per step, chosen per burst from measured costs and acceptance.

The verification forward of a step costs more as k grows, and how much more depends on the
machine and the batch: on a CPU or a small GPU batch the k + 1 rows ride almost free on the
weight reads, at a large batch they do not. So the engine measures, on this machine, the time
of a step at each candidate k (an average over the bursts that ran at that k, compile time
excluded), and estimates, per request, what a step at k would yield from that request's own
running acceptance:

    E_b(k) = 1 + r_b * (P_b1 + P_b2 + ... + P_bk)

with r_b the share of its steps that had a proposal at all (n-gram lookup finds none on some)
and P_bj the share of those steps in which draft j was accepted (vLLM's
``num_accepted_tokens_per_pos[j-1]``) among the steps that could have proposed draft j (those
that ran at a k >= j: ``Request.eligible_per_pos``), each pulled towards the previous
position's estimate times the ratio P_b(j-1) / P_b(j-2) (a0 for the first). A position the
request has not run at is that ratio carried on: a request run at k = 2 is not taken to reject
every third draft (counting the steps that could not propose draft 3 as failures kept dynamic
k at k = 2 where fixed k = 4 ran 1.08x faster; measured 2026-12-03).
Without those denominators, ``num_drafts`` is every position's, each P pulled towards a^j. This
counts what proposals really yield: an n-gram match often proposes fewer than k drafts, so a
per-token acceptance a_b = accepted / proposed with E = 1 + r_b (a_b + ... + a_b^k) (the model
used when the per-position counts are not given) over-rates large k, and did (measured 2026-12-02:
dynamic k at batch 16 kept k = 4 at 0.69x AR). The burst
runs at the k with the most expected tokens per second, sum_b E_b(min(k, cap_b)) / t(k); k = 0
(no speculation) is a candidate, so speculation turns itself off when it stops paying.
What the requests before it accepted is a new request's prior (:class:`AcceptancePrior`, shared
by the engine's cost models, fed by each finished request): the position-1 rate and each next
position's ratio P_j / P_(j-1) pooled over recent requests (then a0 and the request's own last
ratio where nothing has run at a position yet), and the pooled share of steps with a proposal for
r_b. Without it a request's first bursts ran on the fixed prior a0^j, which at batch 1 is most of
a request (a 128-token request runs in a few bursts): on code, where n-gram drafts that match go
on matching (P_3 / P_2 ~ 0.95), dynamic k then kept k = 2 and ran at 1.63x AR where fixed k = 4
ran at 1.83x (measured 2026-12-04).
Candidates never measured are tried once first. A measured candidate is timed again after
``refresh_every`` choices without it (times drift with context length and load), but only while
its estimated rate is within ``refresh_margin`` of the best one's: re-timing a k that cannot win
costs a whole burst at that k (at 16 slots on the 2-core CPU a k = 4 step costs 3.4x a plain
one), and doing so every 64 bursts cost dynamic k 10-20% of its throughput in the later rounds
of a benchmark (measured 2026-12-03).
Speculation turns itself off only on evidence. At k = 0 nothing is proposed, so the acceptance
that turned it off never moves: one first prompt whose drafts were accepted 10 times in 54 (the
set's position-1 rate is 0.63-0.66) kept a whole HumanEval run at k = 0 (measured
2026-12-05). So where k = 0 has the best estimated rate, the burst still runs the k > 0
whose rate is best on an optimistic estimate, each P_j raised by ``optimism`` standard errors
(the request's own steps and, through the prior's weight, the pooled ones), if that rate beats
k = 0's: thin evidence, or a k that costs little more than a plain step, is explored until the
evidence rules it out (optimism in the face of uncertainty, as in UCB bandits). A request that
ran without speculation still ages the prior (:meth:`AcceptancePrior.learn`), so evidence that
turned speculation off thins as the workload moves on, and it is tried again.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence


class AcceptancePrior:
    """Acceptance pooled over finished requests: per draft position the accepted and eligible
    counts, and the steps with a proposal among the steps that ran at a k >= 1 (the engine's
    ``Request.spec_steps``: steps at k = 0 could not propose). Each request learned first scales what
    was there by ``decay``, so the prior follows the recent workload (~1 / (1 - decay) requests)."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.accepted: list[float] = []
        self.eligible: list[float] = []
        self.drafted_steps = 0.0
        self.steps = 0.0

    def learn(self, accepted_per_pos: Sequence[int], eligible_per_pos: Sequence[int], drafted_steps: int,
              steps: int) -> None:
        """Pool one finished request's counts. A request without a step at k >= 1 adds nothing
        but still ages what is there (ratios and proposal share unchanged, evidence thinner)."""
        n = max(len(accepted_per_pos), len(eligible_per_pos), len(self.accepted))
        for counts in (self.accepted, self.eligible):
            counts.extend([0.0] * (n - len(counts)))
            counts[:] = [c * self.decay for c in counts]
        for j in range(n):
            self.accepted[j] += accepted_per_pos[j] if j < len(accepted_per_pos) else 0
            self.eligible[j] += eligible_per_pos[j] if j < len(eligible_per_pos) else 0
        self.drafted_steps = self.drafted_steps * self.decay + drafted_steps
        self.steps = self.steps * self.decay + steps

    def proposal_share(self) -> float:
        """Share of steps with a proposal (1.0 before any request)."""
        return self.drafted_steps / self.steps if self.steps > 0 else 1.0

    def ratios(self, k: int, a0: float, weight: float) -> list[Optional[float]]:
        """Per position j = 1..k the pooled P_j / P_(j-1) (P_0 = 1), each estimate pulled towards
        the previous one's ratio (a0 for the first) with ``weight`` steps; None where no pooled
        step could have proposed draft j."""
        out: list[Optional[float]] = []
        p_prev, ratio = 1.0, a0
        for j in range(k):
            seen = self.eligible[j] if j < len(self.eligible) else 0.0
            if seen <= 0:
                out.append(None)
                continue
            p = min((self.accepted[j] + weight * p_prev * ratio) / (seen + weight), p_prev)
            ratio, p_prev = (p / p_prev if p_prev > 0 else 0.0), p
            out.append(ratio)
        return out


class CostModel:
    def __init__(self, candidates: Iterable[int], prior_acceptance: float = 0.5, prior_weight: float = 8.0,
                 smoothing: float = 0.3, refresh_every: int = 64, refresh_margin: float = 0.15,
                 smoothing_steps: int = 8, prior: Optional[AcceptancePrior] = None, optimism: float = 2.0,
                 tree: Optional[tuple[int, int]] = None, tree_prior: Optional[AcceptancePrior] = None):
        self.candidates = tuple(sorted(set(candidates)))
        self.prior = prior  # pooled over finished requests (the engine's, shared by its buckets)
        # (k, depth): the candidate that runs a token tree of k nodes, depth deep (the others are
        # chains), and what finished requests' tree steps accepted
        self.tree = tree
        self.tree_prior = tree_prior
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.smoothing = smoothing
        self.smoothing_steps = smoothing_steps
        self.refresh_every = refresh_every
        self.refresh_margin = refresh_margin
        self.optimism = optimism  # standard errors added to each P_j when k = 0 leads (module docstring)
        self.step_seconds: dict[int, Optional[float]] = {k: None for k in self.candidates}
        self.chosen = 0
        self._since: dict[int, int] = {k: 0 for k in self.candidates}

    def observe(self, k: int, steps: int, seconds: float) -> None:
        if steps <= 0 or seconds <= 0 or k not in self.step_seconds:
            return
        per = seconds / steps
        old = self.step_seconds[k]
        # forgetting per step, not per burst: a burst of ``smoothing_steps`` steps moves the
        # estimate by ``smoothing``, a one-step burst (a request's first token, a short tail) by
        # an eighth as much. A burst's time carries a fixed host cost whatever k runs; weighed
        # like full bursts, one-step bursts inflated k > 0's times (a batch-1 run timed k = 4 at
        # 31-36 ms a step where fixed k = 4 ran at ~25), and dynamic k at 0.25 req/s on the
        # server ran at 1.00x plain decoding; with this rule, 1.35x (measured 2026-12-03)
        weight = 1.0 - (1.0 - self.smoothing) ** (steps / self.smoothing_steps)
        self.step_seconds[k] = per if old is None else old + weight * (per - old)
        self._since[k] = 0

    def expected_tokens(self, k: int, accepted: int, proposed: int, drafted_steps: int, steps: int,
                        accepted_per_pos: Optional[Sequence[int]] = None,
                        eligible_per_pos: Optional[Sequence[int]] = None, optimism: float = 0.0,
                        prior: Optional[AcceptancePrior] = None) -> float:
        """E(k) for one request from its counters (see the module docstring); with ``optimism``
        z > 0, each P_j is raised by z standard errors of its estimate (an upper bound, capped by
        the bound of P_(j-1)). ``prior``: the pooled acceptance to start from (None: the model's)."""
        if k == 0:
            return 1.0
        prior = self.prior if prior is None else prior
        w, a0 = self.prior_weight, self.prior_acceptance
        pooled = prior is not None and prior.steps > 0
        r = (drafted_steps + w * (prior.proposal_share() if pooled else 1.0)) / (steps + w)
        if accepted_per_pos is not None and eligible_per_pos is not None:
            total, p_prev, ratio, bound = 0.0, 1.0, a0, 1.0
            pool = prior.ratios(k, a0, w) if pooled else [None] * k
            for j in range(k):
                acc = accepted_per_pos[j] if j < len(accepted_per_pos) else 0
                seen = eligible_per_pos[j] if j < len(eligible_per_pos) else 0
                # prior: the pooled ratio at this position, else the last ratio goes on
                ratio = ratio if pool[j] is None else pool[j]
                p = min((acc + w * p_prev * ratio) / (seen + w), p_prev)
                ratio, p_prev = (p / p_prev if p_prev > 0 else 0.0), p
                if optimism:
                    # the request's own steps, plus the prior's weight w carrying the pooled
                    # steps' variance: Var = p (1 - p) (seen + w^2 / (pooled + w)) / (seen + w)^2
                    n_pool = prior.eligible[j] if pooled and j < len(prior.eligible) else 0.0
                    var = p * (1 - p) * (seen + w * w / (n_pool + w)) / (seen + w) ** 2
                    p = bound = min(p + optimism * math.sqrt(var), bound)
                total += p
            return 1.0 + r * total
        if accepted_per_pos is not None:
            per_pos = list(accepted_per_pos) + [0] * max(0, k - len(accepted_per_pos))
            total, bound = 0.0, 1.0
            for j in range(1, k + 1):
                p = min((per_pos[j - 1] + w * a0 ** j) / (drafted_steps + w), 1.0)
                if optimism:
                    p = bound = min(p + optimism * math.sqrt(p * (1 - p) / (drafted_steps + w)), bound)
                total += p
            return 1.0 + r * total
        a = (accepted + a0 * w) / (proposed + w)
        if optimism:
            a += optimism * math.sqrt(a * (1 - a) / (proposed + w))
        a = min(max(a, 0.0), 0.999)
        return 1.0 + r * sum(a ** j for j in range(1, k + 1))

    def _expected(self, k: int, row: tuple, optimism: float = 0.0) -> float:
        """E(k) of one request's ``row`` (see :meth:`choose`): a chain's from its chain counters,
        the tree's from its tree counters (its accepted path reaching each position, over the
        tree steps with a proposal) and the pooled tree prior, at most the tree's depth."""
        cap, *counts = row
        if self.tree is None or k != self.tree[0]:
            return self.expected_tokens(min(k, cap), *counts[:6], optimism=optimism)
        tree_acc, tree_drafted = counts[6] if len(counts) > 6 else ((), 0)
        depth = min(self.tree[1], cap)
        acc = list(tree_acc)[:depth]
        return self.expected_tokens(depth, 0, 0, counts[2], counts[3], acc, [tree_drafted] * depth,
                                    optimism=optimism, prior=self.tree_prior)

    def choose(self, requests: list[tuple]) -> int:
        """``requests``: per running request (cap, accepted, proposed, drafted steps, steps) and
        optionally its accepted-per-position counts and their eligible steps (a chain's), and
        (accepted per position, drafted steps) of its tree steps."""
        if not requests:
            return self.chosen
        for k in self.candidates:
            self._since[k] += 1
        unmeasured = [k for k in self.candidates if self.step_seconds[k] is None]
        if unmeasured:
            self.chosen = unmeasured[0]
            return self.chosen
        rate = {k: sum(self._expected(k, row) for row in requests) / self.step_seconds[k] for k in self.candidates}
        best = max(self.candidates, key=lambda k: rate[k])  # the first of equals: the smallest k
        if best == 0 and self.optimism > 0:
            # speculation off only on evidence: the k > 0 best on the optimistic estimate runs
            # while it could still beat a plain step (module docstring)
            upper = {k: sum(self._expected(k, row, optimism=self.optimism) for row in requests) / self.step_seconds[k]
                     for k in self.candidates if k > 0}
            if upper:
                explore = max(upper, key=lambda k: upper[k])
                best = explore if upper[explore] > rate[0] else 0
        stale = [k for k in self.candidates if self._since[k] > self.refresh_every
                 and rate[k] >= (1 - self.refresh_margin) * rate[best]]
        self.chosen = stale[0] if stale else best
        return self.chosen
