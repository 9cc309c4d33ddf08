"""A few-row matrix product on the CPU: ``y = x @ w.T`` for x [..., K] with few rows, w [N, K].

A decode step multiplies 1 row per sequence by each weight, a verification k + 1 rows. On XLA's
CPU backend 2 or more rows go through a general matrix product that re-packs the weight, so a
5-row product costs ~1.5x a 1-row one, though both must read the same bytes (measured
2026-12-01). This is not a Pallas kernel (Pallas has no CPU backend outside interpret mode): it is
a C++ kernel (``small_rows.cc`` beside this file) called through XLA's FFI, built at first use
with the machine's C++ compiler and ``-march=native``, and cached (:mod:`pallas_kernels.cpu.build`). The file keeps the kernels'
shape: the kernel, a validated wrapper (:func:`small_rows_matmul`), and
:func:`small_rows_matmul_reference` in plain ``jnp`` with the same signature.

:func:`fused_small_rows` is the same product with a decoder layer's neighbours folded into the
call (``small_rows.cc``'s second target): RMSNorm of ``x`` before it, a residual added after it,
so that a decode step does not run them as XLA ops of their own between two products.

The weight is rows [N, K], packed (:func:`pack_rows`), or a GGUF file's Q4_1 / Q8_0 blocks in the
kernel's quantized layout (:func:`pack_quantized`), which it reads as they are and dequantizes in
registers: the same results, bit for bit, as from the packed float32 weight.

The wrapper lowers to the kernel on the CPU only, for float32 operands, when the kernel could
be built (:func:`available`); everywhere else (GPUs, other dtypes, no compiler,
``JSPEC_CPU_KERNELS=0``) it lowers to the reference's ``dot_general``. Results equal the
reference's up to float rounding (another summation order). Its gradient is the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import available, on_cpu

TARGET = "jspec_small_rows"
FUSED_TARGET = "jspec_small_rows_fused"


PACK_ROWS, LANES = 4, 16  # the packed layout: [N / 4, K / 16, 4, 16], see pack_rows


def pack_rows(w: jax.Array) -> jax.Array:
    """Weight rows [N, K] -> the packed layout [ceil(N / 4), ceil(K / 16), 4, 16] (zero-padded):
    each group of 4 rows interleaved 16 floats at a time, so that the kernel reads a tile of 4
    rows as one sequential stream and multiplies each loaded vector by up to 5 rows of x."""
    n, k = w.shape
    w = jnp.pad(w, ((0, -n % PACK_ROWS), (0, -k % LANES)))
    return w.reshape(w.shape[0] // PACK_ROWS, PACK_ROWS, w.shape[1] // LANES, LANES).transpose(0, 2, 1, 3)


def unpack_rows(packed: jax.Array, n: int, k: int) -> jax.Array:
    """The inverse of :func:`pack_rows`: [N / 4, K / 16, 4, 16] -> [n, k]."""
    g, c, r, l = packed.shape
    return packed.transpose(0, 2, 1, 3).reshape(g * r, c * l)[:n, :k]


# ------------------------------------------------------------------ quantized weights
# GGUF's Q4_1 and Q8_0 blocks of 32 weights along K, read by the kernel as they are stored (with
# their float16 scales widened to float32): [ceil(N / 4), K / 32, 4, record] uint8, each group of 4
# rows interleaved one block at a time. A Q4_1 record is float32 d, float32 m and 16 bytes of 4-bit
# q (weight i = d q_i + m; q_i the low nibble of byte i for i < 16, then the high nibbles); a Q8_0
# record float32 d and 32 int8 q (weight i = d q_i). The values are exactly the float32 ones the
# ``gguf`` package dequantizes the file to (d q is exact in float32), and the kernel sums them in the
# order it sums the packed floats: the product equals the packed float32 weight's bit for bit while
# reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes a weight instead of 4.
QUANT_BLOCK = 32
QUANT_TYPES = ("q4_1", "q8_0")
GGUF_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # a block as the GGUF file stores it (float16 scales)
RECORD_BYTES = {"q4_1": 24, "q8_0": 36}
_TYPE_OF_RECORD = {v: k for k, v in RECORD_BYTES.items()}


def pack_quantized(blocks: np.ndarray, qtype: str) -> np.ndarray:
    """GGUF blocks of a weight's rows, uint8 [N, K / 32 * block bytes] (Q4_1: 20, Q8_0: 34) ->
    the kernel's quantized layout uint8 [ceil(N / 4), K / 32, 4, record] (see above; padding rows
    are zero records: weights 0)."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"pack_quantized: qtype must be one of {QUANT_TYPES}, got {qtype!r}")
    blocks = np.asarray(blocks)
    size = GGUF_BLOCK_BYTES[qtype]
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] % size:
        raise ValueError(f"pack_quantized: blocks must be uint8 [N, K / 32 * {size}], got {blocks.dtype} "
                         f"{blocks.shape}")
    n, nb = blocks.shape[0], blocks.shape[1] // size
    b = blocks.reshape(n, nb, size)
    scales = b[..., :2].copy().view(np.float16).astype(np.float32).view(np.uint8)  # d -> float32 bytes
    if qtype == "q4_1":
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32).view(np.uint8)
        rec = np.concatenate([scales, m, b[..., 4:]], axis=-1)
    else:
        rec = np.concatenate([scales, b[..., 2:]], axis=-1)
    rec = np.pad(rec, ((0, -n % PACK_ROWS), (0, 0), (0, 0)))
    return np.ascontiguousarray(rec.reshape(-1, PACK_ROWS, nb, RECORD_BYTES[qtype]).transpose(0, 2, 1, 3))


