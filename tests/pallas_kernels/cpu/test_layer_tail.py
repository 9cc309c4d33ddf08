"""The CPU layer-tail kernel (pallas_kernels/cpu/layer_tail.cc: attention, o_proj + residual,
RMSNorm, gate/up, SwiGLU, down_proj + residual in one call) and the whole-layer kernel (RMSNorm,
QKV, RoPE and the K/V write before it) against their references: poisoned pages and table
slots, ragged q_lens and kv_lens across 256-key chunks, empty sequences, GQA; the pages written
where write_kv writes and nowhere else; a row's result independent of the rows beside it; the
gradients; where they lower; bad shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import Case, make_inputs
from pallas_kernels.cpu import build as cpu_kernels
from pallas_kernels.cpu.layer_tail import (
    LAYER_TARGET,
    STACK_TARGET,
    TARGET,
    decoder_layer,
    decoder_layer_reference,
    decoder_stack,
    decoder_stack_reference,
    layer_tail,
    layer_tail_reference,
)
from pallas_kernels.cpu.small_rows import pack_int8_dot, pack_rows
from quant_blocks import weights as quantized_weights

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the CPU kernels are not built")

EPS = 1e-5


def _weights(hq_d: int, hidden: int, inter: int, seed: int):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    return (f(hidden, hq_d) / np.sqrt(hq_d), 1.0 + 0.1 * f(hidden), f(2 * inter, hidden) / np.sqrt(hidden),
            f(hidden, inter) / np.sqrt(inter))


def _operands(case: Case, hidden: int, inter: int, seed: int = 0):
    """(kernel args with poisoned pages, reference args with clean ones), both ending in the
    residual stream x [B T, H] and the packed o, gain, gate_up and down."""
    kernel_args, ref_args = make_inputs(case, seed=seed)
    q = kernel_args[0]
    b, t, hq, d = q.shape
    q_lens = kernel_args[5] if kernel_args[5] is not None else jnp.full((b,), t, jnp.int32)
    x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((b * t, hidden)).astype(np.float32))
    o, gain, gate_up, down = _weights(hq * d, hidden, inter, seed + 2)
    rest = (x, pack_rows(o), gain, pack_rows(gate_up), pack_rows(down))
    return (*kernel_args[:5], q_lens, *rest), (*ref_args[:5], q_lens, *rest)


CASES = [  # (attention case, hidden, intermediate)
    (Case(t=1, group=3, head_dim=64, page_size=16, kv_lens=(1, 17, 100), kv_heads=3), 576, 1536),  # SmolLM2 decode
    (Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(600, 257), q_lens=(5, 3), kv_heads=3), 576, 1536),
    (Case(t=4, group=2, head_dim=16, page_size=8, kv_lens=(4, 0, 300), q_lens=(4, 0, 2), garbage="mixed"), 64, 128),
    (Case(t=2, group=1, head_dim=32, page_size=4, kv_lens=(2, 9)), 48, 80),  # o_proj's K (64) is not H
]


@pytest.mark.parametrize("case,hidden,inter", CASES, ids=lambda c: str(c) if isinstance(c, int) else f"t{c.t}-kv{max(c.kv_lens)}")
def test_kernel_matches_the_reference_on_poisoned_inputs(case, hidden, inter):
    kernel_args, ref_args = _operands(case, hidden, inter, seed=case.t + hidden)
    f = jax.jit(lambda *a: layer_tail(*a, eps=EPS))
    assert TARGET in f.lower(*kernel_args).as_text()
    out = np.asarray(f(*kernel_args))
    ref = np.asarray(layer_tail_reference(*ref_args, eps=EPS))
    assert np.isfinite(out).all(), "the kernel read a poisoned value"
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    # rows past a sequence's q_len: attention gives zeros, so they are x through o (0) and the MLP
    assert out.shape == (len(case.kv_lens) * case.t, hidden)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """A decode step's row and the same row as the first of a verification step's rows give the
    same bits: greedy speculative decoding stays token-identical to plain decoding on this path."""
    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(700,), kv_heads=3)
    args, _ = _operands(case, 576, 1536, seed=5)
    q, k, v, table, _, _, x, *weights = args
    f = jax.jit(lambda *a: layer_tail(*a, eps=EPS))
    for pos in (0, 255, 600):
        verify = f(q, k, v, table, jnp.array([pos + 5], jnp.int32), jnp.array([5], jnp.int32), x, *weights)
        for t in range(5):
            alone = f(q[:, t:t + 1], k, v, table, jnp.array([pos + t + 1], jnp.int32), jnp.array([1], jnp.int32),
                      x[t:t + 1], *weights)
            assert (np.asarray(alone[0]) == np.asarray(verify[t])).all(), (pos, t)


def test_gradient_is_the_references():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    _, args = _operands(case, 32, 48, seed=7)

    def loss(fn, x, o, gain):
        return jnp.sum(jnp.sin(fn(*args[:6], x, o, gain, *args[9:], eps=EPS)))

    got = jax.grad(lambda *p: loss(layer_tail, *p), argnums=(0, 1, 2))(*args[6:9])
    want = jax.grad(lambda *p: loss(layer_tail_reference, *p), argnums=(0, 1, 2))(*args[6:9])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_kernel_lowers_on_the_cpu_only_and_falls_back_elsewhere(monkeypatch):
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    args, ref_args = _operands(case, 32, 48)
    f = jax.jit(lambda *a: layer_tail(*a, eps=EPS))
    for platform in ("cuda", "rocm"):
        assert TARGET not in f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    monkeypatch.setenv("JSPEC_CPU_KERNELS", "0")
    g = jax.jit(lambda *a: layer_tail(*a, eps=EPS))
    assert TARGET not in g.lower(*ref_args).as_text()
    np.testing.assert_allclose(g(*ref_args), layer_tail_reference(*ref_args, eps=EPS), rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_value_errors():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    (q, k, v, table, kv_lens, q_lens, x, o, gain, gate_up, down), _ = _operands(case, 32, 48)
    call = lambda **kw: layer_tail(*{**dict(q=q, k=k, v=v, table=table, kv_lens=kv_lens, q_lens=q_lens, x=x, o=o,  # noqa: E731
                                            gain=gain, gate_up=gate_up, down=down), **kw}.values(), eps=EPS)
    with pytest.raises(ValueError, match="x must be"):
        call(x=x[:1])
    with pytest.raises(ValueError, match="gain must be"):
        call(gain=gain[:8])
    with pytest.raises(ValueError, match="o_w must be packed"):
        call(o=o.reshape(o.shape[0], -1))
    with pytest.raises(ValueError, match="down_w must pack"):
        call(down=pack_rows(jnp.ones((32, 24), jnp.float32)))  # K = 24 padded to 32: not this MLP's 48
    with pytest.raises(ValueError, match="block_tables"):
        call(table=table[:1])


# ---------------------------------------------------------------------------- the whole layer
def _layer_operands(case: Case, hidden: int, inter: int, seed: int = 0):
    """Operands of decoder_layer: (kernel's, reference's), the pages poisoned past each
    sequence's keys for the kernel; ``case.kv_lens`` are the lengths after the step's rows."""
    kernel_args, ref_args = make_inputs(case, seed=seed)
    _, k_bad, v_bad, tables_bad, kv_lens, _ = kernel_args
    _, k, v, tables, _, _ = ref_args
    b, t, hq, d = kernel_args[0].shape
    kvh = k.shape[0]
    q_lens = jnp.asarray(case.q_lens or (t,) * b, jnp.int32)
    start = kv_lens - q_lens
    rng = np.random.default_rng(seed + 1)
    f = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    x = f(b * t, hidden)
    qkv = pack_rows(f((hq + 2 * kvh) * d, hidden) / np.sqrt(hidden))
    angles = (np.asarray(start)[:, None] + np.arange(t)[None, :]).reshape(-1, 1) * 0.1 ** np.arange(d // 2)
    cos, sin = (jnp.asarray(np.concatenate([fn(angles)] * 2, -1), jnp.float32) for fn in (np.cos, np.sin))
    o, gain, gate_up, down = _weights(hq * d, hidden, inter, seed + 2)
    head = (x, qkv, 1.0 + 0.1 * f(hidden), cos, sin)
    tail = (start, q_lens, pack_rows(o), gain, pack_rows(gate_up), pack_rows(down))
    return (*head, k_bad, v_bad, tables_bad, *tail), (*head, k, v, tables, *tail)


LAYER_CASES = [
    (Case(t=1, group=3, head_dim=64, page_size=16, kv_lens=(1, 17, 100), kv_heads=3), 576, 1536),  # SmolLM2 decode
    (Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(600, 257), q_lens=(5, 3), kv_heads=3), 576, 1536),
    (Case(t=4, group=2, head_dim=16, page_size=8, kv_lens=(4, 0, 300), q_lens=(4, 0, 2), garbage="mixed"), 64, 128),
]


@pytest.mark.parametrize("case,hidden,inter", LAYER_CASES,
                         ids=lambda c: str(c) if isinstance(c, int) else f"t{c.t}-kv{max(c.kv_lens)}")
def test_whole_layer_matches_the_reference(case, hidden, inter):
    kernel_args, ref_args = _layer_operands(case, hidden, inter, seed=case.t + hidden)
    f = jax.jit(lambda *a: decoder_layer(*a, eps=EPS))
    assert LAYER_TARGET in f.lower(*kernel_args).as_text()
    out, k, v = f(*kernel_args)
    ref_out, ref_k, ref_v = decoder_layer_reference(*ref_args, eps=EPS)
    assert np.isfinite(np.asarray(out)).all(), "the kernel read a poisoned value"
    np.testing.assert_allclose(out, ref_out, rtol=2e-5, atol=2e-5 * np.abs(ref_out).max())
    # the written slots hold the reference's K/V; every other slot is what it was (NaN stays NaN)
    for i, got, want in ((5, k, ref_k), (6, v, ref_v)):
        got, want, before = np.asarray(got), np.asarray(want), np.asarray(kernel_args[i])
        written = want != np.asarray(ref_args[i])
        assert written.any()
        np.testing.assert_allclose(got[written], want[written], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got[~written], before[~written])


def test_whole_layer_rows_do_not_depend_on_the_rows_beside_them():
    """The whole layer, too: a decode row and the same row first in a verification step (its
    drafts written behind it) give the same bits, and so do the K/V they write."""
    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(700,), kv_heads=3)
    args, _ = _layer_operands(case, 576, 1536, seed=9)
    x, qkv, in_gain, cos, sin, k, v, table, _, _, *weights = args
    f = jax.jit(lambda *a: decoder_layer(*a, eps=EPS))
    pos = 600
    verify = f(x, qkv, in_gain, cos, sin, k, v, table, jnp.array([pos], jnp.int32), jnp.array([5], jnp.int32), *weights)
    for t in range(5):
        alone = f(x[t:t + 1], qkv, in_gain, cos[t:t + 1], sin[t:t + 1], verify[1], verify[2], table,
                  jnp.array([pos + t], jnp.int32), jnp.array([1], jnp.int32), *weights)
        assert (np.asarray(alone[0][0]) == np.asarray(verify[0][t])).all(), t
        assert np.array_equal(alone[1], verify[1], equal_nan=True), t  # the same K over itself (NaN: poisoned slots)


def test_whole_layer_gradient_is_the_references():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    _, args = _layer_operands(case, 32, 48, seed=11)

    def loss(fn, x, qkv, o):
        out, k, v = fn(x, qkv, *args[2:10], o, *args[11:], eps=EPS)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(k))

    got = jax.grad(lambda *p: loss(decoder_layer, *p), argnums=(0, 1, 2))(args[0], args[1], args[10])
    want = jax.grad(lambda *p: loss(decoder_layer_reference, *p), argnums=(0, 1, 2))(args[0], args[1], args[10])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_whole_layer_lowers_on_the_cpu_only_and_rejects_bad_shapes():
    case = Case(t=2, group=2, head_dim=16, page_size=4, kv_lens=(5, 9))
    args, _ = _layer_operands(case, 32, 48)
    f = jax.jit(lambda *a: decoder_layer(*a, eps=EPS))
    for platform in ("cuda", "rocm"):
        assert LAYER_TARGET not in f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    x, qkv, in_gain, cos, sin, *rest = args
    with pytest.raises(ValueError, match="cos must be"):
        decoder_layer(x, qkv, in_gain, cos[:, :8], sin, *rest, eps=EPS)
    with pytest.raises(ValueError, match="in_gain must be"):
        decoder_layer(x, qkv, in_gain[:4], cos, sin, *rest, eps=EPS)
    with pytest.raises(ValueError, match="x must be"):
        decoder_layer(x[:3], qkv, in_gain, cos[:3], sin[:3], *rest, eps=EPS)
    with pytest.raises(ValueError, match="qkv_w"):
        decoder_layer(x, pack_rows(jnp.ones((20, 32), jnp.float32)), in_gain, cos, sin, *rest, eps=EPS)


def _narrowed(x: np.ndarray, cache_dtype) -> np.ndarray:
    """float32 values as pages of ``cache_dtype`` hold them: numpy's cast (round to nearest even),
    the 8-bit formats saturated first (pallas_kernels.paged_verify_attention.write_kv)."""
    if jnp.dtype(cache_dtype).itemsize == 1:
        big = float(jnp.finfo(cache_dtype).max)
        x = np.clip(x, -big, big)
    with np.errstate(over="ignore"):  # float16's overflow to inf is the point
        return x.astype(cache_dtype)


@pytest.mark.parametrize("cache_dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_whole_layer_writes_and_reads_narrow_pages(cache_dtype):
    """Pages of float16 / bfloat16 / 8-bit floats (a KV cache of half or a quarter of the bytes):
    the layer writes each k and v as the float32 layer computes it, rounded to nearest even as
    XLA's convert rounds it (the same bits as numpy's cast, across subnormals and overflow to inf,
    or, for the 8-bit formats, saturation to their largest value: the QKV rows scaled from 1e-9
    to 1e6), every other slot untouched; the attention reads the pages widened, so the output
    is the reference's on the same pages within float32 rounding."""
    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(600, 257), q_lens=(5, 3), kv_heads=3)
    args32, ref32 = _layer_operands(case, 576, 1536, seed=21)
    half = lambda a: tuple(x.astype(cache_dtype) if i in (5, 6) else x for i, x in enumerate(a))  # noqa: E731
    args, ref = half(args32), half(ref32)
    f = jax.jit(lambda *a: decoder_layer(*a, eps=EPS))
    assert LAYER_TARGET in f.lower(*args).as_text()
    out, k, v = f(*args)
    assert k.dtype == cache_dtype and v.dtype == cache_dtype
    ref_out, ref_k, ref_v = decoder_layer_reference(*ref, eps=EPS)
    np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())
    _, k32, v32 = f(*args32)  # the same layer on float32 pages: the values the half pages round
    for i, got, full in ((5, k, k32), (6, v, v32)):
        got, before = np.asarray(got), np.asarray(args[i])
        written = np.asarray(ref_k if i == 5 else ref_v) != np.asarray(ref[i])
        assert written.any()
        np.testing.assert_array_equal(got[written], _narrowed(np.asarray(full)[written], cache_dtype))
        np.testing.assert_array_equal(got[~written], before[~written])
    # extreme magnitudes: each of the QKV weight's rows scaled by 10^u, u uniform in [-9, 6]
    x, qkv, *rest = args32
    rows = qkv.shape[0] * qkv.shape[2]
    scale = 10.0 ** np.random.default_rng(5).uniform(-9, 6, rows).astype(np.float32)
    qkv = qkv * jnp.asarray(scale.reshape(qkv.shape[0], 1, qkv.shape[2], 1))
    _, k32, v32 = f(x, qkv, *rest)
    _, k, v = f(*half((x, qkv, *rest)))
    for got, full in ((k, k32), (v, v32)):
        got, full = np.asarray(got), np.asarray(full)
        live = ~np.isnan(full)
        np.testing.assert_array_equal(got[live].view(np.uint8), _narrowed(full[live], cache_dtype).view(np.uint8))
    kv = np.concatenate([np.asarray(k32)[live], np.asarray(v32)[live]])
    info = jnp.finfo(cache_dtype)
    if cache_dtype != jnp.bfloat16:  # (bfloat16 has float32's range) values past the largest one
        # (inf, or saturated) and below the smallest normal (subnormals) were written
        assert (np.abs(kv) > float(info.max)).any() and ((np.abs(kv) < float(info.smallest_normal)) & (kv != 0)).any()


