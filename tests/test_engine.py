"""The serving engine on tiny models: every request's output equals running it alone (every
drafter, any arrival order, under page pressure with preemption), prefix-cache hits are exact
and prefill less, drafter state survives prefix hits, sampled requests are reproducible per
seed, and nothing compiles after warm-up."""

import dataclasses
import json
import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from helpers import tiny_config, tiny_model
from jspec.cache.allocator import PageAllocator
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
from jspec.engine.scheduler import Scheduler, prefill_shapes
from jspec.models.eagle import init_eagle_params
from jspec.models.llama import output_embedding
from jspec.speculative.drafters import DraftModelDrafter, LayerSkipDrafter, NgramDrafter
from jspec.speculative.drafters.eagle import EagleDrafter

GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=3), scale=4.0)


@pytest.fixture(scope="module")
def drafters(target):
    draft = tiny_model(tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1), seed=5, scale=4.0)
    cfg = target.config
    eagle = {"head": init_eagle_params(cfg, jax.random.key(3), target.params),
             "lm_head": output_embedding(target.params, cfg), "vocab_ids": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}
    eagle3 = dict(eagle, head=init_eagle_params(cfg, jax.random.key(4), target.params, num_features=3))
    return {
        "none": (None, None),
        "ngram-3": (NgramDrafter(3, 3, 1), None),
        "layerskip-2": (LayerSkipDrafter(2, cfg, 1), None),
        "draft-3": (DraftModelDrafter(3, draft.config), draft.params),
        "self-draft-4": (DraftModelDrafter(4, cfg), target.params),
        "eagle-3": (EagleDrafter(3, cfg), eagle),
        "eagle3-3": (EagleDrafter(3, cfg, feature_layers=(0, 1, 2)), eagle3),  # fuses all three layers
    }


def prompts_with_repeats(n, seed=0, lo=2, hi=40):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(2, 96) for _ in range(rng.randrange(2, 6))]
        p = (motif * 20)[:rng.randrange(lo, hi)]
        out.append(p)
    return out


SOLO = {}


def solo(target, prompt, sp):
    """The request alone through plain decoding (cached per prompt and params)."""
    key = (tuple(prompt), sp)
    if key not in SOLO:
        SOLO[key] = jspec.generate(target, [prompt], sp).token_ids[0]
    return SOLO[key]


def run(target, requests, config, drafter=None, drafter_params=None, spec=SpecConfig(), check=True):
    """``requests``: (prompt, params, arrival step). Returns (engine, {index: request})."""
    engine = LLMEngine(target, config, spec, drafter=drafter, drafter_params=drafter_params)
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    reqs, step = {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            reqs[i] = engine.add_request(str(i), requests[i][0], requests[i][1])
        engine.step()
        if check:
            engine.scheduler.check()
        step += 1
        assert step < 2000, "the engine does not make progress"
    return engine, reqs


@pytest.mark.parametrize("name", ["none", "ngram-3", "layerskip-2", "draft-3", "self-draft-4", "eagle-3", "eagle3-3"])
def test_every_request_equals_its_solo_run(target, drafters, name):
    """Five requests of different lengths (some prefilled in several chunks) arriving at
    different steps into three slots: each one's greedy tokens equal its run alone."""
    prompts = prompts_with_repeats(5, seed=1)
    requests = [(p, dataclasses.replace(GREEDY, max_tokens=8 + 3 * i), [0, 0, 2, 5, 9][i]) for i, p in enumerate(prompts)]
    d, dp = drafters[name]
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=3 * 5 + 32, max_model_len=128, page_size=8,
                          max_burst_steps=4)
    engine, reqs = run(target, requests, config, d, dp)
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, sp), (name, i)
        assert reqs[i].finish_reason in ("stop", "length")
    assert engine.stats.bursts_by_slots[1] > 0  # decode bursts ran on fewer rows than slots
    if name == "self-draft-4":  # the target drafting for itself: every draft is accepted
        assert all(r.metrics.num_accepted_tokens == r.metrics.num_draft_tokens > 0 for r in reqs.values())
    if name == "ngram-3":  # repeated motifs: the n-gram drafter does propose and gets some right
        assert sum(r.metrics.num_accepted_tokens for r in reqs.values()) > 0
        # at a fixed k every drafted step could have proposed each of the 3 drafts
        assert all(r.eligible_per_pos == [r.metrics.num_drafts] * 3 for r in reqs.values())


