"""Chunked prefill of a paged cache: ``prompt[:-1]`` of every sequence, ``prefill_chunk`` tokens
per jitted forward (no logits: the last prompt token is the first decode step's input)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import CacheConfig, ModelConfig
from jspec.models.llama import forward


@functools.partial(jax.jit, static_argnames=("config", "attention"), donate_argnums=2)
def _prefill_chunk(params, tokens, cache, q_lens, *, config, attention):
    out = forward(params, config, tokens, cache, q_lens, attention=attention, compute_logits=False)
    return out.cache, out.hidden



def _bucket(n: int, lo: int = 16) -> int:
    """Round up to a power of two (fewer distinct shapes, fewer compilations)."""
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def prefill_chunks(prompt_lens: np.ndarray, cache_config: CacheConfig) -> tuple[int, list[int]]:
    """(chunk size, chunk starts) covering ``prompt[:-1]`` of every sequence."""
    longest = int((prompt_lens - 1).max())
    if longest == 0:
        return 0, []
    chunk = min(cache_config.prefill_chunk, _bucket(longest))
    return chunk, list(range(0, longest, chunk))


def prefill(params, config: ModelConfig, tokens: np.ndarray, prompt_lens: np.ndarray, cache,
            cache_config: CacheConfig, attention: str, return_hidden: bool = False):
    """Write ``prompt[:-1]`` of each sequence into ``cache`` in chunks; returns the cache, and
    with ``return_hidden`` also the final hidden states [B, N, H] of those positions."""
    todo = prompt_lens - 1
    chunk, starts = prefill_chunks(prompt_lens, cache_config)
    hidden = []
    for start in starts:
        piece = np.zeros((tokens.shape[0], chunk), np.int32)
        width = min(chunk, tokens.shape[1] - start)
        piece[:, :width] = tokens[:, start:start + width]
        q_lens = np.clip(todo - start, 0, chunk).astype(np.int32)
        cache, h = _prefill_chunk(params, jnp.asarray(piece), cache, jnp.asarray(q_lens),
                                  config=config, attention=attention)
        if return_hidden:
            hidden.append(h)
    if not return_hidden:
        return cache
    if not hidden:
        return cache, jnp.zeros((tokens.shape[0], 0, config.hidden_size), jnp.dtype(config.dtype))
    return cache, jnp.concatenate(hidden, axis=1)


