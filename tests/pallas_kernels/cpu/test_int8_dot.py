"""The small-row kernel's int8 dot-product layout (pallas_kernels.cpu.small_rows.pack_int8_dot,
EngineConfig.quantized_activations): the layout holds the GGUF file's weights exactly; the product
quantizes x as its reference does and sums as it does (equal up to float rounding), moves the
result by no more than x's rounding can, and gives each row the same bits whatever rows it is
computed with (what keeps speculative output equal to plain decoding); the fused product and the
layer kernels on it. quantized_check.cc (test_quantized_rows.py) checks every build's tiles against
the scalar definition bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant_blocks import bits, fused_operands, verify_step_operands, weights
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.layer_tail import decoder_layer, decoder_layer_reference, layer_tail, layer_tail_reference
from pallas_kernels.cpu.small_rows import (
    DOT_ROWS,
    FUSED_TARGET,
    TARGET,
    dequantize,
    fused_small_rows,
    fused_small_rows_reference,
    group_rows,
    int8_dot,
    int8_dot_reference,
    pack_int8_dot,
    pack_rows,
    packed_dims,
    quantize_rows_int8,
    quantized_type,
    small_rows_matmul,
)

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernel is not built")


def dot_weights(qtype, n, k, seed=0):
    w, rows = weights(qtype, n, k, seed)
    return jnp.asarray(pack_int8_dot(w)), rows


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(7, 64), (130, 576), (48, 1536)])
def test_the_layout_holds_ggufs_values_bit_for_bit(qtype, n, k):
    w, rows = dot_weights(qtype, n, k, seed=n + k)
    padded = -(-n // DOT_ROWS) * DOT_ROWS
    assert int8_dot(w) and quantized_type(w) == qtype and group_rows(w) == DOT_ROWS
    assert packed_dims(w) == (padded, k) and w.shape == (padded // DOT_ROWS, k // 32, DOT_ROWS, 24 if qtype == "q4_1"
                                                         else 36)
    assert (bits(dequantize(w, n)) == bits(rows)).all()
    assert (np.asarray(dequantize(w, padded))[n:] == 0).all()  # padding rows are zero weights
    assert np.array_equal(pack_int8_dot(w), np.asarray(w))  # already in the layout: as it is
    float_layout, _ = weights(qtype, n, k, seed=n + k)
    assert not int8_dot(float_layout) and group_rows(float_layout) == 4


def test_pack_int8_dot_takes_quantized_weights_only():
    with pytest.raises(ValueError, match="pack_quantized"):
        pack_int8_dot(pack_rows(jnp.ones((8, 64), jnp.float32)))


def test_x_is_rounded_to_8_bits_a_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 96)).astype(np.float32) * np.repeat([1.0, 30.0, 1e-3], 32)[None]
    x[1, 40:64] = 0.0
    x[2, 64:] = 0.0  # a block of zeros: d = 0, a = 0
    a, d = (np.asarray(v) for v in quantize_rows_int8(jnp.asarray(x)))
    assert a.shape == (3, 3, 32) and d.shape == (3, 3)
    assert np.abs(a).max() == 127 and (np.abs(a).max(-1)[d > 0] == 127).all()  # a block's largest entry is +-127
    assert (a[2, 2] == 0).all() and d[2, 2] == 0
    err = np.abs(x.reshape(3, 3, 32) - d[..., None] * a)
    assert (err <= d[..., None] * 0.5 * (1 + 1e-5)).all()


@needs_kernel
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(7, 64), (130, 576), (64, 1536)])
def test_the_product_follows_its_reference_and_each_row_stands_alone(qtype, n, k):
    w, rows = dot_weights(qtype, n, k, seed=n * k)
    f = jax.jit(small_rows_matmul, static_argnums=2)
    assert TARGET in f.lower(jnp.zeros((1, k), jnp.float32), w, n).as_text()
    rng = np.random.default_rng(k)
    xs = jnp.asarray(rng.standard_normal((40, k)).astype(np.float32))
    alone = np.concatenate([np.asarray(f(xs[i:i + 1], w, n)) for i in range(40)])
    for m in (1, 2, 3, 5, 8, 9, 16, 20, 33, 40):  # any number of rows (no float32 twin in XLA past 32)
        got = np.asarray(f(xs[:m], w, n))
        assert got.shape == (m, n)
        assert (bits(got) == bits(alone[:m])).all(), m  # a row's bits do not depend on its neighbours
    want = np.asarray(int8_dot_reference(xs, w, n))
    scale = np.abs(want).max()
    np.testing.assert_allclose(alone, want, rtol=0, atol=2e-6 * np.sqrt(k) * scale)
    # against the float32 weights' product: moved by x's rounding, and no more than it can move it
    exact = np.asarray(xs, np.float64) @ np.asarray(rows, np.float64).T
    a, d = (np.asarray(v, np.float64) for v in quantize_rows_int8(xs))
    x_err = np.abs(np.asarray(xs, np.float64) - (d[..., None] * a).reshape(40, k))
    bound = x_err @ np.abs(np.asarray(rows, np.float64)).T
    moved = np.abs(alone - exact)
    assert moved.max() > 10 * 2e-6 * np.sqrt(k) * scale  # the reference check above could tell them apart
    assert (moved <= bound * (1 + 1e-3) + 1e-5 * scale).all()


@needs_kernel
@pytest.mark.parametrize("norm,add", [(True, True), (False, True), (True, False)])
def test_the_fused_product_quantizes_after_the_norm(norm, add):
    n, k, m = 96, 576, 5
    w, _ = dot_weights("q4_1", n, k, seed=3)
    x, kw = fused_operands(n, k, m, norm, add)
    f = jax.jit(lambda x, w: fused_small_rows(x, w, n, **kw))
    assert FUSED_TARGET in f.lower(x, w).as_text()
    got, want = np.asarray(f(x, w)), np.asarray(fused_small_rows_reference(x, w, n, **kw))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    r = kw.pop("residual")
    rows = [fused_small_rows(x[i:i + 1], w, n, **kw, residual=None if r is None else r[i:i + 1]) for i in range(m)]
    assert (bits(got) == bits(np.concatenate(rows))).all()  # each row alone: the same bits


@needs_kernel
def test_the_layer_kernels_on_int8_weights_follow_their_references():
    """decoder_layer and layer_tail (SmolLM2's shapes, a verification of 5 rows over a ragged pair
    of sequences) on int8-layout weights: the kernels quantize each product's input in their
    phases (the silu phase a block of 32 at a time) as the separate products do."""
    hidden, inter, eps = 576, 1536, 1e-5
    x, in_gain, cos, sin, k, v, tables, start, q_lens, gain = verify_step_operands(hidden)
    spec = (("q8_0", 15 * 64, hidden), ("q4_1", hidden, 9 * 64), ("q4_1", 2 * inter, hidden),
            ("q4_1", hidden, inter))
    ws = [dot_weights(t, n, kk, 6 + i)[0] for i, (t, n, kk) in enumerate(spec)]
    args = (x, ws[0], in_gain, cos, sin, k, v, tables, start, q_lens, ws[1], gain, ws[2], ws[3])
    layer = jax.jit(lambda *a: decoder_layer(*a, eps=eps))
    assert "jspec_decoder_layer" in layer.lower(*args).as_text()
    got, want = layer(*args), decoder_layer_reference(*args, eps=eps)
    scale = np.abs(np.asarray(want[0])).max()
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-4 * scale)
    for g, r in zip(got[1:], want[1:]):  # the written K/V: the QKV product's, up to rounding
        live = ~np.isnan(np.asarray(r))
        np.testing.assert_allclose(np.asarray(g)[live], np.asarray(r)[live], rtol=0, atol=1e-4 * scale)
    q = jnp.asarray(np.random.default_rng(7).standard_normal((2, 5, 9, 64)), jnp.float32)
    targs = (q, got[1], got[2], tables, start + q_lens, q_lens, x, ws[1], gain, ws[2], ws[3])
    tail = jax.jit(lambda *a: layer_tail(*a, eps))
    assert "jspec_layer_tail" in tail.lower(*targs).as_text()
    want = layer_tail_reference(*targs, eps)
    np.testing.assert_allclose(tail(*targs), want, rtol=0, atol=1e-4 * np.abs(np.asarray(want)).max())


def test_without_the_kernels_the_reference_runs(monkeypatch):
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    w, _ = dot_weights("q8_0", 20, 64, seed=8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 64)), jnp.float32)
    f = jax.jit(small_rows_matmul, static_argnums=2)
    assert TARGET not in f.lower(x, w, 20).as_text()
    np.testing.assert_array_equal(f(x, w, 20), int8_dot_reference(x, w, 20))
