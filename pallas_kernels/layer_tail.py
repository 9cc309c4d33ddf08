"""A decoder layer after its K/V write, in one kernel call on the CPU (``layer_tail.cc``):
verification attention over the pages, the output projection plus the residual, RMSNorm, the
gate/up projection, SwiGLU and the down projection plus the residual.

    layer_tail(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps)
        -> x + attn o^T + (silu(gate) * up) down^T        [M, H]

A decode step on the CPU is bound by reading the weights, and each kernel call costs the time
the pool's helper thread takes to join it and the wait for the last chunk; this call runs what
were four kernel calls and an XLA op (pallas_kernels.paged_attention_cpu, three
pallas_kernels.small_rows products, silu) as seven phases of one call, the helper joining once.
The file keeps the kernels' shape: the kernel, a validated wrapper (:func:`layer_tail`, which
lowers to the kernel on the CPU where it is built and to the reference elsewhere) and
:func:`layer_tail_reference` in plain ``jnp``, composed of the two kernels' references. Results
equal the reference's up to float rounding; the gradient is the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_kernels import available
from pallas_kernels.paged_verify_attention import check_paged_verify_args, paged_verify_attention_reference
from pallas_kernels.small_rows import LANES, PACK_ROWS, fused_small_rows_reference

TARGET = "jspec_layer_tail"


def layer_tail_reference(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w,
                         eps: float):
    """:func:`layer_tail` in plain ``jnp`` (the attention contract's oracle and the small-row
    product's reference)."""
    m, hidden = x.shape
    attn = paged_verify_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, q_lens).reshape(m, -1)
    h = fused_small_rows_reference(attn, o_w, hidden, residual=x)
    inter = gate_up_w.shape[0] * PACK_ROWS // 2
    gate, up = jnp.split(fused_small_rows_reference(h, gate_up_w, 2 * inter, scale=gain, eps=eps), 2, axis=-1)
    return fused_small_rows_reference(jax.nn.silu(gate) * up, down_w, hidden, residual=h)


def check_layer_tail_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w):
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    b, t, hq, d = q.shape
    if x.ndim != 2 or x.shape[0] != b * t:
        raise ValueError(f"layer_tail: x must be [B * T = {b * t}, H], got shape {x.shape}")
    hidden = x.shape[1]
    for name, w in (("o_w", o_w), ("gate_up_w", gate_up_w), ("down_w", down_w)):
        if w.ndim != 4 or w.shape[2:] != (PACK_ROWS, LANES):
            raise ValueError(f"layer_tail: {name} must be packed [N / {PACK_ROWS}, K / {LANES}, {PACK_ROWS}, {LANES}], "
                             f"got shape {w.shape}")
    inter = gate_up_w.shape[0] * PACK_ROWS // 2
    want = {"o_w": (hidden, hq * d), "gate_up_w": (2 * inter, hidden), "down_w": (hidden, inter)}
    for name, w in (("o_w", o_w), ("gate_up_w", gate_up_w), ("down_w", down_w)):
        n, k = want[name]
        if (w.shape[0] * PACK_ROWS, w.shape[1] * LANES) != (n, k):
            raise ValueError(f"layer_tail: {name} must pack [{n}, {k}] with no padding (N a multiple of "
                             f"{PACK_ROWS}, K of {LANES}), got shape {w.shape}")
    if gain.shape != (hidden,):
        raise ValueError(f"layer_tail: gain must be [{hidden}], got shape {gain.shape}")
    if len({a.dtype for a in (q, k_pages, x, o_w, gain, gate_up_w, down_w)}) != 1:
        raise ValueError("layer_tail: q, the pages, x, the weights and the gain must share a dtype")


def applies(q, k_pages, x, o_w, gate_up_w, down_w) -> bool:
    """Whether the kernel can run these operands: float32, head_dim <= 256, weights packed
    without padding (each product's K a multiple of 16, N of 4), kernels built."""
    hidden, (b, t, hq, d) = x.shape[-1], q.shape
    inter2 = gate_up_w.shape[0] * PACK_ROWS
    return (q.dtype == jnp.float32 and k_pages.dtype == jnp.float32 and d <= 256 and inter2 % 2 == 0
            and o_w.shape[0] * PACK_ROWS == hidden and o_w.shape[1] * LANES == hq * d
            and gate_up_w.shape[1] * LANES == hidden and down_w.shape[0] * PACK_ROWS == hidden
            and down_w.shape[1] * LANES == inter2 // 2 and available())


def _kernel(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, *, eps):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps=np.float32(eps))


def layer_tail(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps: float):
    """``q`` [B, T, Hq, D] over the pages [KVH, P, S, D] (``block_tables`` [B, W], ``kv_lens`` and
    ``q_lens`` [B], K/V already written: the verification-attention contract), then through the
    packed projections ``o_w`` [H, Hq D], ``gate_up_w`` [2 I, H] and ``down_w`` [H, I]
    (:func:`pallas_kernels.small_rows.pack_rows`) with ``x`` [B T, H] the residual stream and
    ``gain`` [H] the post-attention RMSNorm's -> [B T, H]. One kernel call where
    :func:`applies`; :func:`layer_tail_reference` elsewhere."""
    check_layer_tail_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w)
    args = (q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w)
    if not applies(q, k_pages, x, o_w, gate_up_w, down_w):
        return layer_tail_reference(*args, eps=eps)
    return _tail(*args, float(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(11,))
def _tail(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps):
    args = (q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w)
    return jax.lax.platform_dependent(*args, cpu=functools.partial(_kernel, eps=eps),
                                      default=functools.partial(layer_tail_reference, eps=eps))


def _tail_fwd(*args):
    return _tail(*args), args[:11]


def _tail_bwd(eps, res, dy):
    floats = (0, 1, 2, 6, 7, 8, 9, 10)  # the integer operands (tables, lengths) get no cotangent

    def f(*fl):
        full = list(res)
        for i, v in zip(floats, fl):
            full[i] = v
        return layer_tail_reference(*full, eps=eps)

    _, vjp = jax.vjp(f, *(res[i] for i in floats))
    grads = dict(zip(floats, vjp(dy)))
    return tuple(grads.get(i) for i in range(11))


_tail.defvjp(_tail_fwd, _tail_bwd)
