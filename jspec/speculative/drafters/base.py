"""The drafter interface: drafters only propose.

A drafter is a frozen, hashable dataclass (a static argument of the jitted decode loop); its
parameters, if any, travel separately as a pytree, and its changing state lives in
``GenState.drafter``. It never decides acceptance and never owns the target's buffers: the
layer-skip drafter may write the K/V of the target's first layers (identical to what the
target writes for them), and hands the cache back for verification.

    init(target_params, drafter_params, tokens, prompt_lens, state, cache_config, prefill_hidden)
        -> drafter state. Host side, after the target's prefill; ``prefill_hidden`` [B, N, H]
        holds the target's final hidden states of ``prompt[:-1]`` (EAGLE heads need them).
    propose(drafter_params, target_params, state, sampling) -> Proposal      (jitted)
    observe(drafter_params, target_params, prev_state, state, verify_hidden, num_accepted)
        -> drafter state, after acceptance was committed (``prev_state`` is the state the step
        started from): roll back the drafter's own cache, keep the target's features.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax

from jspec.cache.paged import PagedKVCache


class Proposal(NamedTuple):
    drafts: jax.Array  # int32 [B, k]
    draft_probs: Optional[jax.Array]  # [B, k, V] q distributions, or None (deterministic drafter)
    drafter_state: Any
    target_cache: PagedKVCache  # the target cache to verify on (unchanged except layer-skip)
    num_drafts: Optional[jax.Array] = None  # int32 [B]: real drafts (<= k); None = k for all


class StatelessDrafter:
    """Mixin for drafters without state of their own."""

    def init(self, target_params, drafter_params, tokens, prompt_lens, state, cache_config, prefill_hidden=None):
        return None

    def observe(self, drafter_params, target_params, prev_state, state, verify_hidden, num_accepted):
        return state.drafter


def sample_chain(step_fn, cache, first_logits: jax.Array, keys: jax.Array, k: int, sampling):
    """Draft k tokens autoregressively from ``first_logits`` [B, V] (the distribution of d_1).

    ``step_fn(tokens [B, 1], carry) -> (logits [B, V], carry)`` runs the draft one token
    further (``carry`` is its cache, or any pytree); it runs k - 1 times inside ``lax.scan``
    (traced once, whatever k is). Returns (drafts int32 [B, k], q [B, k, V] or None when greedy,
    carry).
    """
    import jax.numpy as jnp

    from jspec import sampling as sampling_lib

    def pick(j, logits):
        sub = jax.vmap(lambda kk: jax.random.fold_in(kk, j))(keys)
        tok = jax.vmap(lambda kk, l: sampling_lib.sample(kk, l, sampling))(sub, logits)
        return tok, (None if sampling.greedy else sampling_lib.probs(logits, sampling))

    d0, q0 = pick(0, first_logits)

    def body(carry, j):
        tok, c = carry
        logits, c = step_fn(tok[:, None], c)
        d, q = pick(j, logits)
        return (d, c), (d, q)

    (_, cache), (ds, qs) = jax.lax.scan(body, (d0, cache), jnp.arange(1, k))
    drafts = jnp.concatenate([d0[:, None], ds.T], axis=1).astype(jnp.int32)  # [B, k]
    q = None if sampling.greedy else jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    return drafts, q, cache


def draft_vocab_logits(hidden: jax.Array, head: jax.Array, vocab_ids: jax.Array, vocab_size: int) -> jax.Array:
    """Logits over the full vocabulary [B, V] from a head over a draft vocabulary.

    ``head`` [V', H] holds the target's output embedding rows of the V' tokens ``vocab_ids``
    (the most frequent ones in the training data, as EAGLE-3's draft vocabulary): the draft
    reads a V'/V share of the LM head per token. Tokens outside it get ``-inf``: never drafted,
    q = 0 there, which rejection sampling handles exactly (the target still emits them).
    """
    import jax.numpy as jnp

    small = jnp.einsum("bh,vh->bv", hidden, head, preferred_element_type=jnp.float32)  # [B, V']
    full = jnp.full((hidden.shape[0], vocab_size), -jnp.inf, jnp.float32)
    return full.at[:, vocab_ids].set(small)