@pytest.mark.parametrize("name", ["ngram-3", "draft-3", "eagle-3"])
def test_slot_buckets_shrink_and_grow_losslessly(target, drafters, name):
    """Seven requests of very different lengths into four slots (buckets 1, 2, 4), arriving in
    waves: the live set grows and shrinks across every bucket, with live slots scattered (slot 3
    running while slot 0 is free), and each request's greedy tokens still equal its run alone."""
    prompts = prompts_with_repeats(7, seed=11, lo=3, hi=30)
    budgets = [40, 3, 6, 30, 4, 25, 2]
    arrivals = [0, 0, 0, 0, 14, 15, 30]
    requests = [(p, SamplingParams(max_tokens=m, ignore_eos=True), a) for p, m, a in zip(prompts, budgets, arrivals)]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 32, max_model_len=128, page_size=8,
                          max_burst_steps=2)
    d, dp = drafters[name]
    seen = []
    engine = LLMEngine(target, config, drafter=d, drafter_params=dp)
    burst = engine.runner.burst
    engine.runner.burst = lambda *a: (seen.append(a[-1]), burst(*a))[1]
    pending, reqs, step = list(range(len(requests))), {}, 0
    while pending or engine.has_unfinished_requests():
        while pending and requests[pending[0]][2] <= step:
            i = pending.pop(0)
            reqs[i] = engine.add_request(str(i), *requests[i][:2])
        engine.step()
        engine.scheduler.check()
        step += 1
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, sp), (name, i)
    by = engine.stats.bursts_by_slots
    assert set(by) == {1, 2, 4} and all(n > 0 for n in by.values()), by
    buckets = [s for s in seen if s is not None]
    assert any(s[0] != 0 and len(s) < 4 for s in buckets)  # a bucket that is not the low slots


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 12), st.integers(1, 16), st.integers(0, 10_000)),
                min_size=1, max_size=7))
def test_random_request_sets_under_a_tight_page_budget(target, drafters, spec):
    """Random prompts, arrival steps, budgets and EOS (token 1, free to occur) under a pool of
    10 pages of 8 tokens: at every step every page is free or held once per holder, every
    request completes, and each output equals the request's run alone."""
    requests = []
    for length, arrival, budget, seed in spec:
        rng = random.Random(seed)
        requests.append(([rng.randrange(1, 96) for _ in range(length)], SamplingParams(max_tokens=budget), arrival))
    d, dp = drafters["ngram-3"]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 32, max_model_len=64, page_size=8,
                          kv_cache_tokens=80, max_burst_steps=4)
    engine, reqs = run(target, requests, config, d, dp)
    assert all(r.status.value == "finished" for r in reqs.values())
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, sp)
    engine.scheduler.check()
    assert engine.allocator.num_free == engine.allocator.num_usable  # nothing leaked


def test_preemption_recomputes_identically(target, drafters):
    """A pool too small for four long requests at once: the newest are preempted, recomputed
    from prompt + output, and still produce exactly their solo tokens (greedy and sampled)."""
    prompts = prompts_with_repeats(4, seed=7, lo=20, hi=30)
    params = [SamplingParams(max_tokens=30, ignore_eos=True),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.9, seed=11),
              SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.7, top_k=20, seed=12),
              SamplingParams(max_tokens=30, ignore_eos=True, top_p=0.9, temperature=1.0, seed=13)]
    requests = [(p, sp, 0) for p, sp in zip(prompts, params)]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 32, max_model_len=64, page_size=8,
                          kv_cache_tokens=136, max_burst_steps=8)
    for name in ("none", "ngram-3", "eagle-3", "eagle3-3"):
        d, dp = drafters[name]
        engine, reqs = run(target, requests, config, d, dp)
        assert engine.stats.preemptions > 0, name
        for i, (p, sp, _) in enumerate(requests):
            if sp.greedy:  # lossless: the plain run's tokens
                assert reqs[i].output_ids == solo(target, p, sp), (name, i)
            else:  # sampled: the same request alone with the same drafter, token for token
                _, alone = run(target, [(p, sp, 0)], config, d, dp)
                assert reqs[i].output_ids == alone[0].output_ids, (name, i)


