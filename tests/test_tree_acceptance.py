"""Acceptance on token trees: the greedy walk against a plain-Python walk, the chain as the tree
of width one (the same results as the chain's rules, draw for draw), and a statistical test that
recursive rejection over a tree emits the target's law, with a biased control it must catch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.config import SamplingParams
from jspec.sampling import probs
from jspec.speculative import tree as tree_lib
from jspec.speculative.acceptance import greedy_accept, rejection_sample
from jspec.speculative.tree import TokenTree, greedy_accept_tree, rejection_sample_tree


def _walk(tokens, parents, num, best):
    """The greedy rule in plain Python: from the root, follow the child equal to the argmax."""
    cur, path = -1, []
    while True:
        want = best[cur + 1]
        nxt = [i for i in range(num) if parents[i] == cur and tokens[i] == want]
        if not nxt:
            return path, want
        cur = nxt[0]
        path.append(cur)


def _random_tree(rng, n, v):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    return rng.integers(0, v, n), np.asarray(parents)


def test_greedy_walk_matches_plain_walk():
    rng = np.random.default_rng(0)
    b, n, v = 64, 9, 3  # a small vocabulary: many matches, paths of every length
    toks, pars, nums = zip(*[(*_random_tree(rng, n, v), rng.integers(0, n + 1)) for _ in range(b)])
    logits = rng.normal(size=(b, n + 1, v)).astype(np.float32)
    tree = TokenTree(jnp.asarray(np.stack(toks), jnp.int32), jnp.asarray(np.stack(pars), jnp.int32),
                     jnp.asarray(nums, jnp.int32))
    acc = jax.jit(greedy_accept_tree)(tree, jnp.asarray(logits))
    best = logits.argmax(-1)
    lengths = []
    for i in range(b):
        path, nxt = _walk(toks[i], pars[i], nums[i], best[i])
        assert int(acc.num_accepted[i]) == len(path)
        assert list(np.asarray(acc.path[i, :len(path)])) == path
        assert int(acc.next_token[i]) == nxt
        lengths.append(len(path))
    assert max(lengths) >= 2 and min(lengths) == 0  # the cases are not all trivial


def test_masks_and_positions_of_a_tree():
    # root -> a(0), b(1); a -> c(2); c -> d(3); b -> e(4)
    parents = jnp.asarray([[-1, -1, 0, 2, 1]], jnp.int32)
    assert tree_lib.row_positions(parents).tolist() == [[0, 1, 1, 2, 3, 2]]
    bits = tree_lib.ancestor_bits(parents)[0].tolist()
    assert bits == [0b1, 0b11, 0b101, 0b1011, 0b11011, 0b100101]
    chain = tree_lib.ancestor_bits(tree_lib.chain_parents(1, 4))[0].tolist()
    assert chain == [1, 3, 7, 15, 31]  # the causal mask
    full = tree_lib.ancestor_bits(tree_lib.chain_parents(1, 31))[0]
    assert int(full[31]) == -1  # all 32 bits
    with pytest.raises(ValueError, match="at most 31"):
        tree_lib.depths(jnp.zeros((1, 32), jnp.int32))


def test_chain_as_tree_equals_the_chain_rules():
    rng = np.random.default_rng(1)
    b, k, v = 3000, 4, 6
    drafts = jnp.asarray(rng.integers(0, v, (b, k)), jnp.int32)
    num = jnp.asarray(rng.integers(0, k + 1, b), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)) * 2, jnp.float32)
    n0, t0 = greedy_accept(drafts, logits, num)
    acc = greedy_accept_tree(tree_lib.chain(drafts, num), logits)
    assert (np.asarray(acc.num_accepted) == np.asarray(n0)).all() and (np.asarray(acc.next_token) == np.asarray(t0)).all()

    sp = SamplingParams(temperature=1.0)
    p = probs(logits, sp)
    q = probs(logits[:, :k] + jnp.asarray(rng.normal(size=(b, k, v)), jnp.float32), sp)
    keys = jax.random.split(jax.random.key(3), b)
    n1, t1 = rejection_sample(keys, drafts, q, p, num)
    acc = rejection_sample_tree(keys, tree_lib.chain(drafts, num), q, p)
    assert (np.asarray(acc.num_accepted) == np.asarray(n1)).mean() == 1.0
    assert (np.asarray(acc.next_token) == np.asarray(t1)).mean() > 0.999  # float rounding of the residual


V = 6


def _laws(seed):
    kp = jax.random.split(jax.random.key(seed), 4)
    sp = SamplingParams(temperature=1.0)
    p0 = probs(jax.random.normal(kp[0], (V,)) * 1.2, sp)  # the root's next token
    p1 = probs(jax.random.normal(kp[1], (V, V)) * 1.2, sp)  # after a first token x: p1[x]
    p2 = probs(jax.random.normal(kp[2], (V,)) * 1.2, sp)  # two tokens in (any): the third
    q = probs(jax.random.normal(kp[3], (2, V)) * 1.2, sp)  # the draft's laws at depth 1 and 2
    return p0, p1, p2, q


def _draw_trees(key, num, q, sampled):
    """Trees: root -> c0, c1 (depth 1), c0 -> g0, c1 -> g1 (depth 2). Sampled: every node drawn
    from q at its depth (c0, c1 independent: they may repeat). Deterministic: c0, c1 the two
    most likely tokens under q, g0, g1 the most likely at depth 2."""
    if sampled:
        k1, k2 = jax.random.split(key)
        c = jax.random.categorical(k1, jnp.log(q[0]), shape=(num, 2))
        g = jax.random.categorical(k2, jnp.log(q[1]), shape=(num, 2))
    else:
        top = jnp.argsort(-q[0])[:2]
        c = jnp.broadcast_to(top, (num, 2))
        g = jnp.broadcast_to(jnp.argsort(-q[1])[:1], (num, 2))
    toks = jnp.concatenate([c, g], axis=1).astype(jnp.int32)
    parents = jnp.broadcast_to(jnp.asarray([-1, -1, 0, 1], jnp.int32), (num, 4))
    return TokenTree(toks, parents, jnp.full((num,), 4, jnp.int32))


def biased_rejection_sample_tree(keys, tree, q, p):
    """A plausible but wrong rule: the walk is right, but the extra token comes from the target's
    distribution at the last accepted node instead of the residual its rejected children left."""
    acc = rejection_sample_tree(keys, tree, q, p)
    end = jnp.concatenate([jnp.zeros((p.shape[0], 1), jnp.int32), acc.path + 1], axis=1)
    row = jnp.take_along_axis(end, acc.num_accepted[:, None], axis=1)[:, 0]
    p_end = jnp.take_along_axis(p, row[:, None, None], axis=1)[:, 0]
    rk = jax.vmap(lambda kk: jax.random.split(kk)[1])(keys)
    return acc._replace(next_token=jax.vmap(lambda kk, pp: jax.random.categorical(kk, jnp.log(pp)))(rk, p_end))


def tree_law_check(rule, sampled, num=60000, seed=0):
    """Largest z-score of the emitted tokens against the target's law: the first token against
    p0, the second given the first (x) against p1[x], the third against p2, over every cell
    reached often enough. Also returns the share of steps that accepted at least one node and
    the share that rejected one."""
    p0, p1, p2, q = _laws(seed)
    kt, ka = jax.random.split(jax.random.key(seed + 100))
    tree = _draw_trees(kt, num, q, sampled)
    # the target's rows: root p0; c0, c1 -> p1[their token]; g0, g1 -> p2
    p = jnp.stack([jnp.broadcast_to(p0, (num, V)), p1[tree.tokens[:, 0]], p1[tree.tokens[:, 1]],
                   jnp.broadcast_to(p2, (num, V)), jnp.broadcast_to(p2, (num, V))], axis=1)
    qn = None if not sampled else jnp.stack([jnp.broadcast_to(q[0], (num, V))] * 2
                                             + [jnp.broadcast_to(q[1], (num, V))] * 2, axis=1)
    acc = jax.jit(rule)(jax.random.split(ka, num), tree, qn, p)
    emitted = np.asarray(tree_lib.path_tokens(tree, acc))
    n = np.asarray(acc.num_accepted)
    worst = 0.0

    def score(tokens, law):
        nonlocal worst
        if len(tokens) < 500:
            return
        freq = np.bincount(tokens, minlength=V) / len(tokens)
        law = np.asarray(law)
        z = np.abs(freq - law) / np.sqrt(np.maximum(law * (1 - law), 1e-12) / len(tokens))
        worst = max(worst, float(z.max()))

    score(emitted[:, 0], p0)
    for x in range(V):
        score(emitted[(n >= 1) & (emitted[:, 0] == x), 1], p1[x])
    score(emitted[n >= 2, 2], p2)
    return worst, float((n >= 1).mean()), float((n < 2).mean())


@pytest.mark.parametrize("sampled", [False, True], ids=["top-k candidates", "sampled nodes"])
def test_recursive_rejection_follows_the_target(sampled):
    worst, accepted, rejected = tree_law_check(rejection_sample_tree, sampled)
    assert accepted > 0.2 and rejected > 0.2  # drafts both accepted and rejected
    assert worst < 5.0


@pytest.mark.parametrize("sampled", [False, True], ids=["top-k candidates", "sampled nodes"])
def test_the_tree_check_catches_a_biased_rule(sampled):
    worst, _, _ = tree_law_check(biased_rejection_sample_tree, sampled)
    assert worst > 8.0