@pytest.mark.parametrize("head_dim", [64, 40])
def test_rope_rounds_each_product_before_the_sum(head_dim):
    """layer_tail.rotate on the CPU (jspec_rope): x c + r s with each product rounded to float32
    first, bit for bit, in any compiled program (XLA's elementwise code for it was contracted to
    FMAs in some steps and not others: an engine with drafts prefilled K an ulp away from one
    without); gradients are the reference's. Head dim 40: 16 lanes of each half, then 4 one by one."""
    from pallas_kernels.cpu.layer_tail import ROPE_TARGET, rotate, rotate_reference

    half = head_dim // 2
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 7, 3, head_dim)).astype(np.float32)
    ang = rng.uniform(0, 100, (2, 7, half)).astype(np.float32)
    cos, sin = (np.concatenate([fn(ang)] * 2, -1).astype(np.float32) for fn in (np.cos, np.sin))
    r = np.concatenate([-x[..., half:], x[..., :half]], -1)
    want = (x * cos[..., None, :]).astype(np.float32) + (r * sin[..., None, :]).astype(np.float32)
    f = jax.jit(rotate)
    assert ROPE_TARGET in f.lower(x, cos, sin).as_text()
    for fn in (f, jax.jit(lambda x, c, s: rotate(x * 1.0, c * 1.0, s) * 1.0)):  # alone, and among other ops
        assert np.array_equal(np.asarray(fn(x, cos, sin)).view(np.uint32), want.view(np.uint32))
    g = jax.grad(lambda x: jnp.sum(jnp.sin(rotate(x, cos, sin))))(jnp.asarray(x))
    g_ref = jax.grad(lambda x: jnp.sum(jnp.sin(rotate_reference(x, cos, sin))))(jnp.asarray(x))
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)