def test_prefix_cache_hits_are_exact_and_prefill_less(target, drafters):
    common = prompts_with_repeats(1, seed=3, lo=39, hi=40)[0]
    prompts = [common + [5, 6, 7], common + [9, 9], common[:20] + [4]]
    requests = [(p, GREEDY, 3 * i) for i, p in enumerate(prompts)]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 4 + 64, max_model_len=128, page_size=8)
    for name in ("none", "draft-3", "eagle-3"):
        d, dp = drafters[name]
        engine, reqs = run(target, requests, config, d, dp)
        off, reqs_off = run(target, requests, dataclasses.replace(config, enable_prefix_caching=False), d, dp)
        for i in range(3):
            assert reqs[i].output_ids == reqs_off[i].output_ids == solo(target, prompts[i], GREEDY), (name, i)
        assert reqs[0].metrics.num_cached_tokens == 0
        assert reqs[1].metrics.num_cached_tokens == 32 and reqs[2].metrics.num_cached_tokens == 16  # full pages
        assert engine.stats.prefilled_tokens < off.stats.prefilled_tokens
        assert reqs[1].metrics.num_prefilled_tokens == len(prompts[1]) - 1 - 32
        if name != "none":  # the drafter saw the same context: same proposals, same acceptance
            for i in range(3):
                assert reqs[i].metrics.num_accepted_tokens_per_pos == reqs_off[i].metrics.num_accepted_tokens_per_pos


def test_reset_prefix_cache_forgets_pages_only_when_idle(target):
    """``reset_prefix_cache()`` (vLLM's name): refused while a request runs (the cache stays),
    then the same prompt prefills from scratch and decodes the same tokens."""
    prompt = prompts_with_repeats(1, seed=5, lo=39, hi=40)[0]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 + 64, max_model_len=128, page_size=8)
    engine = LLMEngine(target, config)

    def finish(rid):
        r = engine.add_request(rid, prompt, GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        return r

    first = finish("a")
    r = engine.add_request("b", prompt, GREEDY)
    engine.step()
    assert engine.reset_prefix_cache() is False and r.metrics.num_cached_tokens == 32
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.allocator.num_cached > 0 and engine.reset_prefix_cache() is True
    assert engine.allocator.num_cached == 0
    again = finish("c")
    assert again.metrics.num_cached_tokens == 0 and again.metrics.num_prefilled_tokens == len(prompt) - 1
    assert again.output_ids == first.output_ids == r.output_ids == solo(target, prompt, GREEDY)


@pytest.mark.parametrize("name", ["eagle-3", "eagle3-3"])
def test_eagle_state_after_a_prefix_hit_equals_a_full_prefill(target, drafters, name):
    """The EAGLE head's previous feature and its K/V for a prompt that starts from cached pages
    equal those of the same prompt prefilled from scratch (never drafted from garbage)."""
    d, dp = drafters[name]
    common = prompts_with_repeats(1, seed=4, lo=35, hi=36)[0]
    second = common + [3, 1, 4, 1, 5]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 4 + 64, max_model_len=128, page_size=8)

    def state_after_prefill(first):
        engine = LLMEngine(target, config, drafter=d, drafter_params=dp)
        if first:
            engine.add_request("a", common, SamplingParams(max_tokens=2))
            while engine.has_unfinished_requests():
                engine.step()
        r = engine.add_request("b", second, SamplingParams(max_tokens=5))
        while r.status.value in ("waiting", "prefilling"):
            engine.step()
        s = engine.runner.state
        slot = r.slot
        pos = np.arange(len(second) - 1)
        pages = np.asarray(s.cache.block_tables)[slot, pos // 8]
        kv = np.asarray(s.drafter.k_pages[0])[:, pages, pos % 8]
        return r, np.asarray(s.drafter.last_feature)[slot], kv

    hit, feat_hit, kv_hit = state_after_prefill(True)
    miss, feat_miss, kv_miss = state_after_prefill(False)
    assert hit.metrics.num_cached_tokens == 32 and miss.metrics.num_cached_tokens == 0
    # (EAGLE-3's features are the raw residual stream, up to ~100 here: float32 rounding of
    # another chunking shows at 1e-5 relative)
    np.testing.assert_allclose(feat_hit, feat_miss, rtol=1e-4, atol=1e-5 * np.abs(feat_miss).max())
    np.testing.assert_allclose(kv_hit, kv_miss, rtol=1e-4, atol=1e-5 * np.abs(kv_miss).max())


def test_sampled_requests_are_the_same_alone_and_batched(target, drafters):
    prompts = prompts_with_repeats(4, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in [(1.0, 0, 1.0, 1), (0.7, 10, 1.0, 2), (1.2, 0, 0.8, 3), (0.0, 0, 1.0, 4)]]
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 32, max_model_len=64, page_size=8)
    for name in ("none", "ngram-3", "draft-3"):
        d, dp = drafters[name]
        _, batched = run(target, [(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))], config, d, dp)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            _, alone = run(target, [(p, sp, 0)], config, d, dp)
            assert batched[i].output_ids == alone[0].output_ids, (name, i)


