"""The CPU small-row kernel on GGUF's quantized blocks (pallas_kernels.cpu.small_rows.pack_quantized):
the layout dequantizes to exactly what the ``gguf`` package makes of the file, and every kernel
that takes a packed float32 weight (the product, the fused product, the layer tail, the whole
layer) gives the same bits from the quantized form of that weight; gradients, the fallback
without the kernels and bad weights."""

import os
import pathlib
import platform
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant_blocks import bits, fused_operands, random_blocks, verify_step_operands, weights
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.layer_tail import decoder_layer, layer_tail
from pallas_kernels.cpu.small_rows import (
    FUSED_TARGET,
    TARGET,
    check_small_rows_args,
    dequantize,
    fused_small_rows,
    pack_quantized,
    pack_rows,
    packed_dims,
    quantized_type,
    small_rows_matmul,
    small_rows_matmul_reference,
)

needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the kernel is not built")
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(7, 64), (130, 576), (4, 1536)])
def test_the_layout_dequantizes_to_ggufs_values_bit_for_bit(qtype, n, k):
    w, rows = weights(qtype, n, k, seed=n + k)
    assert quantized_type(w) == qtype and packed_dims(w) == (-(-n // 4) * 4, k)
    assert (bits(dequantize(w, n)) == bits(rows)).all()
    assert (np.asarray(dequantize(w, -(-n // 4) * 4))[n:] == 0).all()  # padding rows are zero weights


@needs_kernel
@pytest.mark.parametrize("qtype", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(7, 64), (130, 576), (64, 1536)])
def test_the_product_equals_the_float_weights_bit_for_bit(qtype, n, k):
    w, rows = weights(qtype, n, k, seed=n * k)
    f = jax.jit(small_rows_matmul, static_argnums=2)
    x0 = jnp.zeros((1, k), jnp.float32)
    assert TARGET in f.lower(x0, w, n).as_text()
    rng = np.random.default_rng(k)
    for m in (1, 2, 3, 5, 6, 9, 16, 20, 32):  # up to 32 rows on quantized weights (cpu_path.QUANTIZED_KERNEL_ROWS)
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
        got = f(x, w, n)
        assert got.shape == (m, n)
        assert (bits(got) == bits(f(x, pack_rows(rows), n))).all(), m
        want = np.asarray(x, np.float64) @ np.asarray(rows, np.float64).T
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.sqrt(k) * np.abs(want).max())


@needs_kernel
@pytest.mark.parametrize("norm,add", [(True, True), (True, False), (False, True)])
def test_the_fused_product_equals_the_float_weights_bit_for_bit(norm, add):
    n, k, m = 96, 576, 5
    w, rows = weights("q4_1", n, k, seed=3)
    x, kw = fused_operands(n, k, m, norm, add)
    f = jax.jit(lambda x, w: fused_small_rows(x, w, n, **kw))
    assert FUSED_TARGET in f.lower(x, w).as_text()
    assert (bits(f(x, w)) == bits(f(x, pack_rows(rows)))).all()


def _layer_weights(hidden, qkv_rows, hq_d, inter, seed):
    """Each projection of a decoder layer quantized (both types among them) and as packed floats."""
    spec = (("q8_0", qkv_rows, hidden), ("q4_1", hidden, hq_d), ("q4_1", 2 * inter, hidden), ("q4_1", hidden, inter))
    made = [weights(t, n, k, seed + i) for i, (t, n, k) in enumerate(spec)]
    return [q for q, _ in made], [pack_rows(r) for _, r in made]


@needs_kernel
def test_the_layer_kernels_equal_the_float_weights_bit_for_bit():
    """layer_tail and decoder_layer (SmolLM2's shapes, a verification step of 5 rows over a
    ragged pair of sequences) give the same output and the same written pages from the
    quantized weights as from their float32 forms."""
    hidden, inter, eps = 576, 1536, 1e-5
    x, in_gain, cos, sin, k, v, tables, start, q_lens, gain = verify_step_operands(hidden)
    quant, floats = _layer_weights(hidden, (9 + 6) * 64, 9 * 64, inter, seed=6)
    layer = jax.jit(lambda qkv, o, gu, dn: decoder_layer(x, qkv, in_gain, cos, sin, k, v, tables, start, q_lens,
                                                        o, gain, gu, dn, eps=eps))
    got, want = layer(*quant), layer(*floats)
    assert "jspec_decoder_layer" in layer.lower(*quant).as_text()
    for a, b in zip(got, want):
        assert np.array_equal(bits(a), bits(b))  # the pages hold NaN where they were poisoned: compare bits
    q = jnp.asarray(np.random.default_rng(7).standard_normal((2, 5, 9, 64)), jnp.float32)
    tail = jax.jit(lambda o, gu, dn: layer_tail(q, got[1], got[2], tables, start + q_lens, q_lens, x, o, gain, gu,
                                                dn, eps))
    assert (bits(tail(*quant[1:])) == bits(tail(*floats[1:]))).all()


@needs_kernel
def test_gradient_and_the_fallback_follow_the_reference(monkeypatch):
    w, rows = weights("q4_1", 20, 64, seed=8)
    x = jnp.asarray(np.random.default_rng(9).standard_normal((3, 64)), jnp.float32)
    ref = small_rows_matmul_reference(x, w, 20)
    np.testing.assert_allclose(ref, np.asarray(x) @ np.asarray(rows).T, rtol=1e-5, atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(small_rows_matmul(x, w, 20))))(x)
    g_ref = jax.grad(lambda x: jnp.sum(jnp.sin(x @ rows.T)))(x)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    f = jax.jit(small_rows_matmul, static_argnums=2)
    assert TARGET not in f.lower(x, w, 20).as_text()
    np.testing.assert_allclose(f(x, w, 20), ref, rtol=1e-6, atol=1e-6)


def test_bad_quantized_weights_are_value_errors():
    w, _ = weights("q4_1", 8, 64)
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="quantized"):  # a record of 25 bytes is no layout
        check_small_rows_args(x, jnp.zeros((2, 2, 4, 25), jnp.uint8), 8)
    with pytest.raises(ValueError, match="does not fit"):  # K is whole blocks: no padding to take up
        check_small_rows_args(jnp.zeros((2, 60), jnp.float32), w, 8)
    with pytest.raises(ValueError, match="float32 x"):
        check_small_rows_args(x.astype(jnp.bfloat16), w, 8)
    with pytest.raises(ValueError, match="n given"):
        check_small_rows_args(x, w, 3)
    with pytest.raises(ValueError, match="qtype"):
        pack_quantized(random_blocks("q4_1", 4, 64), "q5_0")
    with pytest.raises(ValueError, match="blocks must be"):
        pack_quantized(random_blocks("q4_1", 4, 64)[:, :-1], "q4_1")


def _marches():
    """-march values whose tiles this CPU can run: its own, the AVX2 + FMA tiles, the plain vectors."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["native"]
    flags = set(cpu_kernels._cpu_flags().split())
    return ["native", *(["haswell"] if {"avx2", "fma"} <= flags else []), "x86-64-v2"]


@pytest.mark.parametrize("march", _marches())
def test_every_tile_build_gives_the_float_weights_bits(tmp_path, march):
    """quantized_check.cc (beside this file) runs the quantized and packed tiles of one build
    side by side; built for the AVX2 + FMA tiles and the plain 16-lane vectors too, it checks on
    this CPU the code other CPUs run."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    flags = [f if not f.startswith("-march=") else f"-march={march}" for f in cpu_kernels.FLAGS
             if f not in ("-shared", "-fPIC")]
    exe = tmp_path / "check"
    built = subprocess.run([cxx, *flags, f"-I{jax.ffi.include_dir()}", f"-I{cpu_kernels.HERE}",
                            str(pathlib.Path(__file__).with_name("quantized_check.cc")), "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout + ran.stderr
