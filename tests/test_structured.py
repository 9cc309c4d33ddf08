"""Structured output: a request's text follows a regex, a choice, a JSON schema or a grammar, and
speculation under the constraint is lossless (greedy token-identical to constrained decoding,
sampled following the constrained target's law), on a 12-token model whose tokens are
characters, so every constrained law can be enumerated."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import jspec
from jspec.config import StructuredOutputsParams as SO
from jspec.loading import LoadedModel
from jspec.speculative import steps as steps_lib
from jspec.speculative.drafters import DraftModelDrafter, NgramDrafter
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.engine.generate import release_engine
from jspec.sampling.structured import GrammarCompiler

from helpers import (chi_square_check, eagle_params, exact_two_token_distribution, sampled_pair_counts, tiny_config,
                     tiny_model)

VOCAB = ["<s>", "</s>", "a", "b", "c", "{", "}", "0", "1", "2", "x", "y"]
EOS = 1


def char_tokenizer():
    """A transformers tokenizer with one token per character of VOCAB (byte-level, as the
    grammar engine reads tokenizers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def char_model(seed: int, num_layers: int = 2) -> LoadedModel:
    cfg = tiny_config(vocab_size=len(VOCAB), num_layers=num_layers, eos_token_ids=(EOS,))
    m = tiny_model(cfg, seed=seed, scale=2.0)
    return dataclasses.replace(m, tokenizer=char_tokenizer())


@pytest.fixture(scope="module")
def target():
    return char_model(1)


@pytest.fixture(scope="module")
def draft():
    return char_model(2, num_layers=1)


def text_of(ids) -> str:
    return "".join(VOCAB[t] for t in ids if t != EOS)


PROMPTS = [[2, 3, 4], [5, 7, 8, 6], [10, 11, 10, 11, 10]]


@pytest.mark.parametrize("spec,pattern", [
    (SO(regex="[ab]{2,6}c"), r"[ab]{2,6}c"),
    (SO(choice=["abc", "xyx", "ab"]), r"abc|xyx|ab"),
    (SO(grammar='start: "{" item ("," item)* "}"\nitem: /[0-2]/ | "x"'), r"\{[0-2x](,[0-2x])*\}"),
])
def test_greedy_constrained_speculation_equals_constrained_decoding(target, draft, spec, pattern):
    """Every drafter gives the tokens constrained decoding gives, and the text follows the
    constraint (ended by EOS where the grammar is complete)."""
    sp = jspec.SamplingParams(max_tokens=12, structured_outputs=spec)
    plain = jspec.generate(target, PROMPTS, sp)
    for ids, reason in zip(plain.token_ids, plain.finish_reasons):
        if reason == "eos":
            assert re.fullmatch(pattern, text_of(ids)), text_of(ids)
    assert "eos" in plain.finish_reasons
    free = jspec.generate(target, PROMPTS, dataclasses.replace(sp, structured_outputs=None))
    assert free.token_ids != plain.token_ids  # the constraint changed what the model writes
    head = EagleDrafter(3, target.config)
    for d, dp in [(NgramDrafter(4, 2, 1), None), (DraftModelDrafter(3, draft.config), draft.params),
                  (head, eagle_params(target)), (HybridDrafter(3, head, 3, 2), eagle_params(target))]:
        out = jspec.generate(target, PROMPTS, sp, drafter=d, drafter_params=dp)
        assert out.token_ids == plain.token_ids, type(d).__name__
        assert out.finish_reasons == plain.finish_reasons


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(target, draft):
    """A batch mixing constrained and free requests: each gets the tokens it gets alone."""
    llm_params = [jspec.SamplingParams(max_tokens=10, structured_outputs=SO(regex="[xy]{1,4}c")),
                  jspec.SamplingParams(max_tokens=10),
                  jspec.SamplingParams(max_tokens=10, temperature=0.9, seed=5)]
    for d, dp in [(None, None), (DraftModelDrafter(3, draft.config), draft.params)]:
        engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=4, max_model_len=64), drafter=d,
                                 drafter_params=dp)
        for i, (prompt, sp) in enumerate(zip(PROMPTS, llm_params)):
            engine.add_request(str(i), prompt, sp)
        together = {}
        for outs in engine.step_until_done():
            for o in outs:
                if o.finished:
                    together[o.request_id] = o.outputs[0].token_ids
        for i, (prompt, sp) in enumerate(zip(PROMPTS, llm_params)):
            alone = jspec.generate(target, [prompt], sp, drafter=d, drafter_params=dp).token_ids[0]
            assert together[str(i)] == alone, (i, d)
        assert re.fullmatch(r"[xy]{1,4}c", text_of(together["0"])), text_of(together["0"])
        assert len(engine.constraints) == 0  # finished requests let go of their matchers


