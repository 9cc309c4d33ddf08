"""Where a speculative step's time goes: draft vs verify, and op by op inside a forward.

Inside ``generate`` a whole step (propose, verify, accept, commit, observe) runs fused in one
``lax.while_loop``, so its parts cannot be timed there. ``profile_step`` prepares the same state
(prefill plus ``warm_steps`` real steps), then times, each as its own jitted call repeated
``repeats`` times on that state: the drafter's ``propose``, the target's verification forward
(q_len = k + 1), the whole speculative step, and a plain one-token step for comparison.

``profile_ops`` goes one level down: it runs the jitted target forward + acceptance at several
q_lens under ``jax.profiler`` and sums the XLA CPU backend's per-thunk trace events by what the
op belongs to (its ``jax.named_scope`` path in the compiled HLO's metadata): the LM head, each
projection, attention, the cache write, norms and RoPE, acceptance.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import statistics
import tempfile
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine, encode_prompt
from jspec.engine.layout import fit_max_model_len
from jspec.speculative.drafters.base import Proposal
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.steps import PlainStep, SpecStep, plain_token_step


@dataclasses.dataclass
class StepProfile:
    draft_ms: float  # drafter.propose (k draft tokens)
    verify_ms: float  # target forward over [last, d_1..d_k] + acceptance
    step_ms: float  # the whole speculative step
    plain_step_ms: float  # one plain decoding step (a single-token target forward)
    k: int

    def summary(self) -> str:
        return (f"k={self.k}: draft {self.draft_ms:.1f} ms + verify {self.verify_ms:.1f} ms, whole step "
                f"{self.step_ms:.1f} ms; a plain step {self.plain_step_ms:.1f} ms")


def best_ms(fn, *args, repeats: int, compile: bool = True) -> float:
    """Best of ``repeats`` calls of ``fn(*args)`` in milliseconds (after one untimed call that
    compiles, unless ``compile`` is False)."""
    if compile:
        jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def prepared_engine(model, prompt, spec: SpecConfig, sampling: SamplingParams = SamplingParams(), *,
                    warm_steps: int = 4, attention: str = "auto", extra_tokens: int = 0,
                    kv_cache_dtype: str = "auto") -> LLMEngine:
    """An engine with one request: ``prompt`` prefilled, its first token and ``warm_steps``
    steps decoded (the state a decode or verification step of that request starts from)."""
    k = spec.num_speculative_tokens if spec.enabled else 0
    sp = dataclasses.replace(sampling, max_tokens=warm_steps * (k + 1) + 8 + extra_tokens, ignore_eos=True)
    ids = encode_prompt(model.tokenizer, prompt)
    max_model_len = fit_max_model_len(len(ids) + sp.max_tokens, model.config.max_position_embeddings)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=max_model_len, max_burst_steps=warm_steps,
                                           attention=attention, kv_cache_dtype=kv_cache_dtype), spec)
    engine.add_request("profile", ids, sp)
    r = engine.requests["profile"]
    for _ in engine.step_until_done(until=lambda: bool(r.output_ids)):  # prefill, first token
        pass
    engine.step()  # warm_steps real steps
    return engine


def profile_step(model, prompt, spec: SpecConfig, sampling: SamplingParams = SamplingParams(), *,
                 warm_steps: int = 4, repeats: int = 10, attention: str = "auto") -> StepProfile:
    """Best-of-``repeats`` milliseconds of the parts of one speculative step on ``prompt``.
    These calls do not donate their state, so each includes a copy of the page pool (small for
    the short prompts this is run on); :class:`StepLoop` times the target step as the engine
    runs it."""
    k = spec.drafts_per_step
    engine = prepared_engine(model, prompt, spec, sampling, warm_steps=warm_steps, attention=attention)
    state, drafter, dparams = engine.runner.state, engine.drafter, engine.runner.drafter_params
    params = engine.runner.params  # what the engine runs
    step = engine._steps[k]

    propose = jax.jit(lambda dp, p, s: drafter.propose(dp, p, s, s.sampling))
    prop = propose(dparams, params, state)
    num = jnp.full((1,), k, jnp.int32) if prop.num_drafts is None else jnp.minimum(prop.num_drafts, k)
    verify = jax.jit(lambda p, s, pr: step._verify(p, s, pr, num, None, pr.target_cache))
    whole = jax.jit(lambda p, dp, s: step(p, dp, s))
    plain = PlainStep(step.config, step.eos_ids, step.attention, path=step.path)
    plain_fn = jax.jit(lambda p, s: plain(p, None, s))
    return StepProfile(
        draft_ms=best_ms(propose, dparams, params, state, repeats=repeats),
        verify_ms=best_ms(verify, params, state, prop, repeats=repeats),
        step_ms=best_ms(whole, params, dparams, state, repeats=repeats),
        plain_step_ms=best_ms(plain_fn, params, state.replace(drafter=None), repeats=repeats),
        k=k)


@dataclasses.dataclass
class TreeTrace:
    """One verification of a drafted token tree, for looking at (``trace_tree``)."""

    context: list[int]  # the committed tokens; the last one is the tree's root
    tokens: list[int]  # node tokens, parents first
    parents: list[int]  # each node's parent (-1: the root)
    accepted: list[int]  # the accepted path's nodes, root side first
    next_token: int  # the target's extra token after the path


def trace_tree(model, prompt, spec: SpecConfig, sampling: SamplingParams = SamplingParams(), *,
               warm_steps: int = 2, attention: str = "auto") -> TreeTrace:
    """Draft one tree (or chain) for ``prompt`` after ``warm_steps`` steps of decoding and verify
    it as the engine's step does: the drafter's proposal, the target's verdict."""
    engine = prepared_engine(model, prompt, spec, sampling, warm_steps=warm_steps, attention=attention)
    state, drafter, dparams = engine.runner.state, engine.drafter, engine.runner.drafter_params
    params = engine.runner.params
    k = spec.drafts_per_step
    step = engine._steps[k]
    prop = jax.jit(lambda dp, p, s: drafter.propose(dp, p, s, s.sampling))(dparams, params, state)
    num = jnp.full((1,), k, jnp.int32) if prop.num_drafts is None else jnp.minimum(prop.num_drafts, k)
    _, (_, n, cand, _) = jax.jit(lambda p, s, pr: step._verify(p, s, pr, num, None, pr.target_cache))(
        params, state, prop)
    m = int(num[0])
    tokens = [int(t) for t in prop.drafts[0, :m]]
    parents = list(range(-1, m - 1)) if prop.parents is None else [int(x) for x in prop.parents[0, :m]]
    cand, n = [int(t) for t in cand[0]], int(n[0])
    path, cur = [], -1
    for tok in cand[:n]:  # the accepted nodes: under the path's end, the first with the emitted token
        cur = next(i for i in range(m) if parents[i] == cur and tokens[i] == tok)
        path.append(cur)
    seq = int(state.seq_lens[0])
    return TreeTrace([int(t) for t in state.tokens[0, :seq]], tokens, parents, path, cand[n])


