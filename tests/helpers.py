"""Shared builders for tests: tiny configs, tiny Hugging Face checkpoints, tiny tokenizers."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.loading import LoadedModel

TINY = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=(1,))


def tiny_subprocess_xla_flags(flags: str) -> str:
    """``XLA_FLAGS`` for a subprocess that runs tiny models only (the notebooks, the
    tensor-parallel runs): XLA CPU's older elemental emitters, which compile small programs
    faster, as conftest.py has this process compile its small ones. Off with
    JSPEC_TEST_FUSION_EMITTER_OPS <= 0 (as conftest.py reads it), or when the flag is already set."""
    if int(os.environ.get("JSPEC_TEST_FUSION_EMITTER_OPS", "10000")) <= 0 or "xla_cpu_use_fusion_emitters" in flags:
        return flags
    return f"{flags} --xla_cpu_use_fusion_emitters=false".strip()


def tiny_config(**kw) -> ModelConfig:
    return dataclasses.replace(TINY, **kw)


def tiny_model(config: ModelConfig | None = None, seed: int = 0, scale: float = 1.0) -> LoadedModel:
    """A random model on ``config`` (weights scaled up so greedy choices are far from ties)."""
    from jspec.models.llama import init_params

    config = config or TINY
    params = init_params(config, jax.random.key(seed))
    if scale != 1.0:
        params = jax.tree_util.tree_map(lambda p: p * scale if p.ndim > 1 else p, params)
    return LoadedModel(config, params, None, Path("tiny"), "test")


def tiny_qwen3(seed: int = 0, scale: float = 1.0, **kw) -> LoadedModel:
    """A random Qwen3-style model (per-head q/k RMSNorm) with gains drawn in [0.5, 1.5]."""
    model = tiny_model(tiny_config(architecture="qwen3", qk_norm=True, **kw), seed=seed, scale=scale)
    rng = np.random.default_rng(seed)

    def gains(path, x):
        names = {getattr(k, "key", None) for k in path}
        return jnp.asarray(rng.uniform(0.5, 1.5, x.shape), x.dtype) if names & {"q_norm", "k_norm"} else x

    model.params = jax.tree_util.tree_map_with_path(gains, model.params)
    return model


GEMMA = {  # the Gemma fields of tiny configs: windows shorter than the prompts, caps that bind
    "gemma2": dict(layer_types=("sliding", "full"), sliding_window=6, query_pre_attn_scalar=24.0,
                   attn_logit_softcap=4.0, final_logit_softcap=6.0),
    "gemma3_text": dict(layer_types=("sliding", "full"), sliding_window=6, qk_norm=True, local_rope_theta=1e4,
                        rope_theta=1e6, rope_linear_factor=8.0),
}


def tiny_gemma(arch: str = "gemma2", seed: int = 0, scale: float = 1.0, **kw) -> LoadedModel:
    """A random Gemma 2 or Gemma 3 model (``arch``: "gemma2" or "gemma3_text"; the fields of
    GEMMA, ``kw`` over them) with its norms' offsets drawn in [-0.5, 0.5]."""
    fields = dict(GEMMA[arch], architecture=arch, hidden_act="gelu_tanh", tie_word_embeddings=True)
    fields.update(kw)
    if "num_layers" in kw and "layer_types" not in kw:
        fields["layer_types"] = tuple("sliding" if i % 2 == 0 else "full" for i in range(kw["num_layers"]))
    model = tiny_model(tiny_config(**fields), seed=seed, scale=scale)
    rng = np.random.default_rng(seed)

    def offsets(path, x):
        return jnp.asarray(rng.uniform(-0.5, 0.5, x.shape), x.dtype) if x.ndim == 1 and "norm" in str(path) else x

    model.params = jax.tree_util.tree_map_with_path(offsets, model.params)
    return model