def _allowed_pairs(target, spec: SO):
    """bool [V] and [V, V]: what the constraint allows first, and second after each first."""
    compiler = GrammarCompiler(target.tokenizer, target.config.vocab_size, (EOS,))
    v = target.config.vocab_size

    def allowed(m):
        mask = np.zeros((compiler.words,), np.int32)
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        return np.array([(mask[t >> 5] >> (t & 31)) & 1 for t in range(v)], bool)

    m = compiler.matcher(spec)
    first = allowed(m)
    second = np.zeros((v, v), bool)
    for x in np.flatnonzero(first):
        m2 = compiler.matcher(spec)
        assert m2.consume_token(int(x))
        second[x] = allowed(m2)
    return first, second


SAMPLED = jspec.SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True,
                               structured_outputs=SO(regex="[abcxy01]{2,4}"))


def test_sampled_constrained_speculation_follows_the_constrained_law(target, draft):
    """The joint law of the first two tokens over 3000 seeds fits the constrained target's exact
    law (chi-square, false-alarm rate ~1e-6) for plain constrained sampling, n-gram drafts and a
    draft model whose q puts mass on refused tokens (its drafts are cut and q conditioned)."""
    prompt = [2, 3, 4]
    a1, a2 = _allowed_pairs(target, SAMPLED.structured_outputs)
    exact = exact_two_token_distribution(target, prompt, SAMPLED, a1, a2)
    assert exact[~a1].sum() == 0 and np.isclose(exact.sum(), 1.0)
    result = {}
    for name, d, dp in [("plain", None, None), ("ngram", NgramDrafter(2, 1, 1), None),
                        ("draft", DraftModelDrafter(2, draft.config), draft.params)]:
        counts, accepted, proposed = sampled_pair_counts(target, prompt, SAMPLED, 3000, d, dp, chunk=1000)
        result[name] = chi_square_check(counts, exact)
        if name == "draft":
            assert proposed > 0 and 0 < accepted < proposed
    for name, (stat, threshold) in result.items():
        assert stat < threshold, (name, result)


def test_the_check_catches_a_draft_law_left_unconditioned(target, draft, monkeypatch):
    """The same test with q left as the drafter's own (drafts cut, q not conditioned on the
    mask): the output leans toward the refused mass and the chi-square test rejects it."""
    monkeypatch.setattr(steps_lib, "conditioned_draft_probs", lambda q, masks: q)
    release_engine()  # generate() keeps its engine: this one must compile the steps anew
    prompt = [2, 3, 4]
    a1, a2 = _allowed_pairs(target, SAMPLED.structured_outputs)
    exact = exact_two_token_distribution(target, prompt, SAMPLED, a1, a2)
    counts, _, _ = sampled_pair_counts(target, prompt, SAMPLED, 3000, DraftModelDrafter(2, draft.config),
                                       draft.params, chunk=1000)
    release_engine()
    stat, threshold = chi_square_check(counts, exact)
    assert stat > threshold, (stat, threshold)


@pytest.mark.parametrize("spec,match", [
    ({"regex": "[ab"}, "regex is invalid"),
    ({"regex": "a{3,1}"}, "regex is invalid"),
    ({"json": {"type": "foo"}}, "json is invalid"),
    ({"grammar": "start: ("}, "grammar is invalid"),
    ({"regex": "zzz"}, "admits no text"),  # no token spells z
    ({"choice": []}, "choice"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"jsn": {}}, "unknown field"),
])
def test_bad_constraints_are_one_line_config_errors_before_anything_runs(target, spec, match):
    engine = jspec.LLMEngine(target, jspec.EngineConfig(max_num_seqs=2, max_model_len=64))
    with pytest.raises(jspec.ConfigError, match=match) as e:
        engine.add_request("r", [2, 3], jspec.SamplingParams(max_tokens=8, structured_outputs=spec))
    assert "\n" not in str(e.value)
    assert not engine.has_unfinished_requests() and not engine.requests


def test_a_constraint_longer_than_max_tokens_finishes_by_length(target):
    out = jspec.generate(target, PROMPTS[:1], jspec.SamplingParams(max_tokens=5, structured_outputs=SO(regex="a{9}c")))
    assert out.finish_reasons == ["length"] and text_of(out.token_ids[0]) == "aaaaa"


def test_forced_tokens_are_drafted_where_the_drafter_has_none(target):
    """Jump-forward: where the grammar allows one continuation, its tokens fill the draft
    positions n-gram lookup leaves empty, and the target accepts them in one verification each."""
    sp = jspec.SamplingParams(max_tokens=12, structured_outputs=SO(regex="xyabcxy"))
    plain = jspec.generate(target, [[5, 7, 8, 6]], sp)
    out = jspec.generate(target, [[5, 7, 8, 6]], sp, drafter=NgramDrafter(4, 3, 3), drafter_params=None)
    assert text_of(plain.token_ids[0]) == "xyabcxy" and out.token_ids == plain.token_ids
    assert out.mean_accepted_length >= 3, out
    assert out.num_target_forwards <= 4, out
