"""A few-row matrix product on the CPU: ``y = x @ w.T`` for x [..., K] with few rows, w [N, K].

A decode step multiplies 1 row per sequence by each weight, a verification k + 1 rows. On XLA's
CPU backend 2 or more rows go through a general matrix product that re-packs the weight, so a
5-row product costs ~1.5x a 1-row one, though both must read the same bytes (BENCHMARKS.md,
issue 11). This is not a Pallas kernel (Pallas has no CPU backend outside interpret mode): it is
a C++ kernel (``small_rows.cc`` beside this file) called through XLA's FFI, built at first use
with the machine's C++ compiler and ``-march=native``, and cached (:mod:`pallas_kernels.cpu_kernels`). The file keeps the kernels'
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

from pallas_kernels.cpu_kernels import available

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
    """"q4_1" or "q8_0" for a weight in the quantized layout (array or ShapeDtypeStruct), else None."""
    if w.dtype == jnp.uint8 and w.ndim == 4 and w.shape[2] == PACK_ROWS:
        return _TYPE_OF_RECORD.get(w.shape[3])
    return None


def packed_dims(w) -> tuple[int, int] | None:
    """(rows N, padded to 4; K) of a packed float32 or quantized weight, None for anything else."""
    if w.ndim != 4 or w.shape[2] != PACK_ROWS:
        return None
    if quantized_type(w) is not None:
        return w.shape[0] * PACK_ROWS, w.shape[1] * QUANT_BLOCK
    return (w.shape[0] * PACK_ROWS, w.shape[1] * LANES) if w.shape[3] == LANES and w.dtype != jnp.uint8 else None


def dequantize(w: jax.Array, n: int) -> jax.Array:
    """A quantized-layout weight -> float32 rows [n, K] in plain ``jnp`` (the kernel's reference)."""
    qtype = quantized_type(w)
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
    if quantized_type(w) is not None:
        w = dequantize(w, n)
    elif w.ndim == 4:
        w = unpack_rows(w, n, x.shape[-1])
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def check_small_rows_args(x: jax.Array, w: jax.Array, n: int | None = None) -> None:
    quantized = quantized_type(w) is not None
    if w.ndim == 4:
        dims = packed_dims(w)
        if dims is None or n is None or not dims[0] - PACK_ROWS < n <= dims[0]:
            raise ValueError(f"small_rows_matmul: a packed w must be [ceil(n / {PACK_ROWS}), ceil(K / {LANES}), "
                             f"{PACK_ROWS}, {LANES}] (or quantized: uint8 [ceil(n / {PACK_ROWS}), K / {QUANT_BLOCK}, "
                             f"{PACK_ROWS}, 24 | 36]) with n given, got {w.dtype} {w.shape} and n = {n}")
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
    n = w.shape[0] * PACK_ROWS if w.ndim == 4 else w.shape[0]
    out = jax.ShapeDtypeStruct((x2.shape[0], n), x2.dtype)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, w)


def _reference(x2, w):
    return small_rows_matmul_reference(x2, w, w.shape[0] * PACK_ROWS if w.ndim == 4 else None)


@jax.custom_vjp
def _product(x2, w):
    return jax.lax.platform_dependent(x2, w, cpu=_kernel, default=_reference)


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
    y = jax.lax.platform_dependent(x2, cpu=_argmax_kernel, default=row_argmax_reference)
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
    n = w.shape[0] * PACK_ROWS if w.ndim == 4 else w.shape[0]
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
    padded_n = w.shape[0] * PACK_ROWS if w.ndim == 4 else w.shape[0]
    if x.dtype != jnp.float32 or not available() or padded_n != true_n:
        return fused_small_rows_reference(x, w, n, scale=scale, eps=eps, residual=residual)
    x2 = x.reshape(-1, x.shape[-1])
    g = jnp.zeros((0,), x.dtype) if scale is None else scale.astype(x.dtype)
    r = jnp.zeros((0,), x.dtype) if residual is None else residual.reshape(x2.shape[0], true_n)
    y = _fused(x2, w, g, r, eps, scale is not None, residual is not None)
    return y.reshape(*x.shape[:-1], true_n)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(x2, w, g, r, eps, norm, add):
    return jax.lax.platform_dependent(x2, w, g, r, cpu=functools.partial(_fused_kernel, eps=eps),
                                      default=functools.partial(_fused_reference, eps=eps, norm=norm, add=add))


def _fused_reference(x2, w, g, r, *, eps, norm, add):
    n = w.shape[0] * PACK_ROWS if w.ndim == 4 else w.shape[0]
    return fused_small_rows_reference(x2, w, n, scale=g if norm else None, eps=eps, residual=r if add else None)


def _fused_fwd(x2, w, g, r, eps, norm, add):
    return _fused(x2, w, g, r, eps, norm, add), (x2, w, g, r)


def _fused_bwd(eps, norm, add, res, dy):
    _, vjp = jax.vjp(functools.partial(_fused_reference, eps=eps, norm=norm, add=add), *res)
    return vjp(dy)


_fused.defvjp(_fused_fwd, _fused_bwd)
