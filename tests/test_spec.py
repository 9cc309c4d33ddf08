"""Speculative decoding end to end on tiny models: lossless greedy for every drafter, EOS inside
an accepted block, metrics, sampled output distribution, and bad input."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import chi_square_check, exact_two_token_distribution, sampled_pair_counts, tiny_config, tiny_model
from jspec.speculative.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter

# Prompts with repeats (so n-gram lookup finds matches) and of different lengths.
PROMPTS = [[5, 9, 3, 17, 2, 44, 8, 5, 9, 3, 17], [7, 7], [60, 61, 62, 63, 64, 65, 60, 61, 62], [30, 31, 32, 33, 34]]
SP = jspec.SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=4), scale=4.0)


@pytest.fixture(scope="module")
def draft():
    # A different, smaller model over the same vocabulary
    return tiny_model(tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), seed=5, scale=4.0)


@pytest.fixture(scope="module")
def baseline(target):
    return {b: jspec.generate(target, PROMPTS[:b], SP).token_ids for b in (1, 4)}


def drafters(target, draft, k):
    return {
        "ngram": (NgramDrafter(k, 3, 1), None),
        "layerskip": (LayerSkipDrafter(k, target.config, 2), None),
        "draft": (DraftModelDrafter(k, draft.config), draft.params),
        "self-draft": (DraftModelDrafter(k, target.config), target.params),
    }


# k = 1 (one draft), 3 and 8 (a block longer than most accepted runs), each drafter at each k;
# batches of 1 and 4 alternate so both occur at the extremes of k.
@pytest.mark.parametrize("k, batch", [(1, 4), (3, 1), (8, 4), (8, 1)])
def test_greedy_speculative_equals_greedy(target, draft, baseline, k, batch):
    for name, (d, dp) in drafters(target, draft, k).items():
        out = jspec.generate(target, PROMPTS[:batch], SP, drafter=d, drafter_params=dp)
        assert out.token_ids == baseline[batch], (name, k, batch)
        assert out.mean_accepted_length is not None and 1.0 <= out.mean_accepted_length <= k + 1
        assert len(out.acceptance_per_position) == k
        if name == "self-draft":  # the target drafting for itself: every draft is accepted
            assert out.acceptance_per_position == [1.0] * k


def test_eos_inside_an_accepted_block(target, baseline):
    free = baseline[4]
    eos = free[0][5]  # the 6th token of sequence 0 becomes EOS: it lands inside a block of 8
    m = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(eos,)))
    sp = dataclasses.replace(SP, ignore_eos=False)
    plain = jspec.generate(m, PROMPTS, sp)
    for d, dp in [(DraftModelDrafter(8, m.config), m.params), (NgramDrafter(8, 3, 1), None)]:
        out = jspec.generate(m, PROMPTS, sp, drafter=d, drafter_params=dp)
        assert out.token_ids == plain.token_ids
        assert out.finish_reasons == plain.finish_reasons
    for got, ref in zip(plain.token_ids, free):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert got == ref[:cut]
    assert plain.finish_reasons[0] == "eos"


def test_metrics_count_forwards_and_acceptance(target):
    out = jspec.generate(target, PROMPTS[:1], SP, drafter=DraftModelDrafter(3, target.config),
                         drafter_params=target.params)
    # 24 tokens, 4 per forward (3 accepted + bonus) -> 6 target forwards
    assert out.num_target_forwards == 6 and out.mean_accepted_length == 4.0
    ngram = jspec.generate(target, PROMPTS[:1], SP, spec=jspec.SpecConfig("ngram", 3, ngram_max=3))
    assert ngram.num_tokens / ngram.num_target_forwards == pytest.approx(ngram.mean_accepted_length)


def test_spec_config_through_generate(target, baseline):
    out = jspec.generate(target, PROMPTS, SP, spec=jspec.SpecConfig("layerskip", 2, layerskip_layers=3))
    assert out.token_ids == baseline[4] and out.spec_method == "layerskip"


@pytest.mark.parametrize("sp", [jspec.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True),
                                jspec.SamplingParams(temperature=0.8, top_p=0.9, top_k=10, max_tokens=2,
                                                     ignore_eos=True)], ids=["plain", "topk-topp"])
def test_sampled_speculative_generation_follows_target(sp):
    """Speculative sampling with a draft model over a 12-token vocabulary: the joint law of the
    first two tokens over 3000 seeds passes a chi-square goodness-of-fit test against the
    target's exact law (false-alarm rate ~1e-6), as plain sampling does."""
    cfg = tiny_config(vocab_size=12, num_layers=2)
    target = tiny_model(cfg, seed=1, scale=2.0)
    draft = tiny_model(dataclasses.replace(cfg, num_layers=1), seed=2, scale=2.0)
    prompt = [3, 4, 5]
    exact = exact_two_token_distribution(target, prompt, sp)
    n = 3000
    result = {}
    for name, d, dp in [("plain", None, None), ("draft", DraftModelDrafter(3, draft.config), draft.params)]:
        counts, _, _ = sampled_pair_counts(target, prompt, sp, n, d, dp)
        result[name] = chi_square_check(counts, exact)
    for name, (stat, threshold) in result.items():
        assert stat < threshold, (name, result)


