"""``GET /metrics``: Prometheus text format (``prometheus_client``), every series labelled
``model_name`` as vLLM does.

Speculative decoding, under vLLM's names (totals over finished and aborted requests):
``vllm:spec_decode_num_drafts_total`` (steps with a proposal), ``..._num_draft_tokens_total``,
``..._num_accepted_tokens_total``, ``..._num_accepted_tokens_per_pos_total{position}``; and
their ratios ``jspec:spec_decode_accepted_per_verification`` (tokens a verification emits) and
``jspec:spec_decode_draft_tokens_per_verification`` (a token tree's nodes per verification).

The rest under ``jspec:`` names: requests (``jspec:num_requests_running`` / ``_waiting``,
``jspec:request_success_total{finished_reason}``), tokens (``jspec:prompt_tokens_total``,
``jspec:generation_tokens_total``, ``jspec:num_preemptions_total``,
``jspec:prefix_cache_hit_rate``), KV pages (``jspec:kv_cache_free_pages``,
``jspec:kv_cache_total_pages``, ``jspec:kv_cache_usage_perc``; a page kept only by the prefix
cache counts as free), and histograms of ``jspec:time_to_first_token_seconds``,
``jspec:time_per_output_token_seconds``, ``jspec:request_queue_time_seconds`` and
``jspec:e2e_request_latency_seconds``. Refusals before the engine:
``jspec:request_rejected_total{reason}`` (``queue_full`` 429, ``prompt_too_long`` 400,
``body_timeout`` 408); ``jspec:engine_failures_total`` counts bursts that raised.

Counters and gauges are read at scrape time from the engine thread's snapshot (no lock, no
call into the engine); the histograms are observed by the engine thread as requests finish.
"""

from __future__ import annotations

from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jspec.engine.request import Request

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)


class _SnapshotCollector:
    def __init__(self, snapshot: Callable[[], dict], model_name: str, rejected: dict):
        self.snapshot, self.model, self.rejected = snapshot, model_name, rejected

    def collect(self):
        snap, m = self.snapshot(), [self.model]
        s = snap["stats"]

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        yield counter("vllm:spec_decode_num_drafts", "Verification steps with a proposal.", s.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft.",
                                      labels=["model_name", "position"])
        for j, a in enumerate(s.num_accepted_tokens_per_pos):
            per_pos.add_metric([self.model, str(j)], a)
        yield per_pos
        yield gauge("jspec:spec_decode_accepted_per_verification",
                    "Tokens a verification emits (accepted drafts + the target's own), over finished requests; "
                    "0 before the first.", s.accepted_per_verification or 0.0)
        yield gauge("jspec:spec_decode_draft_tokens_per_verification",
                    "Drafted tokens (a tree's nodes) a verification scores, over finished requests; 0 before the first.",
                    s.draft_tokens_per_verification or 0.0)

        yield gauge("jspec:num_requests_running", "Requests in an engine slot (prefilling or decoding).",
                    snap["running"])
        yield gauge("jspec:num_requests_waiting", "Requests queued for a slot.", snap["waiting"])
        done = CounterMetricFamily("jspec:request_success", "Finished requests, by finish reason.",
                                   labels=["model_name", "finished_reason"])
        for reason, n in snap["finished"].items():
            done.add_metric([self.model, reason], n)
        yield done
        refused = CounterMetricFamily("jspec:request_rejected", "Requests refused before the engine, by reason.",
                                      labels=["model_name", "reason"])
        for reason, n in list(self.rejected.items()):
            refused.add_metric([self.model, reason], n)
        yield refused
        yield counter("jspec:engine_failures", "Engine bursts that raised (their requests failed).",
                      snap.get("failed_bursts", 0))
        yield counter("jspec:prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens)
        yield counter("jspec:generation_tokens", "Generated tokens of finished requests.", s.generation_tokens)
        yield counter("jspec:num_preemptions", "Preemptions (a request recomputed later).", s.preemptions)
        yield gauge("jspec:prefix_cache_hit_rate", "Prompt tokens taken from the prefix cache, as a fraction.",
                    s.prefix_cache_hit_rate)
        free, total = snap["free_pages"], snap["usable_pages"]
        yield gauge("jspec:kv_cache_free_pages", "KV pages free (prefix-cached pages nobody holds included).", free)
        yield gauge("jspec:kv_cache_total_pages", "KV pages in the pool.", total)
        yield gauge("jspec:kv_cache_usage_perc", "Fraction of KV pages held by requests.",
                    1.0 - free / total if total else 0.0)


class ServerMetrics:
    """A registry of its own (several apps can live in one process, as in tests)."""

    def __init__(self, snapshot: Callable[[], dict], model_name: str):
        prometheus_client.disable_created_metrics()  # no *_created series (vLLM turns them off too)
        self.registry = CollectorRegistry()
        self.model = model_name
        self.rejected = {"queue_full": 0, "prompt_too_long": 0, "body_timeout": 0}  # the app counts them
        self.registry.register(_SnapshotCollector(snapshot, model_name, self.rejected))

        def hist(name, doc, buckets):
            return Histogram(name, doc, ["model_name"], registry=self.registry, buckets=buckets).labels(model_name)

        self.ttft = hist("jspec:time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = hist("jspec:time_per_output_token_seconds", "Time per output token after the first.",
                         TOKEN_BUCKETS)
        self.queue = hist("jspec:request_queue_time_seconds", "Time from arrival to a slot.", LATENCY_BUCKETS)
        self.e2e = hist("jspec:e2e_request_latency_seconds", "Time from arrival to the last token.", LATENCY_BUCKETS)

    def observe(self, r: Request) -> None:
        """Record a finished request (called in the engine thread)."""
        m = r.metrics
        for h, v in ((self.ttft, m.ttft), (self.tpot, m.time_per_output_token), (self.queue, m.time_in_queue)):
            if v is not None:
                h.observe(v)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "ServerMetrics"]
