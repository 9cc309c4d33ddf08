"""The packed copy of the layer projections the engine keeps for steps of a few rows on the CPU
small-row kernel (``EngineConfig(small_row_weights=...)``, issue 11, item 2): same parameters as
``nn.Dense``, used exactly for the row counts it is meant for, and the engine's outputs
unchanged by it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import tiny_config, tiny_model
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine
from jspec.errors import ConfigError
from jspec.models.llama import KERNEL_ROWS, PROJECTIONS, Linear, with_small_row_weights
from pallas_kernels import small_rows
from pallas_kernels.small_rows import pack_rows, unpack_rows


def test_linear_has_dense_parameters_and_uses_the_copy_for_small_row_counts():
    x = jnp.ones((3, 8))
    ours = Linear(5, use_bias=True).init(jax.random.PRNGKey(0), x)
    dense = nn.Dense(5, use_bias=True).init(jax.random.PRNGKey(0), x)
    assert jax.tree.map(lambda a, b: bool((a == b).all()), ours, dense) == {"params": {"bias": True, "kernel": True}}
    p = ours["params"]
    # a copy that is deliberately NOT the kernel's transpose shows which one each row count reads
    doubled = {"params": {**p, "weight": pack_rows(2 * p["kernel"].T)}}
    for rows in (1, 2, 5, 8, 9, 17, 64):
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 8))
        plain = x @ p["kernel"]
        got = Linear(5, use_bias=True).apply(doubled, x) - p["bias"]
        reads_copy = rows in KERNEL_ROWS and small_rows.available()
        np.testing.assert_allclose(got, 2 * plain if reads_copy else plain, rtol=1e-5, atol=1e-5)


def test_with_small_row_weights_adds_packed_transposes_of_the_layer_projections_only():
    model = tiny_model(tiny_config(num_layers=2))
    out = with_small_row_weights(model.params)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(out)[0]}
    weights = [k for k in flat if k.endswith("/weight")]
    assert len(weights) == 2 * len(PROJECTIONS)
    for k in weights:
        kernel = flat[k[: -len("weight")] + "kernel"]
        np.testing.assert_array_equal(unpack_rows(flat[k], kernel.shape[1], kernel.shape[0]), kernel.T)
    n_before = len(jax.tree.leaves(model.params))
    assert len(flat) == n_before + len(weights)


def _greedy(model, spec, copy, prompts):
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=96, small_row_weights=copy), spec)
    has_copy = any(getattr(k, "key", None) == "weight"
                   for path, _ in jax.tree_util.tree_flatten_with_path(engine.runner.params)[0] for k in path)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=24, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return [out[str(i)] for i in range(len(prompts))], has_copy


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("ngram", num_speculative_tokens=4)], ids=["ar", "ngram4"])
def test_engine_output_is_the_same_with_and_without_the_copy(spec):
    model = tiny_model(tiny_config(num_layers=3), scale=4.0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, model.config.vocab_size, n)) * 2 for n in (5, 9, 13)]
    with_copy, has = _greedy(model, spec, True, prompts)
    without, has_not = _greedy(model, spec, False, prompts)  # the default
    assert has and not has_not
    assert with_copy == without


def test_small_row_weights_must_be_a_bool_on_one_device():
    with pytest.raises(ConfigError, match="small_row_weights"):
        EngineConfig(small_row_weights="yes")
    with pytest.raises(ConfigError, match="one device"):
        EngineConfig(small_row_weights=True, tensor_parallel_size=2)
