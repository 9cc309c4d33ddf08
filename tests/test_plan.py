"""``jspec plan`` and :func:`jspec.engine.plan.plan_run`: bytes per device, the KV tokens that
fit and the programs to compile, from a config alone; refusals with the reason; and the engine
sizing itself with the same arithmetic (the plan is what the run does)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from helpers import TINY, tiny_model
from jspec.cli import main
from jspec.config import EngineConfig
from jspec.engine.engine import LLMEngine
from jspec.engine.layout import step_variants
from jspec.engine.plan import plan_run
from jspec.errors import ConfigError, InsufficientMemoryError
from jspec.loading import memory, read_config

CONFIGS = Path(__file__).resolve().parents[1] / "docs" / "configs"
GiB = 1 << 30


def llama8b():
    return read_config(str(CONFIGS / "llama-3.1-8b.json"), "bfloat16")


def test_shipped_configs_give_the_published_parameter_counts():
    counts = {path.stem: read_config(str(path), "bfloat16").num_params() / 1e9 for path in CONFIGS.glob("*.json")}
    assert counts == pytest.approx({"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-3.1-405b": 405.85,
                                    "qwen3-8b": 8.19, "qwen3-32b": 32.76, "gemma-3-27b": 27.01}, abs=0.01)


def test_the_plan_of_gemma_3_27b_counts_its_language_model_by_hand():
    """Gemma-3-27B's config.json (multimodal: the language model in text_config over
    Gemma3TextConfig's defaults): the weights, counted here from its published shapes, and its
    layers' kinds; tp 2 on two 80 GiB devices splits them."""
    cfg = read_config(str(CONFIGS / "gemma-3-27b.json"), "bfloat16")
    assert cfg.architecture == "gemma3_text" and cfg.qk_norm and cfg.tie_word_embeddings
    assert cfg.layer_types.count("full") == 10 and cfg.layer_types[5] == "full" and cfg.sliding_window == 1024
    assert (cfg.query_pre_attn_scalar, cfg.rope_linear_factor, cfg.local_rope_theta) == (168, 8.0, 1e4)
    h, layer_params = 5376, 5376 * (32 + 16 + 16) * 128 + 32 * 128 * 5376 + 3 * 5376 * 21504 + 4 * 5376 + 2 * 128
    params = 262208 * h + 62 * layer_params + h
    plan = plan_run(cfg, device_memory=192 * GiB)
    assert plan.weight_bytes == 2 * params
    assert plan.kv_bytes_per_token == 2 * 62 * 16 * 128 * 2
    tp2 = plan_run(cfg, EngineConfig(tensor_parallel_size=2), device_memory=80 * GiB)
    assert params < tp2.weight_bytes < params + 2 * (4 * 62 + 1) * h * 2


