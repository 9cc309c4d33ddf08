"""The CPU small-row kernel (pallas_kernels/cpu/small_rows.cc through XLA's FFI) against its
reference, over row counts, both layouts and shapes that are not multiples of the tiles; its
rows independent of their neighbours; its gradient; where it lowers and where it does not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.small_rows import (
    FUSED_TARGET,
    check_small_rows_args,
    fused_small_rows,
    fused_small_rows_reference,
    pack_rows,
    small_rows_matmul,
    small_rows_matmul_reference,
    unpack_rows,
)

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernel is not built")


def _operands(m, k, n, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)),
            jnp.asarray(rng.standard_normal((n, k), dtype=np.float32)))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 17, 33])
@pytest.mark.parametrize("k,n", [(16, 4), (24, 7), (64, 130), (576, 960), (100, 1)])
def test_kernel_matches_the_reference_in_both_layouts(m, k, n):
    x, w = _operands(m, k, n, seed=m * 1000 + k + n)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    plain = jax.jit(small_rows_matmul)(x, w)
    packed = jax.jit(small_rows_matmul, static_argnums=2)(x, pack_rows(w), n)
    assert plain.shape == packed.shape == (m, n)
    tol = 1e-5 * np.sqrt(k) * np.abs(want).max()
    np.testing.assert_allclose(plain, want, atol=tol)
    np.testing.assert_allclose(packed, want, atol=tol)
    np.testing.assert_allclose(small_rows_matmul_reference(x, pack_rows(w), n), want, atol=tol)


@needs_kernel
def test_kernel_runs_in_the_compiled_cpu_program_and_not_on_gpus():
    x, w = _operands(5, 64, 32)
    cpu = jax.jit(small_rows_matmul).lower(x, w).as_text()
    assert "jspec_small_rows" in cpu
    for platform in ("cuda", "rocm"):  # the reference's dot there
        text = jax.jit(small_rows_matmul).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        assert "jspec_small_rows" not in text and "dot_general" in text


@needs_kernel
def test_tracing_for_cpu_traces_the_kernel_alone_with_the_same_result():
    """Inside tracing_for_cpu no platform choice (and no reference) is traced: the jaxpr holds the
    FFI call and no platform_index, the compiled result is the same bits, and the program holds
    the CPU op whatever it is lowered for. Outside, both branches are traced as before."""
    x, w = _operands(5, 64, 32)
    outside = str(jax.make_jaxpr(small_rows_matmul)(x, w))
    assert "platform_index" in outside and "dot_general" in outside

    def for_cpu(x, w):
        with cpu_kernels.tracing_for_cpu():
            return small_rows_matmul(x, w)

    inside = str(jax.make_jaxpr(for_cpu)(x, w))
    assert "platform_index" not in inside and "dot_general" not in inside and "ffi_call" in inside
    np.testing.assert_array_equal(jax.jit(for_cpu)(x, w), jax.jit(small_rows_matmul)(x, w))
    cuda = jax.jit(for_cpu).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert "jspec_small_rows" in cuda and "dot_general" not in cuda  # the CPU op, for the CPU only
    assert "platform_index" in str(jax.make_jaxpr(small_rows_matmul)(x, w))  # the context ended


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Each output is summed in one order whatever the tile holds: a decode step's row (alone)
    and the same row inside a verification step's rows give the same bits, as greedy
    speculative decoding needs to match plain decoding."""
    x, w = _operands(9, 576, 300, seed=3)
    f = jax.jit(small_rows_matmul, static_argnums=2)
    for layout, weight, n in (("plain", w, None), ("packed", pack_rows(w), 300)):
        full = np.asarray(f(x, weight, n))
        for i in range(9):
            for lo in range(0, i + 1):
                part = np.asarray(f(x[lo:i + 1], weight, n))
                assert (part[i - lo] == full[i]).all(), (layout, i, lo)


@needs_kernel
def test_leading_dimensions_vmap_and_gradient_follow_the_reference():
    x, w = _operands(6, 48, 20, seed=5)
    x3 = x.reshape(2, 3, 48)
    np.testing.assert_allclose(small_rows_matmul(x3, w), small_rows_matmul_reference(x3, w), rtol=1e-5, atol=1e-5)
    batched = jax.vmap(small_rows_matmul, in_axes=(0, None))(x3, w)
    np.testing.assert_allclose(batched, small_rows_matmul_reference(x3, w), rtol=1e-5, atol=1e-5)

    def loss(f):
        return lambda x, w: (f(x, w) ** 2).sum()

    got = jax.grad(loss(small_rows_matmul), argnums=(0, 1))(x, w)
    want = jax.grad(loss(small_rows_matmul_reference), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)


def test_pack_and_unpack_round_trip_with_padding():
    _, w = _operands(1, 37, 10)
    packed = pack_rows(w)
    assert packed.shape == (3, 3, 4, 16)
    np.testing.assert_array_equal(unpack_rows(packed, 10, 37), w)
    assert float(jnp.abs(packed).sum()) == pytest.approx(float(jnp.abs(w).sum()), rel=1e-6)  # the padding is zeros


@pytest.mark.parametrize("xs,ws,n,match", [
    ((5, 8), (4, 9), None, "must end in"),
    ((5, 8), (4,), None, "must be \\[N, K\\]"),
    ((5, 40), (2, 3, 4, 16), None, "n given"),
    ((5, 40), (2, 3, 4, 16), 9, "n given"),
    ((5, 20), (2, 3, 4, 16), 8, "does not fit"),
])
def test_bad_shapes_are_value_errors(xs, ws, n, match):
    with pytest.raises(ValueError, match=match):
        check_small_rows_args(jnp.zeros(xs), jnp.zeros(ws), n)


