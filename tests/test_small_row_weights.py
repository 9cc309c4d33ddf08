"""The CPU path (jspec.models.cpu_path) and the packed copy of the layer projections the engine
keeps for steps of a few rows on the CPU small-row kernel (``EngineConfig(small_row_weights=...)``):
same parameters as ``nn.Dense``, used exactly for the row counts it is meant for, and the
engine's outputs unchanged by it; the path chosen once by the engine."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_model
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
from jspec.errors import ConfigError
from jspec.models.cpu_path import HEAD_PROJECTIONS, KERNEL_ROWS, PROJECTIONS, Linear, with_small_row_weights
from jspec.models.eagle import init_eagle_params
from jspec.models.llama import output_embedding
from jspec.speculative.drafters.eagle import EagleDrafter
from pallas_kernels.cpu import small_rows
from pallas_kernels.cpu.small_rows import pack_rows, unpack_rows


def test_linear_has_dense_parameters_and_uses_the_copy_for_small_row_counts(kernels_on):
    x = jnp.ones((3, 8))
    ours = Linear(5, use_bias=True).init(jax.random.PRNGKey(0), x)
    dense = nn.Dense(5, use_bias=True).init(jax.random.PRNGKey(0), x)
    assert jax.tree.map(lambda a, b: bool((a == b).all()), ours, dense) == {"params": {"bias": True, "kernel": True}}
    p = ours["params"]
    # a copy that is deliberately NOT the kernel's transpose shows which one each row count reads
    doubled = {"params": {**p, "weight": pack_rows(2 * p["kernel"].T)}}
    for rows in (1, 2, 5, 8, 9, 17, 64):
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 8))
        plain = x @ p["kernel"]
        got = Linear(5, use_bias=True).apply(doubled, x) - p["bias"]
        reads_copy = rows in KERNEL_ROWS
        np.testing.assert_allclose(got, 2 * plain if reads_copy else plain, rtol=1e-5, atol=1e-5)


def test_a_quantized_copy_is_read_up_to_32_rows(kernels_on):
    """A copy in the quantized layout (a GGUF file's blocks) is read for up to 32 rows, where the
    float32 ``kernel`` through XLA would read 4.8x the bytes; a float copy only up to 16."""
    from jspec.loading.convert import quantize_rows
    from jspec.models.cpu_path import QUANTIZED_KERNEL_ROWS

    p = Linear(8).init(jax.random.PRNGKey(0), jnp.ones((3, 64)))["params"]
    doubled = {"params": {**p, "weight": jnp.asarray(quantize_rows(np.asarray(2 * p["kernel"].T), "q8_0"))}}
    for rows in (1, 16, 17, 32, 33, 64):
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 64))
        plain = x @ p["kernel"]
        got = Linear(8).apply(doubled, x)
        reads_copy = rows in QUANTIZED_KERNEL_ROWS
        assert reads_copy == (rows <= 32)
        np.testing.assert_allclose(got, 2 * plain if reads_copy else plain, rtol=0, atol=2e-2 * np.abs(plain).max())


def test_with_small_row_weights_adds_packed_transposes_of_the_layer_projections_only():
    model = tiny_model(tiny_config(num_layers=2))
    out = with_small_row_weights(model.params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(out)[0]}
    weights = [k for k in flat if k.endswith("/weight")]
    assert len(weights) == 2 * len(PROJECTIONS)
    for k in weights:
        kernel = flat[k[: -len("weight")] + "kernel"]
        np.testing.assert_array_equal(unpack_rows(flat[k], kernel.shape[1], kernel.shape[0]), kernel.T)
    n_before = len(jax.tree.leaves(model.params))
    assert len(flat) == n_before + len(weights)


@pytest.fixture
def kernels_on(monkeypatch):
    """The kernel's path on any CPU (the model uses it by default only with AVX-512 or AVX2 + FMA)."""
    if not small_rows.available():
        pytest.skip("no C++ compiler: the kernel is not built")
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "1")


