"""Requests and what the engine hands back, in vLLM's shapes (``RequestOutput`` with
``outputs[0].text / .token_ids / .finish_reason`` and ``metrics``), and the engine's totals over
finished requests (``EngineStats``)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from jspec.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and to be recomputed)
    PREFILLING = "prefilling"  # in a slot, prompt chunks going into the cache
    RUNNING = "running"  # in a slot, decoding
    FINISHED = "finished"


class PerVerification:
    """Per-verification ratios of a record with ``num_drafts`` (verifications with a proposal),
    ``num_draft_tokens`` and ``num_accepted_tokens``."""

    @property
    def accepted_per_verification(self) -> Optional[float]:
        """Tokens a verification emits: its accepted drafts plus the extra token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def draft_tokens_per_verification(self) -> Optional[float]:
        """Drafted tokens a verification scores (a tree's nodes)."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else None


@dataclasses.dataclass
class RequestMetrics(PerVerification):
    """Per request, in seconds of ``time.perf_counter()`` and token counts. The spec-decode
    counters use vLLM's names: ``num_drafts`` (steps with a proposal), ``num_draft_tokens``,
    ``num_accepted_tokens`` and ``num_accepted_tokens_per_pos``."""

    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (first admission)
    num_prefilled_tokens: int = 0  # tokens run through prefill (recomputation included)
    num_preemptions: int = 0
    num_steps: int = 0  # target forwards the request took part in
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)  # (a jspec extension)
    num_output_tokens: int = 0

    @property
    def time_in_queue(self) -> Optional[float]:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> Optional[float]:
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        """Tokens per target forward (accepted drafts + the bonus/recovered token); None
        before the first step."""
        return self.num_output_tokens / self.num_steps if self.num_steps else None

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop" (EOS or a stop string), "length", "abort", "error" (this request failed: RequestOutput.error)
    finish_reason: Optional[str] = None
    stop_reason: Optional[str] = None  # the stop string that matched, if any


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Optional[str] = None  # why the request failed (finish reason "error"), else None


@dataclasses.dataclass(eq=False)
class Request:
    """The engine's host-side record of one request."""

    request_id: str
    prompt: Optional[str]
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    metrics: RequestMetrics
    order: int  # arrival order (preemption takes the latest first)
    status: Status = Status.WAITING
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: Optional[str] = None
    error: Optional[str] = None  # set with finish reason "error"
    slot: Optional[int] = None
    pages: list[int] = dataclasses.field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in the cache (host view: prefix hit + prefill)
    registered: int = 0  # full pages of this request registered in the prefix cache
    emitted: int = 0  # output tokens already handed to the caller (streaming)
    base: Optional[RequestMetrics] = None  # counters at the last admission (device counters start at 0)
    # per draft position j, the drafted steps that ran at a k > j (could have proposed draft j):
    # the denominator of position j's acceptance in dynamic k's estimate (jspec.engine.cost)
    eligible_per_pos: list[int] = dataclasses.field(default_factory=list)
    # steps that ran at a k >= 1 (could have had a proposal): the denominator of the proposal share
    # the engine's pooled prior learns (steps at k = 0 say nothing about it)
    spec_steps: int = 0
    # a tree drafter's tree steps under dynamic k, counted apart from its chain steps (the two
    # accept differently): per position the tree steps whose accepted path reached it, the tree
    # steps with a proposal, and all tree steps
    tree_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    tree_drafted_steps: int = 0
    tree_steps: int = 0
    constraint: int = -1  # its structured-output handle (jspec.sampling.structured), -1 for none

    def count_tree_step(self, accepted_before: list[int], drafted: int, steps: int) -> None:
        """A burst of tree steps ran: what its verifications accepted (the per-position counters
        now, less ``accepted_before``) goes to the tree's counters."""
        now = self.metrics.num_accepted_tokens_per_pos
        if len(self.tree_accepted_per_pos) < len(now):
            self.tree_accepted_per_pos.extend([0] * (len(now) - len(self.tree_accepted_per_pos)))
        for j, (a, b) in enumerate(zip(now, accepted_before)):
            self.tree_accepted_per_pos[j] += a - b
        self.tree_drafted_steps += max(drafted, 0)
        self.tree_steps += max(steps, 0)

    def chain_accepted_per_pos(self) -> list[int]:
        """Per position, what the chain steps accepted (all steps' counters less the tree's)."""
        tree = self.tree_accepted_per_pos
        return [a - (tree[j] if j < len(tree) else 0) for j, a in enumerate(self.metrics.num_accepted_tokens_per_pos)]

    @property
    def all_ids(self) -> list[int]:
        """Prompt and output so far: what a recomputation after preemption prefills."""
        return self.prompt_ids + self.output_ids

    @property
    def max_len(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    def to_output(self, incremental: bool = False) -> RequestOutput:
        ids = self.output_ids[self.emitted:] if incremental else list(self.output_ids)
        done = self.status is Status.FINISHED
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids),
                             [CompletionOutput(0, self.text, ids, self.finish_reason if done else None,
                                               self.stop_reason)], done, self.metrics, self.error)


@dataclasses.dataclass
class EngineStats(PerVerification):
    """Totals over finished requests (vLLM's metric names where it has them)."""

    k_max: int
    bursts: int = 0
    bursts_by_slots: dict[int, int] = dataclasses.field(default_factory=dict)  # bursts per slot bucket run
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0  # request-steps (target forwards per request, summed)
    steps_run: int = 0  # device steps (loop iterations) over all bursts

    def finished(self, r: Request) -> None:
        m = r.metrics
        self.num_requests += 1
        self.prompt_tokens += m.num_prompt_tokens
        self.cached_prompt_tokens += m.num_cached_tokens
        self.prefilled_tokens += m.num_prefilled_tokens
        self.generation_tokens += len(r.output_ids)
        self.preemptions += m.num_preemptions
        self.num_drafts += m.num_drafts
        self.num_draft_tokens += m.num_draft_tokens
        self.num_accepted_tokens += m.num_accepted_tokens
        self.steps += m.num_steps
        pos = m.num_accepted_tokens_per_pos
        if len(self.num_accepted_tokens_per_pos) < len(pos):
            self.num_accepted_tokens_per_pos += [0] * (len(pos) - len(self.num_accepted_tokens_per_pos))
        for j, a in enumerate(pos):
            self.num_accepted_tokens_per_pos[j] += a

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> Optional[float]:
        return self.generation_tokens / self.steps if self.steps else None
