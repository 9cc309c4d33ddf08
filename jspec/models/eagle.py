"""An EAGLE-style draft head (Li et al., "EAGLE: Speculative Sampling Requires Rethinking
Feature Uncertainty", ICML 2024, arXiv:2401.15077).

The head drafts at the *feature* level. Feature f_t is the target's final hidden state at
position t (after its final norm: the vector its LM head turns into the distribution of token
t + 1). Head entry t takes the previous feature and the current token,

    x_t = fc([embed(token_t), f_{t-1}])            fc: [2H] -> [H]
    h_t = DecoderLayer(x_t; attention over entries <= t, its own one-layer paged cache)
    f^_t = RMSNorm(h_t)                            ~ f_t
    logits_t = f^_t @ E_draft^T                    E_draft: target embedding rows of the draft vocabulary

reusing the target's (frozen) embedding for both the token input and the LM head. Drafting
chains the head on its own predicted features; verification then hands back the target's
true features, which replace the predicted ones in the head's cache.

Parameters: ``fc/{kernel,bias}``, ``layer/...`` (a Llama decoder layer with the target's
dimensions), ``norm/scale``.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec import attention as attention_lib
from jspec.cache.paged import PagedKVCache
from jspec.config import ModelConfig
from jspec.models.llama import DecoderLayer, RMSNorm, Segment, segment_meta


class EagleHead(nn.Module):
    config: ModelConfig  # the target's
    attention: str = "reference"

    @nn.compact
    def __call__(self, embeds, prev_features, cache: PagedKVCache, q_lens, rows=None):
        """embeds, prev_features [B, T, H] -> (predicted features [B, T, H], cache); ``rows``
        [B] picks the cache rows (None: all, in order)."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        t = embeds.shape[1]
        x = nn.Dense(cfg.hidden_size, dtype=dtype, param_dtype=dtype, name="fc")(
            jnp.concatenate([embeds, prev_features.astype(embeds.dtype)], axis=-1))
        b = embeds.shape[0]
        meta = segment_meta(Segment(jnp.zeros((b, t), jnp.int32), q_lens, rows), cache)
        x, k, v = DecoderLayer(cfg, self.attention, name="layer")(
            x.reshape(b * t, -1), (meta,), cache.k_pages[0], cache.v_pages[0])
        feats = RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(x).reshape(b, t, -1)
        lengths = cache.lengths + q_lens if rows is None else cache.lengths.at[rows].add(q_lens, mode="drop")
        return feats, cache.replace(k_pages=(k,), v_pages=(v,), lengths=lengths)


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig, attention: str) -> EagleHead:
    return EagleHead(config, attention_lib.resolve(attention))


def eagle_forward(head_params, config: ModelConfig, embeds, prev_features, cache: PagedKVCache, q_lens,
                  attention: str = "reference", rows=None):
    """Pure head forward; returns (predicted features [B, T, H], new one-layer cache)."""
    with jax.named_scope("eagle_head"):
        return _module(config, attention).apply({"params": head_params}, embeds, prev_features, cache, q_lens,
                                                rows)


def init_eagle_params(config: ModelConfig, key: jax.Array, target_params=None):
    """Random head parameters; with ``target_params`` the decoder layer starts as the target's
    last layer and the norm as its final norm (a warm start used by training)."""
    from jspec.cache.paged import init_cache

    cache = init_cache(1, config.num_kv_heads, config.head_dim, jnp.zeros((1, 1), jnp.int32), 1, 16,
                       jnp.dtype(config.dtype))
    x = jnp.zeros((1, 1, config.hidden_size), jnp.dtype(config.dtype))
    params = _module(config, "reference").init(key, x, x, cache, jnp.ones((1,), jnp.int32))["params"]
    if target_params is not None:
        params = dict(params)
        params["layer"] = jax.tree_util.tree_map(jnp.array, target_params[f"layers_{config.num_layers - 1}"])
        params["norm"] = {"scale": jnp.array(target_params["norm"]["scale"])}
    return params
