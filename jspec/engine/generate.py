"""Generation for a batch of prompts: setup, chunked prefill, and the on-device decode loop.

``generate`` is the library's front door. Per call:

1. prompts are tokenized and checked; each sequence gets pages for prompt + budget (+ k + 1
   slack for verification) from a :class:`PageAllocator`;
2. prefill writes ``prompt[:-1]`` into the cache in chunks (no logits needed: the last prompt
   token is the first decode step's input);
3. the decode loop runs inside ``lax.while_loop`` on the device with the state donated: plain
   decoding (one token per target forward) or speculative decoding (a drafter proposes k
   tokens, one target forward verifies them). The first step runs alone to time the first
   token; the rest runs in one call, or in bursts of ``stream_interval`` steps when the caller
   streams tokens.

Compilation happens on the first call of each jitted function; its time (from
``jax.monitoring``, see :mod:`jspec.timing`) is reported apart and subtracted from the timings.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec import attention as attention_lib
from jspec import sampling as sampling_lib
from jspec.cache import PageAllocator, init_cache
from jspec.speculative.drafters import make_drafter
from jspec.config import CacheConfig, ModelConfig, SamplingParams, SpecConfig
from jspec.errors import ConfigError, PromptError
from jspec.models.prefill import prefill
from jspec.speculative.state import GenState
from jspec.speculative.steps import PlainStep, SpecStep, _burst_jit
from jspec.timing import Stopwatch


@dataclasses.dataclass
class GenerationResult:
    token_ids: list[list[int]]  # new tokens of each prompt (EOS included when hit)
    texts: Optional[list[str]]  # decoded new tokens, special tokens skipped (None without tokenizer)
    prompt_lens: list[int]
    finish_reasons: list[str]  # "eos" or "length"
    num_tokens: int  # new tokens over the batch
    ttft_s: float  # prefill + first decode step
    total_s: float  # prefill + every decode step (compilation excluded)
    compile_s: float
    tokens_per_second: float  # num_tokens / total_s
    num_target_forwards: int  # decode-loop iterations (each is one target forward)
    mean_accepted_length: Optional[float]  # new tokens per target forward per sequence (bonus included)
    # acceptance_per_position[j] = P(draft j+1 accepted | it was proposed): since a draft is only
    # accepted after all earlier ones were, this is the chance the first j+1 drafts all survive
    # (~ a^(j+1) for a per-token acceptance a), not a conditional per-position rate.
    acceptance_per_position: Optional[list[float]]
    accepted_counts: Optional[list[int]] = None  # sequence-steps in which draft j+1 was accepted
    proposed_counts: Optional[list[int]] = None  # sequence-steps in which draft j+1 was proposed
    sequence_steps: int = 0  # sum over decode steps of the sequences still running
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


# ----------------------------------------------------------------------------- setup

def _logits_key(sp: SamplingParams) -> SamplingParams:
    """The fields that shape logits (seed, budget, stop zeroed) for use as a jit static arg."""
    return dataclasses.replace(sp, seed=None, max_tokens=1, ignore_eos=False, stop=(), num_speculative_tokens=None)


def encode_prompts(tokenizer, prompts: Sequence[str | Sequence[int]], chat: bool = False) -> list[list[int]]:
    """Token ids of each prompt (strings need a tokenizer; ``chat`` applies its chat template)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise PromptError("prompt is empty")
            if tokenizer is None:
                raise ConfigError("text prompts need a tokenizer; pass token ids instead")
            if chat:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=True)
                ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
            else:
                ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise PromptError("prompt is empty (no tokens)")
        out.append(list(ids))
    return out


def _check_prompts(ids: list[list[int]], config: ModelConfig, max_new: int) -> None:
    for i, p in enumerate(ids):
        if min(p) < 0 or max(p) >= config.vocab_size:
            raise PromptError(f"prompt {i} has token ids outside [0, {config.vocab_size})")
        if len(p) + max_new > config.max_position_embeddings:
            raise PromptError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new} that exceeds the "
                f"model's context of {config.max_position_embeddings} tokens")


SHAPE_QUANTUM = 64  # tokens: granularity of the token buffer and of each sequence's pages (padding
# costs ~3% per token in the reference attention; an exact fit would recompile per prompt length)