def test_the_whole_layer_ropes_as_the_rope_op_does():
    """The K the whole-layer call writes equals the separate path's (the QKV product, then the
    RoPE op) bit for bit: a row gets the same K whether its step runs the layer as one call or
    not (a prefill chunk beside it)."""
    from pallas_kernels.cpu.layer_tail import rotate
    from pallas_kernels.cpu.small_rows import fused_small_rows

    case = Case(t=5, group=3, head_dim=64, page_size=16, kv_lens=(40,), kv_heads=3)
    _, args = _layer_operands(case, 576, 1536, seed=4)  # clean pages and tables
    x, qkv, in_gain, cos, sin, k, v, table, _, _, *weights = args
    start, q_lens = jnp.array([30], jnp.int32), jnp.array([5], jnp.int32)
    _, k_out, _ = jax.jit(lambda *a: decoder_layer(*a, eps=EPS))(x, qkv, in_gain, cos, sin, k, v, table, start, q_lens,
                                                                  *weights)
    rows = jax.jit(lambda x: fused_small_rows(x, qkv, (9 + 6) * 64, scale=in_gain, eps=EPS))(x)
    k_sep = np.asarray(jax.jit(rotate)(rows[:, 9 * 64:12 * 64].reshape(5, 3, 64), cos, sin))
    page = int(np.asarray(table)[0, 30 // 16])
    got = np.asarray(k_out)[:, page, 30 % 16:30 % 16 + 2]  # positions 30, 31 on the page
    assert np.array_equal(got.transpose(1, 0, 2).view(np.uint32), k_sep[:2].view(np.uint32))


# ---------------------------------------------------------------------------- the layers of a step
STACK_CASE = Case(t=3, group=3, head_dim=32, page_size=8, kv_lens=(40, 3), q_lens=(3, 2), kv_heads=2)


def _stack_operands(kind: str, layers: int = 3, page_dtype=jnp.float32):
    """decoder_stack's operands for ``layers`` layers of distinct weights (``kind``: packed float32,
    GGUF Q4_1 / Q8_0 blocks, or those blocks in the int8 dot layout) over poisoned pages (one
    copy per layer): (x, cos, sin, tables, start, q_lens, layers, k_pages, v_pages)."""
    args, _ = _layer_operands(STACK_CASE, 64, 128, seed=3)
    x, _, _, cos, sin, k, v, tables, start, q_lens, *_ = args
    hq_d, kv_d, hidden, inter = 3 * 2 * 32, 2 * 32, 64, 128
    rng = np.random.default_rng(7)

    def weight(n, k, seed):
        if kind == "f32":
            return pack_rows(jnp.asarray(rng.standard_normal((n, k)).astype(np.float32)) / np.sqrt(k))
        w, _ = quantized_weights("q4_1" if seed % 2 else "q8_0", n, k, seed)
        return jnp.asarray(pack_int8_dot(w)) if kind == "int8" else w

    stack = [(weight(hq_d + 2 * kv_d, hidden, 10 * i), jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.float32),
              weight(hidden, hq_d, 10 * i + 1), jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), jnp.float32),
              weight(2 * inter, hidden, 10 * i + 2), weight(hidden, inter, 10 * i + 3)) for i in range(layers)]
    pages = lambda a: tuple(jnp.array(a.astype(page_dtype), copy=True) for _ in range(layers))  # noqa: E731
    return x, cos, sin, tables, start, q_lens, stack, pages(k), pages(v)


