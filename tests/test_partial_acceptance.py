"""Speculative tests that can fail, end to end through the engine.

Greedy equality alone cannot see a useless drafter (one that is never accepted is trivially
lossless), and a sampled check without a biased control cannot show it has power. So:

* every drafter runs with acceptance held strictly between "never" and "always" (n-gram lookup on
  prompts with repeats; layer skipping; a draft made of the target's weights plus noise; an EAGLE
  head built from the target's own layer) and the test asserts that partial acceptance happened
  (0 < accepted < proposed, and 30-70% for the noisy draft, whose noise sets it) before it
  asserts greedy equality. Mutation shown failing: ``greedy_accept`` returning ``n + 1``
  accepted (one rejected draft kept) breaks equality here; no drafter of the older sweep noticed
  because none was ever partially accepted.
* the sampled law of the first two tokens under every drafter passes a chi-square test against
  the target's exact law, and the same check rejects a sampler whose residual after a rejection
  is ``p`` instead of ``norm(max(p - q, 0))`` (the biased control: the check has power).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jspec
from helpers import (chi_square_check, eagle_params, exact_two_token_distribution, sampled_pair_counts, tiny_config,
                     tiny_model)
from jspec.speculative import acceptance, steps
from jspec.speculative.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
from jspec.speculative.drafters.eagle import EagleDrafter

# A 12-token vocabulary: greedy continuations fall into cycles, so n-gram lookup and imperfect
# drafts are right some of the time and wrong some of the time.
PROMPTS = [[5, 9, 3, 11, 2, 4, 8, 5, 9, 3, 11], [6, 7, 8, 9, 10, 6, 7, 8], [3, 1, 3, 2, 3, 4]]
SP = jspec.SamplingParams(max_tokens=32, ignore_eos=True)


def noisy(model, sigma: float, seed: int):
    """The model's weights plus Gaussian noise of ``sigma`` times each matrix's own spread."""
    leaves, tree = jax.tree_util.tree_flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = [p + sigma * jnp.std(p) * jax.random.normal(k, p.shape, p.dtype) if p.ndim > 1 else p
           for p, k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, out)


def make_drafters(model, k: int, sigma: float):
    cfg = model.config
    return {
        "ngram": (NgramDrafter(k, 3, 1), None),
        "layerskip": (LayerSkipDrafter(k, cfg, cfg.num_layers // 2), None),
        "noisy-draft": (DraftModelDrafter(k, cfg), noisy(model, sigma, seed=11)),
        "eagle": (EagleDrafter(k, cfg), eagle_params(model)),
    }


# ---------------------------------------------------------------------------------- greedy


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(vocab_size=12, num_layers=4), seed=1, scale=2.0)


@pytest.fixture(scope="module")
def baseline(target):
    return jspec.generate(target, PROMPTS, SP).token_ids


@pytest.mark.parametrize("name", ["ngram", "layerskip", "noisy-draft", "eagle"])
def test_partial_acceptance_is_lossless(target, baseline, name):
    d, dp = make_drafters(target, 3, sigma=0.03)[name]
    out = jspec.generate(target, PROMPTS, SP, drafter=d, drafter_params=dp)
    accepted, proposed = sum(out.accepted_counts), sum(out.proposed_counts)
    assert 0 < accepted < proposed, (name, accepted, proposed)  # rollback really happened
    if name == "noisy-draft":  # the tunable one: about half its drafts are accepted (61 of 120)
        assert 0.3 <= accepted / proposed <= 0.7, (name, accepted, proposed)
    assert out.token_ids == baseline, name


# ---------------------------------------------------------------------------------- sampled

SAMPLED = jspec.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
SAMPLED_PROMPT = [3, 4, 3, 4, 3]  # repeats, so n-gram lookup proposes after the first token
N = 4000


@pytest.fixture(scope="module")
def small():
    """A 12-token vocabulary, so the joint law of two tokens (144 cells) can be enumerated."""
    return tiny_model(tiny_config(vocab_size=12, num_layers=2), seed=1, scale=2.0)


@pytest.fixture(scope="module")
def exact(small):
    return exact_two_token_distribution(small, SAMPLED_PROMPT, SAMPLED)


@pytest.mark.parametrize("name", ["ngram", "layerskip", "noisy-draft", "eagle"])
def test_sampled_output_follows_the_target_for_every_drafter(small, exact, name):
    d, dp = make_drafters(small, 2, sigma=1.0)[name]
    counts, accepted, proposed = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, N, d, dp)
    assert 0 < accepted < proposed, name  # drafts were judged, both ways
    stat, threshold = chi_square_check(counts, exact)
    assert stat < threshold, (name, stat, threshold)


def _residual_is_p(keys, drafts, q, p, num_drafts=None):
    """rejection_sample with a classic bug: after a rejection the extra token comes from p."""
    n, _ = acceptance.rejection_sample(keys, drafts, q, p, num_drafts)
    r_keys = jax.vmap(lambda kk: jax.random.split(kk)[1])(keys)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
    return n, jax.vmap(acceptance.sample_from_probs)(r_keys, p_n)


@pytest.mark.parametrize("name", ["ngram", "noisy-draft"])
def test_the_check_catches_a_biased_sampler(small, exact, name, monkeypatch):
    """The same check, with the residual replaced by p, must fail: the test has power."""
    monkeypatch.setattr(steps, "rejection_sample", _residual_is_p)
    jax.clear_caches()  # the steps are traced again with the biased sampler
    try:
        d, dp = make_drafters(small, 2, sigma=1.0)[name]
        counts, _, _ = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, N, d, dp)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    stat, threshold = chi_square_check(counts, exact)
    assert stat > threshold, (name, stat, threshold)


# ---------------------------------------------------------------------------------- front door


@pytest.mark.parametrize("prompts, kw, error, match", [
    ([], {}, jspec.PromptError, "no prompts"),
    ([[1.5]], {}, jspec.PromptError, "integers"),
    ([[True]], {}, jspec.PromptError, "integers"),
    ([[2**40]], {}, jspec.PromptError, "outside"),
    ([[3, 12]], {}, jspec.PromptError, "outside"),
    ([None], {}, jspec.PromptError, "string or a list"),
    ("a text prompt", {}, jspec.ConfigError, "tokenizer"),  # a string is one prompt: it needs a tokenizer
    ([[3]], dict(seeds=[2**70]), jspec.ConfigError, "seed"),
    ([[3]], dict(seeds=[-1]), jspec.ConfigError, "seed"),
    ([[3]], dict(seeds=[1, 2]), jspec.ConfigError, "seeds"),
], ids=["empty", "float", "bool", "huge-id", "id-past-vocab", "none", "text-without-tokenizer", "seed-2^70",
        "negative-seed", "seed-count"])
def test_generate_refuses_bad_prompts_with_typed_errors(target, prompts, kw, error, match):
    with pytest.raises(error, match=match):
        jspec.generate(target, prompts, jspec.SamplingParams(max_tokens=2), **kw)