def test_per_request_speculation_off_or_lower(target, drafters):
    d, dp = drafters["self-draft-4"]
    prompts = prompts_with_repeats(3, seed=2)
    caps = [0, 1, None]
    requests = [(p, dataclasses.replace(GREEDY, num_speculative_tokens=c), 0) for p, c in zip(prompts, caps)]
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=3 * 5 + 32, max_model_len=64, page_size=8)
    _, reqs = run(target, requests, config, d, dp)
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, dataclasses.replace(sp, num_speculative_tokens=None))
    assert reqs[0].metrics.num_drafts == 0 and reqs[0].metrics.num_draft_tokens == 0
    assert reqs[1].metrics.num_draft_tokens == reqs[1].metrics.num_drafts > 0  # one draft per step
    assert reqs[2].metrics.num_draft_tokens > reqs[2].metrics.num_drafts
    n1, n2 = reqs[1].metrics.num_drafts, reqs[2].metrics.num_drafts  # draft positions each could fill
    assert reqs[1].eligible_per_pos == [n1, 0, 0, 0] and reqs[2].eligible_per_pos == [n2] * 4


def test_dynamic_k_is_lossless_and_measures_each_k(target):
    prompts = prompts_with_repeats(6, seed=5)
    requests = [(p, SamplingParams(max_tokens=20), i) for i, p in enumerate(prompts)]
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=3 * 5 + 32, max_model_len=64, page_size=8,
                          max_burst_steps=2)
    spec = SpecConfig("ngram", 4, ngram_min=1, dynamic_k=True)
    engine, reqs = run(target, requests, config, spec=spec)
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, sp)
    assert engine.cost.candidates == (0, 1, 2, 4)
    # each bucket times each k on its own; the bucket that ran most has timed every k
    most = max(engine.costs, key=lambda n: engine.stats.bursts_by_slots[n])
    assert all(t is not None for t in engine.costs[most].step_seconds.values()), engine.stats.bursts_by_slots
    # what the finished requests accepted is the prior of every bucket's estimates
    prior = engine.acceptance
    assert all(c.prior is prior for c in engine.costs.values())
    assert prior.steps > 0 and sum(prior.eligible) > 0 and 0 < sum(prior.accepted) <= sum(prior.eligible)
    # it learns the proposal share over the steps that ran at k >= 1 only
    done = list(reqs.values())
    assert all(r.spec_steps <= r.metrics.num_steps for r in done) and sum(r.spec_steps for r in done) > 0
    assert all(r.metrics.num_drafts <= r.spec_steps for r in done)


