"""Logits processing against Hugging Face's logits warpers, and sampler frequencies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jspec.config import SamplingParams
from jspec.sampling import probs, process_logits, sample


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


def test_process_logits_marks_removed_tokens_minus_inf():
    x = process_logits(jnp.asarray([[1.0, 2.0, 3.0, 4.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert np.isneginf(np.asarray(x)[0, :2]).all() and np.isfinite(np.asarray(x)[0, 2:]).all()
