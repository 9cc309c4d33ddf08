"""The plain-jnp verification attention (the oracle) against dense causal attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import dense_causal_attention
from jspec.cache import PageAllocator, write_kv
from pallas_kernels import paged_verify_attention_reference


def _paged_setup(rng, kv_lens, q_lens, kvh, hq, d, page_size, t):
    """Random K/V written into randomly permuted pages; returns dense copies for the oracle."""
    b = len(kv_lens)
    need = [int(n) for n in kv_lens]
    alloc = PageAllocator(sum(-(-n // page_size) for n in need) + 3, page_size, shuffle_seed=int(rng.integers(1 << 30)))
    tables = alloc.block_tables(need)
    num_pages = alloc.num_pages
    k_dense = [rng.standard_normal((n, kvh, d)).astype(np.float32) for n in need]
    v_dense = [rng.standard_normal((n, kvh, d)).astype(np.float32) for n in need]
    # poison: every slot not written below holds NaN, so reading one would show
    k_pages = jnp.full((kvh, num_pages, page_size, d), jnp.nan, jnp.float32)
    v_pages = jnp.full((kvh, num_pages, page_size, d), jnp.nan, jnp.float32)
    width = max(need)
    k_new = np.zeros((b, width, kvh, d), np.float32)
    v_new = np.zeros((b, width, kvh, d), np.float32)
    for i in range(b):
        k_new[i, :need[i]], v_new[i, :need[i]] = k_dense[i], v_dense[i]
    tables = jnp.asarray(tables)
    zeros = jnp.zeros((b,), jnp.int32)
    lens = jnp.asarray(need, jnp.int32)
    k_pages = write_kv(k_pages, jnp.asarray(k_new), tables, zeros, lens)
    v_pages = write_kv(v_pages, jnp.asarray(v_new), tables, zeros, lens)
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    return q, k_pages, v_pages, tables, k_dense, v_dense


@pytest.mark.parametrize("kv_lens,q_lens,t,kvh,hq,page_size", [
    ([1, 17, 33], [1, 1, 1], 1, 2, 4, 16),  # decode, lengths crossing page boundaries
    ([5, 16, 40, 64], [5, 2, 3, 4], 5, 3, 9, 16),  # verification, ragged q_lens, SmolLM2 GQA 3
    ([7, 31, 8], [7, 8, 1], 8, 1, 8, 4),  # GQA 8, tiny pages
    ([100], [16], 16, 4, 4, 32),  # MHA, chunked prefill-like
])
def test_paged_equals_dense_causal(kv_lens, q_lens, t, kvh, hq, page_size):
    rng = np.random.default_rng(sum(kv_lens) + t)
    d = 16
    q, k_pages, v_pages, tables, k_dense, v_dense = _paged_setup(rng, kv_lens, q_lens, kvh, hq, d, page_size, t)
    out = np.asarray(paged_verify_attention_reference(
        jnp.asarray(q), k_pages, v_pages, tables, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(q_lens, jnp.int32)))
    assert np.isfinite(out).all()
    for b, (n, ql) in enumerate(zip(kv_lens, q_lens)):
        want = dense_causal_attention(q[b, :ql], k_dense[b], v_dense[b], n - ql)
        np.testing.assert_allclose(out[b, :ql], want, rtol=2e-5, atol=2e-5)
        assert (out[b, ql:] == 0).all(), "rows beyond q_len must be zero"


def test_q_lens_none_means_full_rows():
    rng = np.random.default_rng(0)
    q, k_pages, v_pages, tables, _, _ = _paged_setup(rng, [9, 12], [3, 3], 2, 4, 8, 4, 3)
    kv = jnp.asarray([9, 12], jnp.int32)
    a = paged_verify_attention_reference(jnp.asarray(q), k_pages, v_pages, tables, kv)
    b = paged_verify_attention_reference(jnp.asarray(q), k_pages, v_pages, tables, kv, jnp.asarray([3, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_close_to_float32():
    rng = np.random.default_rng(1)
    q, k_pages, v_pages, tables, _, _ = _paged_setup(rng, [20, 7], [4, 2], 2, 4, 16, 8, 4)
    args = (tables, jnp.asarray([20, 7], jnp.int32), jnp.asarray([4, 2], jnp.int32))
    f32 = paged_verify_attention_reference(jnp.asarray(q), k_pages, v_pages, *args)
    bf = paged_verify_attention_reference(jnp.asarray(q, jnp.bfloat16), k_pages.astype(jnp.bfloat16),
                                          v_pages.astype(jnp.bfloat16), *args)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), np.asarray(f32), atol=5e-2)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(q=jnp.zeros((2, 3, 5, 8))), "multiple"),
    (lambda a: a.update(block_tables=a["block_tables"].astype(jnp.int64 if jax.config.x64_enabled else jnp.float32)), "block_tables"),
    (lambda a: a.update(kv_lens=jnp.asarray([2, 2], jnp.int32)), "kv_lens"),
    (lambda a: a.update(v_pages=a["v_pages"][:, :1]), "v_pages"),
])
def test_bad_input_names_the_argument(mutate, match):
    rng = np.random.default_rng(2)
    q, k_pages, v_pages, tables, _, _ = _paged_setup(rng, [9, 12], [3, 3], 2, 4, 8, 4, 3)
    args = dict(q=jnp.asarray(q), k_pages=k_pages, v_pages=v_pages, block_tables=tables,
                kv_lens=jnp.asarray([9, 12], jnp.int32), q_lens=jnp.asarray([3, 3], jnp.int32))
    mutate(args)
    with pytest.raises(ValueError, match=match):
        paged_verify_attention_reference(**args)