def _packed(tree) -> list[str]:
    """Paths of the packed copies in a parameter tree."""
    return ["/".join(str(getattr(k, "key", k)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0] if getattr(path[-1], "key", None) == "weight"]


def _greedy(model, spec, copy, prompts, drafter=None, drafter_params=None):
    """Greedy outputs of ``prompts`` and the engine that made them."""
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=96, small_row_weights=copy), spec,
                       drafter=drafter, drafter_params=drafter_params)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=24, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return [out[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("ngram", num_speculative_tokens=4)], ids=["ar", "ngram4"])
def test_engine_output_is_the_same_with_and_without_the_copy(spec, kernels_on):
    model = tiny_model(tiny_config(num_layers=3), scale=4.0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, model.config.vocab_size, n)) * 2 for n in (5, 9, 13)]
    with_copy, packed = _greedy(model, spec, True, prompts)
    without, plain = _greedy(model, spec, False, prompts)  # the default
    assert _packed(packed.runner.params) and not _packed(plain.runner.params)
    assert with_copy == without


def test_small_row_weights_must_be_a_bool_on_one_device():
    with pytest.raises(ConfigError, match="small_row_weights"):
        EngineConfig(small_row_weights="yes")
    with pytest.raises(ConfigError, match="one device"):
        EngineConfig(small_row_weights=True, tensor_parallel_size=2)


def test_the_engine_picks_the_model_path_once(kernels_on, monkeypatch):
    """The engine chooses how the models run once (jspec.models.path): on the CPU kernels
    (jspec.models.cpu_path.CPU) where the small-row kernel applies, for every step and for the
    drafter alike (a hybrid's EAGLE head included); the plain modules (PLAIN) where it does not."""
    from jspec.models.cpu_path import CPU
    from jspec.models.path import PLAIN
    from jspec.speculative.drafters.hybrid import HybridDrafter

    model = tiny_model(tiny_config(num_layers=4))
    head, params = _eagle(model)
    for kernels, path in (("1", CPU), ("0", PLAIN)):
        monkeypatch.setenv("JSPEC_CPU_KERNELS", kernels)
        engine = LLMEngine(model, EngineConfig(max_num_seqs=2, max_model_len=64), SpecConfig(),
                           drafter=HybridDrafter(3, head), drafter_params=params)
        assert engine.path is path and engine.drafter.head.path is path
        assert engine._steps.keys() == {0, 3}
        assert all(step.path is path and step.drafter.head.path is path for step in engine._steps.values())
        assert bool(_packed(engine.runner.params)) == (path is CPU)


def test_the_models_rms_norm_is_the_kernels_reference_bit_for_bit():
    """One RMSNorm formula: the plain model's (jspec.models.llama.rms_norm) is the CPU kernels'
    reference (pallas_kernels.cpu.small_rows.rms_norm_reference; the kernels import nothing of
    jspec) bit for bit, so a norm no kernel folds gives the same bits on either path."""
    from jspec.models.llama import rms_norm

    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(30 * rng.standard_normal((7, 96)), dtype)
        scale = jnp.asarray(1 + 0.1 * rng.standard_normal(96), dtype)
        for eps in (1e-5, 1e-6):
            ours = jax.jit(rms_norm, static_argnums=2)(x, scale, eps)
            kernels = jax.jit(small_rows.rms_norm_reference, static_argnums=2)(x, scale, eps)
            assert ours.dtype == kernels.dtype and np.asarray(ours).tobytes() == np.asarray(kernels).tobytes()


def test_only_the_cpu_path_imports_the_cpu_kernels():
    """DESIGN.md: a model family's file never imports the CPU kernels; jspec.models.cpu_path alone
    wraps the models for them."""
    import ast
    import pathlib

    import jspec.models

    for f in sorted(pathlib.Path(jspec.models.__file__).parent.glob("*.py")):
        names = []
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names += [f"{node.module}.{a.name}" for a in node.names]
        assert any(n.startswith("pallas_kernels.cpu") for n in names) == (f.name == "cpu_path.py"), f.name