def test_the_plan_of_llama_8b_on_80_gib_by_hand():
    """Weights, KV bytes per token and the pool, each computed here from the config's numbers."""
    cfg = llama8b()
    config = EngineConfig(max_num_seqs=64, max_model_len=32768, max_num_batched_tokens=512)
    plan = plan_run(cfg, config, device_memory=80 * GiB)  # every slot at full length: 256 GiB of pages
    weights = 8_030_261_248 * 2
    assert plan.weight_bytes == weights
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, head dim, bf16
    budget = int((80 * GiB - weights - plan.activation_bytes) * 0.9)
    page = 16 * plan.kv_bytes_per_token
    buffer = 64 * (32768 + 16) * 4  # the int32 token buffer: 64 slots of 32768 + 1 tokens in whole pages
    pages = (budget - buffer) // page  # the null page included
    assert plan.layout.num_pages == pages and plan.layout.sized_by_memory
    assert plan.kv_tokens == plan.fit_tokens == (pages - 1) * 16
    assert plan.full_length_requests == plan.kv_tokens // (32768 + 16)
    assert plan.device_bytes <= 80 * GiB
    # fewer slots: every slot at full length fits, so that is what is allocated; more would fit
    few = plan_run(cfg, dataclasses.replace(config, max_num_seqs=4), device_memory=80 * GiB)
    assert not few.layout.sized_by_memory and few.kv_tokens == 4 * (32768 + 16)
    assert few.fit_tokens == ((budget - 4 * (32768 + 16) * 4) // page - 1) * 16 > few.kv_tokens
    # tensor parallelism splits the weights and the pages (8 KV heads over 4 devices: 2 each)
    tp4 = plan_run(cfg, dataclasses.replace(config, tensor_parallel_size=4), device_memory=80 * GiB)
    assert tp4.kv_bytes_per_token == plan.kv_bytes_per_token // 4
    assert weights // 4 < tp4.weight_bytes < weights // 4 + 2 * 65 * 4096 * 2  # + the copied norms
    assert tp4.kv_tokens > 4 * plan.kv_tokens


def test_a_given_pool_is_not_cut_and_the_programs_are_the_warmups():
    cfg = llama8b()
    config = EngineConfig(max_num_seqs=8, max_model_len=4096, kv_cache_tokens=10_000)
    plan = plan_run(cfg, config, k_max=4, dynamic_k=True, device_memory=80 * GiB)
    assert plan.kv_tokens >= 10_000 and not plan.layout.sized_by_memory
    ks = sorted({k for k, _ in plan.variants.decode})
    assert ks == [0, 1, 2, 4]  # dynamic k: none, 1, 2 and the maximum
    assert plan.variants.count == len(ks) * len(plan.layout.buckets) + len(plan.layout.prefill_shapes) + 1
    fixed = plan_run(cfg, config, k_max=4, device_memory=80 * GiB)
    assert sorted({k for k, _ in fixed.variants.decode}) == [4]


def test_refusals_name_the_reason():
    seventy = read_config(str(CONFIGS / "llama-3.1-70b.json"), "bfloat16")
    with pytest.raises(InsufficientMemoryError, match=r"weights .* do not fit in 80\.0 GiB; --tp 2 would hold them"):
        plan_run(seventy, EngineConfig(), device_memory=80 * GiB)
    big = read_config(str(CONFIGS / "llama-3.1-405b.json"), "bfloat16")
    long = EngineConfig(max_num_seqs=1, max_model_len=131072, tensor_parallel_size=8)
    with pytest.raises(InsufficientMemoryError, match="lower --max-model-len"):
        plan_run(big, long, device_memory=100 * GiB)  # 94.5 GiB of weights leave room for ~80k tokens
    assert plan_run(big, long, device_memory=192 * GiB).full_length_requests >= 1
    with pytest.raises(ConfigError, match="heads"):
        plan_run(TINY, EngineConfig(tensor_parallel_size=3))


def test_the_engine_sizes_itself_with_the_plan(monkeypatch):
    """With the free memory pinned, the engine's layout is the plan's for a device of that free
    memory plus the weights, and so are the programs it compiles."""
    target = tiny_model(TINY)
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256)
    full = plan_run(TINY, config).layout
    free = full.memory_bytes // 3 + memory.activation_bytes(TINY, 256)
    monkeypatch.setattr(memory, "available_bytes", lambda device=None: free)
    engine = LLMEngine(target, config)
    plan = plan_run(TINY, config, device_memory=free + memory.weights_bytes(TINY))
    assert engine.layout.sized_by_memory and engine.layout == plan.layout
    assert engine.step_variants == plan.variants == step_variants(plan.layout.buckets, plan.layout.prefill_shapes, 0,
                                                                  False)


def test_parse_bytes():
    assert memory.parse_bytes("192GiB") == 192 * GiB
    assert memory.parse_bytes("80 GB") == 80 * 10**9
    assert memory.parse_bytes("1.5TiB") == int(1.5 * (1 << 40))
    assert memory.parse_bytes("4096") == 4096
    for bad in ("lots", "-1GiB", "0", "12 parsecs"):
        with pytest.raises(ValueError):
            memory.parse_bytes(bad)


def test_read_config_from_a_lone_config_json_equals_the_checkpoints(tmp_path, tiny_hf_llama):
    lone = tmp_path / "config.json"
    lone.write_text((Path(tiny_hf_llama) / "config.json").read_text())
    assert read_config(str(lone)) == read_config(str(tiny_hf_llama))
    only = tmp_path / "only"
    only.mkdir()
    (only / "config.json").write_text(lone.read_text())  # a directory without weights
    assert read_config(str(only), "bfloat16") == dataclasses.replace(read_config(str(lone)), dtype="bfloat16")


def test_cli_plan_prints_the_plan_and_json(capsys):
    rc = main(["plan", "--model", str(CONFIGS / "llama-3.1-70b.json"), "--dtype", "bfloat16", "--tp", "4",
               "--device-memory", "80GiB", "--max-num-seqs", "16", "--max-model-len", "8192", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    d = json.loads(out)
    assert d["tensor_parallel_size"] == 4 and d["max_model_len"] == 8192 and d["model"]["num_layers"] == 80
    assert d["kv_bytes_per_token_per_device"] == 2 * 80 * 2 * 128 * 2  # 8 KV heads over 4 devices
    assert d["device_bytes"] <= 80 * GiB and d["full_length_requests"] >= 16
    rc = main(["plan", "--model", str(CONFIGS / "llama-3.1-8b.json"), "--dtype", "bfloat16",
               "--device-memory", "24GB", "--spec", "ngram", "-k", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "k = 4" in out and "KV cache" in out


@pytest.mark.parametrize("args, message", [
    (["--device-memory", "lots"], "--device-memory: not a size"),
    (["--model", str(CONFIGS / "llama-3.1-70b.json"), "--dtype", "bfloat16", "--device-memory", "80GiB"],
     "--tp 2 would hold them"),
    (["--model", str(CONFIGS / "llama-3.1-8b.json"), "--max-model-len", "200000"], "exceeds the model's context"),
    (["-k", "3"], "--num-speculative-tokens needs --spec"),
    (["--tp", "0"], "--tp must be >= 1"),
])
def test_cli_plan_bad_input_is_one_line_exit_2(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
