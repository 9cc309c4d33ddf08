"""Logits processing and sampling: one path for autoregressive decoding and verification.

``process_logits`` applies, in order, temperature, top-k and top-p (the order Hugging Face's
``generate`` and vLLM use) and returns float32 logits with removed tokens at ``-inf``.
``probs`` is its softmax: the distribution p (target) or q (draft) that speculative
acceptance compares. Greedy (temperature 0) is an argmax and has no distribution; its "probs"
are one-hot on the argmax so the same acceptance code can treat it as a deterministic draft.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.config import SamplingParams


def process_logits(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """[..., V] -> float32 [..., V]: temperature, then top-k, then top-p (``-inf`` = removed)."""
    x = logits.astype(jnp.float32)
    if sp.greedy:
        return x
    x = x / sp.temperature
    v = x.shape[-1]
    if 0 < sp.top_k < v:
        kth = jax.lax.top_k(x, sp.top_k)[0][..., -1:]  # [..., 1]
        x = jnp.where(x < kth, -jnp.inf, x)  # ties with the k-th value stay, as in HF
    if sp.top_p < 1.0:
        sorted_x = jnp.sort(x, axis=-1)[..., ::-1]  # descending
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        # keep the smallest prefix whose mass reaches top_p: tokens whose predecessors already
        # hold >= top_p are removed; the first token is always kept.
        keep = mass_before < sp.top_p
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x < cutoff, -jnp.inf, x)
    return x


def probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """The sampling distribution [..., V] (one-hot on the argmax when greedy)."""
    if sp.greedy:
        return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(process_logits(logits, sp), axis=-1)


def sample(key: jax.Array, logits: jax.Array, sp: SamplingParams) -> jax.Array:
    """Draw token ids [...] from logits [..., V] (argmax when greedy)."""
    if sp.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, process_logits(logits, sp), axis=-1).astype(jnp.int32)


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """Draw token ids [...] from (possibly unnormalized, non-negative) probabilities [..., V]."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