def test_an_eagle_head_is_packed_too_and_drafts_the_same(kernels_on):
    """The engine packs a drafter's projections beside the target's (an EAGLE-3 head's fusion,
    ``fc`` and decoder layer; its draft-vocabulary LM head reads its rows in place): the drafts it
    makes, counted by the tokens accepted, and the output are the same with and without."""
    model = tiny_model(tiny_config(num_layers=4), scale=3.0)
    cfg, layers = model.config, (0, 2, 3)
    vocab_ids = jnp.arange(0, cfg.vocab_size, 2, dtype=jnp.int32)  # a draft vocabulary of every other token
    params = {"head": init_eagle_params(cfg, jax.random.key(1), model.params, num_features=len(layers)),
              "lm_head": output_embedding(model.params, cfg)[vocab_ids], "vocab_ids": vocab_ids}
    drafter = EagleDrafter(3, cfg, feature_layers=layers)
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(1, cfg.vocab_size, n)) * 2 for n in (5, 9, 13)]
    with_copy, packed = _greedy(model, SpecConfig(), True, prompts, drafter, params)
    without, plain = _greedy(model, SpecConfig(), False, prompts, drafter, params)
    assert _packed(packed.runner.params) and not _packed(plain.runner.params)
    head_copies = _packed(packed.runner.drafter_params)
    assert sorted(p.split("/")[-2] for p in head_copies) == sorted(HEAD_PROJECTIONS)
    assert not _packed(plain.runner.drafter_params)
    assert with_copy == without
    assert packed.stats.num_drafts > 0 and packed.stats.num_accepted_tokens > 0  # the head drafted and was right
    assert (packed.stats.num_accepted_tokens, packed.stats.num_drafts) == (plain.stats.num_accepted_tokens,
                                                                           plain.stats.num_drafts)


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qkv-bias"])
def test_a_layer_folds_its_norms_and_residual_adds_into_the_kernel_calls(kernels_on, qkv_bias, monkeypatch):
    """With the packed copies, a step of a few rows runs each layer's two RMSNorms and two
    residual adds inside kernel calls. With the cpu attention the whole layer is one call
    (pallas_kernels.cpu.layer_tail.decoder_layer: norm, QKV, RoPE, the K/V write, attention, o_proj,
    norm, MLP), and all the step's layers one call (layer_tail.decoder_stack), or, where the QKV
    has a bias (Qwen2), one fused QKV product
    (pallas_kernels.cpu.small_rows.fused_small_rows) and one call for the rest after the K/V write
    (layer_tail); with another attention, 4 fused products. No plain product either way, and the
    logits, hidden states and cache equal the plain parameters' up to float rounding. A step of
    more rows folds nothing."""
    from jspec.models.cpu_path import CPU
    from jspec.train.objectives import fresh_cache
    from pallas_kernels.cpu.layer_tail import LAYER_TARGET, STACK_TARGET
    from pallas_kernels.cpu.layer_tail import TARGET as TAIL_TARGET
    from pallas_kernels.cpu.small_rows import FUSED_TARGET, TARGET

    from jspec.models import llama

    monkeypatch.setattr(llama, "TRACE_LAYERS_ONCE", False)  # each layer's calls in the lowered text
    model = tiny_model(tiny_config(num_layers=2, qkv_bias=qkv_bias), scale=2.0)
    cfg = model.config
    layers = cfg.num_layers
    packed = with_small_row_weights(model.params)
    for rows in (1, 5, 24):
        tokens = jnp.asarray(np.random.default_rng(rows).integers(1, cfg.vocab_size, (1, rows)), jnp.int32)
        for attention in ("cpu", "xla"):
            def step(params):
                return CPU.forward(params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, 1, 32), jnp.asarray([rows]),
                                   attention=attention)

            text = jax.jit(step).lower(packed).as_text()
            folded = rows in KERNEL_ROWS
            cpu = folded and attention == "cpu"
            whole, tail = cpu and not qkv_bias, cpu and qkv_bias
            assert text.count(f"@{STACK_TARGET}(") == (1 if whole else 0)
            assert text.count(f"@{LAYER_TARGET}(") == 0
            assert text.count(f"@{TAIL_TARGET}(") == (layers if tail else 0)
            assert text.count(f"@{FUSED_TARGET}(") == (0 if whole else layers if tail else 4 * layers if folded else 0)
            assert text.count(f"@{TARGET}(") == 0  # every projection folded something in (this LM head is untied)
            got, want = jax.jit(step)(packed), jax.jit(step)(model.params)
            np.testing.assert_allclose(got.logits, want.logits, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got.hidden, want.hidden, rtol=1e-4, atol=1e-4)
            for a, b in zip(got.cache.k_pages + got.cache.v_pages, want.cache.k_pages + want.cache.v_pages):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ a drafter's weights as Q8_0
