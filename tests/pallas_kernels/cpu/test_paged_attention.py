"""The CPU paged-attention kernel (pallas_kernels/cpu/paged_attention_cpu.cc through XLA's FFI)
against the contract's reference: shuffled pages, poisoned pages and table slots past each
sequence (NaN, invalid and foreign page ids), ragged q_lens and kv_lens across page and
256-key chunk boundaries, GQA ratios, head dims; a row's result independent of the rows
beside it; where it lowers and where it does not."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import TOL, Case, make_inputs
from jspec.attention import paged_attention_xla
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_cpu_reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels are not built")

CASES = [
    Case(t=1, group=3, head_dim=64, page_size=16, kv_lens=(1, 17, 100, 255), kv_heads=3),  # SmolLM2 decode
    Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(5, 40, 256, 257), kv_heads=3),  # verification, k = 4
    Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(600, 1030), q_lens=(5, 3), kv_heads=3),  # split-K
    Case(t=8, group=1, head_dim=32, page_size=32, kv_lens=(8, 70, 513), q_lens=(8, 1, 6)),
    Case(t=17, group=8, head_dim=128, page_size=16, kv_lens=(17, 300), garbage="mixed"),
    Case(t=2, group=2, head_dim=80, page_size=16, kv_lens=(2, 90), garbage="mixed"),  # D not a multiple of 16
    Case(t=3, group=1, head_dim=8, page_size=4, kv_lens=(3, 0, 9), q_lens=(3, 0, 2)),  # an empty sequence
    Case(t=4, group=2, head_dim=44, page_size=8, kv_lens=(4, 300), garbage="mixed"),  # D % 8 != 0: scalar tails
    Case(t=64, group=3, head_dim=64, page_size=16, kv_lens=(64, 700), q_lens=(64, 40), kv_heads=3),  # prefill
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c.t}-g{c.group}-d{c.head_dim}-kv{max(c.kv_lens)}")
def test_kernel_matches_the_reference_on_poisoned_inputs(case):
    kernel_args, ref_args = make_inputs(case, seed=case.t + max(case.kv_lens))
    out = np.asarray(jax.jit(paged_attention_cpu)(*kernel_args))
    ref = np.asarray(paged_attention_cpu_reference(*ref_args))
    assert np.isfinite(out).all(), "the kernel read a poisoned value"
    np.testing.assert_allclose(out, ref, **TOL[jnp.float32])
    q_lens = case.q_lens or (case.t,) * len(case.kv_lens)
    for i, ql in enumerate(q_lens):  # rows past q_len are exactly zero
        assert not out[i, ql:].any()


HALF_CASES = [
    Case(t=1, group=3, head_dim=64, page_size=16, kv_lens=(1, 17, 100, 1000), kv_heads=3),  # decode, split-K
    Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(5, 256, 257), kv_heads=3, garbage="mixed"),  # verify
    Case(t=4, group=2, head_dim=44, page_size=8, kv_lens=(4, 300), garbage="mixed"),  # scalar tails
]


@pytest.mark.parametrize("cache_dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("case", HALF_CASES, ids=lambda c: f"t{c.t}-d{c.head_dim}-kv{max(c.kv_lens)}")
def test_narrow_pages_are_read_as_float32(case, cache_dtype):
    """float32 queries over float16 / bfloat16 / 8-bit float pages (a KV cache of half or a quarter
    of the bytes): the kernel lowers for them, and each element is widened to float32 as it is
    read, so the result is the float32 kernel's on the widened pages (the same bits) and the
    reference's within float32 rounding; NaN pages past each sequence stay out."""
    case = dataclasses.replace(case, cache_dtype=cache_dtype)
    kernel_args, ref_args = make_inputs(case, seed=case.t + max(case.kv_lens))
    assert kernel_args[1].dtype == cache_dtype
    f = jax.jit(paged_attention_cpu)
    assert "jspec_paged_attention" in f.lower(*kernel_args).as_text()
    out = np.asarray(f(*kernel_args))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    widened = (kernel_args[0], kernel_args[1].astype(jnp.float32), kernel_args[2].astype(jnp.float32)) + kernel_args[3:]
    assert (out == np.asarray(f(*widened))).all()
    np.testing.assert_allclose(out, np.asarray(paged_attention_cpu_reference(*ref_args)), **TOL[jnp.float32])


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 8])  # vector loads; the scalar tails
def test_every_8_bit_code_widens_as_ml_dtypes_does(cache_dtype, head_dim):
    """All 256 codes of an 8-bit format in the value row of a lone key (its weight is exactly 1,
    so the output is the row widened): the same float32 as ml_dtypes' cast, subnormals, the
    largest values and NaN codes included."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.dtype(cache_dtype))
    heads = 256 // head_dim
    v = jnp.zeros((heads, 2, 4, head_dim), cache_dtype).at[:, 1, 0, :].set(codes.reshape(heads, head_dim))
    q = jnp.ones((1, 1, heads, head_dim), jnp.float32)
    out = jax.jit(paged_attention_cpu)(q, jnp.zeros_like(v), v, jnp.array([[1]], jnp.int32),
                                       jnp.array([1], jnp.int32), jnp.array([1], jnp.int32))
    want = codes.astype(np.float32)
    assert np.isnan(want).any() and (want == 0).sum() == 2
    np.testing.assert_array_equal(np.asarray(out).reshape(-1), want)  # (-0 comes out +0: 0 + 1 x -0)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """A decode step's row and the same row as the first of a verification step's rows (its
    drafts' keys written behind it) give the same bits, over several 256-key chunks."""
    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(700,), kv_heads=3)
    (q, k, v, table, kv_lens, _), _ = make_inputs(case, seed=3)
    f = jax.jit(paged_attention_cpu)
    for pos in (0, 255, 256, 600, 695):  # the first verification row's position
        verify = f(q, k, v, table, jnp.array([pos + 5], jnp.int32), jnp.array([5], jnp.int32))
        for t in range(5):
            alone = f(q[:, t:t + 1], k, v, table, jnp.array([pos + t + 1], jnp.int32), jnp.array([1], jnp.int32))
            assert (np.asarray(alone[0, 0]) == np.asarray(verify[0, t])).all(), (pos, t)


def test_kernel_lowers_on_the_cpu_only_and_falls_back_elsewhere():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    args, _ = make_inputs(case)
    assert "jspec_paged_attention" in jax.jit(paged_attention_cpu).lower(*args).as_text()
    for platform in ("cuda", "rocm"):
        text = jax.jit(paged_attention_cpu).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        assert "jspec_paged_attention" not in text
    bf16 = (args[0].astype(jnp.bfloat16), args[1].astype(jnp.bfloat16), args[2].astype(jnp.bfloat16)) + args[3:]
    assert "jspec_paged_attention" not in jax.jit(paged_attention_cpu).lower(*bf16).as_text()
    _, ref_args = make_inputs(case)
    bf16_ref = tuple(a.astype(jnp.bfloat16) if i < 3 else a for i, a in enumerate(ref_args))
    np.testing.assert_allclose(np.asarray(paged_attention_cpu(*bf16_ref, fallback=paged_attention_xla), np.float32),
                               np.asarray(paged_attention_xla(*bf16_ref), np.float32))


def test_bad_shapes_are_value_errors():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    (q, k, v, table, kv_lens, q_lens), _ = make_inputs(case)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_cpu(q[..., :8], k, v, table, kv_lens, q_lens)
    with pytest.raises(ValueError, match="block_tables"):
        paged_attention_cpu(q, k, v, table[:1], kv_lens, q_lens)
