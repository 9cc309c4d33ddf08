"""EAGLE-3 pieces on tiny models: the target's feature layers, the head's fusion, and the
training-time test, whose pass j must be exactly the entry drafting computes j steps into a
chain (checked against the paged head run as the drafter runs it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_model
from jspec.models.eagle import eagle_forward, eagle_ttt_forward, init_eagle_params, num_features_of
from jspec.models.llama import Segment, _module, forward
from jspec.train.objectives import fresh_cache

LAYERS = (0, 2, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=4), scale=3.0)


def test_feature_layers_are_the_residual_stream_after_those_layers(target):
    cfg = target.config
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 96, (2, 11)), jnp.int32)
    lens = jnp.asarray([11, 7], jnp.int32)
    plain = forward(target.params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, 2, 11), lens, attention="reference")
    feats = forward(target.params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, 2, 11), lens, attention="reference",
                    feature_layers=LAYERS)
    (_, _, _), inter = _module(cfg, "reference").apply(
        {"params": target.params}, (Segment(tokens, lens),), fresh_cache(cfg, cfg.num_layers, 2, 11),
        capture_intermediates=True, mutable=["intermediates"])
    want = np.concatenate([np.asarray(inter["intermediates"][f"layers_{i}"]["__call__"][0][0]).reshape(2, 11, -1)
                           for i in LAYERS], axis=-1)
    assert feats.hidden.shape == (2, 11, cfg.hidden_size * len(LAYERS))
    np.testing.assert_allclose(np.asarray(feats.hidden), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(feats.logits), np.asarray(plain.logits))  # logits unchanged
    with pytest.raises(ValueError, match="feature_layers"):
        forward(target.params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, 2, 11), lens, feature_layers=(4,))


def _inputs(target, n, length, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(2, 96, (n, length)), jnp.int32)
    lens = jnp.full((n,), length, jnp.int32)
    return tokens, lens


def _head_inputs(target, tokens, lens, layers):
    """Token embeddings and the target's F_{t-1} aligned to each position t (row 0 zero)."""
    cfg = target.config
    f = forward(target.params, cfg, tokens, fresh_cache(cfg, cfg.num_layers, *tokens.shape), lens,
                attention="reference", compute_logits=False, feature_layers=layers).hidden
    prev = jnp.concatenate([jnp.zeros_like(f[:, :1]), f[:, :-1]], axis=1)
    return jnp.take(target.params["embed_tokens"]["embedding"], tokens, axis=0), prev


@pytest.mark.parametrize("layers", [(), LAYERS], ids=["eagle1", "eagle3"])
def test_training_time_test_pass_j_is_the_drafting_chain(target, layers):
    """Pass j at position t of the training-time test equals the paged head's entry t when the
    head is prefilled with true features up to entry t - j and then chained j times on its own
    outputs, as the drafter does (tokens taken from the sequence, as when drafts are accepted)."""
    cfg = target.config
    head = init_eagle_params(cfg, jax.random.key(1), target.params, num_features=len(layers))
    assert num_features_of(head) == len(layers)
    tokens, lens = _inputs(target, 2, 12)
    emb, prev = _head_inputs(target, tokens, lens, layers)
    depth = 4
    passes = eagle_ttt_forward(head, cfg, emb, prev, depth)
    assert len(passes) == depth
    checked = 0
    for t0 in (1, 3, 6):
        # entries 0..t0 from true features, as prefill + propose's first entry build them
        cache = fresh_cache(cfg, 1, 2, 12)
        out = eagle_forward(head, cfg, emb[:, :t0 + 1], prev[:, :t0 + 1], cache, jnp.full((2,), t0 + 1, jnp.int32))
        np.testing.assert_allclose(np.asarray(out.normed[:, t0]), np.asarray(passes[0][:, t0]), rtol=2e-4, atol=2e-4)
        cache, chained = out.context, out.chained[:, t0]
        for j in range(1, depth):
            t = t0 + j
            step = eagle_forward(head, cfg, emb[:, t:t + 1], chained[:, None], cache, jnp.ones((2,), jnp.int32),
                                 fused=True)
            np.testing.assert_allclose(np.asarray(step.normed[:, 0]), np.asarray(passes[j][:, t]),
                                       rtol=2e-4, atol=2e-4, err_msg=f"start {t0}, pass {j}")
            cache, chained = step.context, step.chained[:, 0]
            checked += 1
    assert checked == 9


def test_training_time_test_differs_from_teacher_forcing(target):
    """A control for the test above: pass 1 fed the *true* feature (teacher forcing, what a
    one-pass objective trains on) gives other outputs than the chain, so the comparison has power."""
    cfg = target.config
    head = init_eagle_params(cfg, jax.random.key(1), target.params, num_features=len(LAYERS))
    tokens, lens = _inputs(target, 2, 12)
    emb, prev = _head_inputs(target, tokens, lens, LAYERS)
    passes = eagle_ttt_forward(head, cfg, emb, prev, 2)
    assert not np.allclose(np.asarray(passes[0][:, 2:]), np.asarray(passes[1][:, 2:]), atol=1e-3)


def test_fusion_ignores_the_scale_of_each_layer(target):
    """Each target layer's features are RMS-normalised before the fusion: scaling one layer's
    part (SmolLM2's residual stream spans 3 to 1e3 RMS) leaves the head's output unchanged."""
    cfg = target.config
    head = init_eagle_params(cfg, jax.random.key(2), num_features=len(LAYERS))
    tokens, lens = _inputs(target, 1, 6)
    emb, prev = _head_inputs(target, tokens, lens, LAYERS)
    h = cfg.hidden_size
    scaled = prev.at[..., h:2 * h].multiply(500.0)
    a = eagle_ttt_forward(head, cfg, emb, prev, 1)[0]
    b = eagle_ttt_forward(head, cfg, emb, scaled, 1)[0]
    np.testing.assert_allclose(np.asarray(a[:, 1:]), np.asarray(b[:, 1:]), rtol=1e-4, atol=1e-4)