def test_quantize_rows_is_llama_cpps_q8_0_and_keeps_q8_0_values_exactly():
    """``quantize_rows``: per 32 weights d = max |w| / 127 (float16), q = round(w / d); each weight
    comes back within half a step (and d's rounding), and rows that already are Q8_0 values come back bit for bit
    (the target's Q8_0 LM-head rows, which a draft vocabulary's head reads)."""
    from jspec.loading.convert import quantize_rows

    rng = np.random.default_rng(0)
    w = rng.normal(size=(7, 96)).astype(np.float32) * np.array([0.03, 1.0, 30.0], np.float32).repeat(32)  # d float16-normal
    w[2, 32:64] = 0.0  # an all-zero block: d = 0
    back = np.asarray(small_rows.dequantize(jnp.asarray(quantize_rows(w)), 7))
    d = (np.abs(w.reshape(7, 3, 32)).max(-1) / 127).astype(np.float16).astype(np.float32)
    err = np.abs(back - w).reshape(7, 3, 32).max(-1)
    # half a step, plus the float16 rounding of d times |q| <= 127
    assert (err <= d * (0.5 + 127 * 2.0 ** -11) * (1 + 1e-6)).all() and (back[2, 32:64] == 0).all()
    assert not np.array_equal(back, w)  # lossy for arbitrary floats ...
    q = rng.integers(-127, 128, size=(5, 64)).astype(np.float32)
    q[:, ::32] = 127  # a block's largest |q| is 127, as llama.cpp's quantizer leaves it
    scales = rng.uniform(1e-3, 1e-1, size=(5, 2, 1)).astype(np.float16).astype(np.float32)
    exact = (q.reshape(5, 2, 32) * scales).reshape(5, 64)
    np.testing.assert_array_equal(np.asarray(small_rows.dequantize(jnp.asarray(quantize_rows(exact)), 5)), exact)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_rows(np.ones((4, 40), np.float32))
    with pytest.raises(ValueError, match="q8_0"):
        quantize_rows(w, "q4_0")


def _eagle(model, layers=(0, 2, 3)):
    cfg = model.config
    vocab_ids = jnp.arange(0, cfg.vocab_size, 2, dtype=jnp.int32)
    params = {"head": init_eagle_params(cfg, jax.random.key(1), model.params, num_features=len(layers)),
              "lm_head": output_embedding(model.params, cfg)[vocab_ids], "vocab_ids": vocab_ids}
    return EagleDrafter(3, cfg, feature_layers=layers), params


