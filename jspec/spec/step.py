"""One speculative decoding step, on the device (called inside ``lax.while_loop``).

The drafter proposes, one target forward verifies, acceptance decides, the caches roll back.
Every shape is fixed (k drafts for every sequence); sequences that are done run with q_len 0
and change nothing.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec import sampling as sampling_lib
from jspec.config import ModelConfig, SamplingParams
from jspec.models.llama import forward
from jspec.spec.acceptance import greedy_accept, rejection_sample
from jspec.state import GenState, commit, last_tokens, step_keys

SALT_ACCEPT = 1  # step_keys salt of the acceptance draws (drafters use other salts)


@dataclasses.dataclass(frozen=True)
class SpecStep:
    config: ModelConfig
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    attention: str
    drafter: object  # a hashable drafter (see jspec.spec.drafters.base)

    def __call__(self, params, drafter_params, state: GenState) -> GenState:
        k = self.drafter.k
        running = ~state.done
        b = running.shape[0]

        # 1. Draft: k proposals per sequence (+ their distributions q for stochastic drafters).
        with jax.named_scope("draft"):
            prop = self.drafter.propose(drafter_params, params, state, self.sampling)

        # 2. Verify: the target scores [last token, d_1..d_k] in one forward (q_len = k + 1),
        #    writing their K/V at positions seq_len - 1 .. seq_len + k - 1.
        with jax.named_scope("verify"):
            q_lens = jnp.where(running, k + 1, 0).astype(jnp.int32)
            inp = jnp.concatenate([last_tokens(state), prop.drafts], axis=1)  # [B, k + 1]
            out = forward(params, self.config, inp, prop.target_cache, q_lens, attention=self.attention)

        # 3. Accept: n drafts survive; one recovered/bonus token follows them.
        with jax.named_scope("accept"):
            if self.sampling.greedy:
                n, nxt = greedy_accept(prop.drafts, out.logits)
            else:
                p = sampling_lib.probs(out.logits, self.sampling)  # [B, k + 1, V]
                q = prop.draft_probs if prop.draft_probs is not None else jax.nn.one_hot(
                    prop.drafts, p.shape[-1], dtype=p.dtype)  # deterministic drafter: one-hot q
                n, nxt = rejection_sample(step_keys(state, SALT_ACCEPT), prop.drafts, q, p)

        # 4. Commit d_1..d_n and the extra token; commit() cuts at EOS and the token budget and
        #    rolls the target cache back to seq_len - 1 (the K/V of rejected drafts go stale).
        j = jnp.arange(k + 1)[None, :]
        drafts_pad = jnp.concatenate([prop.drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
        cand = jnp.where(j < n[:, None], drafts_pad, nxt[:, None])  # [B, k + 1]
        accepted = state.accepted + jnp.sum((running[:, None] & (jnp.arange(k)[None, :] < n[:, None])), axis=0)
        new = state.replace(cache=out.cache, drafter=prop.drafter_state, steps=state.steps + 1,
                            active_steps=state.active_steps + jnp.sum(running), accepted=accepted)
        new = commit(new, cand, n + 1, self.eos_ids)

        # 5. The drafter catches up with what was committed (its own cache rollback, features).
        with jax.named_scope("draft_observe"):
            return new.replace(drafter=self.drafter.observe(drafter_params, params, new, out.hidden, n))
