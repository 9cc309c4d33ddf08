"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

For n from ``ngram_max`` down to ``ngram_min``, find the latest position i < seq_len - n where
``tokens[i:i+n]`` equals the last n committed tokens; the first n with a match wins and its
continuation ``tokens[i+n : i+n+k]`` is proposed, cut at the end of the committed text: the
proposal has ``num_drafts <= k`` real tokens, 0 without any match (the step then runs a plain
one-token forward instead of a verification). Deterministic, so q is one-hot. Runs on the device:
matching is a fixed-shape comparison over the token buffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.speculative.drafters.base import Proposal, StatelessDrafter
from jspec.speculative.state import DecodeState


def ngram_propose(tokens: jax.Array, seq_len: jax.Array, k: int, n_max: int, n_min: int):
    """(drafts int32 [k], num_drafts int32 []) for one sequence: tokens int32 [N], seq_len int32 []."""
    size = tokens.shape[0]
    pos = jnp.arange(size)
    best_start = jnp.int32(-1)
    found = jnp.bool_(False)
    for n in range(n_max, n_min - 1, -1):  # longest n first
        suffix = jax.lax.dynamic_slice(tokens, (jnp.maximum(seq_len - n, 0),), (n,))
        match = jnp.ones((size,), bool)
        for j in range(n):
            match &= jnp.roll(tokens, -j) == suffix[j]  # tokens[i + j] == suffix[j]
        match &= (pos + n < seq_len) & (seq_len >= n + 1)  # an earlier occurrence, not the suffix
        latest = jnp.max(jnp.where(match, pos, -1))
        take = ~found & (latest >= 0)
        best_start = jnp.where(take, latest + n, best_start)
        found |= latest >= 0
    idx = jnp.minimum(jnp.where(found, best_start, seq_len - 1) + jnp.arange(k), seq_len - 1)
    num = jnp.where(found, jnp.minimum(k, seq_len - best_start), 0)  # committed tokens only
    return tokens[idx], num.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class NgramDrafter(StatelessDrafter):
    k: int
    n_max: int = 4
    n_min: int = 1

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        drafts, num = jax.vmap(lambda t, s: ngram_propose(t, s, self.k, self.n_max, self.n_min))(
            state.tokens, state.seq_lens)
        return Proposal(drafts.astype(jnp.int32), None, state.drafter, state.cache, num)
