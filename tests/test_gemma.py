"""Gemma 2 and Gemma 3 through the engine (the logits against transformers are in
tests/test_models_hf.py, tensor parallelism in tests/test_parallel.py): speculative greedy
output equals plain greedy with lookup and draft-model drafters on prompts longer than the
sliding window, on the reference attention and on the CPU engine's path; the window, caps and
norms run; configs in both of Hugging Face's layouts read the same; what is not built is
refused by name."""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import pytest

import jspec
from helpers import add_gguf_geometry, tiny_config, tiny_gemma, tiny_model, write_hf_checkpoint
from jspec.config import SamplingParams, SpecConfig
from jspec.errors import ConfigError, UnsupportedModelError
from jspec.loading.hf import config_from_hf
from jspec.speculative.drafters import DraftModelDrafter

PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 7, 40, 41, 42, 43, 7, 40, 41], [3, 4] * 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ARCHS = ["gemma2", "gemma3_text"]


@pytest.fixture(scope="module", params=ARCHS)
def gemma(request):
    model = tiny_gemma(request.param, seed=1, scale=4.0)
    return model, jspec.generate(model, PROMPTS, GREEDY, attention="reference").token_ids


@pytest.mark.parametrize("attention", ["reference", "auto"])
def test_ngram_and_draft_model_speculation_equal_plain_greedy(gemma, attention):
    """A lookup drafter, and a Gemma draft model of one layer (its own window and caps)."""
    model, plain = gemma
    assert jspec.generate(model, PROMPTS, GREEDY, attention=attention).token_ids == plain
    ngram = jspec.generate(model, PROMPTS, GREEDY, attention=attention,
                           spec=SpecConfig("ngram", num_speculative_tokens=3))
    assert ngram.token_ids == plain and ngram.mean_accepted_length > 1
    draft = tiny_gemma(model.config.architecture, seed=7, scale=4.0, num_layers=1)
    out = jspec.generate(model, PROMPTS, GREEDY, attention=attention,
                         drafter=DraftModelDrafter(3, draft.config), drafter_params=draft.params)
    assert out.token_ids == plain and out.proposed_counts[0] > 0


def test_layer_skip_over_gemma_layers(gemma):
    """The target's first layer (local, with its window and norms) then the final norm, capped
    head: drafts accepted, output the target's."""
    model, plain = gemma
    out = jspec.generate(model, PROMPTS, GREEDY, attention="reference",
                         spec=SpecConfig("layerskip", 2, layerskip_layers=1))
    assert out.token_ids == plain and out.accepted_counts[0] > 0


def test_a_llama_draft_for_a_gemma_target(gemma):
    model, plain = gemma
    draft = tiny_model(tiny_config(num_layers=1), seed=3, scale=4.0)
    out = jspec.generate(model, PROMPTS, GREEDY, attention="reference",
                         drafter=DraftModelDrafter(2, draft.config), drafter_params=draft.params)
    assert out.token_ids == plain


@pytest.mark.parametrize("change", [dict(layer_types=("full", "full")), dict(attn_logit_softcap=None),
                                    dict(hidden_act="silu")])
def test_the_window_cap_and_activation_change_the_output(change):
    """The same weights with one Gemma feature dropped decode differently: each one runs (the
    final logits' cap keeps the argmax; tests/test_models_hf.py checks it on the logits)."""
    model = tiny_gemma("gemma2", seed=1, scale=4.0)
    plain = jspec.generate(model, PROMPTS, GREEDY, attention="reference").token_ids
    other = dataclasses.replace(model, config=dataclasses.replace(model.config, **change))
    assert jspec.generate(other, PROMPTS, GREEDY, attention="reference").token_ids != plain


def test_token_trees_are_refused_for_sliding_window_layers(gemma):
    model, _ = gemma
    with pytest.raises(ConfigError, match="sliding-window layers"):
        jspec.generate(model, PROMPTS[:1], GREEDY, spec={"method": "eagle", "model": "any-head",
                                                         "num_speculative_tokens": 3,
                                                         "tree": {"max_nodes": 6, "max_width": 2}})


