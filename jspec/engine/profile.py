"""Where a speculative step's time goes: draft vs verify, measured apart.

Inside ``generate`` a whole step (propose, verify, accept, commit, observe) runs fused in one
``lax.while_loop``, so its parts cannot be timed there. ``profile_step`` prepares the same state
(prefill plus ``warm_steps`` real steps), then times, each as its own jitted call repeated
``repeats`` times on that state: the drafter's ``propose``, the target's verification forward
(q_len = k + 1), the whole speculative step, and a plain one-token step for comparison.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp

from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine, encode_prompt
from jspec.speculative.steps import PlainStep


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


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def profile_step(model, prompt, spec: SpecConfig, sampling: SamplingParams = SamplingParams(), *,
                 warm_steps: int = 4, repeats: int = 10, attention: str = "auto") -> StepProfile:
    """Best-of-``repeats`` milliseconds of the parts of one speculative step on ``prompt``."""
    k = spec.num_speculative_tokens
    sp = dataclasses.replace(sampling, max_tokens=warm_steps * (k + 1) + 8, ignore_eos=True)
    ids = encode_prompt(model.tokenizer, prompt)
    engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=_round_up(len(ids) + sp.max_tokens, 64),
                                           max_burst_steps=warm_steps, attention=attention), spec)
    engine.add_request("profile", ids, sp)
    r = engine.requests["profile"]
    while engine.has_unfinished_requests() and not r.output_ids:  # prefill, first token
        engine.step()
    engine.step()  # warm_steps real steps
    state, drafter, dparams = engine.runner.state, engine.drafter, engine.runner.drafter_params
    step = engine._steps[k]

    propose = jax.jit(lambda dp, p, s: drafter.propose(dp, p, s, s.sampling))
    prop = propose(dparams, model.params, state)
    num = jnp.full((1,), k, jnp.int32) if prop.num_drafts is None else jnp.minimum(prop.num_drafts, k)
    verify = jax.jit(lambda p, s, pr: step._verify(p, s, pr, num, None))
    whole = jax.jit(lambda p, dp, s: step(p, dp, s))
    plain = PlainStep(step.config, step.eos_ids, step.attention)
    plain_fn = jax.jit(lambda p, s: plain(p, None, s))
    return StepProfile(
        draft_ms=_time(propose, dparams, model.params, state, repeats=repeats),
        verify_ms=_time(verify, model.params, state, prop, repeats=repeats),
        step_ms=_time(whole, model.params, dparams, state, repeats=repeats),
        plain_step_ms=_time(plain_fn, model.params, state.replace(drafter=None), repeats=repeats),
        k=k)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m
