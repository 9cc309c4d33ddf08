"""``jspec.generate``: a batch of prompts through the engine, all admitted at once.

A thin call into :class:`~jspec.engine.engine.LLMEngine` (one decode path, not two): the
engine has up to ``GENERATE_SLOTS`` slots (a power of two that holds the prompts; more prompts
queue for them, continuous batching) and shapes rounded up to ``SHAPE_QUANTUM`` tokens (the
sizing rules are :mod:`jspec.engine.layout`'s); each prompt's pages come from a shared pool sized
to the free memory, and the prompts are prefilled several per step while the ones already
prefilled decode. The result carries timings with compilation subtracted (:mod:`jspec.timing`)
and the speculative counters summed over the batch.

The engine outlives the call: the next call on the same model with the same settings reuses it
(and its compiled programs) when it has enough slots and context, and otherwise replaces it by
one with the larger of both, so a run of calls with any prompt counts compiles each slot bucket
and shape once. Outputs do not depend on it (a row's result never depends on the other rows of
its step, nor on how many slots there are); ``release_engine()`` frees it.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Optional, Sequence

from jspec.config import MAX_SEED, CacheConfig, EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine, Prompt, encode_prompt
from jspec.engine.layout import batched_tokens, fit_max_model_len, full_pool_tokens
from jspec.errors import ConfigError, PromptError
from jspec.timing import Stopwatch


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens of each prompt (EOS included when hit)
    texts: Optional[list[str]]  # decoded new tokens, special tokens skipped (None without tokenizer)
    prompt_lens: list[int]
    finish_reasons: list[str]  # "eos", "stop" (a stop string) or "length"
    num_tokens: int  # new tokens over the batch
    ttft_s: float  # until every prompt has its first token (prefill included)
    total_s: float  # prefill + every decode step (compilation excluded)
    compile_s: float
    tokens_per_second: float  # num_tokens / total_s
    num_target_forwards: int  # decode steps of the longest-running prompt (each one target forward)
    mean_accepted_length: Optional[float]  # new tokens per target forward per sequence (bonus included)
    # acceptance_per_position[j] = P(draft j+1 accepted | it was proposed): since a draft is only
    # accepted after all earlier ones were, this is the chance the first j+1 drafts all survive
    # (~ a^(j+1) for a per-token acceptance a), not a conditional per-position rate.
    acceptance_per_position: Optional[list[float]]
    accepted_counts: Optional[list[int]] = None  # sequence-steps in which draft j+1 was accepted
    proposed_counts: Optional[list[int]] = None  # sequence-steps in which draft j+1 was proposed
    sequence_steps: int = 0  # sum over prompts of their decode steps
    spec_method: str = "none"
    num_speculative_tokens: int = 0

    def summary(self) -> str:
        s = (f"{self.num_tokens} tokens in {self.total_s:.2f}s: {self.tokens_per_second:.1f} tokens/s, "
             f"time to first token {self.ttft_s * 1e3:.0f} ms (compile {self.compile_s:.1f}s)")
        if self.mean_accepted_length is not None:
            acc = ", ".join(f"{a:.2f}" for a in self.acceptance_per_position or [])
            s += (f"; {self.spec_method} k={self.num_speculative_tokens}: mean accepted length "
                  f"{self.mean_accepted_length:.2f}, acceptance per position [{acc}], "
                  f"{self.num_target_forwards} target forwards")
        return s


def normalize_prompts(prompts) -> list[Prompt]:
    """A string is one prompt (as in vLLM); a list of ints is one token-id prompt only inside a
    list; an empty batch is refused."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise PromptError(f"prompts must be a string or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise PromptError("no prompts given")
    return list(prompts)


