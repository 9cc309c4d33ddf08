"""A request's failure is that request's: sampling parameters fuzzed at the edges of their dtypes
are refused at construction or decode valid tokens; a host-side fault in one request (its
detokenizer raising) fails that request alone; a failed device burst (state intact, or donated
away) fails the requests of that burst and the engine serves the next ones; ``LLM.generate`` /
``LLM.stream`` leave the engine idle whatever happens to them."""

import dataclasses
import math

import jax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from helpers import tiny_config, tiny_model
from jspec.config import FLOAT32_MAX, FLOAT32_TINY, EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
from jspec.speculative.drafters import DraftModelDrafter

VOCAB = 96
PROMPT = [5, 6, 7, 8, 5, 6, 7]
NORMAL = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=2), scale=4.0)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), seed=5, scale=4.0)


def make_engine(target, draft, **kw):
    """A draft-model speculative engine: sampled rows verify through rejection sampling with
    both p and q processed by the request's parameters."""
    config = EngineConfig(**{**dict(max_num_seqs=4, max_model_len=64, page_size=8, max_burst_steps=4), **kw})
    return LLMEngine(target, config, SpecConfig(), drafter=DraftModelDrafter(3, draft.config),
                     drafter_params=draft.params)


def run_all(engine, limit=500):
    outs = []
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            return outs
        outs += engine.step()
        engine.scheduler.check()
    raise AssertionError("the engine does not make progress")


def assert_idle(engine):
    assert not engine.has_unfinished_requests()
    engine.scheduler.check()
    assert engine.allocator.num_free == engine.allocator.num_usable  # every page back


@pytest.fixture(scope="module")
def normal_ids(target, draft):
    engine = make_engine(target, draft)
    engine.add_request("n", PROMPT, NORMAL)
    run_all(engine)
    return engine.requests["n"].output_ids


# Values the device takes, at the edges of its dtypes (float32 temperature and top-p, int32
# top-k, a 64-bit seed), and values it must refuse.
VALID = {
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, 5e-324, 1e-46, 1e-45, 1e-40, FLOAT32_TINY, 2e-38, 1e-30,
                                              1e-7, 0.5, 1.0, 7.0, 1e30, FLOAT32_MAX]), st.floats(0, FLOAT32_MAX)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-46, 1e-45, 1e-40, FLOAT32_TINY, 1e-30, 1e-7, 0.5, 1 - 1e-9, 1.0]),
                       st.floats(5e-324, 1)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1]), st.integers(-1, 200)),
    "seed": st.one_of(st.sampled_from([None, 0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1]),
                      st.integers(0, 2**63 - 1)),
    "max_tokens": st.sampled_from([1, 2, 5, 9, 2**20]),  # 2**20: refused by add_request (the context)
    "num_speculative_tokens": st.sampled_from([None, 0, 1, 3, 16]),
    "ignore_eos": st.booleans(),
    "stop": st.sampled_from([(), ("x",), "\ud800"]),
}
INVALID = [("temperature", v) for v in (3.4028236e38, 1e39, math.inf, -math.inf, math.nan, -1e-300, 10**400, True)] + \
    [("top_p", v) for v in (0.0, -0.0, 1.0000001, math.inf, math.nan, 10**400)] + \
    [("top_k", v) for v in (-2, 2**31, 2**63, 10**400, 1.0, None)] + [("seed", v) for v in (-1, 2**63, 2**64, 1.0)] + \
    [("max_tokens", v) for v in (0, -1, 2**20 + 1, 2**31)] + [("num_speculative_tokens", v) for v in (-1, 17)] + \
    [("ignore_eos", 1), ("stop", ("",)), ("stop", [None])]


@st.composite
def request_kw(draw):
    """Every field at an edge value; one request in three also carries one value to refuse."""
    kw = {name: draw(s) for name, s in VALID.items()}
    bad = draw(st.one_of(st.none(), st.none(), st.sampled_from(INVALID)))
    if bad is not None:
        kw[bad[0]] = bad[1]
    return kw


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(st.lists(request_kw(), min_size=1, max_size=3))
def test_fuzzed_sampling_parameters_are_refused_or_decode_valid_tokens(fuzz_engine, normal_ids, kws):
    """Every request is refused with ConfigError at construction (or PromptError when its
    budget cannot fit the context), or finishes with token ids in [0, vocab) within its budget;
    the pages all come back, and a normal request after it decodes exactly as before."""
    engine = fuzz_engine
    engine.pop_finished()
    for rid in list(engine.requests):  # left by a failing example while hypothesis shrinks
        engine.abort_request(rid)
    engine.pop_finished()
    added = []
    for i, kw in enumerate(kws):
        try:
            sp = SamplingParams(**kw)
        except jspec.ConfigError as e:
            assert "\n" not in str(e)
            continue
        try:
            engine.add_request(f"f{i}", PROMPT, sp)
        except jspec.PromptError:
            assert sp.max_tokens + len(PROMPT) > engine.max_model_len
            continue
        added.append((f"f{i}", sp))
    run_all(engine)
    for rid, sp in added:
        r = engine.requests[rid]
        assert r.finish_reason in ("stop", "length") and r.error is None
        assert 1 <= len(r.output_ids) <= sp.max_tokens
        assert all(0 <= t < VOCAB for t in r.output_ids), r.output_ids
    engine.add_request("normal", PROMPT, NORMAL)
    run_all(engine)
    assert engine.requests["normal"].output_ids == normal_ids
    engine.pop_finished()
    assert_idle(engine)


