"""GGUF loading: metadata -> config, dequantization per type, llama.cpp's Q/K permutation undone."""

import chex
import numpy as np
import pytest

import jspec
from helpers import add_gguf_geometry, write_hf_checkpoint
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
                     ("ffn_down.weight", "mlp.down_proj.weight"), ("attn_q_norm.weight", "self_attn.q_norm.weight"),
                     ("attn_k_norm.weight", "self_attn.k_norm.weight")]:
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
    add_gguf_geometry(w, cfg)
    w.add_eos_token_id(1)
    expected = {}
    rng = np.random.default_rng(0)
    for name in sorted(src.keys()):
        x = np.asarray(src.get(name), np.float32)
        g = _gguf_name(name)
        permuted = arch in ("llama", "mistral")  # llama.cpp's converter permutes Q/K rows for these only
        if permuted and name.endswith("q_proj.weight"):
            x = _permute(x, cfg.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
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
        if permuted and name.endswith("q_proj.weight"):
            deq = _permute_back(deq, cfg.num_heads)
        elif permuted and name.endswith("k_proj.weight"):
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
        chex.assert_trees_all_equal(ref.params, mine.params)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_dequantization_is_the_gguf_packages_bit_for_bit(qtype, monkeypatch):
    """jspec's whole-chunk dequantizer against the gguf package's on random blocks (every nibble
    and int8 value, scales of both signs, a minimum for Q4_1), over several chunks and a short last one."""
    import gguf

    from jspec.loading import gguf_loader

    monkeypatch.setattr(gguf_loader, "_CHUNK_BLOCKS", 64)
    rng = np.random.default_rng(0)
    n, nbytes = 64 * 3 + 5, gguf_loader._BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (n, nbytes), dtype=np.uint8)
    blocks[:, :2] = rng.standard_normal(n).astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == "Q4_1":
        blocks[:, 2:4] = rng.standard_normal(n).astype(np.float16).view(np.uint8).reshape(n, 2)
    want = gguf.quants.dequantize(blocks, getattr(gguf.GGMLQuantizationType, qtype)).reshape(-1)
    got = gguf_loader.dequantize_blocks(blocks, qtype)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


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


def test_qwen3_gguf_loads_as_its_safetensors(tmp_path):
    """llama.cpp's qwen3 layout (per-head q/k norms, Q/K rows not permuted, key_length given):
    the same config and logits as the Hugging Face directory it came from."""
    import jax.numpy as jnp

    from jspec.cache import init_cache
    from jspec.models.llama import forward

    src = write_hf_checkpoint(tmp_path / "q3", "qwen3", tokenizer=False, vocab_size=256, hidden_size=64,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    write_gguf(tmp_path / "q3.gguf", src, arch="qwen3")
    a, b = jspec.load_model(str(src), tokenizer=False), jspec.load_model(str(tmp_path / "q3.gguf"), tokenizer=False)
    assert b.config.architecture == "qwen3" and b.config.qk_norm and b.config.head_dim == 32
    cfg = a.config
    ids = jnp.asarray([[5, 9, 13, 2, 77, 140, 3]], jnp.int32)
    logits = [forward(m.params, m.config, ids, init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                          jnp.arange(1)[None], 1, 16),
                      jnp.asarray([7], jnp.int32), attention="reference").logits for m in (a, b)]
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(logits[0]), atol=1e-5)


def test_name_mapping():
    assert hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F16"])
