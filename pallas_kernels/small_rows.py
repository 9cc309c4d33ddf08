"""A few-row matrix product on the CPU: ``y = x @ w.T`` for x [..., K] with few rows, w [N, K].

A decode step multiplies 1 row per sequence by each weight, a verification k + 1 rows. On XLA's
CPU backend 2 or more rows go through a general matrix product that re-packs the weight, so a
5-row product costs ~1.5x a 1-row one, though both must read the same bytes (BENCHMARKS.md,
issue 11). This is not a Pallas kernel (Pallas has no CPU backend outside interpret mode): it is
a C++ kernel (``small_rows.cc`` beside this file) called through XLA's FFI, built at first use
with the machine's C++ compiler and ``-march=native``, and cached (:mod:`pallas_kernels.cpu_kernels`). The file keeps the kernels'
shape: the kernel, a validated wrapper (:func:`small_rows_matmul`), and
:func:`small_rows_matmul_reference` in plain ``jnp`` with the same signature.

The wrapper lowers to the kernel on the CPU only, for float32 operands, when the kernel could
be built (:func:`available`); everywhere else (GPUs, other dtypes, no compiler,
``JSPEC_CPU_KERNELS=0``) it lowers to the reference's ``dot_general``. Results equal the
reference's up to float rounding (another summation order). Its gradient is the reference's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_kernels import available

TARGET = "jspec_small_rows"


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


def small_rows_matmul_reference(x: jax.Array, w: jax.Array, n: int | None = None) -> jax.Array:
    """``x`` [..., K] times the weight rows transposed -> [..., N] (one ``dot_general``); ``w`` is
    [N, K], or packed (:func:`pack_rows`) with ``n`` its true row count."""
    if w.ndim == 4:
        w = unpack_rows(w, n, x.shape[-1])
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def check_small_rows_args(x: jax.Array, w: jax.Array, n: int | None = None) -> None:
    if w.ndim == 4:
        g, c, r, l = w.shape
        if (r, l) != (PACK_ROWS, LANES) or n is None or not (g - 1) * PACK_ROWS < n <= g * PACK_ROWS:
            raise ValueError(f"small_rows_matmul: a packed w must be [ceil(n / {PACK_ROWS}), ceil(K / {LANES}), "
                             f"{PACK_ROWS}, {LANES}] with n given, got shape {w.shape} and n = {n}")
        if x.ndim < 1 or not (c - 1) * LANES < x.shape[-1] <= c * LANES:
            raise ValueError(f"small_rows_matmul: x [..., K] does not fit the packed w {w.shape}, got shape {x.shape}")
    elif w.ndim == 2:
        if x.ndim < 1 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"small_rows_matmul: x [..., K] must end in w's K = {w.shape[1]}, got shape {x.shape}")
    else:
        raise ValueError(f"small_rows_matmul: w must be [N, K] or packed, got shape {w.shape}")
    if x.dtype != w.dtype:
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
    packed by :func:`pack_rows` with ``n`` = N. The CPU kernel where it applies (float32, kernel
    built), :func:`small_rows_matmul_reference` elsewhere."""
    check_small_rows_args(x, w, n)
    if x.dtype != jnp.float32 or not available():
        return small_rows_matmul_reference(x, w, n)
    x2 = x.reshape(-1, x.shape[-1])
    if w.ndim == 4:
        x2 = jnp.pad(x2, ((0, 0), (0, w.shape[1] * LANES - x2.shape[1])))
    y = _product(x2, w)
    if w.ndim == 4:
        y = y[:, :n]
    return y.reshape(*x.shape[:-1], y.shape[-1])