def test_calibration_times_every_k_at_every_bucket_and_leaves_nothing(target):
    """warmup() with dynamic k times every candidate k at every slot bucket on the real shapes
    (speculative steps that really propose: the lookup drafter's counters moved), leaves no
    request, page or step count behind, and later requests still equal their solo runs."""
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 5 + 32, max_model_len=256, page_size=8,
                          max_burst_steps=4)
    engine = LLMEngine(target, config, SpecConfig("ngram", 4, ngram_min=1, dynamic_k=True))
    engine.warmup()
    for n in engine.buckets:
        assert all(t is not None and t > 0 for t in engine.costs[n].step_seconds.values()), (n, engine.costs[n])
    assert int(np.asarray(engine.runner.state.proposed)[0].sum()) > 0  # the k = 4 run proposed drafts
    assert all(engine.calibration_drafted[n][0] == 0 for n in engine.buckets)
    # the context was prefilled for real (verification attends to true K/V, not unwritten pages)
    first = np.asarray(engine.runner.state.cache.k_pages[0])[:, engine.allocator.reserved]  # [KVH, S, D]
    assert (np.abs(first).sum(axis=(0, 2)) > 0).all()  # the table's first page: every position written
    assert not engine.has_unfinished_requests() and engine.allocator.num_free == engine.allocator.num_usable
    assert bool(np.asarray(engine.runner.state.done).all())
    prompts = prompts_with_repeats(3, seed=9)
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_ids for r in reqs] == [solo(target, p, GREEDY) for p in prompts]
    assert engine.stats.steps_run <= sum(r.metrics.num_steps for r in reqs)  # calibration's steps not counted


def test_a_saved_calibration_is_reused_by_the_same_engine_only(target, tmp_path, monkeypatch):
    """What ``jspec serve`` asks: a second engine of the same configs on the same machine takes
    the first one's saved step timings without running a burst; another layout measures anew."""
    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path))
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 5 + 32, max_model_len=128, page_size=8,
                          max_burst_steps=4)
    spec = SpecConfig("ngram", 4, ngram_min=1, dynamic_k=True)
    first = LLMEngine(target, config, spec)
    first.warmup(reuse_calibration=True)
    saved = list((tmp_path / "calibration").glob("*.json"))
    assert len(saved) == 1

    def counted(engine):
        bursts, run = [], engine.runner.burst
        engine.runner.burst = lambda *a, **kw: bursts.append(1) or run(*a, **kw)
        return bursts

    second = LLMEngine(target, config, spec)
    bursts = counted(second)
    out = second.calibrate(reuse=True)
    assert not bursts and out == {int(n): {int(k): v for k, v in ks.items()}
                                  for n, ks in json.loads(saved[0].read_text())["seconds"].items()}
    assert all(second.costs[n].step_seconds == first.costs[n].step_seconds for n in first.buckets)
    assert second.calibration_drafted == first.calibration_drafted
    other = LLMEngine(target, dataclasses.replace(config, max_num_seqs=4, max_num_batched_tokens=4 * 5 + 32), spec)
    bursts = counted(other)
    other.calibrate(reuse=True)
    assert bursts and len(list((tmp_path / "calibration").glob("*.json"))) == 2
    bursts = counted(first)
    first.calibrate()
    assert bursts  # reuse=False measures, whatever is saved


def test_nothing_compiles_after_warmup(target):
    """200 random requests (lengths, budgets, sampling settings, per-request caps, arrivals in
    waves that drain) through a warmed-up engine with dynamic k, its decode bursts at every
    slot bucket: not one compilation."""
    compiles = []  # lowerings too: with the persistent compilation cache a recompile may skip the backend
    listener = lambda event, duration, **kw: compiles.append(event) if event.endswith(  # noqa: E731
        ("backend_compile_duration", "jaxpr_to_mlir_module_duration")) else None
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 64, max_model_len=64, page_size=8,
                          max_burst_steps=4)
    engine = LLMEngine(target, config, SpecConfig("ngram", 3, ngram_min=1, dynamic_k=True))
    engine.warmup()
    rng = random.Random(0)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        added, wave = 0, 0
        while added < 200 or engine.has_unfinished_requests():
            if wave == 0 and not engine.has_unfinished_requests():  # waves that drain: every slot bucket runs
                wave = rng.randrange(1, 16)
            for _ in range(min(rng.randrange(0, 4), wave)):
                wave -= 1
                if added < 200:
                    prompt = [rng.randrange(0, 96) for _ in range(rng.randrange(1, 40))]
                    sp = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 0.0, 0.8]),
                                        top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.9]), seed=added,
                                        num_speculative_tokens=rng.choice([None, 0, 2]))
                    engine.add_request(str(added), prompt, sp)
                    added += 1
            engine.step()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert engine.stats.num_requests == 200
    assert all(n > 0 for n in engine.stats.bursts_by_slots.values()), engine.stats.bursts_by_slots  # 1, 2, 4
    assert compiles == []


