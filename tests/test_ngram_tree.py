"""N-gram token trees: the continuations of several matches merged into a trie, verified in one
forward. The trie's shape on a hand-made text; greedy output token-identical to plain greedy;
sampled output following the target's exact law of the first two tokens where the root has
several deterministic children (each rejection removes its token from the residual)."""

import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import chi_square_check, exact_two_token_distribution, sampled_pair_counts, tiny_config, tiny_model
from jspec.config import SamplingParams, SpecConfig
from jspec.errors import ConfigError
from jspec.speculative.drafters import NgramDrafter, make_drafter
from jspec.speculative.drafters.ngram import ngram_trie_propose

# "1 2 3" ends at positions 3, 8 and 13, followed by 4 9 1, 5 8 1 and 4 7 6; the text ends in "1 2 3"
TEXT = [1, 2, 3, 4, 9, 1, 2, 3, 5, 8, 1, 2, 3, 4, 7, 6, 1, 2, 3]


def _trie(text, nodes, width, depth, n_max=3, n_min=1, pad=13):
    buf = jnp.asarray(list(text) + [0] * pad, jnp.int32)
    t, p, n = ngram_trie_propose(buf, jnp.int32(len(text)), nodes, width, depth, n_max, n_min)
    n = int(n)
    return list(np.asarray(t)[:n]), list(np.asarray(p)[:n])


def test_the_trie_merges_shared_prefixes_latest_match_first():
    # the latest match's chain 4 7 6, then 5 8 1 beside it, then 9 1 under the shared 4
    assert _trie(TEXT, 8, 3, 3) == ([4, 7, 6, 5, 8, 1, 9, 1], [-1, 0, 1, -1, 3, 4, 0, 6])
    # a budget keeps the first nodes (parents first, so no orphan)
    assert _trie(TEXT, 5, 3, 3) == ([4, 7, 6, 5, 8], [-1, 0, 1, -1, 3])
    # one match: a chain; the depth caps each continuation
    assert _trie(TEXT, 8, 1, 2) == ([4, 7], [-1, 0])
    # a continuation is cut at the end of the text: the one earlier "3" is followed by 1 2 3, the end
    assert _trie([5, 3, 1, 2, 3], 8, 2, 4, n_max=1) == ([1, 2, 3], [-1, 0, 1])
    # nothing matches: no nodes
    assert _trie([1, 2, 3, 4], 8, 3, 3) == ([], [])


def test_a_trie_of_identical_continuations_is_one_chain():
    assert _trie([7, 8, 9, 7, 8, 9, 7, 8, 9, 7], 8, 3, 3, n_max=1) == ([8, 9, 7], [-1, 0, 1])


def test_spec_config_builds_the_trie_drafter():
    spec = SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "tree": {"max_nodes": 12, "max_width": 3}})
    drafter, _ = make_drafter(spec, None)
    assert drafter == NgramDrafter(12, spec.ngram_max, spec.ngram_min, tree_width=3, tree_depth=4)
    with pytest.raises(ConfigError, match="drop ngram_history"):
        SpecConfig("ngram", num_speculative_tokens=4, ngram_history=64, tree_nodes=8, tree_width=2)


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 6, 5, 1, 2], [3, 4, 3, 5, 3, 6, 3], [9, 1], [5, 5, 5, 5, 5, 5, 5, 5, 11, 5]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(vocab_size=12, num_layers=4), seed=1, scale=2.0)


def test_greedy_trie_equals_plain_greedy(target):
    want = jspec.generate(target, PROMPTS, GREEDY).token_ids
    spec = SpecConfig("ngram", num_speculative_tokens=4, tree_nodes=10, tree_width=3)
    out = jspec.generate(target, PROMPTS, GREEDY, spec=spec)
    assert out.token_ids == want
    assert out.accepted_counts[1] > 0  # paths of two nodes or more


SAMPLED = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
SAMPLED_PROMPT = [3, 4, 3, 5, 3, 6, 3]  # "3" was followed by 4, 5 and 6: three children of the root


def test_sampled_trie_follows_the_target():
    small = tiny_model(tiny_config(vocab_size=12, num_layers=2), seed=1, scale=2.0)
    exact = exact_two_token_distribution(small, SAMPLED_PROMPT, SAMPLED)
    drafter = NgramDrafter(6, 2, 1, tree_width=3, tree_depth=2)
    counts, accepted, proposed = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, 4000, drafter)
    assert 0 < accepted < proposed, (accepted, proposed)
    stat, threshold = chi_square_check(counts, exact)
    assert stat < threshold, (stat, threshold)
