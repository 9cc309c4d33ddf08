"""Logits processing and sampling: one path for autoregressive decoding and verification.

Every row of a batch carries its own parameters (:class:`RowSampling`: temperature, top-k,
top-p per row), so requests with different settings share one compiled step. A
:class:`~jspec.config.SamplingParams` works wherever a ``RowSampling`` does (it is broadcast to
every row).

``process_logits`` applies, in order, temperature, top-k and top-p (the order Hugging Face's
``generate`` and vLLM use) and returns float32 logits with removed tokens at ``-inf``.
``probs`` is its softmax: the distribution p (target) or q (draft) that speculative
acceptance compares. Greedy rows (temperature 0) take the argmax and have no distribution;
their "probs" are one-hot on the argmax, so the same acceptance code treats them as
deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Sampling parameters per row (leading dimension R, or any batch shape)."""

    temperature: jax.Array  # float32 [R]: 0 = greedy
    top_k: jax.Array  # int32 [R]: 0 = off
    top_p: jax.Array  # float32 [R]: 1 = off

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams]) -> "RowSampling":
        """Host (numpy) arrays for a list of requests' parameters."""
        return cls(np.asarray([p.temperature for p in params], np.float32),
                   np.asarray([p.top_k for p in params], np.int32),
                   np.asarray([p.top_p for p in params], np.float32))

    @classmethod
    def broadcast(cls, sp: SamplingParams, shape: tuple[int, ...]) -> "RowSampling":
        return cls(jnp.full(shape, sp.temperature, jnp.float32), jnp.full(shape, sp.top_k, jnp.int32),
                   jnp.full(shape, sp.top_p, jnp.float32))

    def take(self, idx) -> "RowSampling":
        return RowSampling(self.temperature[idx], self.top_k[idx], self.top_p[idx])

    @property
    def greedy(self) -> jax.Array:  # bool [R]
        return self.temperature <= 0


Sampling = Union[SamplingParams, RowSampling]


def _rows(sp: Sampling, logits: jax.Array) -> RowSampling:
    """Parameters shaped like ``logits.shape[:-1]`` (rows may be a prefix: broadcast on the right)."""
    if isinstance(sp, SamplingParams):
        return RowSampling.broadcast(sp, logits.shape[:-1])
    lead = logits.ndim - 1

    def fit(x):
        x = jnp.asarray(x)
        x = x.reshape(x.shape + (1,) * (lead - x.ndim))
        return jnp.broadcast_to(x, logits.shape[:-1])

    return RowSampling(fit(sp.temperature), fit(sp.top_k), fit(sp.top_p))


def _all_greedy(sp: Sampling):
    if isinstance(sp, SamplingParams):
        return sp.greedy
    return None  # decided at run time


def process_logits(logits: jax.Array, sp: Sampling) -> jax.Array:
    """[..., V] -> float32 [..., V]: temperature, then top-k, then top-p (``-inf`` = removed).
    Greedy rows come back unscaled and unfiltered."""
    rs = _rows(sp, logits)
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    greedy = rs.greedy[..., None]
    x = jnp.where(greedy, x, x / jnp.where(greedy, 1.0, rs.temperature[..., None]))
    top_k = jnp.where((rs.top_k > 0) & (rs.top_k < v) & ~rs.greedy, rs.top_k, 0)
    top_p = jnp.where(rs.greedy, 1.0, rs.top_p)
    if isinstance(sp, SamplingParams) and not (0 < sp.top_k < v) and sp.top_p >= 1.0:
        return x  # nothing to filter, known at trace time

    def filtered(x):
        sorted_x = -jnp.sort(-x, axis=-1)  # descending [..., V]
        # top-k: keep values >= the k-th largest (ties with it stay, as in HF)
        kth = jnp.take_along_axis(sorted_x, jnp.maximum(top_k - 1, 0)[..., None], axis=-1)
        kth = jnp.where(top_k[..., None] > 0, kth, -jnp.inf)
        sorted_x = jnp.where(sorted_x < kth, -jnp.inf, sorted_x)
        # top-p over what top-k left: keep the smallest prefix whose mass reaches top_p (tokens
        # whose predecessors already hold >= top_p go; the first token always stays)
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep = (mass_before < top_p[..., None]) & (sorted_x > -jnp.inf)
        cutoff = jnp.min(jnp.where(keep, sorted_x, jnp.inf), axis=-1, keepdims=True)
        cutoff = jnp.where(top_p[..., None] < 1.0, cutoff, kth)
        return jnp.where(x < cutoff, -jnp.inf, x)

    needed = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    return jax.lax.cond(needed, filtered, lambda x: x, x)


def probs(logits: jax.Array, sp: Sampling) -> jax.Array:
    """The sampling distribution [..., V] (one-hot on the argmax for greedy rows)."""
    v = logits.shape[-1]
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)
    if _all_greedy(sp) is True:
        return onehot
    rs = _rows(sp, logits)
    return jnp.where(rs.greedy[..., None], onehot, jax.nn.softmax(process_logits(logits, sp), axis=-1))


def sample(key: jax.Array, logits: jax.Array, sp: Sampling) -> jax.Array:
    """Draw token ids [...] from logits [..., V] (argmax for greedy rows). ``key`` is one key
    for all rows, or one key per row (shape ``logits.shape[:-1]``)."""
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if _all_greedy(sp) is True:
        return best
    rs = _rows(sp, logits)

    def draw(_):
        x = process_logits(logits, sp)
        if key.shape == ():
            tok = jax.random.categorical(key, x, axis=-1)
        else:
            tok = jax.vmap(lambda k, row: jax.random.categorical(k, row, axis=-1))(
                key.reshape(-1), x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])
        return jnp.where(rs.greedy, best, tok.astype(jnp.int32))

    if _all_greedy(sp) is False:
        return draw(None)
    return jax.lax.cond(jnp.all(rs.greedy), lambda _: best, draw, None)


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """Draw token ids [...] from (possibly unnormalized, non-negative) probabilities [..., V]."""
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.random.categorical(key, logp, axis=-1).astype(jnp.int32)
