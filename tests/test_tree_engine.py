"""Token trees end to end: the EAGLE head drafts EAGLE-2 trees (a draft model by the same top-k
expansion), the target verifies them in one forward, and the output is the target's: greedy
token-identical to plain greedy (with trees that branch, accepted paths longer than one, and the
K/V of accepted side branches moved into place), sampled following the target's exact law of the
first two tokens; dynamic k chooses between a tree and its chains."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import (chi_square_check, eagle_params, exact_two_token_distribution, sampled_pair_counts, tiny_config,
                     tiny_model)
from jspec.config import SamplingParams
from jspec.speculative.drafters.draft_model import DraftModelDrafter
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [3, 4, 3, 4, 3], [9, 1], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 11]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(vocab_size=12, num_layers=4), seed=1, scale=2.0)


def _tree_drafter(cfg, nodes=8, depth=3, width=3):
    return EagleDrafter(nodes, cfg, tree_depth=depth, tree_width=width)


@pytest.mark.parametrize("nodes, depth, width", [(8, 3, 3), (4, 4, 1), (12, 4, 4), (8, 3, 1)])  # (8, 3, 1): 3 candidates for 8 nodes
def test_greedy_tree_equals_plain_greedy(target, nodes, depth, width):
    want = jspec.generate(target, PROMPTS, GREEDY).token_ids
    out = jspec.generate(target, PROMPTS, GREEDY, drafter=_tree_drafter(target.config, nodes, depth, width),
                         drafter_params=eagle_params(target))
    assert out.token_ids == want
    assert out.accepted_counts[0] > 0  # drafts were accepted
    if width > 1:
        assert out.accepted_counts[1] > 0  # paths of two nodes or more


def test_without_moving_the_accepted_path_the_output_breaks(target, monkeypatch):
    """The check above has power: with the accepted nodes' K/V left where the tree put them, a
    path through a side branch leaves the wrong K/V at a committed position."""
    from jspec.speculative import steps

    want = jspec.generate(target, PROMPTS, GREEDY).token_ids
    monkeypatch.setattr(steps, "move_positions", lambda cache, src, dst, count: cache)
    jax.clear_caches()  # trace the step again, without the move
    out = jspec.generate(target, PROMPTS, GREEDY, drafter=_tree_drafter(target.config, 12, 4, 4),
                         drafter_params=eagle_params(target))
    jax.clear_caches()
    assert out.token_ids != want


def test_move_positions_moves_only_the_named_positions():
    from jspec.cache import init_cache
    from jspec.cache.paged import move_positions

    rng = np.random.default_rng(0)
    tables = jnp.asarray([[5, 2, 7], [1, 0, 6]], jnp.int32)  # shuffled pages, 4 slots each
    cache = init_cache(2, 2, 4, tables, 8, 4)
    poison = lambda shape: jnp.asarray(np.where(rng.random(shape) < 0.3, np.nan, rng.normal(size=shape)), jnp.float32)  # noqa: E731
    cache = cache.replace(k_pages=tuple(poison(p.shape) for p in cache.k_pages),
                          v_pages=tuple(poison(p.shape) for p in cache.v_pages))
    src = jnp.asarray([[7, 9, 10], [3, 4, 0]], jnp.int32)
    dst = jnp.asarray([[5, 6, 7], [2, 3, 0]], jnp.int32)
    count = jnp.asarray([3, 1], jnp.int32)
    moved = move_positions(cache, src, dst, count)

    def at(pages, b, pos):
        return np.asarray(pages[:, tables[b, pos // 4], pos % 4])

    for layer in range(2):
        for before, after in ((cache.k_pages[layer], moved.k_pages[layer]), (cache.v_pages[layer], moved.v_pages[layer])):
            expect = np.asarray(before).copy()
            for b in range(2):
                for j in range(int(count[b])):
                    s, d = int(src[b, j]), int(dst[b, j])
                    expect[:, int(tables[b, d // 4]), d % 4] = at(before, b, s)  # reads come before writes
            np.testing.assert_array_equal(np.asarray(after), expect)  # NaN where NaN, nothing else moved


def test_greedy_hybrid_tree_equals_plain_greedy(target):
    """Lookup chains where the context repeats, the head's trees elsewhere, in the same steps."""
    want = jspec.generate(target, PROMPTS, GREEDY).token_ids
    drafter = HybridDrafter(8, _tree_drafter(target.config, 8, 3, 3), n_max=3, n_min=2)
    out = jspec.generate(target, PROMPTS, GREEDY, drafter=drafter, drafter_params=eagle_params(target))
    assert out.token_ids == want
    assert out.accepted_counts[1] > 0