def quantized_type(w) -> str | None:
    """"q4_1" or "q8_0" for a weight in a quantized layout (array or ShapeDtypeStruct: the float
    layout's :func:`pack_quantized` or the integer one's :func:`pack_int8_dot`), else None."""
    if w.dtype == jnp.uint8 and w.ndim == 4 and w.shape[2] in (PACK_ROWS, DOT_ROWS):
        return _TYPE_OF_RECORD.get(w.shape[3])
    return None


def int8_dot(w) -> bool:
    """Whether ``w`` is in the int8 dot-product layout (:func:`pack_int8_dot`)."""
    return quantized_type(w) is not None and w.shape[2] == DOT_ROWS


def group_rows(w) -> int:
    """Weight rows a packed or quantized layout interleaves (its padding unit): 4, or 16 for
    :func:`pack_int8_dot`'s."""
    return DOT_ROWS if int8_dot(w) else PACK_ROWS


def packed_dims(w) -> tuple[int, int] | None:
    """(rows N, padded to 4 (16: :func:`pack_int8_dot`); K) of a packed float32 or quantized
    weight, None for anything else."""
    if w.ndim != 4:
        return None
    if quantized_type(w) is not None:
        return w.shape[0] * w.shape[2], w.shape[1] * QUANT_BLOCK
    if w.shape[2] != PACK_ROWS:
        return None
    return (w.shape[0] * PACK_ROWS, w.shape[1] * LANES) if w.shape[3] == LANES and w.dtype != jnp.uint8 else None


# ------------------------------------------------------------------ int8 dot products
# The same blocks arranged for integer dot products (llama.cpp's way of multiplying them), 16 rows
# a block at a time: [N / 16, K / 32, 16, record] uint8, each [16, record] the block's 16 rows: Q4_1
# float32 d [16], float32 m [16], then 4 vectors of 64 bytes whose byte 4 j + u of vector t is byte
# 4 t + u of row j's nibbles (weights 4 t + u low, 16 + 4 t + u high); Q8_0 d [16], then 8 vectors
# whose byte 4 j + u of vector t is row j's q[4 t + u] + 128. The product (small_rows.cc) quantizes
# each row of x to int8 a block of 32 at a time (d = max |x| / 127, a = x (127 / max |x|) rounded
# to nearest even, as llama.cpp's Q8_1) and sums the integer products exactly: per block y += (dw dx) sum(q a)
# (+ m dx sum(a) for Q4_1). Not bit for bit the float32 weight's product (x loses ~0.4% of its
# block's largest entry), but each row's result is the same whatever rows it is computed with,
# so speculative decoding stays token-identical to plain decoding on it. Bytes are the same as
# :func:`pack_quantized`'s.
DOT_ROWS = 16