def test_other_dtypes_use_the_reference():
    x, w = _operands(3, 32, 8)
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    text = jax.jit(small_rows_matmul).lower(x, w).as_text()
    assert "jspec_small_rows" not in text
    np.testing.assert_allclose(small_rows_matmul(x, w).astype(np.float32),
                               small_rows_matmul_reference(x, w).astype(np.float32))


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 5, 9, 16])
@pytest.mark.parametrize("k,n", [(576, 64), (40, 12)])  # 40: narrower than the packed weight's 48 columns
@pytest.mark.parametrize("norm,add", [(True, False), (False, True), (True, True)])
def test_fused_norm_and_residual_match_the_reference(m, k, n, norm, add):
    """RMSNorm before and a residual add after the product, inside one kernel call: the same
    values as the plain ops, and the kernel's call is in the lowered step."""
    x, w = _operands(m, k, n, seed=m + k + n)
    rng = np.random.default_rng(m)
    scale = jnp.asarray(rng.standard_normal(k), jnp.float32) if norm else None
    res = jnp.asarray(rng.standard_normal((m, n)), jnp.float32) if add else None
    f = jax.jit(lambda x, w, s, r: fused_small_rows(x, w, n, scale=s, eps=1e-5, residual=r))
    got = f(x, pack_rows(w), scale, res)
    want = fused_small_rows_reference(x, w, scale=scale, eps=1e-5, residual=res)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)
    assert FUSED_TARGET in f.lower(x, pack_rows(w), scale, res).as_text()
    if add:  # the residual was added (not dropped)
        assert not np.allclose(got, fused_small_rows_reference(x, w, scale=scale, eps=1e-5))


@needs_kernel
def test_fused_falls_back_where_the_kernel_does_not_apply_and_its_gradient_is_the_references():
    x, w = _operands(3, 32, 6)  # 6 rows: the packed weight pads them to 8, the fused call would not fit
    scale, res = jnp.linspace(0.5, 1.5, 32), jnp.ones((3, 6))
    f = jax.jit(lambda x, w: fused_small_rows(x, w, 6, scale=scale, residual=res))
    assert FUSED_TARGET not in f.lower(x, pack_rows(w)).as_text()
    np.testing.assert_allclose(f(x, pack_rows(w)), fused_small_rows_reference(x, w, scale=scale, residual=res),
                               rtol=1e-5, atol=1e-5)
    x, w = _operands(3, 32, 8)
    res = jnp.ones((3, 8))

    def loss(fn, wt):
        return lambda x, s: jnp.sum(fn(x, wt, 8, scale=s, residual=res) ** 2)

    got = jax.grad(loss(fused_small_rows, pack_rows(w)), argnums=(0, 1))(x, scale)
    want = jax.grad(loss(fused_small_rows_reference, w), argnums=(0, 1))(x, scale)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="scale"):
        fused_small_rows(x, pack_rows(w), 8, scale=jnp.ones(31))
    with pytest.raises(ValueError, match="residual"):
        fused_small_rows(x, pack_rows(w), 8, residual=jnp.ones((3, 7)))


# ------------------------------------------------------------------ a row's argmax
@needs_kernel
@pytest.mark.parametrize("shape", [(1, 49152), (5, 49152), (2, 3, 1000), (4, 17), (3, 1)])
def test_row_argmax_is_the_first_index_of_the_maximum(shape):
    """``row_argmax`` (the greedy pick of jspec.sampling.argmax on the CPU): jnp.argmax's index
    for every row: ties (first wins), -inf rows, +inf, the maximum in the last lanes or past the
    last full vector, under jit and vmap."""
    from pallas_kernels.cpu.small_rows import ARGMAX_TARGET, row_argmax, row_argmax_reference

    rng = np.random.default_rng(sum(shape))
    x = np.round(rng.normal(size=shape) * 2) / 2  # ties everywhere, the maximum included
    flat = x.reshape(-1, shape[-1])
    flat[0, -1] = 50.0  # the last entry (past the last full vector when V % 16)
    if flat.shape[0] > 2:
        flat[1, :] = -np.inf
        flat[2, shape[-1] // 2] = np.inf
    x = jnp.asarray(flat.reshape(shape), jnp.float32)
    want = np.asarray(jnp.argmax(x, axis=-1))
    fn = jax.jit(row_argmax)
    np.testing.assert_array_equal(np.asarray(fn(x)), want)
    np.testing.assert_array_equal(np.asarray(row_argmax_reference(x)), want)
    assert ARGMAX_TARGET in fn.lower(x).as_text()
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(row_argmax))(x[None].repeat(2, 0))), want[None].repeat(2, 0))


@needs_kernel
def test_row_argmax_passes_nan_over_and_falls_back_without_the_kernel(monkeypatch):
    from pallas_kernels.cpu.small_rows import ARGMAX_TARGET, row_argmax, row_argmax_reference

    x = np.zeros((3, 40), np.float32)
    x[0, 5], x[0, 9] = np.nan, 2.0
    x[1, :] = np.nan
    x[2, 33] = 1.0
    got = np.asarray(jax.jit(row_argmax)(jnp.asarray(x)))
    assert got.tolist() == [9, 39, 33]  # NaN passed over; an all-NaN row: V - 1, as the reference
    assert np.asarray(row_argmax_reference(jnp.asarray(x)))[1:].tolist() == [39, 33]
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    fn = jax.jit(lambda a: row_argmax(a))  # a new function: not the trace cached above
    assert ARGMAX_TARGET not in fn.lower(jnp.asarray(x)).as_text()
    assert np.asarray(fn(jnp.asarray(x)))[1:].tolist() == [39, 33]
