"""The decode state pytree and the token-commit rule shared by every decode loop.

Invariant while a sequence runs: ``tokens[b, :seq_lens[b]]`` are committed (prompt + new), the
target cache holds K/V for all of them but the last (``cache.lengths == seq_lens - 1``), and
the last committed token is the next forward's input.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.cache.paged import PagedKVCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GenState:
    tokens: jax.Array  # int32 [B, N]: prompt + generated, padded
    seq_lens: jax.Array  # int32 [B]: committed tokens
    prompt_lens: jax.Array  # int32 [B]
    max_lens: jax.Array  # int32 [B]: prompt_len + max_new_tokens
    done: jax.Array  # bool [B]
    eos_hit: jax.Array  # bool [B]: finished by EOS (else by length)
    keys: jax.Array  # [B] typed PRNG keys, one stream per sequence
    cache: PagedKVCache  # the target's cache
    drafter: Any  # the drafter's own state pytree (None for plain decoding)
    steps: jax.Array  # int32 []: loop iterations (one target forward each)
    active_steps: jax.Array  # int32 []: sum over steps of running sequences
    accepted: jax.Array  # int32 [K]: accepted[j] = sequence-steps where draft j was accepted
    proposed: jax.Array  # int32 [K]: proposed[j] = sequence-steps where a draft j was proposed

    def replace(self, **kw) -> "GenState":
        return dataclasses.replace(self, **kw)


def last_tokens(state: GenState) -> jax.Array:
    """The last committed token of each sequence, int32 [B, 1]."""
    return jnp.take_along_axis(state.tokens, state.seq_lens[:, None] - 1, axis=1)


def step_keys(state: GenState, salt: int = 0) -> jax.Array:
    """Per-sequence keys [B] for this step, a function of (seed, position, salt) only, so a
    sequence samples the same whether it runs alone or in a batch."""
    return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, n), salt))(
        state.keys, state.seq_lens)


def commit(state: GenState, cand: jax.Array, counts: jax.Array, eos_ids: tuple[int, ...]) -> GenState:
    """Append the first ``counts[b]`` tokens of ``cand[b]`` (int32 [B, M]) to each running
    sequence, cut at the first EOS and at the token budget; roll the cache back to match."""
    b, m = cand.shape
    counts = jnp.where(state.done, 0, jnp.minimum(counts, state.max_lens - state.seq_lens))
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    eos_hit = jnp.zeros((b,), bool)
    if eos_ids:
        is_eos = jnp.isin(cand, jnp.asarray(eos_ids, jnp.int32)) & (j < counts[:, None])
        eos_hit = jnp.any(is_eos, axis=1)
        counts = jnp.where(eos_hit, jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, counts)
    pos = jnp.where(j < counts[:, None], state.seq_lens[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(b)[:, None], pos].set(cand, mode="drop")
    seq_lens = state.seq_lens + counts
    done = state.done | eos_hit | (seq_lens >= state.max_lens)
    return state.replace(tokens=tokens, seq_lens=seq_lens, done=done, eos_hit=state.eos_hit | eos_hit,
                         cache=state.cache.replace(lengths=seq_lens - 1))
