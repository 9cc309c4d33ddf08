"""The engine-layout planner (jspec.engine.layout) from configs alone. The numbers pinned below
are what LLMEngine's own sizing code derived for these configs at commit 0b68fa1 (engines built
and read back; the tensor-parallel ones on 4 host devices); the engine takes them from the
planner."""

import dataclasses

import pytest

from helpers import tiny_config, tiny_model
from jspec.config import CacheConfig, EngineConfig, SamplingParams
from jspec.engine import layout as layout_lib
from jspec.engine.engine import LLMEngine
from jspec.engine.layout import EngineLayout, fit_max_model_len, plan_layout
from jspec.errors import ConfigError
from jspec.models.tensor_parallel import tp_config
from jspec.speculative.drafters import NgramDrafter

TARGET = tiny_config(num_layers=3)  # 3 layers, 2 KV heads of 16, float32, context 512
DRAFT = tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1)

S16_256 = ((1, 16), (4, 16), (1, 64), (4, 64), (1, 256))  # the prefill shapes of a budget of 256..511
# name: (model config, engine config, k_max, drafter pages, pinned numbers)
# pinned: max_model_len, buffer_len, table_width, num_pages, prefill_shapes ((rows, width), or
# (rows, width, tokens) where packed), buckets, memory bytes, described pool
CASES = {
    "default": (TARGET, EngineConfig(), 0, None,
                (512, 528, 33, 265, ((1, 16), (4, 16), (16, 16), (1, 64), (4, 64), (1, 256)), (1, 2, 4, 8), 3273216,
                 "a KV cache of 4,240 tokens and 8 slots of 528 tokens")),
    "ngram": (TARGET, EngineConfig(max_num_seqs=4, max_model_len=100, page_size=8), 3, None,
              (100, 104, 13, 53, S16_256, (1, 2, 4), 327296, "a KV cache of 424 tokens and 4 slots of 104 tokens")),
    "draft model, bfloat16 pages": (
        TARGET, EngineConfig(max_num_seqs=3, max_model_len=200, kv_cache_tokens=1000, page_size=32,
                             max_num_batched_tokens=300, kv_cache_dtype="bfloat16"), 4, DRAFT,
        (200, 224, 7, 33, S16_256, (1, 2, 3), 475776, "a KV cache of 1,056 tokens and 3 slots of 224 tokens")),
    "pages of one token": (
        TARGET, EngineConfig(max_num_seqs=13, max_model_len=77, max_num_batched_tokens=2048, page_size=1), 0, None,
        (77, 78, 78, 1015, ((1, 32), (4, 32), (16, 32), (1, 128), (4, 128), (1, 512)), (1, 2, 4, 8, 13), 783576,
         "a KV cache of 1,015 tokens and 13 slots of 78 tokens")),
    "many slots: packed prefill shapes": (
        TARGET, EngineConfig(max_num_seqs=64, max_model_len=64, max_num_batched_tokens=64 + 512), 0, None,
        (64, 80, 5, 321, ((1, 32), (4, 32), (16, 32), (64, 32, 128), (64, 32, 256), (64, 32, 512), (1, 128), (4, 128),
          (16, 128, 512), (1, 512)),
         (1, 2, 4, 8, 16, 32, 64), 3964928, "a KV cache of 5,136 tokens and 64 slots of 80 tokens")),
    "one chunk width left": (
        TARGET, EngineConfig(max_num_seqs=2, max_num_batched_tokens=26, max_model_len=64, page_size=64), 4, None,
        (64, 128, 2, 5, ((1, 16),), (1, 2), 246784, "a KV cache of 320 tokens and 2 slots of 128 tokens")),
    "fp8 pages and a draft model's": (
        TARGET, EngineConfig(max_num_seqs=2, max_model_len=90, kv_cache_dtype="fp8"), 2, DRAFT,
        (90, 96, 6, 13, S16_256, (1, 2), 47360, "a KV cache of 208 tokens and 2 slots of 96 tokens")),
    "tensor parallel 2": (
        tp_config(TARGET, 2), EngineConfig(tensor_parallel_size=2, max_num_seqs=2, max_model_len=128), 0, None,
        (128, 144, 9, 19, S16_256, (1, 2), 117888, "a KV cache of 304 tokens and 2 slots of 144 tokens")),
    "tensor parallel 4, KV heads repeated": (
        tp_config(TARGET, 4), EngineConfig(tensor_parallel_size=4, max_num_seqs=3, max_model_len=60, page_size=4,
                                           kv_cache_tokens=333), 2, None,
        (60, 64, 16, 85, S16_256, (1, 2, 3), 131328, "a KV cache of 340 tokens and 3 slots of 64 tokens")),
}


