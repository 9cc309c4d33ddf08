"""Acceptance with fewer real drafts than k, as n-gram lookup produces: ``num_drafts`` in
{0, 1, k - 1} varying per row of one batch, with one-hot q (deterministic drafters) and soft q
(model drafters). Positions past ``num_drafts`` hold drafts and q that a drafter left there
(here: the target's favourite token, so that a missing mask is as visible as it can be).

Mutations each test was seen to fail on (applied to jspec/speculative/acceptance.py, then
reverted):
  M1  drop ``q = jnp.where(real[..., None], q, 0.0)`` in rejection_sample (the issue's
      example: the bonus token at n == num_drafts is drawn from max(p - q_garbage, 0));
  M2  drop ``& real`` from ``accept`` in rejection_sample (drafts past num_drafts accepted);
  M3  drop ``& _real(drafts, num_drafts)`` in greedy_accept.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.config import SamplingParams
from jspec.sampling import probs
from jspec.speculative.acceptance import greedy_accept, rejection_sample

K, V = 4, 8
NUM_DRAFTS = (0, 1, K - 1)


def _pq(seed: int):
    kp, kq = jax.random.split(jax.random.key(seed))
    sp = SamplingParams(temperature=1.0)
    pl = jax.random.normal(kp, (K + 1, V)) * 1.5
    ql = pl[:K] + jax.random.normal(kq, (K, V)) * 1.5
    return np.asarray(probs(pl, sp), np.float64), np.asarray(probs(ql, sp), np.float64)


def _batch(p, q, one_hot: bool, rows: int, seed: int):
    """(drafts [N, K], q [N, K, V], num_drafts [N]): real drafts drawn from q (or fixed one-hot
    proposals); past num_drafts, the slot holds argmax p_j with q concentrated on it."""
    rng = np.random.default_rng(seed)
    m = rng.choice(NUM_DRAFTS, rows)
    fav = p[:K].argmax(-1)  # [K] the target's favourite token per position
    garbage_q = np.eye(V)[fav] if one_hot else 0.2 / V + 0.8 * np.eye(V)[fav]
    if one_hot:
        fixed = np.array([3, 1, 4, 1])[:K]  # an n-gram-like fixed proposal
        real_d, real_q = np.broadcast_to(fixed, (rows, K)), np.eye(V)[fixed]
    else:
        cum = q.cumsum(-1)
        real_d = np.stack([np.searchsorted(cum[j], rng.random(rows), side="right") for j in range(K)], 1)
        real_d = np.minimum(real_d, V - 1)
        real_q = q
    real = np.arange(K)[None, :] < m[:, None]
    drafts = np.where(real, real_d, fav[None, :])
    qs = np.where(real[..., None], real_q[None], garbage_q[None])
    return drafts.astype(np.int32), qs.astype(np.float32), m.astype(np.int32)


def max_z(n, nxt, drafts, m, p) -> float:
    """Largest z-score, over (num_drafts group, position j <= num_drafts, token), of the emitted
    token j (an accepted draft when n > j, else the extra token) against p_j."""
    worst = 0.0
    for g in NUM_DRAFTS:
        rows = m == g
        for j in range(g + 1):
            reach = rows & (n >= j)
            count = int(reach.sum())
            if count < 500:
                continue
            tok = np.where(n[reach] > j, drafts[reach, min(j, K - 1)], nxt[reach])
            freq = np.bincount(tok, minlength=V) / count
            sigma = np.sqrt(np.maximum(p[j] * (1 - p[j]), 1e-12) / count)
            z = np.abs(freq - p[j]) / sigma
            z[(p[j] == 0) & (freq == 0)] = 0.0
            worst = max(worst, float(z.max()))
    return worst


def _run(rule, one_hot: bool, rows: int = 48000, seed: int = 0):
    p, q = _pq(seed)
    drafts, qs, m = _batch(p, q, one_hot, rows, seed)
    keys = jax.random.split(jax.random.key(seed + 100), rows)
    pb = jnp.broadcast_to(jnp.asarray(p, jnp.float32), (rows, K + 1, V))
    n, nxt = jax.jit(rule)(keys, jnp.asarray(drafts), jnp.asarray(qs), pb, jnp.asarray(m))
    return np.asarray(n), np.asarray(nxt), drafts, m, p


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot q", "soft q"])
def test_rejection_sampling_with_num_drafts_varying_per_row(one_hot):
    """Never more accepted than proposed, and every emitted token distributed as p (5 sigma per
    cell over ~100 cells: a false alarm has probability ~1e-4). Fails on M1 and M2."""
    n, nxt, drafts, m, p = _run(rejection_sample, one_hot)
    assert (n <= m).all(), "a draft past num_drafts was accepted"
    for g in NUM_DRAFTS:  # the batch exercised every group, including partial acceptance
        assert (m == g).sum() > 10000
    assert ((n > 0) & (n < m)).any()
    assert max_z(n, nxt, drafts, m, p) < 5.0


def rejection_sample_unmasked(keys, drafts, q, p, num_drafts):
    """A biased control: rejection_sample without the mask that zeroes q past num_drafts (M1)."""
    b, k = drafts.shape
    real = jnp.arange(k)[None, :] < num_drafts[:, None]
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u_keys, r_keys = jax.vmap(lambda kk: tuple(jax.random.split(kk)))(keys)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(u_keys)
    n = jnp.sum(jnp.cumprod(((u * q_d < p_d) & real).astype(jnp.int32), axis=1), axis=1)
    q_pad = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
    logp = jnp.where(residual > 0, jnp.log(jnp.maximum(residual, 1e-38)), -jnp.inf)
    return n.astype(jnp.int32), jax.vmap(jax.random.categorical)(r_keys, logp).astype(jnp.int32)


@pytest.mark.parametrize("one_hot", [True, False], ids=["one-hot q", "soft q"])
def test_the_check_catches_a_missing_mask(one_hot):
    n, nxt, drafts, m, p = _run(rejection_sample_unmasked, one_hot)
    assert max_z(n, nxt, drafts, m, p) > 8.0


def _onehot_logits(rows):
    return jnp.asarray(np.eye(V)[rows] * 5.0)


GREEDY_CASES = [  # drafts, target argmax per position, num_drafts -> accepted, next token
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 4, 4, 5),  # all real and accepted: bonus
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 0, 0, 1),  # no real draft: the target's own token
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 1, 1, 2),  # one real draft accepted, then the bonus at 1
    ([1, 2, 3, 4], [1, 2, 3, 4, 5], 3, 3, 4),  # k - 1 real drafts
    ([1, 2, 0, 0], [1, 2, 3, 4, 5], 2, 2, 3),  # padding past num_drafts never compared
    ([1, 7, 3, 4], [1, 2, 3, 4, 5], 3, 1, 2),  # a rejection inside the real drafts
]


@pytest.mark.parametrize("drafts,target,num,n,nxt", GREEDY_CASES)
def test_greedy_with_num_drafts_table(drafts, target, num, n, nxt):
    """One row per case, and all cases as one batch (num_drafts varying per row). Fails on M3."""
    got_n, got_next = greedy_accept(jnp.asarray([drafts], jnp.int32), _onehot_logits([target]),
                                    jnp.asarray([num], jnp.int32))
    assert (int(got_n[0]), int(got_next[0])) == (n, nxt)


def test_greedy_with_num_drafts_batched():
    table = GREEDY_CASES
    drafts = jnp.asarray([c[0] for c in table], jnp.int32)
    logits = _onehot_logits([c[1] for c in table])
    num = jnp.asarray([c[2] for c in table], jnp.int32)
    got_n, got_next = greedy_accept(drafts, logits, num)
    assert [int(x) for x in got_n] == [c[3] for c in table]
    assert [int(x) for x in got_next] == [c[4] for c in table]
