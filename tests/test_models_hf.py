"""Logits against Hugging Face transformers (PyTorch, CPU, float32) on tiny random checkpoints.

Tolerance: max |jspec - transformers| <= 1e-4 on logits of magnitude ~1-10 (float32 both sides;
the differences are summation order only).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from helpers import write_hf_checkpoint
from jspec.cache import init_cache
from jspec.models.llama import forward

ATOL = 1e-4


def _hf_logits(directory, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0].numpy()


def _jspec_logits(model, ids, chunks=None, page_size=4):
    """Logits of ``ids`` run through the paged cache, optionally split into chunks."""
    cfg = model.config
    n = len(ids)
    pages = -(-n // page_size)
    perm = np.random.default_rng(n).permutation(pages).astype(np.int32)
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.asarray(perm)[None], pages, page_size)
    fwd = jax.jit(lambda p, t, c, q: forward(p, cfg, t, c, q, attention="reference"))
    out, start = [], 0
    for size in chunks or [n]:
        piece = jnp.asarray([ids[start:start + size]], jnp.int32)
        o = fwd(model.params, piece, cache, jnp.asarray([size], jnp.int32))
        cache = o.cache
        out.append(np.asarray(o.logits[0]))
        start += size
    assert int(cache.lengths[0]) == n
    return np.concatenate(out)


CASES = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope-scaling": dict(arch="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}, rope_theta=500000.0),
    "qwen2-bias": dict(arch="qwen2", num_key_value_heads=1),
    "mistral": dict(arch="mistral", num_key_value_heads=4),
    "qwen3": dict(arch="qwen3", num_key_value_heads=2, head_dim=16),
    # Gemma: windows of 4 keys over 23 tokens, caps small enough to bind, a score scale that is
    # not head_dim's; Gemma 3 with a linear-scaled global RoPE beside its local base
    "gemma2": dict(arch="gemma2", head_dim=16, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=24,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma2-tied": dict(arch="gemma2", head_dim=16, sliding_window=5, tie_word_embeddings=True),
    "gemma3": dict(arch="gemma3_text", head_dim=16, num_hidden_layers=3, sliding_window=4,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    kw = dict(CASES[case])
    directory = write_hf_checkpoint(tmp_path / case, kw.pop("arch"), tokenizer=False, **kw)
    model = jspec.load_model(str(directory))
    ids = [int(x) for x in np.random.default_rng(0).integers(2, 300, 23)]
    want = _hf_logits(directory, ids)
    got = _jspec_logits(model, ids)
    assert np.abs(got - want).max() <= ATOL, np.abs(got - want).max()
    if case == "qwen2-bias":
        assert model.config.qkv_bias
    if case == "qwen3":
        assert model.config.qk_norm and not model.config.qkv_bias
    if case == "llama3-rope-scaling":
        assert model.config.rope_scaling is not None and model.config.rope_scaling.factor == 8.0


def test_chunked_prefill_and_decode_equal_one_pass(tiny_hf_llama):
    model = jspec.load_model(str(tiny_hf_llama))
    ids = [int(x) for x in np.random.default_rng(1).integers(2, 300, 19)]
    whole = _jspec_logits(model, ids)
    pieces = _jspec_logits(model, ids, chunks=[7, 5, 1, 1, 5])
    np.testing.assert_allclose(pieces, whole, atol=2e-5)


def test_hf_export_roundtrip(tiny_hf_llama, tmp_path):
    from jspec.loading.convert import params_from_hf, params_to_hf

    model = jspec.load_model(str(tiny_hf_llama))
    tensors = params_to_hf(model.config, model.params)
    again = params_from_hf(model.config, tensors.get)
    chex.assert_trees_all_equal(model.params, again)


def test_sharded_safetensors_with_index(tiny_hf_llama, tmp_path):
    """A checkpoint split over two shards plus model.safetensors.index.json loads the same."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    d = tmp_path / "sharded"
    shutil.copytree(tiny_hf_llama, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate([names[:half], names[half:]]):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a = jspec.load_model(str(tiny_hf_llama), tokenizer=False)
    b = jspec.load_model(str(d), tokenizer=False)
    chex.assert_trees_all_equal(a.params, b.params)
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(jspec.CheckpointError, match="missing"):
        jspec.load_model(str(d), tokenizer=False)
