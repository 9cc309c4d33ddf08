"""Qwen3 (per-head q/k RMSNorm before RoPE) through the engine: speculative greedy output equals
plain greedy on every path the CPU engine takes (the logits against transformers are in
tests/test_models_hf.py, tensor parallelism in tests/test_parallel.py), and the norms matter."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import jspec
from helpers import tiny_config, tiny_model, tiny_qwen3, write_hf_checkpoint
from jspec.config import SamplingParams, SpecConfig
from jspec.engine.plan import plan_run
from jspec.loading import memory
from jspec.speculative.drafters import DraftModelDrafter

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 7, 40, 41, 42, 43, 7, 40, 41], [3, 4] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3():
    return tiny_qwen3(seed=1, scale=4.0)


@pytest.fixture(scope="module")
def plain(qwen3):
    return jspec.generate(qwen3, PROMPTS, GREEDY, attention="reference").token_ids


@pytest.mark.parametrize("attention", ["reference", "cpu"])
def test_ngram_and_draft_model_speculation_equal_plain_greedy(qwen3, plain, attention):
    """A lookup drafter and a Qwen3 draft model (its own q/k norms) on the reference attention
    and on the CPU kernels' path (which runs Qwen3 layer by layer, not as one fused kernel)."""
    assert jspec.generate(qwen3, PROMPTS, GREEDY, attention=attention).token_ids == plain
    ngram = jspec.generate(qwen3, PROMPTS, GREEDY, attention=attention,
                           spec=SpecConfig("ngram", num_speculative_tokens=3))
    assert ngram.token_ids == plain and ngram.mean_accepted_length > 1
    draft = tiny_qwen3(seed=7, scale=4.0, num_layers=1)
    out = jspec.generate(qwen3, PROMPTS, GREEDY, attention=attention,
                         drafter=DraftModelDrafter(3, draft.config), drafter_params=draft.params)
    assert out.token_ids == plain


def test_the_norms_change_the_output(qwen3, plain):
    """The same weights without the q/k norms (a Llama) decode differently: the norms run."""
    params = jax.tree_util.tree_map(lambda x: x, qwen3.params)
    for name, layer in params.items():
        if name.startswith("layers_"):
            layer["self_attn"] = {k: v for k, v in layer["self_attn"].items() if not k.endswith("_norm")}
    llama = dataclasses.replace(qwen3, config=dataclasses.replace(qwen3.config, qk_norm=False, architecture="llama"),
                                params=params)
    assert jspec.generate(llama, PROMPTS, GREEDY, attention="reference").token_ids != plain


def test_a_hugging_face_qwen3_checkpoint_round_trips_and_plans(tmp_path):
    """Load, export (config.json with model_type qwen3, q_norm/k_norm tensors), reload: the same
    config and logits; its plan counts the norms' parameters."""
    from jspec.loading.convert import params_to_hf
    from jspec.loading.drafts import save_tensors
    from jspec.loading.hf import hf_config_dict

    src = write_hf_checkpoint(tmp_path / "q3", "qwen3", tokenizer=False, num_key_value_heads=2, head_dim=16)
    model = jspec.load_model(str(src))
    assert model.config.architecture == "qwen3" and model.config.qk_norm
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(__import__("json").dumps(hf_config_dict(model.config)))
    save_tensors(out / "model.safetensors", params_to_hf(model.config, model.params), {"format": "pt"})
    again = jspec.load_model(str(out))
    assert again.config == model.config
    for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    plan = plan_run(model.config, device_memory=1 << 30)
    assert plan.weight_bytes == memory.weights_bytes(model.config)
    without = dataclasses.replace(model.config, qk_norm=False, architecture="llama")
    assert model.config.num_params() - without.num_params() == 2 * 16 * model.config.num_layers


def test_a_llama_draft_for_a_qwen3_target_keeps_its_own_geometry(qwen3, plain):
    """Draft and target need not share a family: a Llama draft over the Qwen3 target."""
    draft = tiny_model(tiny_config(num_layers=1), seed=3, scale=4.0)
    out = jspec.generate(qwen3, PROMPTS, GREEDY, attention="reference",
                         drafter=DraftModelDrafter(2, draft.config), drafter_params=draft.params)
    assert out.token_ids == plain


def test_a_published_eagle3_head_drafts_for_a_qwen3_target():
    """Published EAGLE-3 heads are Llama layers whatever the target's family: over a Qwen3
    target the head runs without q/k norms and speculation stays lossless."""
    from helpers import published_eagle3_params
    from jspec.speculative.drafters.eagle import EagleDrafter

    target = tiny_qwen3(seed=2, scale=4.0, num_layers=3)
    plain = jspec.generate(target, PROMPTS, GREEDY, attention="reference").token_ids
    params = published_eagle3_params(target)
    assert "q_norm" not in params["head"]["self_attn"]
    out = jspec.generate(target, PROMPTS, GREEDY, attention="reference",
                         drafter=EagleDrafter(3, target.config, feature_layers=(0, 1, 2)), drafter_params=params)
    assert out.token_ids == plain and out.proposed_counts[0] > 0