def test_bad_spec_input(target, tmp_path):
    with pytest.raises(jspec.ConfigError, match="num_speculative_tokens"):
        jspec.SpecConfig("ngram", 0)
    with pytest.raises(jspec.ConfigError, match="num_speculative_tokens"):
        jspec.SpecConfig("ngram", 17)
    with pytest.raises(jspec.ConfigError, match="layerskip"):
        jspec.generate(target, PROMPTS, SP, spec=jspec.SpecConfig("layerskip", 2, layerskip_layers=4))
    with pytest.raises(jspec.ConfigError, match="draft checkpoint"):
        jspec.SpecConfig("draft", 2)


def test_draft_with_another_vocabulary_is_refused(tmp_path, tiny_hf_llama):
    from helpers import write_hf_checkpoint

    other = write_hf_checkpoint(tmp_path / "other-vocab", "llama", vocab_size=280, tokenizer=False)
    target = jspec.load_model(str(tiny_hf_llama))
    with pytest.raises(jspec.DraftMismatchError, match="vocabulary"):
        jspec.generate(target, [[5, 6, 7]], SP, spec=jspec.SpecConfig("draft", 2, draft=str(other)))


def test_profile_step_times_draft_and_verify(target):
    from jspec.bench.profile import profile_step

    prof = profile_step(target, PROMPTS[0], jspec.SpecConfig("layerskip", 3, layerskip_layers=2),
                        jspec.SamplingParams(), warm_steps=2, repeats=2)
    assert prof.k == 3 and prof.draft_ms > 0 and prof.verify_ms > 0 and prof.plain_step_ms > 0
    assert prof.step_ms > 0 and "verify" in prof.summary()


def test_target_step_fn_and_profile_ops_on_the_engine_state(target):
    """The q_len 1 function is the plain step (its next token); the q_len k + 1 function
    verifies k given drafts: with that token as the first draft at least one is accepted, with
    another token none. Each donates its state and hands back one that repeats the same step:
    the lengths it came with and the same answer the next time. profile_ops times each q_len
    and attributes time to the LM head."""
    from jspec.bench.profile import prepared_engine, profile_ops, target_step_fn

    engine = prepared_engine(target, PROMPTS[0], jspec.SpecConfig("ngram", 2), warm_steps=2)
    state = jax.tree.map(jnp.copy, engine.runner.state.replace(drafter=None))
    lengths = np.asarray(state.cache.lengths)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)  # the donated state's
    nxt, state = target_step_fn(engine, 1)(engine.runner.params, state)
    chex.assert_shape(nxt, (state.batch,))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, shapes)
    again, state = target_step_fn(engine, 1)(engine.runner.params, state)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(nxt))
    np.testing.assert_array_equal(np.asarray(state.cache.lengths), lengths)
    wrong = (nxt + 1) % target.config.vocab_size
    (accepted, _), state = target_step_fn(engine, 3)(engine.runner.params, state, jnp.stack([nxt, wrong], axis=1))
    (rejected, _), state = target_step_fn(engine, 3)(engine.runner.params, state, jnp.stack([wrong, nxt], axis=1))
    assert int(accepted[0]) >= 1 and int(rejected[0]) == 0
    chex.assert_trees_all_equal_shapes_and_dtypes(state, shapes)
    chex.assert_tree_all_finite(state.cache)  # the verified rows' K/V, written into the pages
    profs = profile_ops(target, PROMPTS[0], (1, 3), repeats=2, engine=engine)
    assert [p.q_len for p in profs] == [1, 3] and all(p.best_ms > 0 for p in profs)
    assert profs[1].by_category.get("lm_head", 0) > 0


def test_trace_ops_counts_a_loop_once_not_its_body_again():
    """A while thunk's trace event spans its body's events on the same thread: only the
    outermost ones count, so the categories cannot add up to more than the calls took."""
    from jspec.bench.profile import _outermost

    ops = [(100, 50, "attention"), (0, 10, "lm_head"), (110, 5, "attention"), (120, 30, "attention"),
           (160, 5, "norms"), (150, 10, "kv_write")]
    assert _outermost(ops) == [(0, 10, "lm_head"), (100, 50, "attention"), (150, 10, "kv_write"), (160, 5, "norms")]