# ---------------------------------------------------------------------------- per-op profile
# (category, pattern on the op's named-scope path), first match wins
OP_CATEGORIES = (
    ("accept", r"/accept/|sample_next|greedy_accept"),
    ("lm_head", r"\.head/|/head/|lm_head|attend"),
    ("qkv_proj", r"/qkv_proj/"),
    ("o_proj", r"/o_proj/"),
    ("gate_up_proj", r"/gate_up_proj/"),
    ("down_proj", r"/down_proj/"),
    ("attention", r"/verify_attention/"),
    ("layer_tail", r"/layer_tail/"),
    ("decoder_layer", r"/decoder_layer/"),
    ("decoder_stack", r"/decoder_stack/"),
    ("kv_write", r"/kv_write/"),
    ("norms", r"layernorm|/norm/|RMSNorm"),
    ("rope+elementwise", r"/layer_\d+/"),
)


def _op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (the named-scope path)."""
    out = {}
    for m in re.finditer(r'%([\w.\-]+) = [^\n]*?op_name="([^"]+)"', hlo_text):
        out[m.group(1)] = m.group(2)
    return out


def categorize(op_name: str) -> str:
    for cat, pat in OP_CATEGORIES:
        if re.search(pat, op_name):
            return cat
    return "other"


def _outermost(ops: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """The events of one thread that no other contains: a ``while`` thunk's event spans its
    body's thunks (and the loop's own overhead between them), which have events of their own
    and would otherwise count twice."""
    out, end = [], -1
    for op in sorted(ops, key=lambda o: (o[0], -o[1])):
        if op[0] >= end:
            out.append(op)
            end = op[0] + op[1]
    return out


@dataclasses.dataclass
class OpProfile:
    q_len: int
    wall_ms: float  # median wall time of one call (under the profiler)
    best_ms: float  # best wall time of one call, timed apart without the profiler
    by_category: dict  # category -> median ms per call (sum of its thunks' trace events)

    def row(self, categories: Sequence[str]) -> list[str]:
        return [str(self.q_len), f"{self.best_ms:.1f}"] + [f"{self.by_category.get(c, 0.0):.1f}" for c in categories]


def trace_ops(loop: "StepLoop", repeats: int = 10) -> tuple[dict, float]:
    """Run ``loop()`` ``repeats`` times under ``jax.profiler``; returns (category -> median ms
    per call, median wall ms per call). Categories come from :data:`OP_CATEGORIES`."""
    from jax.profiler import ProfileData

    scopes = _op_scopes(loop.compiled.as_text())
    jax.block_until_ready(loop())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            walls = []
            for i in range(repeats):
                with jax.profiler.TraceAnnotation(f"profile_call_{i}"):
                    t = time.perf_counter()
                    jax.block_until_ready(loop())
                    walls.append((time.perf_counter() - t) * 1e3)
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    calls: list[tuple[int, int]] = []
    events = []
    for plane in data.planes:
        for line in plane.lines:
            ops = []
            for e in line.events:
                if e.name.startswith("profile_call_"):
                    calls.append((e.start_ns, e.start_ns + e.duration_ns))
                elif e.name in scopes:
                    ops.append((e.start_ns, e.duration_ns, categorize(scopes[e.name])))
            events += _outermost(ops)
    per_call = [dict() for _ in calls]
    calls.sort()
    for start, dur, cat in events:
        for i, (a, b) in enumerate(calls):
            if a <= start < b:
                per_call[i][cat] = per_call[i].get(cat, 0.0) + dur / 1e6
                break
    cats = sorted({c for pc in per_call for c in pc})
    return {c: statistics.median(pc.get(c, 0.0) for pc in per_call) for c in cats}, statistics.median(walls)


def profile_ops(model, prompt, q_lens: Sequence[int] = (1, 2, 5, 9), *, repeats: int = 10,
                attention: str = "auto", engine: Optional[LLMEngine] = None, params=None) -> list[OpProfile]:
    """Per-op profile of the jitted target step (forward + greedy acceptance) at each q_len on
    the state of ``prompt`` after its prefill: q_len 1 is a plain decoding step, q_len k + 1
    the verification of k drafts. ``params``: the target's parameters to run (default: the
    engine's)."""
    kmax = max(q_lens) - 1
    engine = engine or prepared_engine(model, prompt, SpecConfig("ngram", max(kmax, 1)), attention=attention)
    params = engine.runner.params if params is None else params
    out = []
    for q in q_lens:
        loop = StepLoop(engine, q, params)
        by_cat, _ = trace_ops(loop, repeats)
        best = best_ms(loop, repeats=repeats)
        out.append(OpProfile(q, float("nan"), best, by_cat))
    return out