def test_older_gemma3_configs_read_as_the_current_layout():
    """Gemma 3 configs written before per-layer-type RoPE blocks (``rope_local_base_freq``,
    ``rope_scaling`` linear, ``sliding_window_pattern``), as Gemma-3-27B's, read the same."""
    base = dict(model_type="gemma3_text", vocab_size=300, hidden_size=64, intermediate_size=128,
                num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")
    old = config_from_hf(dict(base, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}))
    new = config_from_hf(dict(base, layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
                              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert old == new
    assert new.layer_types == ("sliding",) * 5 + ("full", "sliding") and new.rope_linear_factor == 8.0
    assert new.tie_word_embeddings and new.qk_norm and new.hidden_act == "gelu_tanh"


def test_keys_a_gemma_config_leaves_out_take_transformers_defaults():
    """A key missing altogether means transformers' class default (Gemma 2's caps 50 and 30, a
    score scale of 256); null is no value (no cap)."""
    import transformers

    d = dict(model_type="gemma2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, head_dim=16, sliding_window=8)
    c = config_from_hf(d)
    hf = transformers.Gemma2Config(**{k: v for k, v in d.items() if k != "model_type"})
    assert (c.attn_logit_softcap, c.final_logit_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping)
    assert c.query_pre_attn_scalar == hf.query_pre_attn_scalar == 256
    assert config_from_hf(dict(d, attn_logit_softcapping=None)).attn_logit_softcap is None


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gemma"), "unsupported architecture 'gemma'"),
    (dict(hidden_activation="relu"), "hidden_activation 'relu'"),
    (dict(layer_types=["sliding_attention"]), "layer_types"),
    (dict(sliding_window=None), "sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type"),
])
def test_bad_gemma_configs_are_refused_by_name(change, match):
    d = dict(model_type="gemma2", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, head_dim=16, sliding_window=8)
    d.update(change)
    with pytest.raises((UnsupportedModelError, jspec.CheckpointError), match=match):
        config_from_hf(d)


def test_a_hugging_face_gemma_checkpoint_round_trips(tmp_path):
    """Load a transformers Gemma 3, export it (config.json, safetensors), load again: the same
    config and parameters."""
    import jax
    import numpy as np

    from jspec.loading.convert import params_to_hf
    from jspec.loading.drafts import save_tensors
    from jspec.loading.hf import hf_config_dict

    src = write_hf_checkpoint(tmp_path / "g3", "gemma3_text", tokenizer=False, head_dim=16, sliding_window=4,
                              num_hidden_layers=3)
    model = jspec.load_model(str(src))
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config)))
    save_tensors(out / "model.safetensors", params_to_hf(model.config, model.params), {"format": "pt"})
    again = jspec.load_model(str(out))
    assert again.config == model.config
    for a, b in zip(jax.tree_util.tree_leaves(model.params), jax.tree_util.tree_leaves(again.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_gemma3_checkpoint_loads_its_language_model(tmp_path, prefix):
    """Gemma 3's published checkpoints are multimodal: config.json keeps the language model in
    ``text_config`` and the tensors under a prefix (the published files' and transformers'
    current one), beside the vision tower's. jspec loads the language model: the same config and
    parameters as the text-only checkpoint."""
    import jax
    import numpy as np
    from safetensors.numpy import load_file, save_file

    src = write_hf_checkpoint(tmp_path / "text", "gemma3_text", tokenizer=False, head_dim=16, sliding_window=4,
                              num_hidden_layers=2)
    text = jspec.load_model(str(src))
    d = tmp_path / "multimodal"
    d.mkdir()
    tensors = {prefix + k[len("model."):] if k.startswith("model.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((4, 3, 2, 2), np.float32)
    save_file(tensors, str(d / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.pop("eos_token_id")
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3", "eos_token_id": [1, 2], "text_config": config,
                                               "architectures": ["Gemma3ForConditionalGeneration"],
                                               "vision_config": {"model_type": "siglip_vision_model"}}))
    both = jspec.load_model(str(d))
    assert both.config.eos_token_ids == (1, 2)  # the top level's, as the published config has them
    assert dataclasses.replace(both.config, eos_token_ids=text.config.eos_token_ids) == text.config
    for a, b in zip(jax.tree_util.tree_leaves(text.params), jax.tree_util.tree_leaves(both.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _write_gemma_gguf(path, hf_dir, arch: str):
    """The tensors and metadata of a tiny transformers Gemma checkpoint as llama.cpp's converter
    writes them (``convert_hf_to_gguf.py``'s Gemma2Model / Gemma3Model): its tensor names (the
    ``gguf`` package's map), every norm weight plus one, no Q/K permutation, the caps, the window
    and Gemma 3's linear RoPE scaling as metadata."""
    import gguf
    import numpy as np

    from jspec.loading.hf import SafetensorsDir, load_hf_config

    cfg = load_hf_config(hf_dir)
    src = SafetensorsDir(hf_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2 if arch == "gemma2" else gguf.MODEL_ARCH.GEMMA3,
                                     cfg.num_layers)
    w = gguf.GGUFWriter(str(path), arch)
    add_gguf_geometry(w, cfg)
    w.add_sliding_window(cfg.sliding_window)
    if cfg.attn_logit_softcap:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcap)
    if cfg.final_logit_softcap:
        w.add_final_logit_softcapping(cfg.final_logit_softcap)
    if cfg.rope_linear_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_linear_factor)
    w.add_eos_token_id(1)
    for name in sorted(src.keys()):
        x = np.asarray(src.get(name), np.float32)
        if name.endswith("norm.weight"):
            x = x + 1
        w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_a_gemma_gguf_file_gives_transformers_logits(tmp_path, arch):
    """A Gemma GGUF (the converter's layout, llama.cpp's fixed layer pattern, local RoPE base and
    score scale): the same config as the Hugging Face directory it came from, and logits within
    1e-4 of transformers' own."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jspec.cache import init_cache
    from jspec.models.llama import forward

    kw = dict(head_dim=16, num_hidden_layers=7 if arch == "gemma3_text" else 3, sliding_window=4,
              query_pre_attn_scalar=16)  # llama.cpp's scale below 27B: head_dim
    if arch == "gemma2":
        kw.update(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    else:
        kw.update(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    src = write_hf_checkpoint(tmp_path / "hf", arch, tokenizer=False, tie_word_embeddings=True, **kw)
    path = _write_gemma_gguf(tmp_path / "model.gguf", src, "gemma2" if arch == "gemma2" else "gemma3")
    model = jspec.load_model(str(path), tokenizer=False)
    hf_cfg = jspec.load_model(str(src), tokenizer=False).config
    # (GGUF keeps eps as a float32; the file names no bos token here)
    assert model.config == dataclasses.replace(hf_cfg, bos_token_id=None, rms_norm_eps=model.config.rms_norm_eps)
    assert model.config.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    ids = [int(x) for x in np.random.default_rng(0).integers(2, 300, 19)]
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(str(src)).eval()(torch.tensor([ids])).logits[0].numpy()
    c = model.config
    cache = init_cache(c.num_layers, c.num_kv_heads, c.head_dim, jnp.arange(2, dtype=jnp.int32)[None], 2, 16)
    got = forward(model.params, c, jnp.asarray([ids], jnp.int32), cache, jnp.asarray([len(ids)], jnp.int32),
                  attention="reference").logits[0]
    assert np.abs(np.asarray(got) - want).max() <= 1e-4