def add_gguf_geometry(w, cfg: ModelConfig) -> None:
    """The geometry fields of ``cfg`` on a ``gguf.GGUFWriter`` (as llama.cpp's converter writes them)."""
    w.add_block_count(cfg.num_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_vocab_size(cfg.vocab_size)


def hf_config_dict(arch: str = "llama", **kw) -> dict:
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                initializer_range=0.2, bos_token_id=0, eos_token_id=1)
    base.update(kw)
    return base


def write_hf_checkpoint(directory: Path, arch: str = "llama", seed: int = 0, tokenizer: bool = True,
                        **config_kw) -> Path:
    """A random transformers model saved as config.json + model.safetensors (+ tokenizer)."""
    import torch
    import transformers

    cls_cfg, cls_model = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    cfg = cls_cfg(**hf_config_dict(arch, **config_kw))
    model = cls_model(cfg).eval()
    if arch == "qwen3":  # gains away from their initial ones, so that a q/k norm mixed up shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    if arch.startswith("gemma"):  # Gemma's norm weights start at 0 (a gain of 1): move them
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(-0.5, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer:
        write_tiny_tokenizer(directory, cfg.vocab_size)
    return directory


_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello jspec. speculative decoding is lossless.",
    "for i in range(10):\n    print(i)\n",
]


def write_tiny_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with exactly ``vocab_size`` entries, saved for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    assert tok.get_vocab_size() <= vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant: {% endif %}")
    fast.save_pretrained(str(directory))


