"""Gemma 2 and Gemma 3 decoders in Flax, on the paged KV cache, beside the Llama family.

What differs from :mod:`jspec.models.llama` (and follows Hugging Face's ``Gemma2ForCausalLM``
and ``Gemma3ForCausalLM``):

- RMSNorm scales by ``1 + w`` (the weights are stored as offsets from one) and rounds after
  the product; every layer has four of them: before and after attention, before and after the
  MLP (the residual adds the normed outputs);
- the embedding is multiplied by ``sqrt(hidden_size)`` (rounded to the model's dtype);
- the MLP is GeGLU (gelu, tanh approximation) with the same fused gate/up product;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` and, in Gemma 2, capped by
  ``c * tanh(s / c)``; local layers (``layer_types``) see the last ``sliding_window`` keys,
  global layers everything: options of the verification-attention contract, so every
  implementation (the reference, the xla path, the Pallas kernel) runs them;
- Gemma 3 normalizes each head's q and k (``1 + w`` norms) and rotates local layers with its
  own RoPE base; Gemma 2 caps the final logits.

The parameter tree has Llama's names (fused ``qkv_proj`` and ``gate_up_proj``, ``layers_{i}``)
plus ``pre_feedforward_layernorm`` and ``post_feedforward_layernorm`` per layer, so loading,
tensor parallelism and the drafters treat both families alike. The CPU path's fused Llama
kernels do not apply: the engine runs Gemma on the plain modules on every backend.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import llama


def gemma_rms_norm(x: jax.Array, offset: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * (1 + offset)`` in float32, rounded to x's dtype at the end."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + offset.astype(jnp.float32))).astype(x.dtype)


class GemmaRMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., H]
        offset = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],), self.dtype)
        return gemma_rms_norm(x, offset, self.eps)


class Attention(llama.Attention):
    """Llama's attention with Gemma's norms, score scale and cap, and layer ``layer``'s window
    and RoPE frequencies."""

    layer: int = 0
    norm_cls = GemmaRMSNorm

    def options(self) -> dict:
        """The attention contract's options this layer sets (none: the plain contract)."""
        cfg = self.config
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        options = dict(sliding_window=cfg.sliding_window if cfg.layer_type(self.layer) == "sliding" else None,
                       soft_cap=cfg.attn_logit_softcap, sm_scale=None if scalar == cfg.head_dim else scalar ** -0.5)
        return {k: v for k, v in options.items() if v is not None}

    def __call__(self, x, metas, k_pages, v_pages):
        cfg = self.config
        if isinstance(metas, llama.DenseContext):
            raise NotImplementedError("Gemma layers run on the paged cache only (no dense training context)")
        qkv = self.qkv_proj(x)
        qs, ks, vs = llama.segment_qkv(cfg, qkv, metas, self.qk_norms, llama.rope_inv_freq(cfg, self.layer))
        o, k_pages, v_pages = llama.write_and_attend(cfg, self.attention, metas, qs, ks, vs, k_pages, v_pages,
                                                     **self.options())
        return self.o_proj(o), k_pages, v_pages


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention: str = "reference"
    layer: int = 0

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        norm = lambda: GemmaRMSNorm(cfg.rms_norm_eps, dtype)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, self.attention, layer=self.layer)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = llama.MLP(cfg)
        self.post_feedforward_layernorm = norm()

    def trace_fields(self, fields: tuple) -> tuple:
        """(name, value) fields for :func:`jspec.models.llama.call_layer`'s cache, with ``layer``
        the first layer of this one's type: a layer's program depends on its type alone (window,
        RoPE), so Gemma-3-27B's 62 layers trace two programs, not 62."""
        cfg, kind = self.config, self.config.layer_type(self.layer)
        first = next(i for i in range(cfg.num_layers) if cfg.layer_type(i) == kind)
        return tuple((name, first if name == "layer" else value) for name, value in fields)

    def __call__(self, x, metas, k_pages, v_pages):  # x: [M, H]
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), metas, k_pages, v_pages)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x, k_pages, v_pages


class GemmaForCausalLM(llama.LlamaForCausalLM):
    """The same interface as :class:`jspec.models.llama.LlamaForCausalLM` (segments, feature
    layers, layer-skip) with Gemma's layers, embedding scale and logit cap."""

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                     embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(cfg, self.attention, layer=i) for i in range(cfg.num_layers)]
        self.norm = GemmaRMSNorm(cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def embed(self, tokens):  # int32 [...] -> [..., H], scaled by sqrt(H) in the model's dtype
        x = self.embed_tokens(tokens)
        return x * jnp.asarray(math.sqrt(self.config.hidden_size), x.dtype)

    def head(self, hidden):  # [..., H] -> float32 logits [..., V], capped where the config says
        logits = super().head(hidden)
        cap = self.config.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