def target_step_fn(engine: LLMEngine, q_len: int):
    """The jitted target step of ``engine``'s model at ``q_len``, as the engine runs it: the
    decode state is donated, so the K/V writes land in place in the page pool. q_len 1:
    ``fn(params, state) -> (next token [B], state)``, the plain one-token step (forward +
    greedy pick). Otherwise ``fn(params, state, drafts [B, q_len - 1]) -> ((accepted counts,
    next tokens), state)``, the verification forward of the drafts plus greedy acceptance.
    ``state``: the engine's decode state without drafter state. The returned state holds the
    written pages and the cache lengths it came with, so a call on it repeats the same step.

    Without the donation XLA copies every layer's pages before writing into them: a cost that
    grows with the pool, not the context, and that the engine's steps never pay."""
    cfg = engine.model.config
    eos, attn = tuple(cfg.eos_token_ids), engine._steps[0].attention

    def same_step_again(state, cache):
        return state.replace(cache=cache.replace(lengths=state.cache.lengths))

    if q_len == 1:
        def decode(p, s):
            cache, _, nxt, _ = plain_token_step(p, cfg, attn, s, s.cache, path=engine.path)
            return nxt, same_step_again(s, cache)

        return jax.jit(decode, donate_argnums=1)
    step = SpecStep(cfg, eos, attn, NgramDrafter(q_len - 1), engine.path)

    def verify(p, s, d):
        num = jnp.full((s.batch,), q_len - 1, jnp.int32)
        prop = Proposal(d, None, None, s.cache, num)
        cache, (_, n, nxt, _) = step._verify(p, s, prop, num, None, s.cache)
        return (n, nxt), same_step_again(s, cache)

    return jax.jit(verify, donate_argnums=1)


class StepLoop:
    """``target_step_fn(engine, q_len)`` called again and again on one state, threading the
    donated state through the calls: ``loop()`` runs one step and returns its result. Starts
    from a copy of the engine's decode state (the engine's own stays valid); the drafts of a
    verification step are the token buffer's first token repeated."""

    def __init__(self, engine: LLMEngine, q_len: int, params=None):
        self.fn = target_step_fn(engine, q_len)
        self.params = engine.runner.params if params is None else params
        self.state = jax.tree.map(jnp.copy, engine.runner.state.replace(drafter=None))
        self.extra = () if q_len == 1 else (jnp.tile(self.state.tokens[:, :1], (1, q_len - 1)),)
        self.compiled = self.fn.lower(self.params, self.state, *self.extra).compile()  # once: timed and traced

    def __call__(self):
        out, self.state = self.compiled(self.params, self.state, *self.extra)
        return out
