"""Hybrid drafting (n-gram lookup where the context has a match, the EAGLE head elsewhere).

* ``propose`` row by row: a row with a match gets the lookup's drafts, ``num_drafts`` and one-hot
  logits; a row without gets the head's drafts and logits, k of them; the state is the head's.
* one-hot logits give exactly the q of a deterministic drafter, for every sampling setting.
* end to end, with both sources seen in use (a counting subclass reports which rows took which):
  greedy output equals plain greedy output, and the sampled joint law of the first two tokens
  passes the chi-square check against the target's exact law (which fails, 7936 against a
  threshold of 90, when lookup rows keep the head's logits as q: the check has power here).

On the real model, ``--spec hybrid:smollm2-135m-eagle`` greedy was checked by hand against plain
greedy (32 tokens, equal); at ~3.5 minutes on 2 loaded cores it is no test here.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import (chi_square_check, eagle_params, exact_two_token_distribution, sampled_pair_counts, tiny_config,
                     tiny_model)
from jspec.cache import init_cache
from jspec.config import SpecConfig
from jspec.errors import ConfigError
from jspec.sampling import RowSampling, probs
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter, one_hot_logits
from jspec.speculative.state import DecodeState


SOURCES = {"ngram": 0, "head": 0}


def _record(ngram_rows, head_rows):
    SOURCES["ngram"] += int(ngram_rows)
    SOURCES["head"] += int(head_rows)


@dataclasses.dataclass(frozen=True)
class CountingHybrid(HybridDrafter):
    """The hybrid drafter, reporting to SOURCES how many running rows took each source per step."""

    def propose(self, drafter_params, target_params, state, sampling):
        prop = super().propose(drafter_params, target_params, state, sampling)
        use = self.lookup.propose(None, target_params, state, sampling).num_drafts > 0
        running = ~state.done
        jax.debug.callback(_record, jnp.sum(use & running), jnp.sum(~use & running))
        return prop


def _reset():
    SOURCES.update(ngram=0, head=0)


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(vocab_size=12, num_layers=4), seed=1, scale=2.0)


@pytest.fixture(scope="module")
def head_params(target):
    return eagle_params(target)


# ---------------------------------------------------------------------------------- propose


def _state(cfg, rows, head, dparams, params, k):
    """A DecodeState over committed ``rows`` (every slot running), caches sized for them."""
    b, size, ps = len(rows), 16, 8
    tokens = np.zeros((b, size), np.int32)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    seq = jnp.asarray([len(r) for r in rows], jnp.int32)
    pages = size // ps
    tables = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, b * pages, ps, lengths=seq - 1)
    d = head.init_state(params, dparams, cache)
    d = dataclasses.replace(d, lengths=seq - 1,
                            last_feature=jax.random.normal(jax.random.key(0), d.last_feature.shape))
    return DecodeState(
        tokens=jnp.asarray(tokens), seq_lens=seq, max_lens=jnp.full((b,), size, jnp.int32),
        done=jnp.zeros((b,), bool), eos_hit=jnp.zeros((b,), bool), ignore_eos=jnp.ones((b,), bool),
        key_data=jnp.zeros((b, 2), jnp.uint32), sampling=RowSampling.broadcast(jspec.SamplingParams(), (b,)),
        spec_k=jnp.full((b,), k, jnp.int32), cache=cache, drafter=d, num_steps=jnp.zeros((b,), jnp.int32),
        num_drafts=jnp.zeros((b,), jnp.int32), accepted=jnp.zeros((b, k), jnp.int32),
        proposed=jnp.zeros((b, k), jnp.int32), steps=jnp.int32(0))


def test_propose_takes_lookup_drafts_where_there_is_a_match_and_the_heads_elsewhere(target, head_params):
    cfg, k = target.config, 3
    head = EagleDrafter(k, cfg)
    hybrid = HybridDrafter(k, head, n_max=3, n_min=1)
    # a full match, a match cut at the committed text (2 < k drafts), no match at all
    rows = [[5, 6, 7, 5, 6], [1, 2, 1], [1, 2, 3, 4]]
    state = _state(cfg, rows, head, head_params, target.params, k)
    sp = jspec.SamplingParams()
    got = jax.jit(hybrid.propose, static_argnums=3)(head_params, target.params, state, sp)
    ref = jax.jit(head.propose, static_argnums=3)(head_params, target.params, state, sp)

    assert np.asarray(got.num_drafts).tolist() == [3, 2, k]
    drafts, logits = np.asarray(got.drafts), np.asarray(got.draft_logits)
    assert drafts[0].tolist() == [7, 5, 6] and drafts[1, :2].tolist() == [2, 1]
    for row in (0, 1):  # lookup rows: logits 0 at the drafted token, -inf elsewhere
        want = np.where(np.arange(cfg.vocab_size)[None, :] == drafts[row][:, None], 0.0, -np.inf)
        np.testing.assert_array_equal(logits[row], want)
    np.testing.assert_array_equal(drafts[2], np.asarray(ref.drafts)[2])  # the head's row, unchanged
    np.testing.assert_array_equal(logits[2], np.asarray(ref.draft_logits)[2])
    # the state is the head's after its chain, whichever rows used it
    chex.assert_trees_all_equal(got.drafter_state, ref.drafter_state)


def test_head_k_caps_the_heads_drafts_not_the_lookups(target, head_params):
    """``head_k``: a row without a match gets the head's first head_k drafts (a head of k =
    head_k: its chain is that long), a row with one still gets up to k lookup drafts."""
    cfg, k = target.config, 3
    hybrid = HybridDrafter(k, EagleDrafter(k, cfg), n_max=3, n_min=1, head_k=1)
    assert hybrid.head.k == 1 and dataclasses.replace(hybrid, k=2).head.k == 1
    assert HybridDrafter(2, EagleDrafter(2, cfg), head_k=3).head.k == 2  # never more than k
    head = EagleDrafter(1, cfg)
    rows = [[5, 6, 7, 5, 6], [1, 2, 1], [1, 2, 3, 4]]
    state = _state(cfg, rows, head, head_params, target.params, k)
    sp = jspec.SamplingParams()
    got = jax.jit(hybrid.propose, static_argnums=3)(head_params, target.params, state, sp)
    ref = jax.jit(head.propose, static_argnums=3)(head_params, target.params, state, sp)
    assert np.asarray(got.num_drafts).tolist() == [3, 2, 1]
    chex.assert_shape([got.drafts, got.draft_logits], [(3, k), (3, k, cfg.vocab_size)])
    assert np.asarray(got.drafts)[0].tolist() == [7, 5, 6]
    np.testing.assert_array_equal(np.asarray(got.drafts)[2, :1], np.asarray(ref.drafts)[2])
    np.testing.assert_array_equal(np.asarray(got.draft_logits)[2, :1], np.asarray(ref.draft_logits)[2])
    with pytest.raises(ConfigError, match="head_tokens applies"):
        SpecConfig("ngram", 4, head_tokens=1)
    with pytest.raises(ConfigError, match="head_tokens must be"):
        SpecConfig("hybrid", 4, draft="x", head_tokens=0)
    assert SpecConfig.from_dict({"method": "hybrid", "model": "x", "head_tokens": 2}).head_tokens == 2


@pytest.mark.parametrize("vocab", [12, 5000])  # the sorted path and the top-k candidate path
def test_one_hot_logits_are_a_deterministic_drafters_q(vocab):
    drafts = jnp.asarray([[3, 0, 7], [11, 11, 2], [5, 1, 4], [9, 8, 6]], jnp.int32)
    rs = RowSampling(jnp.asarray([0.0, 1.0, 0.7, 1.3], jnp.float32), jnp.asarray([0, 0, 5, 1], jnp.int32),
                     jnp.asarray([1.0, 0.9, 0.5, 1.0], jnp.float32))
    q = probs(one_hot_logits(drafts, vocab), rs)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(jax.nn.one_hot(drafts, vocab, dtype=q.dtype)))


def test_spec_config_hybrid_needs_an_eagle_checkpoint():
    assert SpecConfig("hybrid", 4, draft="smollm2-135m-eagle").enabled
    with pytest.raises(ConfigError, match="needs a draft checkpoint"):
        SpecConfig("hybrid", 4)
    with pytest.raises(ConfigError, match="ngram_min"):
        SpecConfig("hybrid", 4, draft="x", ngram_min=3, ngram_max=2)
    d = SpecConfig.from_dict({"method": "hybrid", "model": "x", "num_speculative_tokens": 3,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    assert d == SpecConfig("hybrid", 3, ngram_max=4, ngram_min=1, draft="x")


# ---------------------------------------------------------------------------------- greedy

# 12-token vocabulary: greedy continuations cycle, so lookup matches on some steps and not others.
PROMPTS = [[5, 9, 3, 11, 2, 4, 8, 5, 9, 3, 11], [6, 7, 8, 9, 10, 6, 7, 8], [3, 1, 3, 2, 3, 4]]
SP = jspec.SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("head_k", [None, 1])
def test_greedy_hybrid_equals_plain_greedy_and_uses_both_sources(target, head_params, head_k):
    baseline = jspec.generate(target, PROMPTS, SP).token_ids
    d = CountingHybrid(3, EagleDrafter(3, target.config), n_max=3, n_min=2, head_k=head_k)
    _reset()
    out = jspec.generate(target, PROMPTS, SP, drafter=d, drafter_params=head_params)
    assert SOURCES["ngram"] > 0 and SOURCES["head"] > 0, SOURCES
    accepted, proposed = sum(out.accepted_counts), sum(out.proposed_counts)
    assert 0 < accepted < proposed, (accepted, proposed)
    assert out.token_ids == baseline


# ---------------------------------------------------------------------------------- sampled

SAMPLED = jspec.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
# With n_min = 2 the first step always looks up ([4, 3] occurred: drafts 4, 3); after a rejected
# first draft (x1 != 4) the suffix [3, x1] has no match and the head drafts the second token.
SAMPLED_PROMPT = [3, 4, 3, 4, 3]
N = 4000


@pytest.fixture(scope="module")
def small():
    return tiny_model(tiny_config(vocab_size=12, num_layers=2), seed=1, scale=2.0)


@pytest.mark.parametrize("head_k", [None, 1])
def test_sampled_hybrid_follows_the_target(small, head_k):
    exact = exact_two_token_distribution(small, SAMPLED_PROMPT, SAMPLED)
    d = CountingHybrid(2, EagleDrafter(2, small.config), n_max=3, n_min=2, head_k=head_k)
    dp = eagle_params(small)
    _reset()
    counts, accepted, proposed = sampled_pair_counts(small, SAMPLED_PROMPT, SAMPLED, N, d, dp)
    assert SOURCES["ngram"] > 0 and SOURCES["head"] > 0, SOURCES
    assert 0 < accepted < proposed, (accepted, proposed)  # drafts were judged, both ways
    stat, threshold = chi_square_check(counts, exact)
    assert stat < threshold, (stat, threshold)


def test_a_step_where_every_row_matches_skips_the_chain_and_observe_cannot_tell(target, head_params):
    """When every running row has a match the head builds only the entry of the pending token;
    after ``observe`` of the same verification its state equals the one after the whole chain."""
    cfg, k = target.config, 3
    head = EagleDrafter(k, cfg)
    hybrid = HybridDrafter(k, head, n_max=3, n_min=1)
    rows = [[5, 6, 7, 5, 6], [1, 2, 1]]  # both match
    state = _state(cfg, rows, head, head_params, target.params, k)
    sp = jspec.SamplingParams()
    got = jax.jit(hybrid.propose, static_argnums=3)(head_params, target.params, state, sp)
    full = jax.jit(head.propose, static_argnums=3)(head_params, target.params, state, sp)
    seq = np.asarray(state.seq_lens)
    np.testing.assert_array_equal(np.asarray(got.drafter_state.lengths), seq)  # one entry, not k
    np.testing.assert_array_equal(np.asarray(full.drafter_state.lengths), seq - 1 + k)
    assert np.asarray(got.num_drafts).tolist() == [3, 2]

    # the verification committed 2 tokens in row 0 and 1 in row 1; its true features are random here
    n_new = np.asarray([2, 1])
    tokens = np.asarray(state.tokens).copy()
    tokens[0, seq[0]:seq[0] + 2] = [7, 5]
    tokens[1, seq[1]] = 2
    after = dataclasses.replace(state, tokens=jnp.asarray(tokens), seq_lens=state.seq_lens + n_new)
    hidden = jax.random.normal(jax.random.key(1), (len(rows), k + 1, cfg.hidden_size))
    observe = jax.jit(head.observe)
    outs = [observe(head_params, target.params, state, dataclasses.replace(after, drafter=p.drafter_state), hidden,
                    jnp.asarray(n_new - 1)) for p in (got, full)]
    a, b = outs
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    np.testing.assert_array_equal(np.asarray(a.last_feature), np.asarray(b.last_feature))
    ps = state.cache.page_size
    tables = np.asarray(state.cache.block_tables)
    for row, n in enumerate(np.asarray(a.lengths)):  # every entry observe leaves in use
        pos = np.arange(n)
        slots = tables[row, pos // ps], pos % ps
        for pa, pb in ((a.k_pages[0], b.k_pages[0]), (a.v_pages[0], b.v_pages[0])):
            np.testing.assert_allclose(np.asarray(pa)[:, slots[0], slots[1]], np.asarray(pb)[:, slots[0], slots[1]],
                                       rtol=0, atol=0)


def test_hybrid_with_lookup_history_is_lossless_and_drafts_from_finished_requests(target, head_params):
    """``ngram_history`` on the hybrid: the lookup's history rides in the head's parameters; the
    same prompt again is drafted from the first run's text (more accepted), greedy output stays
    the plain one, and forgetting the history leaves the head's parameters as they were."""
    from jspec.config import EngineConfig
    from jspec.engine.engine import LLMEngine

    prompt = [5, 9, 3, 11, 2, 4, 8, 1]
    sp = jspec.SamplingParams(max_tokens=24, ignore_eos=True)
    want = jspec.generate(target, [prompt], sp).token_ids[0]
    drafter = HybridDrafter(3, EagleDrafter(3, target.config), n_max=3, n_min=2, history=64)
    params = {**head_params, **drafter.lookup.init_params()}
    engine = LLMEngine(target, EngineConfig(max_num_seqs=1, max_num_batched_tokens=36, max_model_len=64, page_size=8),
                       drafter=drafter, drafter_params=params)
    runs = []
    for i in range(2):
        r = engine.add_request(str(i), prompt, sp)
        while engine.has_unfinished_requests():
            engine.step()
        assert r.output_ids == want
        runs.append(r.metrics)
    assert runs[1].num_accepted_tokens > runs[0].num_accepted_tokens, runs
    assert np.asarray(engine.runner.drafter_params["history"])[-len(prompt) - 24:].tolist() == prompt + list(want)
    engine.reset_lookup_history()
    assert (np.asarray(engine.runner.drafter_params["history"]) == -1).all()
    assert set(engine.runner.drafter_params) == set(params)  # the head's parameters kept


