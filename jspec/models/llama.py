"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) in Flax, on a paged KV cache.

RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query attention through the
verification-attention contract, SwiGLU MLP, tied or untied embeddings, optional QKV bias.
The Q/K/V projections are fused into one matmul and gate/up into another (fewer, larger
matmuls: decode on a CPU is bound by reading weights and by per-op overhead).

:func:`forward` is the pure function the rest of jspec jits:

    forward(params, config, tokens [B, T], cache, q_lens [B])
        -> logits [B, T, V] (or None), hidden [B, T, H] (after the final norm), new cache

Row t of sequence b sits at position ``cache.lengths[b] + t``; rows ``t < q_lens[b]`` have
their K/V written into the cache before attention, and the returned cache's lengths are
``cache.lengths + q_lens``. ``num_layers`` < config.num_layers runs only the first layers
(layer-skip self-speculation) and still applies the final norm and LM head.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import attention as attention_lib
from jspec.cache.paged import PagedKVCache, write_kv
from jspec.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float32, computed as Hugging Face does)."""
    d = config.head_dim
    inv = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    if config.rope_freq_factors is not None:  # llama.cpp stores Llama-3 scaling as divisors
        return (inv / np.asarray(config.rope_freq_factors, np.float32)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    # Llama-3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, D], positions int32 [B, T]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., H]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return scale * xf.astype(x.dtype)


class Attention(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    @nn.compact
    def __call__(self, x, positions, k_pages, v_pages, block_tables, start, q_lens):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        b, t, _ = x.shape
        qkv = nn.Dense(cfg.q_size + 2 * cfg.kv_size, use_bias=cfg.qkv_bias, dtype=dtype,
                       param_dtype=dtype, name="qkv_proj")(x)  # [B, T, (Hq + 2 KVH) D]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        inv_freq = rope_inv_freq(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)

        with jax.named_scope("kv_write"):
            k_pages = write_kv(k_pages, k, block_tables, start, q_lens)
            v_pages = write_kv(v_pages, v, block_tables, start, q_lens)
        with jax.named_scope("verify_attention"):
            attn = attention_lib.get(self.attention)
            o = attn(q, k_pages, v_pages, block_tables, start + q_lens, q_lens)  # [B, T, Hq, D]
        out = nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                       name="o_proj")(o.reshape(b, t, cfg.q_size))
        return out, k_pages, v_pages


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        gate_up = nn.Dense(2 * cfg.intermediate_size, use_bias=False, dtype=dtype,
                           param_dtype=dtype, name="gate_up_proj")(x)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        return nn.Dense(cfg.hidden_size, use_bias=False, dtype=dtype, param_dtype=dtype,
                        name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    @nn.compact
    def __call__(self, x, positions, k_pages, v_pages, block_tables, start, q_lens):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        h, k_pages, v_pages = Attention(cfg, self.attention, name="self_attn")(
            RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x),
            positions, k_pages, v_pages, block_tables, start, q_lens)
        x = x + h
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, dtype, name="post_attention_layernorm")(x))
        return x, k_pages, v_pages


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                     embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(cfg, self.attention) for _ in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def embed(self, tokens):  # int32 [B, T] -> [B, T, H]
        return self.embed_tokens(tokens)

    def head(self, hidden):  # [B, T, H] (after the final norm) -> float32 logits [B, T, V]
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    def __call__(self, tokens, cache: PagedKVCache, q_lens, num_layers: Optional[int] = None,
                 compute_logits: bool = True):
        n = self.config.num_layers if num_layers is None else num_layers
        b, t = tokens.shape
        start = cache.lengths  # [B]
        positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
        x = self.embed(tokens)
        k_all, v_all = list(cache.k_pages), list(cache.v_pages)
        for i in range(n):
            with jax.named_scope(f"layer_{i}"):
                x, k_all[i], v_all[i] = self.layers[i](
                    x, positions, k_all[i], v_all[i], cache.block_tables, start, q_lens)
        hidden = self.norm(x)
        logits = self.head(hidden) if compute_logits else None
        cache = cache.replace(k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=start + q_lens)
        return logits, hidden, cache


class ForwardOutput(NamedTuple):
    logits: Optional[jax.Array]  # float32 [B, T, V]
    hidden: jax.Array  # [B, T, H], after the final norm
    cache: PagedKVCache


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig, attention: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, attention_lib.resolve(attention))


def forward(params, config: ModelConfig, tokens, cache: PagedKVCache, q_lens, *,
            attention: str = "auto", num_layers: Optional[int] = None,
            compute_logits: bool = True) -> ForwardOutput:
    """Run the model over ``tokens`` [B, T] on top of ``cache`` (pure; jit it)."""
    with jax.named_scope("model_forward"):
        return ForwardOutput(*_module(config, attention).apply(
            {"params": params}, tokens, cache, q_lens, num_layers, compute_logits))


def output_embedding(params, config: ModelConfig) -> jax.Array:
    """The LM head as rows [V, H]: logits = hidden @ rows.T (the tied embedding, or lm_head)."""
    if config.tie_word_embeddings:
        return params["embed_tokens"]["embedding"]
    return params["lm_head"]["kernel"].T


def embed(params, config: ModelConfig, tokens) -> jax.Array:
    return _module(config, "reference").apply({"params": params}, tokens, method="embed")


def lm_head(params, config: ModelConfig, hidden) -> jax.Array:
    return _module(config, "reference").apply({"params": params}, hidden, method="head")


def init_params(config: ModelConfig, key: jax.Array):
    """Random parameters (tiny test models, drafts trained from scratch)."""
    from jspec.cache.paged import init_cache

    tables = jnp.zeros((1, 1), jnp.int32)
    cache = init_cache(config.num_layers, config.num_kv_heads, config.head_dim, tables, 1, 16,
                       jnp.dtype(config.dtype))
    tokens = jnp.zeros((1, 1), jnp.int32)
    return _module(config, "reference").init(key, tokens, cache, jnp.ones((1,), jnp.int32))["params"]