def pack_int8_dot(w) -> np.ndarray:
    """A weight in :func:`pack_quantized`'s layout -> the int8 dot-product layout (above), rows
    padded to a multiple of 16 with zero weights. A weight already in it comes back as it is."""
    qtype = quantized_type(w)
    if qtype is None:
        raise ValueError(f"pack_int8_dot: w must be in pack_quantized's layout, got {w.dtype} {w.shape}")
    w = np.asarray(w)
    if int8_dot(w):
        return w
    g, nb, _, size = w.shape
    rows = w.transpose(0, 2, 1, 3).reshape(g * PACK_ROWS, nb, size)
    rows = np.pad(rows, ((0, -rows.shape[0] % DOT_ROWS), (0, 0), (0, 0)))
    rec = rows.reshape(-1, DOT_ROWS, nb, size).transpose(0, 2, 1, 3)  # [G, nb, 16, record]
    head = 8 if qtype == "q4_1" else 4
    parts = [rec[..., 0:4].reshape(*rec.shape[:2], -1)]  # d [16]
    if qtype == "q4_1":
        parts.append(rec[..., 4:8].reshape(*rec.shape[:2], -1))  # m [16]
    q = rec[..., head:]
    if qtype == "q8_0":
        q = q ^ np.uint8(0x80)  # int8 q + 128, unsigned
    q = q.reshape(*rec.shape[:3], -1, 4).transpose(0, 1, 3, 2, 4)  # [G, nb, t, j, u]
    parts.append(q.reshape(*rec.shape[:2], -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(rec.shape))


def _dot_blocks(w):
    """An int8 dot layout's d, m (Q4_1; else None) [G, nb, 16] float32 and q [G, nb, 16, 32] int32."""
    g, nb, r, size = w.shape
    flat = w.reshape(g, nb, r * size)
    d = jax.lax.bitcast_convert_type(flat[..., :64].reshape(g, nb, r, 4), jnp.float32)
    if quantized_type(w) == "q4_1":
        m = jax.lax.bitcast_convert_type(flat[..., 64:128].reshape(g, nb, r, 4), jnp.float32)
        v = flat[..., 128:].reshape(g, nb, 4, r, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, r, 16)
        q = jnp.concatenate([v & 15, v >> 4], axis=-1).astype(jnp.int32)
    else:
        m = None
        v = flat[..., 64:].reshape(g, nb, 8, r, 4).transpose(0, 1, 3, 2, 4).reshape(g, nb, r, 32)
        q = v.astype(jnp.int32) - 128
    return d, m, q


def quantize_rows_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] (K a multiple of 32) -> (a int32 [M, K / 32, 32], d float32 [M, K / 32]): the
    product's quantization of x, x ~ d a per block of 32 (d = max |x| / 127, a = x (127 / max |x|)
    rounded to nearest even)."""
    xb = x.reshape(x.shape[0], -1, QUANT_BLOCK)
    amax = jnp.max(jnp.abs(xb), axis=-1)
    inv = jnp.where(amax > 0, jnp.float32(127) / jnp.where(amax > 0, amax, 1), 0).astype(jnp.float32)
    a = jnp.clip(jnp.round(xb * inv[..., None]), -128, 127).astype(jnp.int32)
    return a, amax / jnp.float32(127)


def int8_dot_reference(x: jax.Array, w: jax.Array, n: int) -> jax.Array:
    """x [M, K] times an int8 dot-layout weight -> [M, n] in plain ``jnp``: x quantized as the
    kernel quantizes it, the integer sums exact, the block sums added in another order than the
    kernel's (equal up to float rounding)."""
    d, m, q = _dot_blocks(w)
    a, dx = quantize_rows_int8(x)
    sums = jnp.einsum("mbi,gbji->mbgj", a, q, preferred_element_type=jnp.int32)  # [M, nb, G, 16]
    part = (d.transpose(1, 0, 2)[None] * dx[:, :, None, None]) * sums.astype(jnp.float32)
    if m is not None:
        ds = dx * jnp.sum(a, axis=-1).astype(jnp.float32)
        part = part + m.transpose(1, 0, 2)[None] * ds[:, :, None, None]
    return jnp.sum(part, axis=1).reshape(x.shape[0], -1)[:, :n]


def dequantize(w: jax.Array, n: int) -> jax.Array:
    """A quantized-layout weight -> float32 rows [n, K] in plain ``jnp`` (the kernel's reference)."""
    qtype = quantized_type(w)
    if int8_dot(w):
        d, m, q = _dot_blocks(w)
        vals = d[..., None] * q.astype(jnp.float32)  # [G, nb, 16, 32]
        vals = vals if m is None else vals + m[..., None]
        return vals.transpose(0, 2, 1, 3).reshape(-1, w.shape[1] * QUANT_BLOCK)[:n]
    g, nb, r, size = w.shape
    d = jax.lax.bitcast_convert_type(w[..., 0:4], jnp.float32)[..., None]  # [g, nb, 4, 1]
    if qtype == "q4_1":
        m = jax.lax.bitcast_convert_type(w[..., 4:8], jnp.float32)[..., None]
        q = w[..., 8:]
        q = jnp.concatenate([q & 15, q >> 4], axis=-1).astype(jnp.float32)  # [g, nb, 4, 32]
        vals = d * q + m
    else:
        vals = d * jax.lax.bitcast_convert_type(w[..., 4:], jnp.int8).astype(jnp.float32)
    return vals.transpose(0, 2, 1, 3).reshape(g * r, nb * QUANT_BLOCK)[:n]