def test_first_token_comes_back_right_after_prefill(target):
    """Bursts run up to max_burst_steps, but a new request's first token is not held back for a
    long one: the burst after its prefill is a single step (time to first token = prefill + one
    step), for a request alone and for one that joins a running one; then bursts are long again,
    and the outputs are the solo runs'."""
    config = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_burst_steps=8)
    engine = LLMEngine(target, config)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    a = engine.add_request("a", [5, 6, 7], sp)
    seen = []
    while engine.has_unfinished_requests():
        if len(a.output_ids) == 17:
            b = engine.add_request("b", [9, 8, 7, 6], sp)
        engine.step()
        seen.append((len(a.output_ids), len(engine.requests["b"].output_ids) if "b" in engine.requests else None))
    assert seen[:3] == [(0, None), (1, None), (9, None)]  # prefill; one step: first token; then 8 steps
    joined = next(i for i, (_, nb) in enumerate(seen) if nb is not None)
    assert [nb for _, nb in seen[joined:joined + 3]] == [0, 1, 9]  # b: prefill (a waits), one step, a burst
    assert seen[joined + 1][0] == seen[joined][0] + 1  # a ran that single step too
    assert a.output_ids == solo(target, [5, 6, 7], sp) and b.output_ids == solo(target, [9, 8, 7, 6], sp)
    r = jspec.generate(target, [[5, 6, 7]], sp)  # one burst for the rest: TTFT is no longer the total
    assert r.ttft_s < r.total_s


def test_add_request_refuses_what_can_never_fit(target):
    config = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, kv_cache_tokens=40)
    engine = LLMEngine(target, config)
    with pytest.raises(jspec.PromptError, match="max_model_len"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(jspec.PromptError, match="kv_cache_tokens"):
        engine.add_request("b", [5] * 30, SamplingParams(max_tokens=20))
    with pytest.raises(jspec.PromptError, match="outside"):
        engine.add_request("c", [500], SamplingParams())
    with pytest.raises(jspec.PromptError):
        engine.add_request("d", [], SamplingParams())
    with pytest.raises(jspec.ConfigError, match="SamplingParams"):
        engine.add_request("e", [5], {"max_tokens": 3})
    assert not engine.has_unfinished_requests()  # nothing was queued
    engine.add_request("f", [5, 6], SamplingParams(max_tokens=3))
    with pytest.raises(jspec.ConfigError, match="already in use"):
        engine.add_request("f", [5, 6], SamplingParams(max_tokens=3))


def test_the_default_pool_holds_every_slot_at_max_model_len_while_speculating(target, drafters):
    """With the default page pool, requests of exactly max_model_len tokens fill every slot at
    once while speculating (their last verification writes k + 1 rows past the budget's pages):
    none is refused and none is preempted (the pool used to hold max_model_len tokens a slot)."""
    d, dp = drafters["ngram-3"]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 4 + 32, max_model_len=64, page_size=8)
    prompts = prompts_with_repeats(2, seed=4, lo=20, hi=30)
    requests = [(p, SamplingParams(max_tokens=64 - len(p), ignore_eos=True), 0) for p in prompts]
    engine, reqs = run(target, requests, config, d, dp)
    for i, (p, sp, _) in enumerate(requests):
        assert reqs[i].output_ids == solo(target, p, sp)
        assert len(p) + len(reqs[i].output_ids) == 64
    assert engine.stats.preemptions == 0


