"""One speculative decoding step, on the device (called inside ``lax.while_loop``).

The drafter proposes, one target forward verifies, acceptance decides, the caches roll back.
Every shape is fixed (k drafts for every sequence); sequences that are done run with q_len 0
and change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jspec import sampling as sampling_lib
from jspec.config import ModelConfig, SamplingParams
from jspec.models.llama import forward
from jspec.speculative.acceptance import greedy_accept, rejection_sample
from jspec.speculative.state import GenState, commit, last_tokens, step_keys

SALT_ACCEPT = 1  # step_keys salt of the acceptance draws (drafters use other salts)


@dataclasses.dataclass(frozen=True)
class PlainStep:
    """One token per target forward: the autoregressive baseline (hashable: a jit static arg)."""

    config: ModelConfig
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    attention: str

    def __call__(self, params, drafter_params, state: GenState) -> GenState:
        del drafter_params
        q_lens = jnp.where(state.done, 0, 1).astype(jnp.int32)
        out = forward(params, self.config, last_tokens(state), state.cache, q_lens,
                      attention=self.attention)
        keys = step_keys(state)
        nxt = jax.vmap(lambda k, l: sampling_lib.sample(k, l, self.sampling))(keys, out.logits[:, 0])
        state = state.replace(cache=out.cache, steps=state.steps + 1,
                              active_steps=state.active_steps + jnp.sum(q_lens))
        return commit(state, nxt[:, None], q_lens, self.eos_ids)


def _burst(step: Callable, params, drafter_params, state: GenState, limit) -> GenState:
    """Run ``step`` on the device until every sequence is done or ``limit`` steps ran."""

    def cond(carry):
        s, i = carry
        return (i < limit) & ~jnp.all(s.done)

    def body(carry):
        s, i = carry
        return step(params, drafter_params, s), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.int32(0)))[0]


_burst_jit = jax.jit(_burst, static_argnums=0, donate_argnums=3)




@dataclasses.dataclass(frozen=True)
class SpecStep:
    config: ModelConfig
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    attention: str
    drafter: object  # a hashable drafter (see jspec.speculative.drafters.base)

    def __call__(self, params, drafter_params, state: GenState) -> GenState:
        k = self.drafter.k
        running = ~state.done
        b = running.shape[0]

        # 1. Draft: k proposals per sequence (+ their distributions q for stochastic drafters).
        with jax.named_scope("draft"):
            prop = self.drafter.propose(drafter_params, params, state, self.sampling)

        # 2-3. Verify and accept: n drafts survive, one recovered/bonus token follows them. A
        #      drafter with nothing to propose for any sequence (n-gram lookup without a match)
        #      costs a plain one-token step instead of a (k + 1)-token verification.
        if prop.num_drafts is None:
            cache, hidden, n, nxt = self._verify(params, state, prop, None)
        else:
            cache, hidden, n, nxt = jax.lax.cond(
                jnp.any(running & (prop.num_drafts > 0)),
                lambda: self._verify(params, state, prop, prop.num_drafts),
                lambda: self._plain(params, state, prop))

        # 4. Commit d_1..d_n and the extra token; commit() cuts at EOS and the token budget and
        #    rolls the target cache back to seq_len - 1 (the K/V of rejected drafts go stale).
        j = jnp.arange(k + 1)[None, :]
        drafts_pad = jnp.concatenate([prop.drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
        cand = jnp.where(j < n[:, None], drafts_pad, nxt[:, None])  # [B, k + 1]
        pos = jnp.arange(k)[None, :]
        real = k if prop.num_drafts is None else prop.num_drafts[:, None]
        accepted = state.accepted + jnp.sum(running[:, None] & (pos < n[:, None]), axis=0)
        proposed = state.proposed + jnp.sum(running[:, None] & (pos < real), axis=0)
        new = state.replace(cache=cache, drafter=prop.drafter_state, steps=state.steps + 1,
                            active_steps=state.active_steps + jnp.sum(running), accepted=accepted,
                            proposed=proposed)
        new = commit(new, cand, n + 1, self.eos_ids)

        # 5. The drafter catches up with what was committed (its own cache rollback, features).
        with jax.named_scope("draft_observe"):
            return new.replace(drafter=self.drafter.observe(drafter_params, params, state, new, hidden, n))

    def _verify(self, params, state: GenState, prop, num_drafts):
        """The target scores [last token, d_1..d_k] in one forward (q_len = drafts + 1), writing
        their K/V at positions seq_len - 1 ..; acceptance picks n and the extra token."""
        k = self.drafter.k
        with jax.named_scope("verify"):
            real = k if num_drafts is None else num_drafts
            q_lens = jnp.where(state.done, 0, real + 1).astype(jnp.int32)
            inp = jnp.concatenate([last_tokens(state), prop.drafts], axis=1)  # [B, k + 1]
            out = forward(params, self.config, inp, prop.target_cache, q_lens, attention=self.attention)
        with jax.named_scope("accept"):
            if self.sampling.greedy:
                n, nxt = greedy_accept(prop.drafts, out.logits, num_drafts)
            else:
                p = sampling_lib.probs(out.logits, self.sampling)  # [B, k + 1, V]
                q = prop.draft_probs if prop.draft_probs is not None else jax.nn.one_hot(
                    prop.drafts, p.shape[-1], dtype=p.dtype)  # deterministic drafter: one-hot q
                n, nxt = rejection_sample(step_keys(state, SALT_ACCEPT), prop.drafts, q, p, num_drafts)
        return out.cache, out.hidden, n, nxt

    def _plain(self, params, state: GenState, prop):
        """No drafts anywhere: one token from the target, as plain decoding would do."""
        k = self.drafter.k
        q_lens = (~state.done).astype(jnp.int32)
        out = forward(params, self.config, last_tokens(state), prop.target_cache, q_lens, attention=self.attention)
        logits = out.logits[:, 0]
        if self.sampling.greedy:
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            p = sampling_lib.probs(logits, self.sampling)
            nxt = jax.vmap(sampling_lib.sample_from_probs)(
                jax.vmap(lambda kk: jax.random.split(kk)[1])(step_keys(state, SALT_ACCEPT)), p)
        hidden = jnp.pad(out.hidden, ((0, 0), (0, k), (0, 0)))  # the verify branch's shape
        return out.cache, hidden, jnp.zeros_like(q_lens), nxt