def test_hybrid_with_dynamic_k_drafts_every_candidate_k_and_stays_lossless(target, head_params):
    """Dynamic k makes one drafter per candidate k (``dataclasses.replace(drafter, k=...)``): the
    hybrid's head follows its k (it used to keep the largest and refuse), every k runs, and
    greedy output stays the plain one."""
    from jspec.config import EngineConfig
    from jspec.engine.engine import LLMEngine

    small = dataclasses.replace(HybridDrafter(4, EagleDrafter(4, target.config)), k=2)
    assert small.k == small.head.k == 2
    sp = jspec.SamplingParams(max_tokens=24, ignore_eos=True)
    want = jspec.generate(target, PROMPTS, sp).token_ids
    engine = LLMEngine(target, EngineConfig(max_num_seqs=3, max_num_batched_tokens=3 * 5 + 32, max_model_len=64,
                                            page_size=8, max_burst_steps=2),
                       SpecConfig("ngram", 4, dynamic_k=True), drafter=HybridDrafter(4, EagleDrafter(4, target.config)),
                       drafter_params=head_params)
    assert sorted(engine._steps) == [0, 1, 2, 4]
    assert all(step.drafter.head.k == k for k, step in engine._steps.items() if k)
    engine.warmup()  # calibration runs every k
    reqs = [engine.add_request(str(i), p, sp) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_ids for r in reqs] == want