@pytest.fixture(scope="module")
def fuzz_engine(target, draft):
    return make_engine(target, draft)


def test_a_host_fault_in_one_request_fails_it_alone(target, draft, normal_ids, monkeypatch):
    """The detokenizer raises for request "b" only: "b" finishes with finish reason "error" and
    the message, its pages freed; "a" and "c" (batched with it) finish as if alone; the engine
    then serves a new request exactly."""
    engine = make_engine(target, draft)
    real = engine._detokenize

    def detokenize(r, new_from):
        if r.request_id == "b" and len(r.output_ids) >= 2:
            raise IndexError("piece id is out of range")
        return real(r, new_from)

    monkeypatch.setattr(engine, "_detokenize", detokenize)
    for rid in "abc":
        engine.add_request(rid, PROMPT, NORMAL)
    outs = run_all(engine)
    b = engine.requests["b"]
    assert b.finish_reason == "error" and "IndexError: piece id is out of range" in b.error
    last_b = [o for o in outs if o.request_id == "b"][-1]
    assert last_b.finished and last_b.outputs[0].finish_reason == "error" and last_b.error == b.error
    for rid in "ac":
        assert engine.requests[rid].output_ids == normal_ids and engine.requests[rid].finish_reason == "length"
    assert engine.stats.num_requests == 3
    engine.add_request("d", PROMPT, NORMAL)
    run_all(engine)
    assert engine.requests["d"].output_ids == normal_ids
    assert_idle(engine)


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("consumed", [False, True], ids=["state-intact", "state-donated-away"])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_failed_burst_fails_its_requests_and_the_engine_serves_on(target, draft, normal_ids, monkeypatch,
                                                                    consumed, exc):
    """One slot, "a" decoding and "b" waiting; a burst raises (before the device call, or after
    its donated state was consumed). "a" fails with finish reason "error"; "b", which was not in
    the burst, and "c", added after, decode exactly; no page leaks. An interrupt still reaches
    the caller, with the engine made whole first."""
    engine = make_engine(target, draft, max_num_seqs=1)
    real = engine.runner.burst
    calls = {"n": 0}

    def burst(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # "a" is decoding by then
            if consumed:
                for x in jax.tree_util.tree_leaves(engine.runner.state):
                    x.delete()
            raise exc("the device fell over")
        return real(*args, **kw)

    monkeypatch.setattr(engine.runner, "burst", burst)
    engine.add_request("a", PROMPT, dataclasses.replace(NORMAL, max_tokens=40))
    engine.add_request("b", PROMPT, NORMAL)
    for _ in range(2):
        engine.step()
    assert engine.requests["a"].output_ids and engine.requests["b"].status.value == "waiting"
    if exc is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            engine.step()
        outs = []
    else:
        outs = engine.step()
    a = engine.requests["a"]
    assert a.finish_reason == "error" and "the device fell over" in a.error
    assert exc is KeyboardInterrupt or [o.request_id for o in outs] == ["a"] and outs[0].error == a.error
    assert engine.runner.usable()
    engine.add_request("c", PROMPT, NORMAL)
    run_all(engine)
    assert engine.requests["b"].output_ids == normal_ids and engine.requests["c"].output_ids == normal_ids
    assert_idle(engine)


def test_generate_and_stream_keep_the_engine_serving(target, normal_ids, monkeypatch):
    """generate: a failing prompt comes back with finish reason "error" beside the others; a
    step that raises propagates, its requests aborted; a stream the caller leaves early aborts
    what it started. After each, the next call decodes exactly."""
    llm = jspec.LLM(target, max_num_seqs=3, max_model_len=64, page_size=8)
    want = llm.generate([PROMPT], NORMAL, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    real = engine._detokenize
    monkeypatch.setattr(engine, "_detokenize",
                        lambda r, n: (_ for _ in ()).throw(ValueError("undecodable")) if r.prompt_ids[0] == 9
                        else real(r, n))
    outs = llm.generate([PROMPT, [9] + PROMPT, PROMPT], NORMAL, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "ValueError: undecodable" and outs[0].outputs[0].token_ids == want
    assert not engine.requests and not engine.has_unfinished_requests()

    real_choose = engine._choose_k
    monkeypatch.setattr(engine, "_choose_k", lambda: (_ for _ in ()).throw(Boom("a bug in the host loop")))
    with pytest.raises(Boom):
        llm.generate([PROMPT, PROMPT], NORMAL, use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished_requests()
    monkeypatch.setattr(engine, "_choose_k", real_choose)

    stream = llm.stream([PROMPT, PROMPT], dataclasses.replace(NORMAL, max_tokens=30))
    next(stream)
    stream.close()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert llm.generate([PROMPT], NORMAL, use_tqdm=False)[0].outputs[0].token_ids == want