def test_gguf_keeps_the_blocks_the_small_row_kernel_reads(tmp_path, hf_dir, qtype):
    """A Q4_1 / Q8_0 file's projections and LM head are kept as their blocks in the kernel's
    layout (LoadedModel.quantized), and they hold exactly the loaded float32 parameters; a file
    in another type, or a model loaded in another dtype, keeps none."""
    from jspec.models.cpu_path import with_small_row_weights
    from jspec.models.llama import output_embedding
    from pallas_kernels.cpu.small_rows import dequantize

    path = tmp_path / f"tiny-{qtype}.gguf"
    write_gguf(path, hf_dir, qtype)
    model = jspec.load_model(str(path), tokenizer=False)
    if qtype == "F16":
        assert model.quantized == {}
        return
    cfg = model.config
    assert len(model.quantized) == 4 * cfg.num_layers + 1
    # the load's memory check counts the blocks (this model's rows are multiples of 4: no padding;
    # an untied model's input embedding is counted though the head's rows are kept instead)
    kept, counted = sum(w.nbytes for w in model.quantized.values()), GGUFFile(path).quantized_bytes(cfg)
    assert kept <= counted <= kept + (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 36 // 32)
    copy = with_small_row_weights(model.params, quantized=model.quantized)
    for where in model.quantized:
        node = copy
        for key in where:
            node = node[key]
        if where == ("lm_head_rows",):
            want, w = output_embedding(model.params, cfg), node
        else:
            want, w = node["kernel"].T, node["weight"]
        assert w.dtype == np.uint8
        np.testing.assert_array_equal(np.asarray(dequantize(w, want.shape[0])).view(np.uint32),
                                      np.asarray(want).view(np.uint32), err_msg=str(where))
    assert jspec.load_model(str(path), dtype="bfloat16", tokenizer=False).quantized == {}


def _q4_1_model_and_step(tmp_path, hf_dir, monkeypatch, pick):
    """The tiny model as a Q4_1 file, loaded, and a jitted step of 5 tokens from an empty cache on
    the CPU kernels: params -> ``pick`` of forward's output."""
    import jax
    import jax.numpy as jnp

    from jspec.cache.paged import init_cache
    from jspec.models.cpu_path import CPU
    from pallas_kernels.cpu import build as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no C++ compiler: the kernels are not built")
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "1")
    path = tmp_path / "tiny-Q4_1.gguf"
    write_gguf(path, hf_dir, "Q4_1")
    model = jspec.load_model(str(path), tokenizer=False)
    cfg = model.config
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.arange(4, dtype=jnp.int32)[None], 4, 16)
    tokens = jnp.array([[3, 17, 42, 7, 99]], jnp.int32)
    q_lens = jnp.array([5], jnp.int32)
    return model, jax.jit(lambda p: pick(CPU.forward(p, cfg, tokens, cache, q_lens, attention="cpu")))


def test_engine_on_quantized_blocks_gives_the_float_weights_results(tmp_path, hf_dir, monkeypatch):
    """The same hidden states bit for bit from the quantized blocks as from float32 copies (a
    5-row step through the decoder-layer kernel), logits within rounding (this model's untied LM
    head is XLA's product without the blocks, the kernel's with them), the same greedy tokens."""
    from jspec.config import EngineConfig
    from jspec.errors import ConfigError
    from jspec.models.cpu_path import with_small_row_weights

    model, step = _q4_1_model_and_step(tmp_path, hf_dir, monkeypatch, lambda out: out[:2])
    quant = with_small_row_weights(model.params, quantized=model.quantized)
    assert "lm_head_rows" in quant and "jspec_decoder_stack" in step.lower(quant).as_text()
    (logits, hidden), (want_logits, want_hidden) = step(quant), step(with_small_row_weights(model.params))
    assert np.array_equal(np.asarray(hidden).view(np.uint32), np.asarray(want_hidden).view(np.uint32))
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5 * np.abs(want_logits).max())
    prompts = [[5, 9, 200, 31], [77, 3]]
    sp = jspec.SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for flag in (True, False):
        llm = jspec.LLM(model, max_num_seqs=2, max_model_len=64, quantized_weights=flag)
        weight = llm.engine.runner.params["layers_0"]["mlp"]["down_proj"]["weight"]
        assert (weight.dtype == np.uint8) == flag
        runs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert runs[True] == runs[False]
    with pytest.raises(ConfigError, match="quantized_weights"):
        EngineConfig(quantized_weights="yes")