def generate(model, prompts: Sequence[Prompt] | str, sampling: SamplingParams = SamplingParams(), *,
             spec: SpecConfig | dict = SpecConfig(), drafter=None, drafter_params=None,
             cache_config: CacheConfig = CacheConfig(), attention: str = "auto", chat: bool = False,
             seeds: Optional[Sequence[int]] = None, on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             stream_interval: int = 8, tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
             quantized_activations: bool = False) -> GenerationResult:
    """Generate continuations of ``prompts`` with ``model`` (a :class:`LoadedModel`).

    With ``spec.method != "none"`` (or an explicit ``drafter``) decoding is speculative and
    lossless: greedy output equals plain greedy output token for token, and sampled output
    follows the target's distribution. A custom ``drafter`` (see
    :mod:`jspec.speculative.drafters.base`) with its ``drafter_params`` replaces the one ``spec``
    names. ``seeds`` gives each prompt its own seed (default ``sampling.seed + i``).
    ``on_tokens`` receives, after each burst of ``stream_interval`` steps, the new tokens of every
    sequence since the last call. ``tensor_parallel_size`` shards the target over that many
    devices (:mod:`jspec.parallel`). ``kv_cache_dtype``: the KV pages' dtype;
    ``quantized_activations``: int8 products on the GGUF blocks (both :class:`EngineConfig`).
    """
    if not isinstance(sampling, SamplingParams):
        raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    spec = SpecConfig.from_dict(spec)  # a dict as vLLM's speculative_config, or a SpecConfig
    prompts = normalize_prompts(prompts)
    ids = [encode_prompt(model.tokenizer, p, chat) for p in prompts]
    b = len(ids)
    if seeds is not None and len(seeds) != b:
        raise ConfigError(f"got {len(seeds)} seeds for {b} prompts")
    context = model.config.max_position_embeddings
    for i, p in enumerate(ids):
        if len(p) + sampling.max_tokens > context:
            raise PromptError(f"prompt {i} has {len(p)} tokens; with max_tokens={sampling.max_tokens} that exceeds "
                              f"the model's context of {context} tokens")
    k = drafter.k if drafter is not None else spec.drafts_per_step
    config = engine_config(model, ids, sampling, k, cache_config, attention, tensor_parallel_size,
                           stream_interval if on_tokens is not None else None, max_num_seqs=generate_slots(b),
                           dynamic_k=spec.dynamic_k, kv_cache_dtype=kv_cache_dtype,
                           quantized_activations=quantized_activations)
    # every request brings its seed (run_requests), so the engine's own does not matter; the pool
    # is sized to the free memory
    config = dataclasses.replace(config, seed=0, kv_cache_tokens=None)
    if drafter is not None:  # a caller's drafter object may carry state of its own: an engine for this call
        engine = LLMEngine(model, config, spec, drafter=drafter, drafter_params=drafter_params)
    else:
        engine = _engine_for(model, config, spec)
    return run_requests(engine, ids, sampling, seeds, on_tokens)


GENERATE_SLOTS = 64  # slots of generate()'s engine at most: more prompts wait for one


def generate_slots(num_prompts: int) -> int:
    """Slots of the engine for ``num_prompts``: the smallest power of two that holds them, at
    most ``GENERATE_SLOTS`` (each slot bucket compiles once; see ``layout.slot_buckets``)."""
    return min(GENERATE_SLOTS, 1 << max(num_prompts - 1, 0).bit_length())


_SIZES = ("max_num_seqs", "max_model_len", "max_num_batched_tokens")
_kept: Optional[tuple] = None  # (weak reference to the model, what it was, its spec, the engine)


def _identity(model) -> tuple:
    """What the kept engine was built from: the model's config, tokenizer and parameter arrays
    (held, so that a model whose parameters were replaced, even in place, is not taken for it)."""
    import jax

    return model.config, model.tokenizer, jax.tree_util.tree_leaves(model.params)


def _same(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and a[1] is b[1] and len(a[2]) == len(b[2])
            and all(x is y for x, y in zip(a[2], b[2])))


def _without_sizes(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, max_num_seqs=1, max_model_len=None, max_num_batched_tokens=1)


def _engine_for(model, config: EngineConfig, spec: SpecConfig) -> LLMEngine:
    """The kept engine if it serves ``config`` (same model, spec and settings; at least its
    slots, context and step budget), else a new one with the larger of each, which is kept."""
    global _kept
    identity = _identity(model)
    if _kept is not None:
        ref, kept_identity, kept_spec, engine = _kept
        c = engine.config
        if (ref() is model and _same(kept_identity, identity) and kept_spec == spec
                and _without_sizes(c) == _without_sizes(config)):
            if all(getattr(c, n) >= getattr(config, n) for n in _SIZES):
                if engine.has_unfinished_requests():  # a call cut short: start clean
                    for rid in list(engine.requests):
                        engine.abort_request(rid)
                engine.pop_finished()
                engine.reset_lookup_history()  # a call's output does not depend on the ones before
                return engine
            config = dataclasses.replace(config, **{n: max(getattr(c, n), getattr(config, n)) for n in _SIZES})
    _kept = None  # the old engine's memory goes before the new one's is taken
    engine = LLMEngine(model, config, spec)
    try:
        _kept = (weakref.ref(model), identity, spec, engine)
    except TypeError:  # a model that takes no weak reference is not kept
        pass
    return engine


def release_engine() -> None:
    """Free the engine :func:`generate` keeps between calls."""
    global _kept
    _kept = None


# With dynamic k the host picks k between bursts from the acceptance seen so far: a burst to the end
# of the budget chose one k per request from the prior alone (measured 2026-12-04).
DYNAMIC_K_BURST_STEPS = 16