def init_state(config: ModelConfig, prompts: list[list[int]], sampling: SamplingParams,
               cache_config: CacheConfig, slack: int, num_spec: int,
               seeds: Optional[Sequence[int]] = None) -> tuple[GenState, np.ndarray]:
    """The state before prefill, with pages allocated for prompt + budget + ``slack`` tokens."""
    b = len(prompts)
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    max_lens = prompt_lens + sampling.max_new_tokens
    # Shapes are rounded up to SHAPE_QUANTUM tokens so that prompts of similar length share one
    # compiled decode loop (otherwise every new prompt length recompiles it).
    ps = cache_config.page_size
    quantum = max(SHAPE_QUANTUM, ps)
    width = -(-(int(max_lens.max()) + slack + 1) // quantum) * quantum
    tokens = np.zeros((b, width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    need = [int(n) + slack for n in max_lens]
    pages_per_seq = width // ps
    num_pages = b * pages_per_seq
    alloc = PageAllocator(num_pages, ps, shuffle_seed=(sampling.seed or 0) if cache_config.shuffle_pages else None)
    tables = alloc.block_tables(need, pages_per_seq)
    cache = init_cache(config.num_layers, config.num_kv_heads, config.head_dim, tables, num_pages, ps,
                       jnp.dtype(config.dtype))
    seeds = [(sampling.seed or 0) + i for i in range(b)] if seeds is None else list(seeds)
    if len(seeds) != b:
        raise ConfigError(f"got {len(seeds)} seeds for {b} prompts")
    state = GenState(
        tokens=jnp.asarray(tokens), seq_lens=jnp.asarray(prompt_lens), prompt_lens=jnp.asarray(prompt_lens),
        max_lens=jnp.asarray(max_lens), done=jnp.zeros((b,), bool), eos_hit=jnp.zeros((b,), bool),
        keys=jnp.stack([jax.random.key(s) for s in seeds]), cache=cache, drafter=None,
        steps=jnp.int32(0), active_steps=jnp.int32(0), accepted=jnp.zeros((max(num_spec, 1),), jnp.int32),
        proposed=jnp.zeros((max(num_spec, 1),), jnp.int32))
    return state, tokens


@dataclasses.dataclass
class Run:
    """One generate() call after set-up: the step to loop and the state before prefill."""

    step: Callable  # PlainStep or SpecStep (hashable: a static argument of the jitted loop)
    drafter: Any
    drafter_params: Any
    state: GenState
    tokens: np.ndarray  # int32 [B, N] host copy of the token buffer
    prompt_lens: np.ndarray  # int32 [B]
    k: int
    method: Optional[str]
    attention: str


def setup(model, prompts, sampling: SamplingParams, *, spec: SpecConfig = SpecConfig(), drafter=None,
          drafter_params=None, cache_config: CacheConfig = CacheConfig(), attention: str = "auto",
          chat: bool = False, seeds: Optional[Sequence[int]] = None) -> Run:
    """Validate, tokenize, build the drafter and allocate the state (nothing runs yet)."""
    config = model.config
    attention = attention_lib.resolve(attention)
    ids = encode_prompts(model.tokenizer, prompts, chat)
    _check_prompts(ids, config, sampling.max_new_tokens)
    eos = () if sampling.ignore_eos else tuple(config.eos_token_ids)
    if drafter is None and spec.enabled:
        drafter, drafter_params = make_drafter(spec, model, attention)
    k = drafter.k if drafter is not None else 0
    state, tokens = init_state(config, ids, sampling, cache_config, slack=k + 1, num_spec=k, seeds=seeds)
    if drafter is not None:
        step = SpecStep(config, _logits_key(sampling), eos, attention, drafter)
        method = spec.method if spec.enabled else type(drafter).__name__
    else:
        step, drafter_params, method = PlainStep(config, _logits_key(sampling), eos, attention), None, None
    return Run(step, drafter, drafter_params, state, tokens, np.asarray([len(p) for p in ids], np.int32), k,
               method, attention)


def prefill_and_init(model, run: Run, cache_config: CacheConfig) -> GenState:
    """Prefill the target (and the drafter) and return the state ready for the first step."""
    needs_hidden = getattr(run.drafter, "needs_prefill_hidden", False)
    out = prefill(model.params, model.config, run.tokens, run.prompt_lens, run.state.cache, cache_config,
                  run.attention, return_hidden=needs_hidden)
    cache, hidden = out if needs_hidden else (out, None)
    state = run.state.replace(cache=cache)
    if run.drafter is not None:
        state = state.replace(drafter=run.drafter.init(model.params, run.drafter_params, run.tokens,
                                                       run.prompt_lens, state, cache_config, hidden))
    # Wait for prefill before the decode loop compiles: a compilation overlapping device work
    # would hide that work from the timing (compile time is subtracted).
    return jax.block_until_ready(state)


# ----------------------------------------------------------------------------- front door

def generate(model, prompts: Sequence[str | Sequence[int]], sampling: SamplingParams = SamplingParams(), *,
             spec: SpecConfig = SpecConfig(), drafter=None, drafter_params=None, cache_config: CacheConfig = CacheConfig(),
             attention: str = "auto", chat: bool = False, seeds: Optional[Sequence[int]] = None,
             on_tokens: Optional[Callable[[list[list[int]]], None]] = None,
             stream_interval: int = 8) -> GenerationResult:
    """Generate continuations of ``prompts`` with ``model`` (a :class:`LoadedModel`).

    With ``spec.method != "none"`` (or an explicit ``drafter``) decoding is speculative and
    lossless: greedy output equals plain greedy output token for token, and sampled output
    follows the target's distribution. A custom ``drafter`` (see :mod:`jspec.speculative.drafters.base`)
    with its ``drafter_params`` replaces the one ``spec`` names. ``on_tokens`` receives, after each burst of
    ``stream_interval`` steps, the new tokens of every sequence since the last call.
    """
    run = setup(model, prompts, sampling, spec=spec, drafter=drafter, drafter_params=drafter_params,
                cache_config=cache_config, attention=attention, chat=chat, seeds=seeds)
    params, step, drafter_params, prompt_lens = model.params, run.step, run.drafter_params, run.prompt_lens
    watch = Stopwatch()  # compilation (first call of each jitted function) is timed apart
    state = prefill_and_init(model, run, cache_config)
    state = _burst_jit(step, params, drafter_params, state, jnp.int32(1))
    seq_lens = np.asarray(jax.device_get(state.seq_lens))
    ttft = watch.elapsed()
    emitted = [0] * len(prompt_lens)
    limit = stream_interval if on_tokens is not None else sampling.max_new_tokens + 1
    while True:
        if on_tokens is not None:
            toks = np.asarray(jax.device_get(state.tokens))
            new = [toks[i, prompt_lens[i] + emitted[i]:seq_lens[i]].tolist() for i in range(len(prompt_lens))]
            emitted = [e + len(n) for e, n in zip(emitted, new)]
            on_tokens(new)
        if bool(jax.device_get(jnp.all(state.done))):
            break
        state = _burst_jit(step, params, drafter_params, state, jnp.int32(limit))
        seq_lens = np.asarray(jax.device_get(state.seq_lens))
    total, compile_s = watch.elapsed(), watch.compile_s()
    return _result(state, prompt_lens.tolist(), model.tokenizer, ttft, total, compile_s, run.method, run.k)


def _result(state: GenState, prompt_lens, tokenizer, ttft, total, compile_s, method, k) -> GenerationResult:
    toks, seq_lens, eos_hit, steps, active, accepted, proposed = jax.device_get(
        (state.tokens, state.seq_lens, state.eos_hit, state.steps, state.active_steps, state.accepted,
         state.proposed))
    new = [toks[i, prompt_lens[i]:seq_lens[i]].tolist() for i in range(len(prompt_lens))]
    n = sum(len(t) for t in new)
    texts = [tokenizer.decode(t, skip_special_tokens=True) for t in new] if tokenizer is not None else None
    mean_acc = acc_pos = None
    if method is not None and active > 0:
        mean_acc = n / float(active)
        acc_pos = [float(a) / float(p) if p else 0.0 for a, p in zip(accepted[:k], proposed[:k])]
    return GenerationResult(
        token_ids=new, texts=texts, prompt_lens=list(prompt_lens),
        finish_reasons=["eos" if e else "length" for e in eos_hit], num_tokens=n, ttft_s=ttft,
        total_s=total, compile_s=compile_s, tokens_per_second=n / total if total > 0 else 0.0,
        num_target_forwards=int(steps), mean_accepted_length=mean_acc, acceptance_per_position=acc_pos,
        accepted_counts=[int(a) for a in accepted[:k]] if method else None,
        proposed_counts=[int(p) for p in proposed[:k]] if method else None, sequence_steps=int(active),
        spec_method=method or "none", num_speculative_tokens=k)
