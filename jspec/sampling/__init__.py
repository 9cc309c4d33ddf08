"""Logits processing and sampling: one path for autoregressive decoding and verification.

Every row of a batch carries its own parameters (:class:`RowSampling`: temperature, top-k,
top-p per row), so requests with different settings share one compiled step. A
:class:`~jspec.config.SamplingParams` works wherever a ``RowSampling`` does (it is broadcast to
every row).

``process_logits`` applies, in order, temperature, top-k and top-p (the order Hugging Face's
``generate`` and vLLM use) and returns float32 logits with removed tokens at ``-inf``.
``probs`` is its softmax: the distribution p (target) or q (draft) that speculative
acceptance compares. Greedy rows (:func:`greedy_rows`: temperature 0) take the argmax and have
no distribution; their "probs" are one-hot on the argmax, so the same acceptance code treats
them as deterministic.

Every parameter :class:`~jspec.config.SamplingParams` accepts has a distribution here, never an
empty kept set or a NaN: top-p keeps at least the most likely token (a top-p that float32 rounds
to 0 keeps only it and its ties), and a row whose temperature is so small that its largest logit
over it leaves float32's range is sampled greedily (the limit of softmax(logits / T) as T -> 0).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import SamplingParams
from pallas_kernels.cpu import build as cpu_kernels, small_rows


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


def greedy_rows(logits: jax.Array, sp: Sampling) -> jax.Array:
    """bool [...]: the rows of logits [..., V] drawn by argmax: temperature 0, and rows whose
    largest logit over the temperature is not a finite float32 (a temperature so small that
    logits / T overflows: softmax(logits / T) tends to one-hot on the argmax as T -> 0, where
    the overflowed row would give NaN)."""
    rs = _rows(sp, logits)
    top = jnp.max(logits.astype(jnp.float32), axis=-1)
    return rs.greedy | ~jnp.isfinite(top / jnp.where(rs.greedy, 1.0, rs.temperature))


# Candidate counts of the sort-free path, smallest first: each level is one ``lax.top_k``; a
# batch falls through to the next level (and finally to one full sort) only when some row's
# kept set is not decided by its candidates. SmolLM2-135M sampling stories at temperature 0.8 /
# top-p 0.95: ~90% of the steps' nuclei fit in 64 tokens, ~99% in 256, all in 1024.
CANDIDATE_LEVELS = (64, 1024)
SORT_BELOW = 4096  # vocabularies up to this size go straight to the full sort


def process_logits(logits: jax.Array, sp: Sampling, *, levels: Optional[Sequence[int]] = None) -> jax.Array:
    """[..., V] -> float32 [..., V]: temperature, then top-k, then top-p (``-inf`` = removed).
    Greedy rows (:func:`greedy_rows`) come back unscaled and unfiltered.

    The kept set is the full-sort definition (:func:`filter_sorted`): top-k keeps the values
    >= the k-th largest (ties with it stay), top-p then keeps, in descending order over what
    top-k left, every token whose predecessors hold < top_p of the mass, and every token tied
    with a kept one. It is computed without sorting the vocabulary: the ``levels[0]`` largest
    logits of each row (``lax.top_k``) decide it whenever the cut falls among them (top-k <=
    candidates, or the candidates' mass reaches top_p); otherwise the next level, and at the
    end one full sort, decide it (:func:`filter_candidates`). A vocabulary of at most
    ``SORT_BELOW`` entries is sorted outright (unless ``levels`` is given).
    """
    rs = _rows(sp, logits)
    x = logits.astype(jnp.float32)
    v = x.shape[-1]
    small = levels is None and v <= SORT_BELOW  # sorts fast: one full sort, as before candidates
    levels = CANDIDATE_LEVELS if levels is None else levels
    hot = greedy_rows(x, rs)  # [...]
    greedy = hot[..., None]
    x = jnp.where(greedy, x, x / jnp.where(greedy, 1.0, rs.temperature[..., None]))
    top_k = jnp.where((rs.top_k > 0) & (rs.top_k < v) & ~hot, rs.top_k, 0)
    top_p = jnp.where(hot, 1.0, rs.top_p)
    if isinstance(sp, SamplingParams) and not (0 < sp.top_k < v) and sp.top_p >= 1.0:
        return x  # nothing to filter, known at trace time

    # opaque to XLA: with a constant top-k it folds the k-th candidate into a full sort
    top_k, top_p = jax.lax.optimization_barrier((top_k, top_p))

    def cascade(x, levels):
        if small:
            return filter_sorted(x, top_k, top_p, ordered_sums=False)
        if not levels:
            return filter_sorted(x, top_k, top_p)
        num = min(levels[0], v)
        out, covered = filter_candidates(x, top_k, top_p, num)
        if num == v:
            return out
        return jax.lax.cond(jnp.all(covered), lambda x: out, lambda x: cascade(x, levels[1:]), x)

    needed = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    return jax.lax.cond(needed, lambda x: cascade(x, tuple(levels)), lambda x: x, x)


def filter_candidates(x: jax.Array, top_k: jax.Array, top_p: jax.Array, num: int) -> tuple[jax.Array, jax.Array]:
    """Top-k / top-p over x [..., V] decided from its ``num`` largest entries.

    ``top_k`` int32 [...] (0 = off, else < V), ``top_p`` float32 [...] (1 = off). Returns (x
    with removed entries at ``-inf`` [..., V], covered bool [...]). Where ``covered``, the row
    is bit for bit :func:`filter_sorted`'s: the candidates are the sorted row's first ``num``
    values, and :func:`_top_p_cutoff` computes every float on them as it does on the whole
    sorted row. A row is covered when nothing is filtered, when 0 < top-k <= ``num`` (the k-th
    largest is a candidate), or when top-k is off and the candidates' mass reaches top_p (the
    first non-candidate's predecessors hold >= top_p, so it and all after it go). Elsewhere the
    row is meaningless.
    """
    cand, _ = jax.lax.top_k(x, num)  # [..., num], descending
    kth = jnp.take_along_axis(cand, jnp.clip(top_k - 1, 0, num - 1)[..., None], axis=-1)
    kth = jnp.where(top_k[..., None] > 0, kth, -jnp.inf)  # [..., 1]
    cutoff, mass = _top_p_cutoff(jnp.where(cand < kth, -jnp.inf, cand), x, kth, top_p)
    k_in = (top_k > 0) & (top_k <= num)
    covered = ((top_k == 0) | k_in) & ((top_p >= 1.0) | k_in | (mass >= top_p))
    return jnp.where(x < cutoff, -jnp.inf, x), covered | (num >= x.shape[-1])


def filter_sorted(x: jax.Array, top_k: jax.Array, top_p: jax.Array, ordered_sums: bool = True) -> jax.Array:
    """Top-k / top-p over x [..., V] by one full descending sort of each row: the definition
    (and the last fallback) of :func:`process_logits`'s filtering. ``ordered_sums=False``
    adds up the masses with ``jnp.cumsum`` instead (faster to compile; for a vocabulary
    small enough that no candidate path has to agree with it bit for bit)."""
    sorted_x = -jnp.sort(-x, axis=-1)  # descending [..., V]
    # top-k: keep values >= the k-th largest (ties with it stay, as in HF)
    kth = jnp.take_along_axis(sorted_x, jnp.maximum(top_k - 1, 0)[..., None], axis=-1)
    kth = jnp.where(top_k[..., None] > 0, kth, -jnp.inf)
    cutoff, _ = _top_p_cutoff(jnp.where(sorted_x < kth, -jnp.inf, sorted_x), x, kth, top_p, ordered_sums)
    return jnp.where(x < cutoff, -jnp.inf, x)


def _top_p_cutoff(desc: jax.Array, x: jax.Array, kth: jax.Array, top_p: jax.Array, ordered_sums: bool = True):
    """Top-p over what top-k left: keep the smallest prefix whose mass reaches top_p (a token
    goes when its predecessors already hold >= top_p; the first token always stays, even for a
    top_p of 0, as in vLLM and Hugging Face).

    desc [..., n]: the n largest of x [..., V] in descending order, top-k's removals at
    ``-inf`` (n = V: the whole sorted row); kth [..., 1]: top-k's threshold (``-inf`` = off).
    Returns (cutoff [..., 1]: keep x >= cutoff, so ties with a kept token stay; mass [...]:
    the mass of all n). Every float here is the same for the same sorted prefix whatever n
    is: the softmax's normalizer is summed over x in vocabulary order, and the masses are
    prefix sums added strictly left to right (:func:`_prefix_sums`).
    """
    top = desc[..., :1]
    z = jnp.sum(jnp.where(x < kth, 0.0, jnp.exp(x - top)), axis=-1, keepdims=True)
    p = jnp.exp(desc - top) / z  # [..., n]
    if ordered_sums:
        before, mass = _prefix_sums(p)
    else:
        mass = jnp.cumsum(p, axis=-1)
        before, mass = mass - p, mass[..., -1]
    first = jnp.arange(desc.shape[-1]) == 0
    keep = ((before < top_p[..., None]) | first) & (desc > -jnp.inf)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(top_p[..., None] < 1.0, cutoff, kth), mass


_PREFIX_BLOCK = 64


def _prefix_sums(p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """p [..., n] -> (before [..., n]: sum of p[..., :i]; total [...]: sum of all), added
    strictly left to right in blocks of 64 (within a block one by one, then the block totals
    the same way). So before[i] depends on p[..., :i] only, not on n, ``total`` equals the
    ``before[n]`` of any longer row, and for p >= 0 neither ever decreases. (``jnp.cumsum`` is
    a tree on the CPU whose rounding depends on n.) One ``lax.scan`` of 64 steps per level."""
    n = p.shape[-1]
    nb = -(-n // _PREFIX_BLOCK)
    blocks = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, nb * _PREFIX_BLOCK - n)])  # + 0 is exact
    cols = jnp.moveaxis(blocks.reshape(p.shape[:-1] + (nb, _PREFIX_BLOCK)), -1, 0)  # [64, ..., nb]
    totals, inner = jax.lax.scan(lambda acc, col: (acc + col, acc), jnp.zeros_like(cols[0]), cols)
    inner = jnp.moveaxis(inner, 0, -1)  # [..., nb, 64]
    if nb == 1:
        return inner[..., 0, :n], totals[..., 0]
    block_before, total = _prefix_sums(totals)
    before = block_before[..., None] + inner  # block 0 adds exactly 0
    return before.reshape(p.shape[:-1] + (nb * _PREFIX_BLOCK,))[..., :n], total


def probs(logits: jax.Array, sp: Sampling) -> jax.Array:
    """The sampling distribution [..., V] (one-hot on the argmax for greedy rows)."""
    v = logits.shape[-1]
    onehot = jax.nn.one_hot(argmax(logits), v, dtype=jnp.float32)
    if _all_greedy(sp) is True:
        return onehot
    return jnp.where(greedy_rows(logits, sp)[..., None], onehot, jax.nn.softmax(process_logits(logits, sp), axis=-1))


def sample(key: jax.Array, logits: jax.Array, sp: Sampling) -> jax.Array:
    """Draw token ids [...] from logits [..., V] (argmax for greedy rows). ``key`` is one key
    for all rows, or one key per row (shape ``logits.shape[:-1]``)."""
    best = argmax(logits)
    if _all_greedy(sp) is True:
        return best
    rs = _rows(sp, logits)

    def draw(_):
        x = process_logits(logits, sp)
        if key.shape == ():
            tok = categorical(key, x)
        else:
            tok = jax.vmap(categorical)(
                key.reshape(-1), x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])
        return jnp.where(greedy_rows(logits, rs), best, tok.astype(jnp.int32))

    if _all_greedy(sp) is False:
        return draw(None)
    return jax.lax.cond(jnp.all(rs.greedy), lambda _: best, draw, None)


_DRAW_BLOCK = 64


def sample_from_probs(key: jax.Array, p: jax.Array) -> jax.Array:
    """Draw one token id from (possibly unnormalized, non-negative, not all zero)
    probabilities p [V] by inverting the distribution function with one uniform u: the first
    index whose running mass exceeds u times the total. (The Gumbel-max draw of
    :func:`categorical` needs a random number per vocabulary entry: on the CPU, generating
    49,152 of them costs ~4x everything else in a draw.)

    The running mass is found in two levels, blocks of 64 entries and the entries of one
    block, so the work is one pass of block sums over p plus two short cumulative sums. A
    token with p = 0 is never drawn: the first running sum above the target rose there, and
    when rounding leaves none above it (u times the total rounded up to the total), the last
    block and entry with mass are taken."""
    v = p.shape[-1]
    nb = -(-v // _DRAW_BLOCK)
    blocks = jnp.pad(p.astype(jnp.float32), (0, nb * _DRAW_BLOCK - v)).reshape(nb, _DRAW_BLOCK)
    sums = jnp.sum(blocks, axis=-1)
    ends = jnp.cumsum(sums)  # running mass at each block's end [nb]
    target = jax.random.uniform(key, (), jnp.float32) * ends[-1]
    b = jnp.minimum(jnp.sum(ends <= target), _last_index(sums > 0))
    row = blocks[b]
    inner = jnp.cumsum(row) + jnp.where(b > 0, ends[jnp.maximum(b - 1, 0)], 0.0)
    j = jnp.minimum(jnp.sum(inner <= target), _last_index(row > 0))
    return (b * _DRAW_BLOCK + j).astype(jnp.int32)


def _last_index(mask: jax.Array) -> jax.Array:
    """The last index where ``mask`` [n] holds (-1 if nowhere)."""
    return jnp.max(jnp.where(mask, jnp.arange(mask.shape[0], dtype=jnp.int32), -1))


def categorical(key: jax.Array, logits: jax.Array) -> jax.Array:
    """``jax.random.categorical(key, logits, axis=-1)``, the same draw bit for bit (the
    Gumbel-max trick with the same noise), with the faster :func:`argmax`."""
    return argmax(jax.random.gumbel(key, logits.shape, logits.dtype) + logits)


def argmax(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the maximum of x [..., V], as ``jnp.argmax`` (NaN aside).
    XLA's CPU backend does not vectorize argmax's (value, index) reduction: a max, then the
    smallest index holding it, is 1.5-3x faster over a 49k vocabulary (and, fused with the
    Gumbel noise of a draw, ~3x); float32 logits on the CPU go through jspec's C++ kernel for it
    (``pallas_kernels.cpu.small_rows.row_argmax``): 2.5-3x faster alone, 6x in a verification step."""
    # (the backend first: a GPU machine never builds the CPU kernels)
    if x.dtype == jnp.float32 and jax.default_backend() == "cpu" and cpu_kernels.preferred("small_rows"):
        return small_rows.row_argmax(x)
    return small_rows.row_argmax_reference(x)


def apply_token_masks(logits: jax.Array, masks: jax.Array) -> jax.Array:
    """``logits`` [..., V] with every token whose bit is 0 in ``masks`` [..., ceil(V / 32)]
    (int32 words, bit v % 32 of word v // 32: a structured-output constraint) set to -inf."""
    return jnp.where(token_mask_bits(masks, logits.shape[-1]), logits, -jnp.inf)


def token_mask_bits(masks: jax.Array, vocab: int) -> jax.Array:
    """bool [..., vocab]: the tokens ``masks`` (int32 words [..., ceil(vocab / 32)]) allow."""
    tok = jnp.arange(vocab, dtype=jnp.int32)
    return ((jnp.take(masks, tok >> 5, axis=-1) >> (tok & 31)) & 1).astype(bool)