def small_rows_matmul_reference(x: jax.Array, w: jax.Array, n: int | None = None) -> jax.Array:
    """``x`` [..., K] times the weight rows transposed -> [..., N] (one ``dot_general``); ``w`` is
    [N, K], or packed (:func:`pack_rows`) or quantized (:func:`pack_quantized`) with ``n`` its
    true row count."""
    if int8_dot(w):
        x2 = x.reshape(-1, x.shape[-1])
        return int8_dot_reference(x2, w, n).reshape(*x.shape[:-1], n)
    if quantized_type(w) is not None:
        w = dequantize(w, n)
    elif w.ndim == 4:
        w = unpack_rows(w, n, x.shape[-1])
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def check_small_rows_args(x: jax.Array, w: jax.Array, n: int | None = None) -> None:
    quantized = quantized_type(w) is not None
    if w.ndim == 4:
        dims = packed_dims(w)
        if dims is None or n is None or not dims[0] - group_rows(w) < n <= dims[0]:
            raise ValueError(f"small_rows_matmul: a packed w must be [ceil(n / {PACK_ROWS}), ceil(K / {LANES}), "
                             f"{PACK_ROWS}, {LANES}] (or quantized: uint8 [ceil(n / {PACK_ROWS} | {DOT_ROWS}), "
                             f"K / {QUANT_BLOCK}, {PACK_ROWS} | {DOT_ROWS}, 24 | 36]) with n given, got {w.dtype} "
                             f"{w.shape} and n = {n}")
        lo = dims[1] if quantized else dims[1] - LANES + 1
        if x.ndim < 1 or not lo <= x.shape[-1] <= dims[1]:
            raise ValueError(f"small_rows_matmul: x [..., K] does not fit the packed w {w.shape}, got shape {x.shape}")
    elif w.ndim == 2:
        if x.ndim < 1 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"small_rows_matmul: x [..., K] must end in w's K = {w.shape[1]}, got shape {x.shape}")
    else:
        raise ValueError(f"small_rows_matmul: w must be [N, K] or packed, got shape {w.shape}")
    if quantized and x.dtype != jnp.float32:
        raise ValueError(f"small_rows_matmul: a quantized w takes float32 x, got {x.dtype}")
    if not quantized and x.dtype != w.dtype:
        raise ValueError(f"small_rows_matmul: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def _kernel(x2: jax.Array, w: jax.Array) -> jax.Array:  # [M, K], [N, K] or packed -> [M, N (padded)]
    n = packed_dims(w)[0] if w.ndim == 4 else w.shape[0]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), x2.dtype)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, w)


def _reference(x2, w):
    return small_rows_matmul_reference(x2, w, packed_dims(w)[0] if w.ndim == 4 else None)


@jax.custom_vjp
def _product(x2, w):
    return on_cpu(x2, w, cpu=_kernel, default=_reference)


def _product_fwd(x2, w):
    return _product(x2, w), (x2, w)


def _product_bwd(res, dy):
    x2, w = res
    _, vjp = jax.vjp(_reference, x2, w)
    return vjp(dy)


_product.defvjp(_product_fwd, _product_bwd)


def small_rows_matmul(x: jax.Array, w: jax.Array, n: int | None = None) -> jax.Array:
    """``x`` [..., K] times the weight rows ``w`` transposed -> [..., N]: ``w`` is [N, K], or
    packed by :func:`pack_rows` or :func:`pack_quantized` with ``n`` = N. The CPU kernel where it
    applies (float32, kernel built), :func:`small_rows_matmul_reference` elsewhere."""
    check_small_rows_args(x, w, n)
    if x.dtype != jnp.float32 or not available():
        return small_rows_matmul_reference(x, w, n)
    x2 = x.reshape(-1, x.shape[-1])
    if w.ndim == 4:
        x2 = jnp.pad(x2, ((0, 0), (0, packed_dims(w)[1] - x2.shape[1])))
    y = _product(x2, w)
    if w.ndim == 4:
        y = y[:, :n]
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ------------------------------------------------------------------ a row's argmax
ARGMAX_TARGET = "jspec_row_argmax"


def row_argmax_reference(x: jax.Array) -> jax.Array:
    """int32 [...]: the first index of the maximum of ``x`` [..., V] (a max, then the smallest
    index holding it: on XLA's CPU backend 1.5-3x faster than ``jnp.argmax``'s (value, index)
    reduction, which it does not vectorize). An all-NaN row gives V - 1."""
    v = x.shape[-1]
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1), v - 1)


