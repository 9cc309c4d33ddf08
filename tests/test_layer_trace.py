"""Decoder layers traced once per program (``jspec.models.llama.call_layer``): a forward gives
the same bits as with every layer traced inline, for each family and kind of segment (several
segments, packed rows, a token tree), and its layers share one trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_gemma, tiny_model, tiny_qwen3
from jspec.cache import init_cache
from jspec.models import llama
from jspec.models.llama import Segment, TreeRows, pack_index

MODELS = {
    "llama": lambda: tiny_model(tiny_config(num_layers=3)),
    "qwen3": lambda: tiny_qwen3(num_layers=3),
    "gemma2": lambda: tiny_gemma("gemma2", num_layers=3),
}


def _segments(v: int):
    rng = np.random.default_rng(0)
    toks = lambda b, t: jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)  # noqa: E731
    chain = Segment(toks(2, 5), jnp.asarray([5, 3], jnp.int32), rows=jnp.asarray([0, 1], jnp.int32))
    packed = Segment(toks(2, 6), jnp.asarray([4, 6], jnp.int32), rows=jnp.asarray([2, 3], jnp.int32),
                     packed=jnp.asarray(pack_index([4, 6], 6, 12)))
    # a root and two children of it, then a grandchild under the second child
    tree = Segment(toks(1, 4), jnp.asarray([4], jnp.int32), rows=jnp.asarray([4], jnp.int32),
                   tree=TreeRows(jnp.asarray([[0, 1, 1, 2]], jnp.int32), jnp.asarray([[1, 3, 5, 13]], jnp.int32)))
    return chain, packed, tree


def _forward(model, segments, attention: str):
    cfg = model.config
    tables = jnp.arange(5 * 2, dtype=jnp.int32).reshape(5, 2)
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, 5 * 2, 8, jnp.dtype(cfg.dtype))
    fn = jax.jit(lambda p, c: llama.forward_segments(p, cfg, segments, c, attention=attention))
    logits, hidden, cache = fn(model.params, cache)
    return [np.asarray(x) for x in logits], [np.asarray(h) for h in hidden], np.asarray(cache.k_pages[-1])


@pytest.mark.parametrize("family", sorted(MODELS))
def test_layers_traced_once_give_the_inline_bits(family, monkeypatch):
    model = MODELS[family]()
    segments = _segments(model.config.vocab_size)
    if family == "gemma2":
        segments = segments[:2]  # a token tree with a sliding window is refused
    for attention in ("reference", "xla", "auto"):
        monkeypatch.setattr(llama, "TRACE_LAYERS_ONCE", True)
        once = _forward(model, segments, attention)
        monkeypatch.setattr(llama, "TRACE_LAYERS_ONCE", False)
        inline = _forward(model, segments, attention)
        for a, b in zip(jax.tree_util.tree_leaves(once), jax.tree_util.tree_leaves(inline)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family,programs", [("llama", 1), ("gemma2", 2)])
def test_layers_of_one_kind_share_one_trace(family, programs, monkeypatch):
    """The forward's jaxpr calls a nested program per layer, one program per kind of layer
    (Llama's layers are alike; Gemma's sliding and full layers are two); inline, no layer is a
    nested program."""
    model = tiny_model(tiny_config(num_layers=4)) if family == "llama" else tiny_gemma("gemma2", num_layers=4)
    cfg = model.config
    segments = _segments(cfg.vocab_size)[:1]
    tables = jnp.arange(10, dtype=jnp.int32).reshape(5, 2)
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, 10, 8)

    def layer_calls():
        jaxpr = jax.make_jaxpr(lambda p, c: llama.forward_segments(p, cfg, segments, c, attention="xla"))(
            model.params, cache).jaxpr
        return [e for e in jaxpr.eqns if e.primitive.name in ("pjit", "jit") and e.params["name"] == "layer"]

    monkeypatch.setattr(llama, "TRACE_LAYERS_ONCE", True)
    calls = layer_calls()
    assert len(calls) == cfg.num_layers
    assert len({id(e.params["jaxpr"].jaxpr) for e in calls}) == programs
    monkeypatch.setattr(llama, "TRACE_LAYERS_ONCE", False)
    assert not layer_calls()