def test_abort_frees_the_slot_and_pages(target):
    config = EngineConfig(max_num_seqs=2, max_model_len=64, page_size=8, max_burst_steps=2)
    engine = LLMEngine(target, config)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
    engine.add_request("b", [8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    out = engine.abort_request("a")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    engine.scheduler.check()
    assert engine.allocator.num_free == engine.allocator.num_usable
    assert len(engine.requests["b"].output_ids) == 5


def test_llm_front_door_in_vllm_convention(target):
    llm = jspec.LLM(target, max_num_seqs=2, max_model_len=64, page_size=8,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = prompts_with_repeats(3, seed=8)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=6 + i) for i in range(3)], use_tqdm=False)
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    for o, p, i in zip(outs, prompts, range(3)):
        assert o.finished and o.outputs[0].token_ids == solo(target, p, SamplingParams(max_tokens=6 + i))
        assert o.prompt_token_ids == p and o.metrics.num_output_tokens == len(o.outputs[0].token_ids)
    streamed = {}
    for o in llm.stream([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=6)):
        streamed.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
    assert list(streamed.values()) == [solo(target, prompts[0], SamplingParams(max_tokens=6))]
    with pytest.raises(jspec.ConfigError, match="speculative_config"):
        jspec.LLM(target, speculative_config={"method": "medusa"})
    with pytest.raises(jspec.PromptError, match="no prompts"):
        llm.generate([], use_tqdm=False)


def test_llm_generate_progress_bar(target, capsys):
    """use_tqdm: finished requests of the call, output tokens per second and the acceptance rate on
    stderr; the outputs are the same as without it."""
    llm = jspec.LLM(target, max_num_seqs=2, max_model_len=64, page_size=8,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = prompts_with_repeats(3, seed=8)
    quiet = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    capsys.readouterr()
    shown = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=True)
    err = capsys.readouterr().err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
    assert "3/3" in err and "out tok/s=" in err and re.search(r"accepted=\d\.\d\d", err), err


def test_prefill_width_weighs_padding_against_a_steps_overhead():
    """Where a step costs as much as 16 more prompt tokens (the CPU), a 110-token prompt with
    widths 16 / 64 / 256 goes in two 64-wide chunks, not one 256-wide chunk of mostly padding;
    long prompts still take the widest; with no overhead the smallest width that holds it."""
    def scheduler(overhead):
        return Scheduler(num_slots=1, table_width=8, allocator=PageAllocator(16, 16),
                         shapes=prefill_shapes(257, 1, (16, 64, 256)), max_burst_steps=16,
                         prefix_caching=False, step_overhead_tokens=overhead)

    cpu, free = scheduler(16), scheduler(None)
    assert [cpu.chunk_width(n) for n in (110, 46, 10, 230, 1000)] == [64, 64, 16, 256, 256]
    assert [free.chunk_width(n) for n in (110, 46, 10, 200, 1000)] == [256, 64, 16, 256, 256]


