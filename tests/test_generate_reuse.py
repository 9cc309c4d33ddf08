"""``jspec.generate`` keeps its engine between calls: a run of calls with any prompt counts
compiles each slot bucket and shape once, more prompts than slots queue for them, and nothing
about a call's output depends on what ran before."""

from __future__ import annotations

import importlib
import random

import jax
import pytest

import jspec
from helpers import tiny_model
gen_lib = importlib.import_module("jspec.engine.generate")  # the module (jspec.engine.generate is also the function)


@pytest.fixture
def target():
    gen_lib.release_engine()
    yield tiny_model(scale=4.0)
    gen_lib.release_engine()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 96) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


SPEC = jspec.SpecConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
GREEDY = jspec.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def alone(target, batch, sp, spec=SPEC):
    """Each prompt in an engine of its own (the kept one released first)."""
    out = []
    for p in batch:
        gen_lib.release_engine()
        out.append(jspec.generate(target, [p], sp, spec=spec).token_ids[0])
    gen_lib.release_engine()
    return out


def test_repeated_prompt_counts_compile_nothing_new(target):
    """80 prompts (more than the slots: they queue), then 1, 3 and 16 on the engine that call
    built, then each count again: the second call of each compiles nothing (compile time
    exactly 0) and gives the same tokens. (An engine replaced by a bigger one compiles its slot
    buckets anew: a run that starts with its biggest call compiles each once.)"""
    sizes = [80, 1, 3, 16]
    first = {n: jspec.generate(target, prompts(n, n), GREEDY, spec=SPEC) for n in sizes}
    engine = gen_lib._kept[-1]
    assert engine.config.max_num_seqs == gen_lib.GENERATE_SLOTS
    for n in sizes:
        again = jspec.generate(target, prompts(n, n), GREEDY, spec=SPEC)
        assert gen_lib._kept[-1] is engine
        assert again.compile_s == 0.0, (n, again.compile_s)
        assert again.token_ids == first[n].token_ids and len(again.token_ids) == n
    assert engine.allocator.num_free == engine.allocator.num_usable and not engine.requests


def test_outputs_do_not_depend_on_the_kept_engine(target):
    """Greedy and seeded sampled outputs of a call on the kept engine (grown by earlier calls)
    equal each prompt run in an engine of its own."""
    batch = prompts(5, 7)
    jspec.generate(target, prompts(40, 1), GREEDY, spec=SPEC)  # grow it: 64 slots, with history
    assert [list(t) for t in jspec.generate(target, batch, GREEDY, spec=SPEC).token_ids] == \
        alone(target, batch, GREEDY)
    sampled = jspec.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=11)
    jspec.generate(target, prompts(40, 2), GREEDY, spec=SPEC)
    got = jspec.generate(target, batch, sampled, spec=SPEC).token_ids
    want = [jspec.generate(target, [p], jspec.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8,
                                                            seed=11 + i), spec=SPEC).token_ids[0]
            for i, p in enumerate(batch)]
    assert got == want


def test_a_changed_model_or_setting_gets_a_new_engine(target):
    batch = prompts(3, 3)
    jspec.generate(target, batch, GREEDY, spec=SPEC)
    kept = gen_lib._kept[-1]
    jspec.generate(target, batch, GREEDY)  # another spec
    assert gen_lib._kept[-1] is not kept
    plain = gen_lib._kept[-1]
    other = jspec.generate(target, batch, GREEDY)
    assert gen_lib._kept[-1] is plain
    # the parameters replaced in place: the kept engine's copies are stale, so it is not reused
    target.params = jax.tree_util.tree_map(lambda p: -p, target.params)
    flipped = jspec.generate(target, batch, GREEDY)
    assert gen_lib._kept[-1] is not plain
    gen_lib.release_engine()
    assert flipped.token_ids == jspec.generate(target, batch, GREEDY).token_ids != other.token_ids


def test_a_call_cut_short_leaves_the_kept_engine_usable(target):
    batch = prompts(6, 4)
    want = jspec.generate(target, batch, GREEDY, spec=SPEC).token_ids

    def boom(new):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        jspec.generate(target, batch, GREEDY, spec=SPEC, on_tokens=boom, stream_interval=2)
    assert jspec.generate(target, batch, GREEDY, spec=SPEC).token_ids == want
