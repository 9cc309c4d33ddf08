"""Plain (autoregressive) generation on tiny random models: cache, loop, batching, sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jspec
from helpers import tiny_config, tiny_model
from jspec.cache import init_cache
from jspec.models.llama import forward

PROMPTS = [[5, 9, 3, 17, 2, 44, 8], [7, 7], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(scale=4.0)


def naive_greedy(model, prompt, n):
    """Recompute the whole sequence every step (no cache reuse): the oracle for the loop."""
    cfg = model.config
    ids = list(prompt)
    fwd = jax.jit(lambda p, t, c, q: forward(p, cfg, t, c, q, attention="reference").logits)
    for _ in range(n):
        pages = -(-len(ids) // 16)
        cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                           jnp.arange(pages, dtype=jnp.int32)[None], pages, 16)
        logits = fwd(model.params, jnp.asarray([ids]), cache, jnp.asarray([len(ids)], jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


def test_greedy_equals_recompute_oracle(model):
    sp = jspec.SamplingParams(max_tokens=12, ignore_eos=True)
    out = jspec.generate(model, PROMPTS, sp)
    for p, got in zip(PROMPTS, out.token_ids):
        assert got == naive_greedy(model, p, 12)
    assert out.num_tokens == 36 and out.finish_reasons == ["length"] * 3
    assert out.num_target_forwards == 12 and out.mean_accepted_length is None


def test_batch_equals_each_prompt_alone(model):
    for sp in [jspec.SamplingParams(max_tokens=10, ignore_eos=True),
               jspec.SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_tokens=10, seed=3, ignore_eos=True)]:
        batch = jspec.generate(model, PROMPTS, sp, seeds=[11, 12, 13])
        for i, p in enumerate(PROMPTS):
            alone = jspec.generate(model, [p], sp, seeds=[11 + i])
            assert alone.token_ids[0] == batch.token_ids[i], (sp, i)


def test_sampling_reproducible_by_seed(model):
    sp = jspec.SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    a = jspec.generate(model, PROMPTS, sp).token_ids
    b = jspec.generate(model, PROMPTS, sp).token_ids
    c = jspec.generate(model, PROMPTS, dataclasses.replace(sp, seed=8)).token_ids
    assert a == b
    assert a != c


def test_paging_geometry_does_not_change_output(model):
    sp = jspec.SamplingParams(max_tokens=10, ignore_eos=True)
    base = jspec.generate(model, PROMPTS, sp).token_ids
    for cc in [jspec.CacheConfig(page_size=4, shuffle_pages=True), jspec.CacheConfig(page_size=8, prefill_chunk=4),
               jspec.CacheConfig(page_size=32, prefill_chunk=1)]:
        assert jspec.generate(model, PROMPTS, sp, cache_config=cc).token_ids == base, cc


def test_eos_stops_each_sequence(model):
    sp = jspec.SamplingParams(max_tokens=12, ignore_eos=True)
    free = jspec.generate(model, PROMPTS, sp).token_ids
    eos = free[0][4]  # make the 5th token of sequence 0 an EOS
    cfg = dataclasses.replace(model.config, eos_token_ids=(eos,))
    m2 = dataclasses.replace(model, config=cfg)
    out = jspec.generate(m2, PROMPTS, dataclasses.replace(sp, ignore_eos=False))
    for got, ref in zip(out.token_ids, free):
        cut = ref.index(eos) + 1 if eos in ref else len(ref)
        assert got == ref[:cut]
    assert out.finish_reasons[0] == "eos" and len(out.token_ids[0]) <= 5


def test_streaming_yields_the_same_tokens(model):
    sp = jspec.SamplingParams(max_tokens=11, ignore_eos=True)
    whole = jspec.generate(model, PROMPTS, sp).token_ids
    got = [[] for _ in PROMPTS]
    calls = []

    def on_tokens(new):
        calls.append(new)
        for g, n in zip(got, new):
            g.extend(n)

    streamed = jspec.generate(model, PROMPTS, sp, on_tokens=on_tokens, stream_interval=3)
    assert got == whole == streamed.token_ids
    assert len(calls) >= 4  # 1 first step + 10 more in bursts of 3


def test_gqa_and_tied_variants_run(model):
    for cfg in [tiny_config(num_kv_heads=1), tiny_config(num_kv_heads=4, tie_word_embeddings=True)]:
        m = tiny_model(cfg, scale=4.0)
        out = jspec.generate(m, PROMPTS[:2], jspec.SamplingParams(max_tokens=6, ignore_eos=True))
        assert out.token_ids[0] == naive_greedy(m, PROMPTS[0], 6)


@pytest.mark.parametrize("spec", [jspec.SpecConfig(), jspec.SpecConfig("ngram", 3)])
def test_a_new_prompt_length_reuses_the_compiled_loop(model, spec):
    """Shapes are bucketed: after one call, a prompt of another length (same bucket) compiles nothing."""
    sp = jspec.SamplingParams(max_tokens=4, ignore_eos=True)
    jspec.generate(model, [[5, 9]], sp, spec=spec)
    again = jspec.generate(model, [list(range(11, 28))], sp, spec=spec)  # 17 tokens: same prefill chunk
    assert again.compile_s == 0.0
    assert again.num_tokens == 4