@pytest.mark.parametrize("name", list(CASES))
def test_layouts_pinned(name):
    model, config, k, draft, want = CASES[name]
    lay = plan_layout(model, config, k_max=k, draft=draft)
    shapes = tuple(tuple(s) if s.packed else (s.rows, s.width) for s in lay.prefill_shapes)
    got = (lay.max_model_len, lay.buffer_len, lay.table_width, lay.num_pages, shapes, lay.buckets,
           lay.memory_bytes, lay.describe())
    assert got == want
    assert all(s.tokens in ((lay.prefill_budget // 4, lay.prefill_budget // 2, lay.prefill_budget) if s.packed else (s.rows * s.width,))
               for s in lay.prefill_shapes)
    assert lay.k_max == k and lay.num_slots == config.max_num_seqs and lay.page_size == config.page_size
    assert lay.usable_pages == lay.num_pages - 1 and lay.pool_tokens == lay.num_pages * lay.page_size


@pytest.mark.parametrize("config, k, message", [
    (EngineConfig(max_model_len=100000), 0, r"^max_model_len 100000 exceeds the model's context \(512\)$"),
    (EngineConfig(max_num_seqs=8, max_num_batched_tokens=50), 4,
     r"^max_num_batched_tokens \(50\) must hold every slot's decode rows \(8 x 5\) plus a prefill chunk of >= 16 "
     r"tokens$"),
])
def test_layouts_refused(config, k, message):
    with pytest.raises(ConfigError, match=message):
        plan_layout(TARGET, config, k_max=k)


def test_the_engine_takes_its_layout_from_the_planner():
    target = tiny_model(TARGET)
    config = EngineConfig(max_num_seqs=4, max_model_len=100, page_size=8)
    engine = LLMEngine(target, config, drafter=NgramDrafter(3, 3, 1))
    assert engine.layout == plan_layout(TARGET, config, k_max=3)
    assert (engine.k_max, engine.max_model_len, engine.buffer_len) == (3, 100, 104)
    assert engine.allocator.num_pages == 53 and engine.scheduler.tables().shape == (4, 13)


def test_layout_is_frozen_and_max_request_tokens():
    lay = plan_layout(TARGET, EngineConfig(max_num_seqs=1, max_model_len=500, kv_cache_tokens=64), k_max=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.num_pages = 1
    assert isinstance(lay, EngineLayout)
    # a pool of 4 usable pages of 16 holds 64 tokens, 4 of them one verification's rows
    assert lay.max_request_tokens == 60
    assert plan_layout(TARGET, EngineConfig(max_model_len=100)).max_request_tokens == 100


def test_front_end_sizing_pinned():
    """What jspec.generate's engine_config and jspec generate's max_model_len gave at commit 0b68fa1."""
    from jspec.cli.checks import run_tokens
    from jspec.engine.generate import engine_config

    target = tiny_model(TARGET)
    cases = [([[1] * 10, [2] * 37], SamplingParams(max_tokens=20), 0, CacheConfig(), {}, (2, 514, 64, 160, 16, 21)),
             ([[1] * 100], SamplingParams(max_tokens=300), 4, CacheConfig(page_size=128), {"max_num_seqs": 1},
              (1, 517, 448, 512, 128, 301)),
             ([[1] * 5] * 40, SamplingParams(max_tokens=600), 3, CacheConfig(prefill_chunk=100), {"dynamic_k": True},
              (40, 800, 512, 21120, 16, 16))]
    for ids, sp, k, cache, kw, want in cases:
        c = engine_config(target, ids, sp, k, cache, **kw)
        assert (c.max_num_seqs, c.max_num_batched_tokens, c.max_model_len, c.kv_cache_tokens, c.page_size,
                c.max_burst_steps) == want
    assert [run_tokens(0, n, 0, ps, ctx, chat) for n, ps, ctx, chat in
            [(50, 16, 512, False), (50, 16, 512, True), (500, 128, 512, False), (1000, 16, 2048, True)]] == \
        [64, 320, 512, 1280]
    assert fit_max_model_len(65, 512) == 128 and fit_max_model_len(600, 512) == 512
    assert layout_lib.batched_tokens(8, 4) == 8 * 5 + 256


def test_the_default_pool_is_cut_to_the_memory_budget():
    """Without kv_cache_tokens the pool is every slot at full length where that fits the budget,
    else the most whole pages that do (never less than one slot's buffer); a given pool is kept."""
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024)
    full = plan_layout(TARGET, config, k_max=4)
    assert plan_layout(TARGET, config, k_max=4, memory_budget=full.memory_bytes) == full
    budget = full.memory_bytes // 10
    cut = plan_layout(TARGET, config, k_max=4, memory_budget=budget)
    assert cut.sized_by_memory and not full.sized_by_memory
    assert cut.memory_bytes <= budget < plan_layout(TARGET, dataclasses.replace(
        config, kv_cache_tokens=cut.pool_tokens), k_max=4).memory_bytes + cut.memory_bytes // cut.num_pages * 2
    assert cut.buffer_len == full.buffer_len and cut.num_slots == 64 and cut.max_request_tokens == cut.max_model_len
    one_slot = plan_layout(TARGET, config, k_max=4, memory_budget=1)
    assert one_slot.usable_pages * one_slot.page_size == one_slot.buffer_len  # the floor: one full request
    given = dataclasses.replace(config, kv_cache_tokens=4096)
    assert plan_layout(TARGET, given, k_max=4, memory_budget=1) == plan_layout(TARGET, given, k_max=4)
    # a drafter's own pages and tensor parallelism share the same budget per device
    with_draft = plan_layout(TARGET, config, k_max=4, draft=DRAFT, memory_budget=budget)
    assert with_draft.memory_bytes <= budget and with_draft.num_pages < cut.num_pages
    tp = plan_layout(tp_config(TARGET, 2), dataclasses.replace(config, tensor_parallel_size=2), k_max=4,
                     memory_budget=budget)
    assert tp.memory_bytes <= budget and tp.num_pages > cut.num_pages


def test_an_engine_of_more_slots_than_memory_for_full_length_serves_them_all(monkeypatch):
    """64 slots whose full-length pool would need ~10x the memory there is: the engine starts with
    the pool that fits, admits requests as pages allow, and every output equals a roomy engine's."""
    from jspec.loading import memory

    target = tiny_model(TARGET)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=256)
    full = plan_layout(TARGET, config)
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: full.memory_bytes // 9)
    small = LLMEngine(target, config)
    assert small.layout.sized_by_memory and small.layout.memory_bytes <= full.memory_bytes // 10 + 1
    monkeypatch.undo()
    roomy = LLMEngine(target, dataclasses.replace(config, kv_cache_tokens=full.pool_tokens))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = {}
    for name, engine in (("small", small), ("roomy", roomy)):
        for i in range(80):
            engine.add_request(str(i), [3 + i % 50, 7, 11 + i % 7] * (1 + i % 20), params)
        texts = {}
        for step in engine.step_until_done():
            for o in step:
                if o.finished:
                    texts[o.request_id] = o.outputs[0].token_ids
        outs[name] = texts
    assert len(outs["small"]) == 80 and outs["small"] == outs["roomy"]
    assert small.allocator.num_free == small.allocator.num_usable