def test_int8_activations_stay_lossless_and_close(tmp_path, hf_dir, monkeypatch):
    """EngineConfig.quantized_activations on a Q4_1 file: the engine's small-row weights are in the
    int8 dot layout; a step's logits move from the float32 products' by x's 8-bit rounding, and by
    little; greedy output is the same token for token whatever the step's rows: plain decoding of
    each prompt alone, of both together, and n-gram speculation (k + 1 rows a step)."""
    from jspec.config import EngineConfig
    from jspec.errors import ConfigError
    from jspec.models.cpu_path import with_small_row_weights
    from pallas_kernels.cpu import small_rows

    model, step = _q4_1_model_and_step(tmp_path, hf_dir, monkeypatch, lambda out: out.logits)
    int8 = with_small_row_weights(model.params, quantized=model.quantized, int8_dot=True)
    assert "jspec_decoder_stack" in step.lower(int8).as_text()
    got, want = (np.asarray(step(p))[0] for p in (int8, with_small_row_weights(model.params,
                                                                                 quantized=model.quantized)))
    span = want.max() - want.min()
    assert 1e-4 * span < np.abs(got - want).max() < 0.05 * span
    prompts = [[5, 9, 200, 31, 5, 9, 200], [77, 3, 77, 3, 77]]
    sp = jspec.SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for name, spec in (("ar", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = jspec.LLM(model, max_num_seqs=2, max_model_len=64, quantized_activations=True,
                        speculative_config=spec)
        params = llm.engine.runner.params
        assert small_rows.int8_dot(params["layers_0"]["mlp"]["down_proj"]["weight"])
        assert small_rows.int8_dot(params["lm_head_rows"])
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        if name == "ar":
            runs["alone"] = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert runs["ar"] == runs["ngram"] == runs["alone"]
    with pytest.raises(ConfigError, match="quantized_activations"):
        EngineConfig(quantized_activations=1)
    with pytest.raises(ConfigError, match="needs quantized_weights"):
        EngineConfig(quantized_activations=True, quantized_weights=False)


def _same_as_gguf_reader(path):
    """jspec's header walk reads every field and tensor as ``gguf.GGUFReader`` does."""
    import gguf

    from jspec.loading.gguf_loader import GGUFFile

    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # the reader's own pseudo-fields
    assert keys and all(ours.field(k) == theirs.fields[k].contents() for k in keys)
    assert sorted(ours.tensors) == sorted(t.name for t in theirs.tensors)
    for t in theirs.tensors:
        o = ours.tensors[t.name]
        assert o.tensor_type == t.tensor_type and list(o.shape) == list(t.shape) and o.n_elements == t.n_elements
        assert o.data.shape == t.data.shape and o.data.dtype == t.data.dtype
        np.testing.assert_array_equal(o.data, t.data)


@pytest.mark.parametrize("big_endian", [False, True])
def test_the_header_walk_reads_what_gguf_reader_reads(tmp_path, big_endian):
    """Scalars of every type, strings, arrays of numbers and of strings, plain and block tensors,
    in either byte order."""
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE)
    w.add_uint8("x.u8", 200)
    w.add_int16("x.i16", -300)
    w.add_uint32("x.u32", 70000)
    w.add_int64("x.i64", -(1 << 40))
    w.add_float32("x.f32", 0.25)
    w.add_float64("x.f64", 1e-300)
    w.add_bool("x.bool", True)
    w.add_string("x.str", "héllo")
    w.add_array("x.ints", [1, 2, 3])
    w.add_array("x.floats", [0.5, -1.5])
    w.add_array("x.strs", ["a", "", "ß€", "tokens with spaces"])
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("half", rng.normal(size=(2, 32)).astype(np.float16))
    q = gguf.quants.quantize(rng.normal(size=(4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blocks", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _same_as_gguf_reader(path)


def test_the_header_walk_reads_the_default_model_as_gguf_reader_does():
    from jspec.loading import smollm2_path

    _same_as_gguf_reader(smollm2_path())
