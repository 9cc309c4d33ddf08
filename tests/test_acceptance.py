"""The acceptance rule on its own: table-driven greedy cases and a statistical test that
speculative sampling emits tokens distributed exactly as the target (plus proof the test can
fail: a deliberately biased rule is caught)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.config import SamplingParams
from jspec.sampling import probs
from jspec.speculative.acceptance import greedy_accept, rejection_sample


def _onehot_logits(rows, v=6):
    return jnp.asarray(np.eye(v)[rows] * 5.0)


@pytest.mark.parametrize("drafts,target,n,nxt", [
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted + bonus
    ([1, 2, 3], [0, 2, 3, 4], 0, 0),  # first rejected, recovered = target's choice
    ([1, 2, 3], [1, 5, 3, 4], 1, 5),  # a later match after a mismatch does not count
    ([1, 2, 3], [1, 2, 0, 4], 2, 0),
])
def test_greedy_table(drafts, target, n, nxt):
    got_n, got_next = greedy_accept(jnp.asarray([drafts], jnp.int32), _onehot_logits([target]))
    assert int(got_n[0]) == n and int(got_next[0]) == nxt


def biased_rejection_sample(keys, drafts, q, p):
    """A plausible-looking but wrong rule: on rejection, resample from p instead of the residual
    max(0, p - q). It over-weights tokens the draft likes."""
    b, k = drafts.shape
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], -1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], -1)[..., 0]
    uk, rk = jax.vmap(lambda kk: tuple(jax.random.split(kk)))(keys)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(uk)
    n = jnp.sum(jnp.cumprod((u * q_d < p_d).astype(jnp.int32), 1), 1)
    p_n = jnp.take_along_axis(p, n[:, None, None], 1)[:, 0]
    nxt = jax.vmap(lambda kk, pp: jax.random.categorical(kk, jnp.log(pp)))(rk, p_n)
    return n, nxt


def emitted_token_check(rule, p, q, num=60000, seed=0, z=5.0):
    """Run ``rule`` ``num`` times with drafts drawn from q. Token j of the emitted run (drafts
    d_1..d_n then the extra token), given the run reaches j, must be distributed as p_j
    whenever p and q do not depend on the context. Returns the largest z-score over all
    (position, token) cells, with sigma = sqrt(p (1 - p) / count)."""
    k, v = q.shape
    key = jax.random.key(seed)
    kd, kr = jax.random.split(key)
    drafts = jax.random.categorical(kd, jnp.log(jnp.maximum(q, 1e-30)), shape=(num, k)).astype(jnp.int32)
    n, nxt = jax.jit(rule)(jax.random.split(kr, num), drafts,
                           jnp.broadcast_to(q, (num, k, v)), jnp.broadcast_to(p, (num, k + 1, v)))
    n, nxt, drafts = np.asarray(n), np.asarray(nxt), np.asarray(drafts)
    worst = 0.0
    for j in range(k + 1):
        reach = n >= j  # token j is emitted: as an accepted draft (n > j) or the extra token (n == j)
        tok = np.where(n[reach] > j, drafts[reach, min(j, k - 1)], nxt[reach])
        count = reach.sum()
        if count < 500:
            continue
        freq = np.bincount(tok, minlength=v) / count
        pj = np.asarray(p[j])
        sigma = np.sqrt(np.maximum(pj * (1 - pj), 1e-12) / count)
        zs = np.abs(freq - pj) / sigma
        zs[(pj == 0) & (freq == 0)] = 0.0
        zs[(pj == 0) & (freq > 0)] = np.inf  # a token the target forbids was emitted
        worst = max(worst, float(zs.max()))
    return worst


def _random_pq(seed, sp, k=3, v=8):
    kp, kq = jax.random.split(jax.random.key(seed))
    pl = jax.random.normal(kp, (k + 1, v)) * 1.5
    ql = pl[:k] + jax.random.normal(kq, (k, v)) * 1.5  # related but different
    return probs(pl, sp), probs(ql, sp)


SAMPLING = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, top_k=6, top_p=0.9),
]


@pytest.mark.parametrize("sp", SAMPLING, ids=lambda s: f"T{s.temperature}-k{s.top_k}-p{s.top_p}")
def test_rejection_sampling_emits_target_distribution(sp):
    p, q = _random_pq(1, sp)
    # 5 sigma per cell over ~30 cells: a false alarm has probability ~1e-5.
    assert emitted_token_check(rejection_sample, p, q) < 5.0


def test_deterministic_draft_one_hot_q():
    sp = SamplingParams(temperature=1.0)
    p, _ = _random_pq(2, sp)
    q = jax.nn.one_hot(jnp.asarray([3, 1, 4]), 8)  # an n-gram-like fixed proposal
    assert emitted_token_check(rejection_sample, p, q) < 5.0


def test_the_check_catches_a_biased_rule():
    sp = SamplingParams(temperature=1.0)
    p, q = _random_pq(1, sp)
    assert emitted_token_check(biased_rejection_sample, p, q) > 8.0


def test_expected_accepted_length_formula():
    from jspec.speculative.acceptance import expected_accepted_length

    assert expected_accepted_length(0.0, 4) == 1.0
    assert expected_accepted_length(1.0, 4) == 5.0
    a, k = 0.6, 4
    assert abs(expected_accepted_length(a, k) - (1 - a ** (k + 1)) / (1 - a)) < 1e-12
