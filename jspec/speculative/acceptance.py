"""Acceptance of drafted tokens: pure functions, no model, no state.

A verification step scores the last committed token and k drafts d_1..d_k in one target
forward, giving target distributions p_1..p_{k+1} (p_j predicts the token at draft position j;
p_{k+1} the token after d_k). Definitions (vLLM's rejection sampler uses the same words):

- **accepted** tokens: the longest prefix d_1..d_n of the drafts that the rule keeps;
- **recovered** token: when d_{n+1} is rejected (n < k), a replacement drawn at position n+1;
- **bonus** token: when all k drafts are accepted (n = k), one more token drawn from p_{k+1}.

Every step therefore emits n + 1 tokens: the accepted drafts plus one recovered or bonus token.

Greedy (temperature 0): d_j is accepted while it equals argmax p_j; the recovered/bonus token
is argmax p_{n+1}. The output is token-identical to greedy decoding with the target alone.

Sampling: speculative sampling of Leviathan, Kalman and Matias, "Fast Inference from
Transformers via Speculative Decoding" (ICML 2023, arXiv:2211.17192), and Chen et al.
(arXiv:2302.01318). With draft distributions q_j (one-hot for deterministic drafters):
accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection draw the
recovered token from normalize(max(0, p_j - q_j)); after k acceptances draw the bonus token
from p_{k+1}. Each emitted token is then distributed exactly as p (the theorem of the paper),
so sampling from the target alone and speculative sampling give the same distribution.

A drafter may propose fewer than k real drafts for a sequence (``num_drafts[b] <= k``, e.g.
n-gram lookup with a short or no match); positions past ``num_drafts`` are never accepted and
the extra token at ``n == num_drafts`` is the bonus token drawn from p.

p and q are the *processed* distributions (temperature, top-k, top-p via
:func:`jspec.sampling.probs`), the same processing plain sampling uses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.sampling import argmax, sample_from_probs


def _real(drafts: jax.Array, num_drafts) -> jax.Array:
    """bool [B, k]: which draft positions hold real proposals."""
    if num_drafts is None:
        return jnp.ones(drafts.shape, bool)
    return jnp.arange(drafts.shape[1])[None, :] < num_drafts[:, None]


def greedy_accept(
    drafts: jax.Array,  # int32 [B, k]
    target_logits: jax.Array,  # [B, k + 1, V]
    num_drafts: jax.Array | None = None,  # int32 [B]: real drafts per sequence (None = k)
) -> tuple[jax.Array, jax.Array]:  # num_accepted int32 [B], next_token int32 [B]
    """Longest prefix of drafts equal to the target's argmax, plus the target's next token."""
    k = drafts.shape[1]
    best = argmax(target_logits)  # [B, k + 1]
    match = ((drafts == best[:, :k]) & _real(drafts, num_drafts)).astype(jnp.int32)
    n = jnp.sum(jnp.cumprod(match, axis=1), axis=1)  # length of the matching prefix
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def rejection_sample(
    keys: jax.Array,  # [B] PRNG keys
    drafts: jax.Array,  # int32 [B, k]
    q: jax.Array,  # [B, k, V] draft distributions (one-hot for deterministic drafters)
    p: jax.Array,  # [B, k + 1, V] target distributions
    num_drafts: jax.Array | None = None,  # int32 [B]: real drafts per sequence (None = k)
) -> tuple[jax.Array, jax.Array]:  # num_accepted int32 [B], next_token int32 [B]
    """Leviathan et al. speculative sampling; see the module docstring."""
    b, k = drafts.shape
    real = _real(drafts, num_drafts)
    q = jnp.where(real[..., None], q, 0.0)  # no draft there: q = 0, the extra token comes from p
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]  # p_j(d_j)  [B, k]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]  # q_j(d_j)       [B, k]
    u_keys, r_keys = jax.vmap(lambda kk: tuple(jax.random.split(kk)))(keys)  # r_keys: see steps.sample_next
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(u_keys)  # [B, k]
    accept = (u * q_d < p_d) & real  # u < p/q without dividing; q_d > 0 for drafted tokens
    n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]

    # Distribution of the extra token at position n: residual after a rejection, p itself
    # (the bonus) after k acceptances (q is padded with a zero row at position k).
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)  # [B, k + 1, V]
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    # A rejection implies p(d) < q(d), so the residual has mass; guard rounding anyway.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    nxt = jax.vmap(sample_from_probs)(r_keys, residual)
    return n.astype(jnp.int32), nxt


def expected_accepted_length(a: float, k: int) -> float:
    """Tokens per verification step for per-token acceptance ``a`` and ``k`` drafts, bonus
    included: E = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a) (Leviathan et al., eq. 1)."""
    return float(sum(a**j for j in range(k + 1)))
