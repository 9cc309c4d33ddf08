"""GGUF loading: metadata -> config, dequantization per type, llama.cpp's Q/K permutation undone."""

import numpy as np
import pytest

import jspec
from helpers import write_hf_checkpoint
from jspec.loading.gguf_loader import GGUFFile, hf_name
from jspec.loading.hf import SafetensorsDir

Q = None  # gguf.GGMLQuantizationType, imported lazily


def _permute(w, n_head):  # what llama.cpp's converter does to Q and K rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf):
    inv = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in inv:
        return inv[hf]
    for n in range(64):
        for g, h in [("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
                     ("attn_q.weight", "self_attn.q_proj.weight"), ("attn_k.weight", "self_attn.k_proj.weight"),
                     ("attn_v.weight", "self_attn.v_proj.weight"), ("attn_output.weight", "self_attn.o_proj.weight"),
                     ("ffn_gate.weight", "mlp.gate_proj.weight"), ("ffn_up.weight", "mlp.up_proj.weight"),
                     ("ffn_down.weight", "mlp.down_proj.weight")]:
            if hf == f"model.layers.{n}.{h}":
                return f"blk.{n}.{g}"
    raise KeyError(hf)


def write_gguf(path, hf_dir, qtype_name="F32", arch="llama", kquant_bytes=None):
    """Write the tensors of a tiny HF checkpoint as a llama.cpp-style GGUF file.

    2-D weights use ``qtype_name``; norms stay F32. Returns {hf_name: expected dequantized array}.
    """
    import gguf

    cfg = jspec.load_model(str(hf_dir), tokenizer=False).config
    src = SafetensorsDir(hf_dir)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(1)
    expected = {}
    rng = np.random.default_rng(0)
    for name in sorted(src.keys()):
        x = np.asarray(src.get(name), np.float32)
        g = _gguf_name(name)
        if name.endswith("q_proj.weight"):
            x = _permute(x, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            x = _permute(x, cfg.num_kv_heads)
        if x.ndim == 1 or qtype_name == "F32":
            w.add_tensor(g, x)
            deq = x
        elif kquant_bytes:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
            # keep the fp16 super-block scales finite and small
            raw = raw.reshape(x.shape[0], -1, size)
            for off in kquant_bytes:
                raw[:, :, off:off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            raw = raw.reshape(x.shape[0], -1)
            w.add_tensor(g, raw, raw_shape=raw.shape, raw_dtype=qtype)
            deq = gguf.quants.dequantize(raw, qtype)
        else:
            qx = gguf.quants.quantize(x, qtype)
            w.add_tensor(g, qx, raw_shape=qx.shape, raw_dtype=qtype)
            deq = gguf.quants.dequantize(qx, qtype)
        if name.endswith("q_proj.weight"):
            deq = _permute_back(deq, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            deq = _permute_back(deq, cfg.num_kv_heads)
        expected[name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _permute_back(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # vocab and dims are multiples of 256 so that every GGML block size divides the rows
    return write_hf_checkpoint(tmp_path_factory.mktemp("gguf-src"), "llama", tokenizer=False,
                               vocab_size=256, hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_dequantizes_and_unpermutes(tmp_path, hf_dir, qtype):
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_gguf(path, hf_dir, qtype)
    f = GGUFFile(path)
    cfg = f.config()
    got = f.hf_tensors(cfg)
    assert set(got) == set(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    if qtype == "F32":  # exact weights: logits equal to the safetensors load
        ref = jspec.load_model(str(hf_dir), tokenizer=False)
        mine = jspec.load_model(str(path), tokenizer=False)
        assert mine.config.num_layers == ref.config.num_layers and mine.config.eos_token_ids == (1,)
        import jax

        for a, b in zip(jax.tree_util.tree_leaves(ref.params), jax.tree_util.tree_leaves(mine.params), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("qtype,scale_offsets", [("Q4_K", [0, 2]), ("Q6_K", [208])])
def test_gguf_k_quants(tmp_path, hf_dir, qtype, scale_offsets):
    path = tmp_path / f"tiny-{qtype}.gguf"
    expected = write_gguf(path, hf_dir, qtype, kquant_bytes=scale_offsets)
    f = GGUFFile(path)
    got = f.hf_tensors(f.config())
    for name, want in expected.items():
        assert got[name].shape == want.shape
        np.testing.assert_array_equal(got[name], want, err_msg=name)
        assert np.isfinite(got[name]).all()


def test_name_mapping():
    assert hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None