@pytest.mark.parametrize("quantization", ["q8_0", None, "auto"])
def test_a_drafters_weights_are_quantized_to_q8_0_and_the_output_stays_exact(kernels_on, quantization):
    """``SpecConfig.draft_quantization`` ("q8_0"; by default for a drafter loaded from a
    checkpoint, the shipped ones included: test_real_model.py): the engine keeps an EAGLE head's
    projections and its draft-vocabulary LM head as Q8_0 blocks (float32 packed copies with None);
    the blocks are the float weights to within Q8_0's rounding, the head's draft logits move by no
    more than that, and the output is the target's greedy output either way."""
    from jspec.loading.convert import quantized_drafter_weights
    from jspec.speculative.drafters.base import draft_vocab_logits

    model = tiny_model(tiny_config(num_layers=4), scale=3.0)
    drafter, params = _eagle(model)
    rng = np.random.default_rng(2)
    prompts = [list(rng.integers(1, model.config.vocab_size, n)) * 2 for n in (5, 9, 13)]
    plain, _ = _greedy(model, SpecConfig(), True, prompts)
    out, engine = _greedy(model, SpecConfig(draft_quantization=quantization), True, prompts, drafter, params)
    assert out == plain
    assert engine.stats.num_drafts > 0
    dp = engine.runner.drafter_params
    copies = {p: w for p, w in (("/".join(str(getattr(k, "key", k)) for k in path), w) for path, w in
                                jax.tree_util.tree_flatten_with_path(dp)[0]) if p.endswith("/weight")}
    assert sorted(p.split("/")[-2] for p in copies) == sorted(HEAD_PROJECTIONS)
    if quantization != "q8_0":  # "auto": parameters passed in as they are stay float32
        assert all(w.dtype == jnp.float32 for w in copies.values()) and "lm_head_rows" not in dp
        return
    assert all(small_rows.quantized_type(w) == "q8_0" for w in copies.values())
    expected = quantized_drafter_weights(params, HEAD_PROJECTIONS)
    assert set(expected) == {tuple(p.split("/")[:-1]) for p in copies} | {("lm_head_rows",)}
    for p, w in copies.items():
        kernel = np.asarray(params["head"][p.split("/")[1]]["kernel"] if p.count("/") == 2 else
                            params["head"]["layer"][p.split("/")[2]][p.split("/")[3]]["kernel"])
        back = np.asarray(small_rows.dequantize(w, kernel.shape[1]))
        np.testing.assert_allclose(back, kernel.T, atol=np.abs(kernel).max() / 127)
    h = jax.random.normal(jax.random.key(3), (2, model.config.hidden_size))
    exact = draft_vocab_logits(h, params, model.config.vocab_size, engine.path)
    quant = draft_vocab_logits(h, dp, model.config.vocab_size, engine.path)
    keep = np.isfinite(np.asarray(exact))
    assert (np.isfinite(np.asarray(quant)) == keep).all()
    scale = float(np.abs(np.asarray(exact)[keep]).max())
    np.testing.assert_allclose(np.asarray(quant)[keep], np.asarray(exact)[keep], atol=0.02 * scale)
    assert not np.array_equal(np.asarray(quant), np.asarray(exact))  # the blocks are read, not the floats


def test_a_draft_models_layers_and_head_rows_are_quantized_too():
    """A draft model's tree: its layers' projections, and the rows its logits read (a draft
    vocabulary's ``lm_head``, or a whole model's untied ``lm_head`` / tied embedding)."""
    from jspec.loading.convert import quantized_drafter_weights

    draft = tiny_model(tiny_config(num_layers=2))
    full = quantized_drafter_weights(draft.params, HEAD_PROJECTIONS)
    layer_keys = {(f"layers_{n}", *w) for n in range(2) for w in
                  (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))}
    assert set(full) == layer_keys | {("lm_head_rows",)}
    np.testing.assert_allclose(np.asarray(small_rows.dequantize(jnp.asarray(full[("lm_head_rows",)]), 96)),
                               np.asarray(draft.params["lm_head"]["kernel"]).T, atol=0.02)
    ids = jnp.arange(10, dtype=jnp.int32)
    vocab = quantized_drafter_weights({"model": draft.params, "lm_head": draft.params["lm_head"]["kernel"].T[ids],
                                       "vocab_ids": ids}, HEAD_PROJECTIONS)
    assert set(vocab) == {("model", *k) for k in layer_keys} | {("lm_head_rows",)}
    assert vocab[("lm_head_rows",)].shape[0] == 3  # 10 rows, 4 to a group


def test_draft_quantization_is_auto_q8_0_or_none():
    assert SpecConfig("eagle", draft="x").draft_quantization == "auto"
    assert SpecConfig.from_dict({"method": "eagle", "model": "x", "quantization": None}).draft_quantization is None
    for bad in ("q4_0", "Q8_0", 8):
        with pytest.raises(ConfigError, match="draft_quantization"):
            SpecConfig("eagle", draft="x", draft_quantization=bad)
