"""Logits processing against Hugging Face's logits warpers, and sampler frequencies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jspec.config import SamplingParams
from jspec.sampling import (CANDIDATE_LEVELS, RowSampling, argmax, categorical, filter_candidates, filter_sorted, probs,
                            process_logits, sample, sample_from_probs)


def _hf_process(logits, sp):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    x = torch.tensor(np.asarray(logits))
    x = TemperatureLogitsWarper(sp.temperature)(None, x)
    if sp.top_k:
        x = TopKLogitsWarper(sp.top_k)(None, x)
    if sp.top_p < 1:
        x = TopPLogitsWarper(sp.top_p)(None, x)
    return torch.softmax(x, -1).numpy()


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=20, top_p=0.9),
    SamplingParams(temperature=1.0, top_p=0.05),
])
def test_matches_transformers_warpers(sp):
    logits = jax.random.normal(jax.random.key(0), (6, 50)) * 3
    got = np.asarray(probs(logits, sp))
    want = _hf_process(logits, sp)
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert ((got > 0) == (want > 0)).all()


def test_greedy_is_argmax_and_one_hot():
    logits = jax.random.normal(jax.random.key(1), (4, 30))
    sp = SamplingParams(temperature=0.0)
    np.testing.assert_array_equal(np.asarray(sample(jax.random.key(0), logits, sp)), np.argmax(logits, -1))
    p = np.asarray(probs(logits, sp))
    assert (p.sum(-1) == 1).all() and (p.argmax(-1) == np.argmax(logits, -1)).all()


def test_sample_frequencies_follow_processed_distribution():
    logits = jnp.log(jnp.asarray([0.5, 0.2, 0.15, 0.1, 0.05]))
    sp = SamplingParams(temperature=1.0, top_k=3)
    n = 40000
    draws = np.asarray(jax.vmap(lambda k: sample(k, logits, sp))(jax.random.split(jax.random.key(2), n)))
    freq = np.bincount(draws, minlength=5) / n
    want = np.asarray(probs(logits, sp))
    # 5 sigma of a binomial proportion with p <= 0.6
    assert np.abs(freq - want).max() < 5 * np.sqrt(0.25 / n)
    assert freq[3] == freq[4] == 0


def _draw_freqs(p, n, seed=0):
    keys = jax.random.split(jax.random.key(seed), n)
    draws = np.asarray(jax.jit(jax.vmap(sample_from_probs, in_axes=(0, None)))(keys, jnp.asarray(p, jnp.float32)))
    return np.bincount(draws, minlength=len(p)) / n


def _worst_z(freq, p, n):
    want = np.asarray(p, np.float64) / np.sum(p)
    sigma = np.sqrt(np.maximum(want * (1 - want), 1e-12) / n)
    return float((np.abs(freq - want) / sigma).max())


def test_sample_from_probs_follows_p_and_never_draws_zero_mass():
    """The inverse-CDF draw over blocks of 64: unnormalized p over a vocabulary that is not a
    multiple of 64, zero-mass tokens and whole zero blocks, mass at both ends."""
    rng = np.random.default_rng(5)
    v, n = 300, 200_000
    p = rng.gamma(0.3, size=v) * 3.7  # skewed, unnormalized
    p[rng.random(v) < 0.3] = 0.0
    p[64:128] = 0.0  # a block without mass
    p[0], p[v - 1] = 2.0, 1.5  # the first and the last entry
    freq = _draw_freqs(p, n)
    assert freq[p == 0].sum() == 0
    assert _worst_z(freq, p, n) < 5.5
    # the check has power: the same draws scored against p with one token's mass moved to its
    # right-hand neighbour (an off-by-one in the search) fail it
    shifted = p.copy()
    i = int(np.argmax(p[:v - 1]))
    shifted[i + 1] += shifted[i] / 2
    shifted[i] /= 2
    assert _worst_z(freq, shifted, n) > 20


@pytest.mark.parametrize("where", [0, 63, 64, 299])
def test_sample_from_probs_single_token(where):
    p = np.zeros(300)
    p[where] = 1e-30  # tiny but positive: all of the mass
    assert (_draw_freqs(p, 64)[where]) == 1.0


def test_process_logits_marks_removed_tokens_minus_inf():
    x = process_logits(jnp.asarray([[1.0, 2.0, 3.0, 4.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert np.isneginf(np.asarray(x)[0, :2]).all() and np.isfinite(np.asarray(x)[0, 2:]).all()


# ------------------------------------------------------------ sort-free path = full sort
@functools.partial(jax.jit, static_argnames="levels")
def _process(logits, rs, levels):
    return process_logits(logits, rs, levels=levels)  # levels=(): straight to filter_sorted


def _random_rows(rng, n, v, scale):
    """n rows of logits [n, V] (every other row rounded: values shared by many tokens) and
    per-row parameters: greedy rows, top-k 1, = or past a level, >= V, top-p tiny to 1 - 1e-7."""
    x = rng.normal(size=(n, v)) * scale
    x[::2] = np.round(x[::2] * 2) / 2
    temp = rng.choice([0.0, 0.5, 0.8, 1.0, 1.7], n).astype(np.float32)
    top_k = rng.choice([0, 0, 1, 3, 8, 9, 40, v - 1, v, v + 5], n).astype(np.int32)
    top_p = rng.choice([1.0, 1.0, 0.05, 0.5, 0.9, 0.95, 0.99, 0.999999, 1 - 1e-7], n).astype(np.float32)
    return jnp.asarray(x, jnp.float32), RowSampling(jnp.asarray(temp), jnp.asarray(top_k), jnp.asarray(top_p))


@pytest.mark.parametrize("levels", [(8,), (4, 16, 64), (1000,)])
def test_candidate_levels_equal_full_sort(levels):
    """Random rows, ties and per-row parameters: the sort-free cascade keeps bit for bit what
    the full sort keeps, wherever the cut falls (in the first level, a later one, the sort)."""
    rng = np.random.default_rng(len(levels) * 1000 + levels[0])
    for scale in (0.3, 2.0, 8.0):
        x, rs = _random_rows(rng, 96, 200, scale)
        np.testing.assert_array_equal(np.asarray(_process(x, rs, levels)), np.asarray(_process(x, rs, ())))


def test_candidates_cover_and_fall_through():
    """filter_candidates says when its candidates decide a row, and is right when it says so."""
    v = 100
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, v)) * 0.1, jnp.float32)  # flat: wide nucleus
    top_k = jnp.asarray([0, 5, 50, 0], jnp.int32)
    top_p = jnp.asarray([0.9, 0.9, 1.0, 0.01], jnp.float32)
    out, covered = jax.jit(filter_candidates, static_argnums=3)(x, top_k, top_p, 8)
    # row 0: a nucleus of ~90 tokens > 8 candidates; row 2: the 50th value is not a candidate
    np.testing.assert_array_equal(np.asarray(covered), [False, True, False, True])
    want = jax.jit(filter_sorted)(x, top_k, top_p)
    np.testing.assert_array_equal(np.asarray(out)[[1, 3]], np.asarray(want)[[1, 3]])


def test_default_levels_equal_full_sort_on_full_vocabulary():
    """SmolLM2's vocabulary size, peaked to flat rows: the default levels and every fallback."""
    v = 49152
    rng = np.random.default_rng(1)
    # nuclei of a few tokens (peaked rows) up to thousands (flat rows)
    x = rng.normal(size=(4, v)) * np.asarray([8.0, 4.0, 2.0, 0.5])[:, None]
    x[0, :7] = x[0].max()  # a tie at the top
    x = jnp.asarray(x, jnp.float32)
    for sp in [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.0, top_k=50),
               SamplingParams(temperature=0.7, top_k=2000, top_p=0.9)]:
        rs = RowSampling.broadcast(sp, (4,))
        np.testing.assert_array_equal(np.asarray(_process(x, rs, CANDIDATE_LEVELS)), np.asarray(_process(x, rs, ())))


def test_argmax_and_categorical_equal_jax():
    """The faster argmax and Gumbel-max draw give jnp.argmax's and jax.random.categorical's
    answers bit for bit (first index among ties; the same noise)."""
    rng = np.random.default_rng(3)
    x = np.round(rng.normal(size=(16, 300)) * 2) / 2  # ties everywhere, the max included
    x[3, :] = -np.inf
    x[4, 7] = np.inf
    x = jnp.asarray(x, jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(x)), np.asarray(jnp.argmax(x, axis=-1)))
    keys = jax.random.split(jax.random.key(4), 50)
    ours = jax.jit(jax.vmap(lambda k: categorical(k, x[:2])))(keys)
    theirs = jax.jit(jax.vmap(lambda k: jax.random.categorical(k, x[:2], axis=-1)))(keys)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