def engine_config(model, ids: Sequence[list[int]], sampling: SamplingParams, k: int,
                  cache_config: CacheConfig = CacheConfig(), attention: str = "auto", tensor_parallel_size: int = 1,
                  stream_interval: Optional[int] = None, max_num_seqs: Optional[int] = None,
                  dynamic_k: bool = False, kv_cache_dtype: str = "auto",
                  quantized_activations: bool = False) -> EngineConfig:
    """The engine :func:`generate` builds for ``ids`` (one slot per prompt unless
    ``max_num_seqs``): shapes rounded up to ``SHAPE_QUANTUM`` tokens (:mod:`jspec.engine.layout`),
    pages for every slot at full length, bursts to the end of the budget (or of
    ``stream_interval`` steps; with ``dynamic_k`` of at most ``DYNAMIC_K_BURST_STEPS``, so that
    k is chosen again as the requests' acceptance comes in, not once per request)."""
    b = max_num_seqs or len(ids)
    max_model_len = fit_max_model_len(max(len(p) for p in ids) + sampling.max_tokens,
                                      model.config.max_position_embeddings)
    chunk = 1 << (max(cache_config.prefill_chunk, 16).bit_length() - 1)
    prefill_budget = max(chunk, min(16 * b, 4096))  # a big batch prefills many prompts per step
    ps = cache_config.page_size
    burst = sampling.max_tokens + 1 if stream_interval is None else stream_interval
    if dynamic_k and stream_interval is None:
        burst = min(burst, DYNAMIC_K_BURST_STEPS)
    return EngineConfig(max_num_seqs=b, max_num_batched_tokens=batched_tokens(b, k, prefill_budget),
                        max_model_len=max_model_len, kv_cache_tokens=full_pool_tokens(b, max_model_len, k, ps),
                        page_size=ps, max_burst_steps=burst,
                        attention=attention, shuffle_pages=cache_config.shuffle_pages,
                        seed=sampling.seed or 0, tensor_parallel_size=tensor_parallel_size,
                        kv_cache_dtype=kv_cache_dtype, quantized_activations=quantized_activations)


def run_requests(engine: LLMEngine, ids: Sequence[list[int]], sampling: SamplingParams,
                 seeds: Optional[Sequence[int]] = None,
                 on_tokens: Optional[Callable[[list[list[int]]], None]] = None) -> GenerationResult:
    """Run ``ids`` through ``engine`` (idle, its finished requests forgotten: ids "0", "1", ...
    are reused) to the end; one :class:`GenerationResult`. The engine keeps what it learned
    (prefix cache, lookup history, cost model)."""
    b = len(ids)
    # seed + i, wrapped into the seeds' range (a seed near 2^63 - 1 stays valid for every prompt)
    seeds = [((sampling.seed or 0) + i) % (MAX_SEED + 1) for i in range(b)] if seeds is None else list(seeds)
    k = engine.k_max
    reqs = [engine.add_request(str(i), p, dataclasses.replace(sampling, seed=seeds[i])) for i, p in enumerate(ids)]
    watch = Stopwatch()  # compilation (first call of each jitted function) is timed apart
    emitted = [0] * b
    first_token_s = None
    for _ in engine.step_until_done():
        if first_token_s is None and all(r.output_ids for r in reqs):
            first_token_s = watch.elapsed()
        if on_tokens is not None:
            new = [r.output_ids[e:] for r, e in zip(reqs, emitted)]
            if any(new):
                emitted = [len(r.output_ids) for r in reqs]
                on_tokens(new)
    total, compile_s = watch.elapsed(), watch.compile_s()
    result = _result(engine, reqs, first_token_s if first_token_s is not None else total, total, compile_s, k)
    engine.pop_finished()
    return result


def _result(engine: LLMEngine, reqs, ttft: float, total: float, compile_s: float, k: int) -> GenerationResult:
    new = [list(r.output_ids) for r in reqs]
    n = sum(len(t) for t in new)
    texts = [r.text for r in reqs] if engine.tokenizer is not None else None
    steps = sum(r.metrics.num_steps for r in reqs)
    spec = k > 0
    accepted = [sum(r.metrics.num_accepted_tokens_per_pos[j] for r in reqs) for j in range(k)] if spec else None
    proposed = [sum(r.metrics.num_draft_tokens_per_pos[j] for r in reqs) for j in range(k)] if spec else None
    reasons = ["eos" if r.finish_reason == "stop" and r.stop_reason is None else r.finish_reason for r in reqs]
    return GenerationResult(
        token_ids=new, texts=texts, prompt_lens=[len(r.prompt_ids) for r in reqs], finish_reasons=reasons,
        num_tokens=n, ttft_s=ttft, total_s=total, compile_s=compile_s,
        tokens_per_second=n / total if total > 0 else 0.0,
        num_target_forwards=max((r.metrics.num_steps for r in reqs), default=0),
        mean_accepted_length=(n / steps if spec and steps else None),
        acceptance_per_position=([a / p if p else 0.0 for a, p in zip(accepted, proposed)] if spec else None),
        accepted_counts=accepted, proposed_counts=proposed, sequence_steps=steps,
        spec_method=(engine.spec.method if engine.spec.enabled else type(engine.drafter).__name__) if spec else "none",
        num_speculative_tokens=k)
