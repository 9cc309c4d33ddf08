"""``cond_in_place``: the branch a speculative step picks on the device (verify or plain; the
hybrid drafter's lookup or head chain) without copying the page pools.

* it computes what ``lax.cond`` computes, for either predicate, inside a loop as the burst does;
* the compiled decode burst of an engine holds no copy of a pool-sized array, for the n-gram
  drafter (the step's branch) and the hybrid drafter (its own branch over the head's pages).
  With ``lax.cond`` there were two copies of the whole pool per step (a lone request's n-gram
  step at 8 slots x 1,024 tokens of SmolLM2-135M: 119 ms before, 31 ms after); this test fails
  on that code (it counted 3 copies per pool array).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import eagle_params, tiny_config, tiny_model
from jspec.config import EngineConfig, SpecConfig
from jspec.engine import runner as runner_lib
from jspec.engine.engine import LLMEngine
from jspec.speculative.control import cond_in_place
from jspec.speculative.drafters import NgramDrafter
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter


def _branches():
    def write_ones(pool):
        return pool.at[2:5].set(1.0), (jnp.sum(pool), jnp.int32(1))

    def write_twos(pool):
        return pool.at[7].set(2.0), (jnp.max(pool), jnp.int32(2))

    return write_ones, write_twos


@pytest.mark.parametrize("pred", [True, False])
def test_cond_in_place_computes_what_lax_cond_computes(pred):
    a, b = _branches()

    def loop(select, pool):
        def body(i, carry):
            pool, acc = carry
            pool, (s, which) = select((i % 2 == 0) == pred, a, b, pool)
            return pool + 0.5, acc + s * which
        return jax.lax.fori_loop(0, 5, body, (pool, jnp.float32(0)))

    pool = jnp.arange(16, dtype=jnp.float32)
    want = jax.jit(lambda p: loop(lambda q, f, g, x: jax.lax.cond(q, f, g, x), p))(pool)
    got = jax.jit(lambda p: loop(cond_in_place, p))(pool)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(w), np.asarray(g))


def _pool_copies(engine) -> int:
    """Copies of arrays of the pool's shape in the compiled decode burst on one slot of four."""
    pool = engine.runner.state.cache.k_pages[0]
    shape = ",".join(str(d) for d in pool.shape)
    step = engine._steps[engine.k_max]
    lowered = runner_lib.run_burst_slots.lower(
        step, engine.runner.params, engine.runner.drafter_params, engine.runner.state, np.arange(1, dtype=np.int32),
        engine.scheduler.tables(), np.zeros((engine.config.max_num_seqs,), np.int32), np.int32(4), np.bool_(False))
    text = lowered.compile().as_text()
    return len(re.findall(rf"= f32\[{shape}\]\S* copy\(", text))


@pytest.fixture(scope="module")
def target():
    return tiny_model(tiny_config(num_layers=2), scale=4.0)


@pytest.mark.parametrize("name", ["ngram", "hybrid"])
def test_the_speculative_burst_copies_no_page_pool(target, name):
    cfg = target.config
    if name == "ngram":
        drafter, params = NgramDrafter(3, 3, 1), None
    else:
        drafter, params = HybridDrafter(3, EagleDrafter(3, cfg), 3, 2), eagle_params(target)
    # a pool whose page count differs from every other dimension, so the shape names it alone
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=4 * 4 + 32, max_model_len=120, page_size=8,
                          kv_cache_tokens=8 * 37)
    engine = LLMEngine(target, config, SpecConfig(), drafter=drafter, drafter_params=params)
    assert engine.runner.state.cache.k_pages[0].shape[1] == 38
    assert _pool_copies(engine) == 0