def test_lookup_history_drafts_from_finished_requests(target):
    """With ``ngram_history`` the lookup also searches finished requests' text: the same prompt
    run again is drafted from the first run's output (fewer steps, more accepted), its greedy
    tokens still equal the solo run's; after ``reset_lookup_history`` it takes the first run's
    steps again; replacing the history between bursts compiles nothing."""
    rng = random.Random(11)
    prompt = rng.sample(range(2, 96), 12)  # distinct tokens: the prompt alone gives the lookup little
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 5 + 32, max_model_len=64, page_size=8,
                          max_burst_steps=4)
    engine = LLMEngine(target, config, SpecConfig("ngram", 4, ngram_history=128))
    engine.warmup()
    want = solo(target, prompt, sp)  # (compiles a plain engine of its own)
    compiles = []
    listener = lambda event, duration, **kw: compiles.append(event) if event.endswith(  # noqa: E731
        ("backend_compile_duration", "jaxpr_to_mlir_module_duration")) else None

    def once(i):
        r = engine.add_request(str(i), prompt, sp)
        while engine.has_unfinished_requests():
            engine.step()
        assert r.output_ids == want
        return r.metrics

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        first, again = once(0), once(1)
        engine.reset_lookup_history()
        reset = once(2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert again.num_steps < first.num_steps and again.num_accepted_tokens > first.num_accepted_tokens, (first, again)
    assert (reset.num_steps, reset.num_accepted_tokens) == (first.num_steps, first.num_accepted_tokens)
    assert compiles == []
    history = np.asarray(engine.runner.drafter_params["history"])
    assert history[-len(prompt) - 24 - 1:].tolist() == [-1] + prompt + list(want)


def test_generate_bursts_are_short_with_dynamic_k(target):
    """generate() runs a request to its end in one burst, except with dynamic k: the host chooses
    k between bursts from the acceptance so far, so bursts of DYNAMIC_K_BURST_STEPS."""
    from jspec.engine.generate import DYNAMIC_K_BURST_STEPS, engine_config

    ids = [[1, 2, 3]]
    assert engine_config(target, ids, SamplingParams(max_tokens=100), 4).max_burst_steps == 101
    assert engine_config(target, ids, SamplingParams(max_tokens=100), 4, dynamic_k=True).max_burst_steps == \
        DYNAMIC_K_BURST_STEPS
    assert engine_config(target, ids, SamplingParams(max_tokens=5), 4, dynamic_k=True).max_burst_steps == 6


@pytest.mark.parametrize("kv_cache_dtype, array_dtype", [("float16", jnp.float16), ("fp8", jnp.float8_e4m3fn)])
def test_narrow_kv_pages_keep_speculation_lossless(target, drafters, kv_cache_dtype, array_dtype):
    """With the page pools in 16 or 8 bits (EngineConfig.kv_cache_dtype; bfloat16 and fp8_e5m2
    take the same paths, their conversions tested with the kernels) every drafter's greedy tokens
    equal plain decoding's on the same pages (both read the same rounded K/V), the pools (the
    target's and a drafter's own) hold that dtype, and they take half (a quarter of) the bytes of
    float32 pages."""
    prompts = prompts_with_repeats(4, seed=7)
    requests = [(p, dataclasses.replace(GREEDY, max_tokens=10 + 2 * i), [0, 1, 3, 4][i]) for i, p in enumerate(prompts)]
    config = EngineConfig(max_num_seqs=2, max_num_batched_tokens=2 * 5 + 32, max_model_len=128, page_size=8,
                          max_burst_steps=4, kv_cache_dtype=kv_cache_dtype)
    plain, base = run(target, requests, config)
    cache = plain.runner.state.cache
    assert all(p.dtype == array_dtype for p in cache.k_pages + cache.v_pages)
    full = run(target, requests[:1], dataclasses.replace(config, kv_cache_dtype="auto"))[0].runner.state.cache
    assert full.k_pages[0].dtype == jnp.float32 and 4 // jnp.dtype(array_dtype).itemsize * cache.nbytes() == full.nbytes()
    for name in ("ngram-3", "draft-3", "eagle-3"):
        d, dp = drafters[name]
        engine, reqs = run(target, requests, config, d, dp)
        for i in base:
            assert reqs[i].output_ids == base[i].output_ids, (kv_cache_dtype, name, i)
        own = engine.runner.state.drafter
        if name != "ngram-3":  # a draft model's and an EAGLE head's pages follow the target's
            assert own.k_pages[0].dtype == array_dtype


def test_kv_cache_dtype_is_checked():
    with pytest.raises(jspec.ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8_e4m3fnuz")


def test_kv_cache_dtype_names_map_to_page_dtypes(target):
    """vLLM's names to the pages' dtypes ("fp8" is E4M3), and the memory checks count their bytes
    (what `jspec generate` checks before loading)."""
    from jspec.config import kv_cache_array_dtype
    from jspec.loading import memory

    names = {n: kv_cache_array_dtype(n, "float32") for n in ("auto", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")}
    assert names == {"auto": "float32", "float16": "float16", "fp8": "float8_e4m3fn",
                     "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
    full = memory.kv_cache_bytes(target.config, 64, "float32")
    assert [memory.kv_cache_bytes(target.config, 64, names[n]) * 4 // full for n in ("fp8", "fp8_e5m2")] == [1, 1]


def test_fp8_pages_refuse_the_triton_kernel(target):
    """The Triton kernel does not read 8-bit pages: asked for by name it is a ConfigError before
    anything is built ("auto" on a GPU runs the xla path for them instead)."""
    with pytest.raises(jspec.ConfigError, match="does not read fp8 pages"):
        LLMEngine(target, EngineConfig(attention="interpret", kv_cache_dtype="fp8_e5m2"))
