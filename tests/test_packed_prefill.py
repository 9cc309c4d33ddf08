"""Packed prefill: a segment whose real tokens are packed into fewer rows of the forward
(``Segment.packed``) computes exactly what the same segment padded to its grid computes (logits,
hidden states, K/V pages, lengths), on the plain and the CPU model paths; the scheduler packs
many short prompts into one step; and an engine whose steps pack gives every request the
tokens it gets alone, with every drafter."""


import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from helpers import tiny_config, tiny_model
from jspec.cache import init_cache
from jspec.cache.allocator import PageAllocator
from jspec.config import EngineConfig, SamplingParams
from jspec.engine import engine as engine_module
from jspec.engine.engine import LLMEngine
from jspec.engine.request import Request, RequestMetrics
from jspec.engine.scheduler import PrefillShape, Scheduler, prefill_shapes
from jspec.models import cpu_path
from jspec.models.llama import LlamaForCausalLM, Segment, forward_segments, pack_index
from parallel_helpers import drafter as parallel_drafter

GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return tiny_model(tiny_config(num_layers=2, vocab_size=128), scale=4.0)  # the parallel drafters' vocabulary


def test_pack_index_lists_real_positions_then_padding():
    assert pack_index(np.array([2, 0, 3]), 4, 8).tolist() == [0, 1, 8, 9, 10, 12, 12, 12]


@pytest.mark.parametrize("module_cls", [LlamaForCausalLM, cpu_path.LlamaForCausalLM], ids=["plain", "cpu-path"])
def test_a_packed_segment_computes_what_the_padded_grid_computes(model, module_cls):
    cfg, page = model.config, 4
    b, width = 5, 8
    tables = jnp.arange(b * 6, dtype=jnp.int32).reshape(b, 6) + 1
    lengths = jnp.array([3, 0, 7, 1, 0], jnp.int32)  # rows already hold some tokens
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, 1 + b * 6, page, lengths=lengths)
    rng = np.random.default_rng(0)
    cache = cache.replace(k_pages=tuple(jnp.asarray(rng.normal(size=p.shape), p.dtype) for p in cache.k_pages),
                          v_pages=tuple(jnp.asarray(rng.normal(size=p.shape), p.dtype) for p in cache.v_pages))
    decode = Segment(jnp.asarray(rng.integers(2, cfg.vocab_size, (2, 1)), jnp.int32), jnp.array([1, 1], jnp.int32),
                     jnp.array([0, 3], jnp.int32))
    q_lens = np.array([5, 8, 2, 0], np.int32)  # the last row is padding
    tokens = np.where(np.arange(width)[None] < q_lens[:, None], rng.integers(2, cfg.vocab_size, (4, width)), 0)
    rows = np.array([1, 2, 4, b], np.int32)
    grid = Segment(jnp.asarray(tokens, jnp.int32), jnp.asarray(q_lens), jnp.asarray(rows))
    packed = grid._replace(packed=jnp.asarray(pack_index(q_lens, width, 16)))  # 15 real tokens in 16 rows

    def run(seg):
        return forward_segments(model.params, cfg, (decode, seg), cache, attention="reference",
                                logits_for=(True, True), feature_layers=(0,), module_cls=module_cls)

    (dl_a, pl_a), (dh_a, ph_a), ca = run(grid)
    (dl_b, pl_b), (dh_b, ph_b), cb = run(packed)
    real = np.arange(width)[None] < q_lens[:, None]
    np.testing.assert_allclose(dl_a, dl_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dh_a, dh_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pl_a)[real], np.asarray(pl_b)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ph_a)[real], np.asarray(ph_b)[real], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ca.lengths, cb.lengths)
    np.testing.assert_array_equal(ca.lengths, lengths + jnp.array([1, 5, 8, 1, 2]))
    for ka, kb in zip(ca.k_pages + ca.v_pages, cb.k_pages + cb.v_pages):
        np.testing.assert_allclose(ka, kb, rtol=1e-5, atol=1e-5)


def _request(i: int, n: int) -> Request:
    ids = [2 + (i + j) % 50 for j in range(n)]
    return Request(str(i), None, ids, SamplingParams(max_tokens=4), 0, RequestMetrics(0.0), order=i)


def test_the_scheduler_packs_many_short_prompts_into_one_step():
    shapes = prefill_shapes(256, 32, (16, 64, 256))
    assert PrefillShape(32, 16, 256) in shapes and not any(s.packed for s in shapes if s.width == 256)
    alloc = PageAllocator(num_pages=400, page_size=8)
    sched = Scheduler(num_slots=32, table_width=8, allocator=alloc, shapes=shapes, max_burst_steps=4,
                      prefix_caching=False, step_overhead_tokens=16)
    for i in range(30):
        sched.waiting.append(_request(i, 9))  # 8 tokens to prefill each
    plan = sched.plan(0)
    pf = plan.prefill
    assert pf.shape.packed and pf.shape.width == 16
    assert len(pf.chunks) == 30 and sum(c.length for c in pf.chunks) == 240 <= pf.shape.tokens
    # unpacked, the same width prefills at most 16 of them a step
    assert max(s.rows for s in shapes if s.width == 16 and not s.packed) == 16
    sched.check()


@pytest.mark.parametrize("name", ["none", "ngram", "draft", "eagle"])
def test_packed_steps_give_every_request_its_solo_tokens(model, name):
    """Forty short prompts at once into sixteen slots whose prefill steps pack: each request's
    greedy tokens equal its run alone, and packed prefill steps did run."""

    cfg = model.config
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, rng.integers(2, 14))] for _ in range(40)]
    drafter, dparams = parallel_drafter(name, model)  # the tensor-parallel tests' drafters
    k = 0 if drafter is None else drafter.k
    config = EngineConfig(max_num_seqs=16, max_num_batched_tokens=16 * (k + 1) + 128, max_model_len=64,
                          page_size=8, max_burst_steps=4)
    engine = LLMEngine(model, config, drafter=drafter, drafter_params=dparams)
    assert any(s.packed for s in engine.prefill_shapes)
    seen = []
    original = engine_module.prefill_segment

    def spy(shape, chunks, pad_row):
        seen.append((shape.packed, len(chunks)))
        return original(shape, chunks, pad_row)

    engine_module.prefill_segment = spy
    try:
        reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
        for _ in engine.step_until_done():
            engine.scheduler.check()
    finally:
        engine_module.prefill_segment = original
    assert any(packed and n > 4 for packed, n in seen), seen
    for p, r in zip(prompts, reqs):
        assert r.output_ids == jspec.generate(model, [p], GREEDY).token_ids[0], name