def _layer_by_layer(x, cos, sin, tables, start, q_lens, stack, k_pages, v_pages):
    k_pages, v_pages = list(k_pages), list(v_pages)
    for i, (qkv, in_gain, o, gain, gate_up, down) in enumerate(stack):
        x, k_pages[i], v_pages[i] = decoder_layer(x, qkv, in_gain, cos, sin, k_pages[i], v_pages[i], tables, start,
                                                  q_lens, o, gain, gate_up, down, EPS)
    return x, k_pages, v_pages


@pytest.mark.parametrize("kind,page_dtype", [("f32", jnp.float32), ("quantized", jnp.float16),
                                             ("int8", jnp.float32), ("int8", jnp.float8_e5m2)])
def test_stack_is_its_layers_one_after_another(kind, page_dtype):
    """One call for the step's layers gives the bits of one call a layer (the output and every
    layer's pages, poisoned slots included), and the reference's values within rounding."""
    args = _stack_operands(kind, page_dtype=page_dtype)
    stacked = jax.jit(lambda *a: decoder_stack(*a, eps=EPS))
    text = stacked.lower(*args).as_text()
    assert STACK_TARGET in text and LAYER_TARGET not in text
    out, k, v = stacked(*args)
    want_out, want_k, want_v = jax.jit(_layer_by_layer)(*args)
    assert np.array_equal(out, want_out)
    for got, want in zip((*k, *v), (*want_k, *want_v)):
        assert got.dtype == page_dtype
        assert np.array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    assert not np.array_equal(k[0], args[7][0]), "nothing was written"
    if kind != "int8":  # (the int8 products round x to 8 bits: no float32 reference to hold them to)
        ref_out, _, _ = decoder_stack_reference(*args, eps=EPS)
        assert np.isfinite(np.asarray(out)).all(), "the kernel read a poisoned value"
        np.testing.assert_allclose(out, ref_out, rtol=1e-4, atol=1e-4 * np.abs(ref_out).max())


