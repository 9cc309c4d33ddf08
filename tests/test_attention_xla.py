"""The CPU path of verification attention (online softmax over key blocks, loop bound by the
live context) against the plain-jnp oracle and dense causal attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import dense_causal_attention
from jspec.attention import paged_attention_xla
from pallas_kernels import paged_verify_attention_reference
from test_attention_reference import _paged_setup


@pytest.mark.parametrize("kv_lens,q_lens,t,kvh,hq,page_size,block_keys", [
    ([1, 17, 33], [1, 1, 1], 1, 2, 4, 16, 16),  # decode; one page per block: several loop trips
    ([5, 16, 40, 64], [5, 2, 3, 4], 5, 3, 9, 16, 32),  # verification, ragged q_lens, GQA 3
    ([7, 31, 8], [7, 8, 1], 8, 1, 8, 4, 8),  # GQA 8, tiny pages
    ([100], [16], 16, 4, 4, 32, 64),  # chunked prefill-like; block crosses the live end
    ([300, 2], [5, 0], 5, 2, 4, 16, 256),  # a q_len-0 row beside a long one
])
def test_equals_oracle_and_dense(kv_lens, q_lens, t, kvh, hq, page_size, block_keys):
    rng = np.random.default_rng(sum(kv_lens) + t)
    d = 16
    q, k_pages, v_pages, tables, k_dense, v_dense = _paged_setup(rng, kv_lens, q_lens, kvh, hq, d, page_size, t)
    # a table wider than the live pages, its extra slots pointing at NaN-poisoned pages
    tables = jnp.pad(tables, ((0, 0), (0, 5)), constant_values=k_pages.shape[1] - 1)
    args = (jnp.asarray(q), k_pages, v_pages, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))
    got = np.asarray(jax.jit(lambda *a: paged_attention_xla(*a, block_keys=block_keys))(*args))
    ref = np.asarray(paged_verify_attention_reference(*args))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
        if ql:
            want = dense_causal_attention(q[b, :ql], k_dense[b], v_dense[b], n - ql)
            np.testing.assert_allclose(got[b, :ql], want, rtol=2e-5, atol=2e-5)
        assert (got[b, ql:] == 0).all(), "rows beyond q_len must be zero"


@pytest.mark.parametrize("cache_dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_narrow_pages_are_read_as_float32(cache_dtype):
    """Pages of 16 or 8 bits (EngineConfig.kv_cache_dtype): the loop widens each block it reads,
    so the result is its own on float32 pages of the same values within float32 rounding, and
    the NaN-poisoned pages past each sequence stay out."""
    rng = np.random.default_rng(11)
    kv_lens, q_lens = [5, 40, 300], [5, 2, 3]
    q, k_pages, v_pages, tables, _, _ = _paged_setup(rng, kv_lens, q_lens, 3, 9, 64, 16, 5)
    tables = jnp.pad(tables, ((0, 0), (0, 5)), constant_values=k_pages.shape[1] - 1)
    narrow = k_pages.astype(cache_dtype), v_pages.astype(cache_dtype)
    rest = (tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))
    f = jax.jit(paged_attention_xla)
    got = np.asarray(f(jnp.asarray(q), *narrow, *rest))
    wide = np.asarray(f(jnp.asarray(q), narrow[0].astype(jnp.float32), narrow[1].astype(jnp.float32), *rest))
    assert np.isfinite(got).all() and got.dtype == np.float32
    np.testing.assert_allclose(got, wide, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(paged_verify_attention_reference(jnp.asarray(q), *narrow, *rest)),
                               rtol=2e-5, atol=2e-5)


def test_loop_trips_follow_the_live_context():
    """Keys past max(kv_lens) are never read: poisoning every page the loop should not reach
    (and the table slots past the live pages) leaves the result unchanged."""
    rng = np.random.default_rng(3)
    q, k_pages, v_pages, tables, _, _ = _paged_setup(rng, [20, 9], [2, 1], 2, 4, 8, 4, 2)
    lens = (jnp.asarray([20, 9], jnp.int32), jnp.asarray([2, 1], jnp.int32))
    wide = jnp.pad(tables, ((0, 0), (0, 64)), constant_values=10**6)  # out-of-range page ids
    a = paged_attention_xla(jnp.asarray(q), k_pages, v_pages, tables, *lens, block_keys=8)
    b = paged_attention_xla(jnp.asarray(q), k_pages, v_pages, wide, *lens, block_keys=8)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("options", [dict(sliding_window=5), dict(sliding_window=40, soft_cap=3.0, sm_scale=0.11),
                                     dict(soft_cap=2.0)])
def test_gemma_options_equal_oracle_and_dense(options):
    """A local layer's window (shorter and longer than a block of keys), soft-capped scores and a
    score scale: the xla path, the reference and a dense numpy computation agree."""
    kv_lens, q_lens, t = [70, 9, 33], [5, 3, 1], 5
    rng = np.random.default_rng(7)
    q, k_pages, v_pages, tables, k_dense, v_dense = _paged_setup(rng, kv_lens, q_lens, 2, 4, 16, 8, t)
    args = (jnp.asarray(q), k_pages, v_pages, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32))
    got = np.asarray(jax.jit(lambda *a: paged_attention_xla(*a, block_keys=16, **options))(*args))
    ref = np.asarray(paged_verify_attention_reference(*args, **options))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
        want = dense_causal_attention(q[b, :ql], k_dense[b], v_dense[b], n - ql, **options)
        np.testing.assert_allclose(got[b, :ql], want, rtol=2e-5, atol=2e-5)
    plain = np.asarray(paged_verify_attention_reference(*args))
    assert not np.allclose(plain, ref, atol=1e-3)  # the options change the answer