def test_engine_stats_count_tokens_and_nodes_per_verification(target):
    """The numbers `jspec generate` and /metrics report for trees: the tokens a verification
    emits and the nodes it scores, from the engine's totals."""
    engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=4, max_model_len=64),
                             drafter=_tree_drafter(target.config, 12, 4, 4), drafter_params=eagle_params(target))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    for _ in engine.step_until_done():
        pass
    s = engine.stats
    assert s.num_drafts > 0
    assert s.accepted_per_verification == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert 1 < s.accepted_per_verification <= 5  # at most the tree's depth + 1
    assert s.draft_tokens_per_verification == pytest.approx(12)  # every verification scores the whole tree


SAMPLED = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
SAMPLED_PROMPT = [3, 4, 3, 4, 3]


def test_sampled_tree_follows_the_target():
    small = tiny_model(tiny_config(vocab_size=12, num_layers=2), seed=1, scale=2.0)
    exact = exact_two_token_distribution(small, SAMPLED_PROMPT, SAMPLED)
    counts, accepted, proposed = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, 4000,
                                                     _tree_drafter(small.config, 6, 2, 3), eagle_params(small))
    assert 0 < accepted < proposed, (accepted, proposed)
    stat, threshold = chi_square_check(counts, exact)
    assert stat < threshold, (stat, threshold)


def _draft_model_tree(target, nodes, depth, width, vocab=None):
    """A draft model drafting trees: the target's first layer, its final norm and head (partly
    right, partly wrong); with ``vocab`` its LM head covers only those tokens."""
    from jspec.models.llama import output_embedding

    config = dataclasses.replace(target.config, num_layers=1)
    params = {k: v for k, v in target.params.items() if not k.startswith("layers_") or k == "layers_0"}
    drafter = DraftModelDrafter(nodes, config, tree_depth=depth, tree_width=width, draft_vocab=vocab is not None)
    if vocab is None:
        return drafter, params
    ids = jnp.asarray(vocab, jnp.int32)
    return drafter, {"model": params, "lm_head": jnp.take(output_embedding(params, config), ids, 0), "vocab_ids": ids}


@pytest.mark.parametrize("nodes, depth, width, vocab", [(8, 3, 3, None), (12, 4, 4, None), (4, 2, 4, None),
                                                        (6, 3, 2, (0, 1, 3, 4, 5, 7, 9))])
def test_greedy_draft_model_tree_equals_plain_greedy(target, nodes, depth, width, vocab):
    """Trees of a draft model (feeding the accepted path back, up to depth + 1 tokens, before the
    next tree): branching, paths longer than one, a draft vocabulary."""
    want = jspec.generate(target, PROMPTS, GREEDY).token_ids
    drafter, params = _draft_model_tree(target, nodes, depth, width, vocab)
    out = jspec.generate(target, PROMPTS, GREEDY, drafter=drafter, drafter_params=params)
    assert out.token_ids == want
    assert out.accepted_counts[1] > 0 and out.accepted_counts[0] < out.proposed_counts[0]


def test_draft_model_trees_beat_its_chain_per_verification(target):
    """The same draft model, 12 nodes against a chain of 4: more tokens per verification."""
    per = {}
    _, params = _draft_model_tree(target, 1, 1, 1)
    chain = DraftModelDrafter(4, dataclasses.replace(target.config, num_layers=1))
    for name, drafter in {"chain": chain, "tree": _draft_model_tree(target, 12, 4, 3)[0]}.items():
        engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=4, max_model_len=64), drafter=drafter,
                                 drafter_params=params)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, GREEDY)
        for _ in engine.step_until_done():
            pass
        per[name] = engine.stats.accepted_per_verification
    assert per["tree"] > per["chain"], per