def test_stack_falls_back_to_a_call_a_layer_and_lowers_on_the_cpu_only():
    args = _stack_operands("f32", layers=2)
    x, cos, sin, tables, start, q_lens, stack, k, v = args
    f = jax.jit(lambda *a: decoder_stack(*a, eps=EPS))
    for platform in ("cuda", "rocm"):
        assert STACK_TARGET not in f.trace(*args).lower(lowering_platforms=(platform,)).as_text()
    # layers whose pages differ in dtype cannot share the call: one call a layer, the same values
    mixed = (x, cos, sin, tables, start, q_lens, stack, (k[0], k[1].astype(jnp.float16)),
             (v[0], v[1].astype(jnp.float16)))
    text = f.lower(*mixed).as_text()
    assert STACK_TARGET not in text and text.count(LAYER_TARGET) == 2
    out, _, _ = f(*mixed)
    want, _, _ = jax.jit(_layer_by_layer)(*mixed)
    assert np.array_equal(out, want)


def test_stack_gradient_is_the_references_and_bad_operands_are_value_errors():
    args = _stack_operands("f32", layers=2)
    x, cos, sin, tables, start, q_lens, stack, k, v = args
    clean = tuple(jnp.nan_to_num(p) for p in k), tuple(jnp.nan_to_num(p) for p in v)

    def loss(fn, x, qkv0):
        layers = [(qkv0, *stack[0][1:]), stack[1]]
        out, ks, _ = fn(x, cos, sin, tables, start, q_lens, layers, *clean, eps=EPS)
        return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(ks[1]))

    got = jax.grad(lambda *p: loss(decoder_stack, *p), argnums=(0, 1))(x, stack[0][0])
    want = jax.grad(lambda *p: loss(decoder_stack_reference, *p), argnums=(0, 1))(x, stack[0][0])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="2 layers, 1 K"):
        decoder_stack(x, cos, sin, tables, start, q_lens, stack, k[:1], v, eps=EPS)
    bad = [stack[0], (stack[1][0], stack[1][1][:8], *stack[1][2:])]
    with pytest.raises(ValueError, match="in_gain must be"):
        decoder_stack(x, cos, sin, tables, start, q_lens, bad, k, v, eps=EPS)