def dense_causal_attention(q, k, v, q_start, *, sm_scale=None, soft_cap=None, sliding_window=None):
    """Numpy oracle: q [T, Hq, D] at positions q_start.., k/v [N, KVH, D] contiguous; the
    options as Hugging Face's Gemma layers apply them (scale, then cap; the window counts the
    row's own key)."""
    t, hq, d = q.shape
    kvh = k.shape[1]
    g = hq // kvh
    scale = 1 / np.sqrt(d) if sm_scale is None else sm_scale
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hq):
        kh, vh = k[:, h // g].astype(np.float64), v[:, h // g].astype(np.float64)
        for i in range(t):
            n = q_start + i + 1
            lo = 0 if sliding_window is None else max(0, n - sliding_window)
            s = kh[lo:n] @ q[i, h].astype(np.float64) * scale
            if soft_cap is not None:
                s = soft_cap * np.tanh(s / soft_cap)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ vh[lo:n]
    return out


def save_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def chi_square_check(counts, probs, z: float = 4.75):
    """Goodness of fit of ``counts`` (any shape) to ``probs`` (same shape).

    Cells expected to hold fewer than 5 samples are pooled into one bin (the chi-square
    approximation needs >= 5 per bin). Returns (statistic, threshold): the threshold is the
    chi-square quantile at one-sided normal level ``z`` (4.75 -> false-alarm rate ~1e-6), from
    the Wilson-Hilferty approximation. A sample in a cell of probability 0 gives an infinite
    statistic.
    """
    counts = np.asarray(counts, np.float64).ravel()
    probs = np.asarray(probs, np.float64).ravel()
    n = counts.sum()
    if ((probs == 0) & (counts > 0)).any():
        return float("inf"), 0.0
    expected = probs * n
    big = expected >= 5
    obs = list(counts[big]) + [counts[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    obs, exp = np.asarray(obs), np.asarray(exp)
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = max(1, int(keep.sum()) - 1)
    threshold = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, float(threshold)


def exact_two_token_distribution(model, prompt, sp, allowed1=None, allowed2=None):
    """p(x1, x2 | prompt) under the target with the sampling processing, by enumeration; with
    ``allowed1`` (bool [V]) and ``allowed2`` (bool [V, V]: after x1, row x1), the constrained
    law: refused tokens' logits at -inf before the processing, as structured output does."""
    import jax.numpy as jnp

    from jspec.cache import init_cache
    from jspec.models.llama import forward
    from jspec.sampling import probs

    cfg = model.config
    v = cfg.vocab_size
    fwd = jax.jit(lambda p, t, c, q: forward(p, cfg, t, c, q, attention="reference").logits)

    def logits_after(seqs):
        seqs = jnp.asarray(seqs, jnp.int32)
        b, t = seqs.shape
        pages = -(-t // 16)
        tables = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, b * pages, 16)
        return fwd(model.params, seqs, cache, jnp.full((b,), t, jnp.int32))[:, -1]

    l1 = logits_after([prompt])  # [1, V]
    l2 = logits_after([prompt + [x] for x in range(v)])  # [V, V]
    if allowed1 is not None:
        l1 = jnp.where(jnp.asarray(allowed1)[None], l1, -jnp.inf)
        l2 = jnp.where(jnp.asarray(allowed2), l2, -jnp.inf)
    p1 = np.asarray(probs(l1, sp))[0]  # [V]
    p2 = np.nan_to_num(np.asarray(probs(l2, sp)))  # [V, V] (rows after a refused x1: never reached)
    return p1[:, None] * p2


def sampled_pair_counts(model, prompt, sp, n: int, drafter=None, drafter_params=None, chunk: int = 500):
    """Counts [V, V] of the first two tokens of ``n`` sampled continuations of ``prompt`` (seeds
    0..n-1), and the summed accepted/proposed counts of the first verification position.

    The samples are drawn ``chunk`` prompts per ``generate`` call (one compiled shape): one call of
    thousands of slots runs every burst over all of them while their prefill trickles in, several
    times the work of a few calls that prefill at once. Seeds, hence samples, do not depend on it.
    """
    import jspec

    v = model.config.vocab_size
    counts = np.zeros((v, v), np.int64)
    accepted = proposed = 0
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        out = jspec.generate(model, [prompt] * m, sp, drafter=drafter, drafter_params=drafter_params,
                             seeds=list(range(start, start + m)))
        pairs = np.asarray([t[:2] for t in out.token_ids])
        np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
        if out.accepted_counts:
            accepted += out.accepted_counts[0]
            proposed += out.proposed_counts[0]
    return counts, accepted, proposed


def eagle_params(model, seed: int = 3):
    """EAGLE drafter parameters over the full vocabulary, the head built from the target's own
    layer (partly right, partly wrong: a drafter that is sometimes accepted)."""
    import jax.numpy as jnp

    from jspec.models.eagle import init_eagle_params
    from jspec.models.llama import output_embedding

    cfg = model.config
    return {"head": init_eagle_params(cfg, jax.random.key(seed), model.params),
            "lm_head": output_embedding(model.params, cfg), "vocab_ids": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}


def published_eagle3_params(model, seed: int = 3, inter: int = 96, eagle1: bool = False):
    """Random parameters of a published-layout EAGLE-3 head (:class:`PublishedEagle3Head`), or
    with ``eagle1`` an EAGLE-1 one (:class:`PublishedEagle1Head` with an fc bias, QKV biases and
    speculators' layernorms), over the full vocabulary, for ``model``'s geometry."""
    from jspec.cache import init_cache
    from jspec.models.eagle import PublishedEagle1Head, PublishedEagle3Head
    from jspec.models.llama import output_embedding

    cfg = dataclasses.replace(model.config, intermediate_size=inter, qkv_bias=eagle1, qk_norm=False)  # a Llama layer
    cache = init_cache(1, cfg.num_kv_heads, cfg.head_dim, jnp.zeros((1, 1), jnp.int32), 1, 16, jnp.dtype(cfg.dtype))
    x = jnp.zeros((1, 1, cfg.hidden_size), jnp.dtype(cfg.dtype))
    module, prev = (PublishedEagle1Head(cfg, fc_bias=True, layernorms=True), x) if eagle1 else \
        (PublishedEagle3Head(cfg), jnp.concatenate([x] * 3, -1))
    head = module.init(jax.random.key(seed), x, prev, cache, jnp.ones((1,), jnp.int32))["params"]
    return {"head": head, "lm_head": output_embedding(model.params, model.config),
            "vocab_ids": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}