def _argmax_kernel(x2: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x2.shape[0],), jnp.int32)
    return jax.ffi.ffi_call(ARGMAX_TARGET, out, vmap_method="sequential")(x2)


def row_argmax(x: jax.Array) -> jax.Array:
    """:func:`row_argmax_reference` for float32 ``x`` on the CPU kernel (``small_rows.cc``), where
    it is :func:`available`: the same index for every row without NaN (the kernel passes NaN
    entries over; the reference's maximum is NaN there, so it gives V - 1). Elsewhere the reference."""
    if x.dtype != jnp.float32 or x.ndim < 1 or x.shape[-1] == 0 or not available():
        return row_argmax_reference(x)
    x2 = x.reshape(-1, x.shape[-1])
    y = on_cpu(x2, cpu=_argmax_kernel, default=row_argmax_reference)
    return y.reshape(x.shape[:-1])


def rms_norm_reference(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm (jspec.models.llama.RMSNorm): ``scale * x / sqrt(mean(x^2) + eps)``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


def fused_small_rows_reference(x, w, n=None, *, scale=None, eps=1e-5, residual=None):
    """:func:`fused_small_rows` in plain ``jnp``: ``rms_norm(x) @ w.T + residual``."""
    if scale is not None:
        x = rms_norm_reference(x, scale, eps)
    y = small_rows_matmul_reference(x, w, n)
    return y if residual is None else y + residual


def _fused_kernel(x2, w, scale, residual, *, eps):
    n = packed_dims(w)[0] if w.ndim == 4 else w.shape[0]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), x2.dtype)
    return jax.ffi.ffi_call(FUSED_TARGET, out, vmap_method="sequential")(x2, w, scale, residual, eps=np.float32(eps))


def fused_small_rows(x: jax.Array, w: jax.Array, n: int | None = None, *, scale: jax.Array | None = None,
                     eps: float = 1e-5, residual: jax.Array | None = None) -> jax.Array:
    """A decoder layer's product with its neighbours folded into the one kernel call: ``x``
    [..., K] through RMSNorm with gain ``scale`` [K] (if given), times the weight rows ``w``
    transposed (as :func:`small_rows_matmul`), plus ``residual`` [..., N] (if given). On the CPU
    kernel (float32, built; a plain ``w``, or a packed one whose ``n`` is a multiple of 4) that
    saves XLA the separate norm and add ops between two products; elsewhere, and for gradients,
    :func:`fused_small_rows_reference`."""
    check_small_rows_args(x, w, n)
    true_n = n if w.ndim == 4 else w.shape[0]
    if scale is not None and scale.shape != (x.shape[-1],):
        raise ValueError(f"fused_small_rows: scale must be [{x.shape[-1]}], got shape {scale.shape}")
    if residual is not None and residual.shape != (*x.shape[:-1], true_n):
        raise ValueError(f"fused_small_rows: residual must be {(*x.shape[:-1], true_n)}, got shape {residual.shape}")
    padded_n = packed_dims(w)[0] if w.ndim == 4 else w.shape[0]
    if x.dtype != jnp.float32 or not available() or padded_n != true_n:
        return fused_small_rows_reference(x, w, n, scale=scale, eps=eps, residual=residual)
    x2 = x.reshape(-1, x.shape[-1])
    g = jnp.zeros((0,), x.dtype) if scale is None else scale.astype(x.dtype)
    r = jnp.zeros((0,), x.dtype) if residual is None else residual.reshape(x2.shape[0], true_n)
    y = _fused(x2, w, g, r, eps, scale is not None, residual is not None)
    return y.reshape(*x.shape[:-1], true_n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(x2, w, g, r, eps, norm, add):
    return on_cpu(x2, w, g, r, cpu=functools.partial(_fused_kernel, eps=eps),
                  default=functools.partial(_fused_reference, eps=eps, norm=norm, add=add))


def _fused_reference(x2, w, g, r, *, eps, norm, add):
    n = packed_dims(w)[0] if w.ndim == 4 else w.shape[0]
    return fused_small_rows_reference(x2, w, n, scale=g if norm else None, eps=eps, residual=r if add else None)


def _fused_fwd(x2, w, g, r, eps, norm, add):
    return _fused(x2, w, g, r, eps, norm, add), (x2, w, g, r)


def _fused_bwd(eps, norm, add, res, dy):
    _, vjp = jax.vjp(functools.partial(_fused_reference, eps=eps, norm=norm, add=add), *res)
    return vjp(dy)


_fused.defvjp(_fused_fwd, _fused_bwd)