def test_a_tree_buffer_stays_within_a_verifications_rows():
    """Expanding D levels W wide writes (D - 1) W drafter rows after the prefix, where the
    engine reserves the nodes + 1 rows of a verification: the depth is cut to fit."""
    from jspec.config import tree_buffer_depth

    assert tree_buffer_depth(16, 4, 4) == 4  # 12 rows of 17
    assert tree_buffer_depth(4, 4, 4) == 2  # 4 rows of 5; depth 4 would write 12
    assert tree_buffer_depth(8, 3, 5) == 4  # 9 rows of 9
    assert tree_buffer_depth(2, 4, 3) == 1  # the root's children only
    spec = jspec.SpecConfig("eagle", num_speculative_tokens=4, draft="x", tree_nodes=4, tree_width=4)
    assert spec.tree_depth == 2 and dataclasses.replace(spec, tree_nodes=16).tree_depth == 4


def test_sampled_draft_model_tree_follows_the_target():
    small = tiny_model(tiny_config(vocab_size=12, num_layers=2), seed=1, scale=2.0)
    exact = exact_two_token_distribution(small, SAMPLED_PROMPT, SAMPLED)
    drafter, params = _draft_model_tree(small, 6, 2, 3)
    counts, accepted, proposed = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, 4000, drafter, params)
    assert 0 < accepted < proposed, (accepted, proposed)
    stat, threshold = chi_square_check(counts, exact)
    assert stat < threshold, (stat, threshold)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_dynamic_k_chooses_among_the_tree_and_its_chains_losslessly(target, kind):
    """With a tree budget, dynamic k's arms are the tree, chains up to its depth and no
    speculation; switching between them (a draft model feeding a tree's accepted path before a
    chain) keeps greedy output the target's, and tree steps are counted apart from chain steps."""
    spec = jspec.SpecConfig("ngram", 4, ngram_min=1, dynamic_k=True, tree_nodes=8, tree_width=2)
    drafter, params = _draft_model_tree(target, 8, 4, 2) if kind == "draft" else (None, None)
    engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=4, max_model_len=64, max_burst_steps=2), spec,
                             drafter=drafter, drafter_params=params)
    assert engine.cost.candidates == (0, 1, 2, 4, 8) and engine.tree_depth == 4
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)]
    for _ in engine.step_until_done():
        pass
    assert [r.output_ids for r in reqs] == jspec.generate(target, PROMPTS, GREEDY).token_ids
    most = max(engine.costs, key=lambda n: engine.stats.bursts_by_slots[n])
    assert all(t is not None for t in engine.costs[most].step_seconds.values())  # every arm ran
    assert sum(r.tree_steps for r in reqs) > 0 and sum(sum(r.eligible_per_pos) for r in reqs) > 0
    assert engine.tree_acceptance.steps > 0 and sum(engine.tree_acceptance.accepted) > 0
    for r in reqs:  # a chain position's counters hold the chain steps' only
        assert all(0 <= a <= e for a, e in zip(r.chain_accepted_per_pos(), r.eligible_per_pos))


def test_a_draft_model_chain_after_its_tree_has_seen_the_accepted_path(target):
    """The draft model is the target itself, so a drafter that follows the committed text has
    every draft accepted. Bursts alternate trees and chains (as dynamic k may); a chain after a
    tree must first feed the tree's whole accepted path (up to depth + 1 tokens): fed two, its
    K/V would miss some and its drafts go wrong."""
    import itertools

    spec = jspec.SpecConfig("ngram", 4, ngram_min=1, dynamic_k=True, tree_nodes=8, tree_width=2)
    drafter = DraftModelDrafter(8, target.config, tree_depth=4, tree_width=2)
    engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=4, max_model_len=96, max_burst_steps=1), spec,
                             drafter=drafter, drafter_params=target.params)
    arms = itertools.cycle([8, 4, 8, 2, 8, 1, 8, 0])
    engine._choose_k = lambda: next(arms)
    long = dataclasses.replace(GREEDY, max_tokens=48)
    reqs = [engine.add_request(str(i), p, long) for i, p in enumerate(PROMPTS)]
    for _ in engine.step_until_done():
        pass
    assert [r.output_ids for r in reqs] == jspec.generate(target, PROMPTS, long).token_ids
    assert sum(r.tree_steps for r in reqs) > 0 and sum(r.eligible_per_pos[0] for r in reqs) > 0
    for r in reqs:
        assert r.chain_accepted_per_pos()[:4] == r.eligible_per_pos[:4], r.eligible_per_pos
