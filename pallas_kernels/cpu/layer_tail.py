"""A Llama decoder layer in one kernel call on the CPU (``layer_tail.cc``), whole or from its
K/V write on:

    decoder_layer(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens,
                  o_w, gain, gate_up_w, down_w, eps) -> (out [M, H], k_pages, v_pages)
        RMSNorm, the QKV product, RoPE, k and v written into the pages (in place), then:
    layer_tail(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps)
        -> x + attn o^T + (silu(gate) * up) down^T        [M, H]
        verification attention over the pages, the output projection plus the residual,
        RMSNorm, the gate/up projection, SwiGLU, the down projection plus the residual.

A decode step on the CPU is bound by reading the weights, and each kernel call costs the time
the pool's helper thread takes to join it and the wait for its last chunk; the layer made five
kernel calls (pallas_kernels.cpu.small_rows products, pallas_kernels.cpu.paged_attention) and a dozen
small XLA ops, and runs here as the phases of one call, the helper joining once. The file keeps
the kernels' shape: the kernels, validated wrappers (:func:`decoder_layer`, :func:`layer_tail`,
which lower to the kernel on the CPU where it is built and to the reference elsewhere) and the
references in plain ``jnp`` (:func:`decoder_layer_reference`, :func:`layer_tail_reference`),
composed of the other kernels' references. Results equal the references' up to float rounding;
the gradients are the references'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.build import available, on_cpu
from pallas_kernels.paged_verify_attention import (PAGE_DTYPES, check_paged_verify_args,
                                                   paged_verify_attention_reference, write_kv)
from pallas_kernels.cpu.small_rows import (LANES, PACK_ROWS, check_small_rows_args, fused_small_rows_reference, packed_dims,
                                      quantized_type)

TARGET = "jspec_layer_tail"
LAYER_TARGET = "jspec_decoder_layer"
STACK_TARGET = "jspec_decoder_stack"



def _rows(w) -> int:
    """The rows N a packed or quantized weight holds (padded to its layout's unit)."""
    dims = packed_dims(w)
    return dims[0] if dims is not None else w.shape[0] * PACK_ROWS


def layer_tail_reference(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w,
                         eps: float):
    """:func:`layer_tail` in plain ``jnp`` (the attention contract's oracle and the small-row
    product's reference)."""
    m, hidden = x.shape
    attn = paged_verify_attention_reference(q, k_pages, v_pages, block_tables, kv_lens, q_lens).reshape(m, -1)
    h = fused_small_rows_reference(attn, o_w, hidden, residual=x)
    inter = _rows(gate_up_w) // 2
    gate, up = jnp.split(fused_small_rows_reference(h, gate_up_w, 2 * inter, scale=gain, eps=eps), 2, axis=-1)
    return fused_small_rows_reference(jax.nn.silu(gate) * up, down_w, hidden, residual=h)


def check_layer_tail_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w):
    check_paged_verify_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens)
    b, t, hq, d = q.shape
    if x.ndim != 2 or x.shape[0] != b * t:
        raise ValueError(f"layer_tail: x must be [B * T = {b * t}, H], got shape {x.shape}")
    hidden, inter = x.shape[1], _rows(gate_up_w) // 2
    for name, w, (n, k) in (("o_w", o_w, (hidden, hq * d)), ("gate_up_w", gate_up_w, (2 * inter, hidden)),
                            ("down_w", down_w, (hidden, inter))):
        if packed_dims(w) is None:
            raise ValueError(f"layer_tail: {name} must be packed [N / {PACK_ROWS}, K / {LANES}, {PACK_ROWS}, {LANES}] "
                             f"or quantized (pallas_kernels.cpu.small_rows.pack_quantized), got {w.dtype} {w.shape}")
        if packed_dims(w) != (n, k):
            raise ValueError(f"layer_tail: {name} must pack [{n}, {k}] with no padding (N a multiple of "
                             f"{PACK_ROWS}, K of {LANES}), got shape {w.shape}")
    if gain.shape != (hidden,):
        raise ValueError(f"layer_tail: gain must be [{hidden}], got shape {gain.shape}")
    floats = [w for w in (o_w, gate_up_w, down_w) if quantized_type(w) is None]
    if len({a.dtype for a in (q, x, gain, *floats)}) != 1:
        raise ValueError("layer_tail: q, x, the float weights and the gain must share a dtype")


def applies(q, k_pages, x, o_w, gate_up_w, down_w) -> bool:
    """Whether the kernel can run these operands (arrays or ``jax.ShapeDtypeStruct`` s): float32
    (the pages float32, float16, bfloat16 or 8-bit floats), head_dim <= 256, weights packed without padding (each
    product's K a multiple of 16, N of 4), kernels built."""
    hidden, (b, t, hq, d) = x.shape[-1], q.shape
    inter2 = _rows(gate_up_w)
    return (q.dtype == jnp.float32 and k_pages.dtype in PAGE_DTYPES and d <= 256 and inter2 % 2 == 0
            and packed_dims(o_w) == (hidden, hq * d) and packed_dims(gate_up_w) == (inter2, hidden)
            and packed_dims(down_w) == (hidden, inter2 // 2) and available())


def _kernel(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, *, eps):
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(x.shape, x.dtype), vmap_method="sequential")(
        q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps=np.float32(eps))


def layer_tail(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w, eps: float):
    """``q`` [B, T, Hq, D] over the pages [KVH, P, S, D] (``block_tables`` [B, W], ``kv_lens`` and
    ``q_lens`` [B], K/V already written: the verification-attention contract), then through the
    packed projections ``o_w`` [H, Hq D], ``gate_up_w`` [2 I, H] and ``down_w`` [H, I]
    (:func:`pallas_kernels.cpu.small_rows.pack_rows`) with ``x`` [B T, H] the residual stream and
    ``gain`` [H] the post-attention RMSNorm's -> [B T, H]. One kernel call where
    :func:`applies`; :func:`layer_tail_reference` elsewhere."""
    check_layer_tail_args(q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w)
    args = (q, k_pages, v_pages, block_tables, kv_lens, q_lens, x, o_w, gain, gate_up_w, down_w)
    if not applies(q, k_pages, x, o_w, gate_up_w, down_w):
        return layer_tail_reference(*args, eps=eps)
    return _tail(*args, float(eps))


def _reference_vjp(reference, res, ints, dy):
    """The reference's cotangents for the float operands in ``res``; None for the integer ones."""
    floats = [i for i in range(len(res)) if i not in ints]

    def f(*fl):
        full = list(res)
        for i, v in zip(floats, fl):
            full[i] = v
        return reference(*full)

    _, vjp = jax.vjp(f, *(res[i] for i in floats))
    grads = dict(zip(floats, vjp(dy)))
    return tuple(grads.get(i) for i in range(len(res)))


def _kernel_or_reference(kernel, reference, n: int, ints: tuple[int, ...]):
    """fn(*arrays, eps) for ``n`` operands (pytrees): ``kernel`` on the CPU, ``reference``
    elsewhere, both taking ``eps``; its gradients are the reference's, none for the operands at
    ``ints`` (integers)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(n,))
    def call(*args):
        *arrays, eps = args
        return on_cpu(*arrays, cpu=functools.partial(kernel, eps=eps), default=functools.partial(reference, eps=eps))

    def fwd(*args):
        return call(*args), args[:n]

    def bwd(eps, res, dy):
        return _reference_vjp(functools.partial(reference, eps=eps), res, ints, dy)

    call.defvjp(fwd, bwd)
    return call


# block_tables, kv_lens, q_lens: no cotangents
_tail = _kernel_or_reference(_kernel, layer_tail_reference, 11, (3, 4, 5))


# ---------------------------------------------------------------------------- the whole layer
ROPE_TARGET = "jspec_rope"


def rotate_reference(x, cos, sin):
    """Rotate-half RoPE of ``x`` [..., heads, D] with ``cos`` / ``sin`` [..., D] of each row's
    position, in plain ``jnp``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def _rope_kernel(x3, c2, s2):
    return jax.ffi.ffi_call(ROPE_TARGET, jax.ShapeDtypeStruct(x3.shape, x3.dtype), vmap_method="sequential")(x3, c2, s2)


@jax.custom_vjp
def _rope(x3, c2, s2):
    return on_cpu(x3, c2, s2, cpu=_rope_kernel, default=rotate_reference)


def _rope_fwd(x3, c2, s2):
    return _rope(x3, c2, s2), (x3, c2, s2)


def _rope_bwd(res, dy):
    return _reference_vjp(rotate_reference, res, (), dy)


_rope.defvjp(_rope_fwd, _rope_bwd)


def rotate(x, cos, sin):
    """Rotate-half RoPE of ``x`` [..., heads, D] with ``cos`` / ``sin`` [..., D] of each row's
    position (jspec.models.llama.apply_rope): :func:`rotate_reference`'s formula, on the CPU (float32,
    kernels built) as a C++ op with each product rounded before the sum, the arithmetic of
    :func:`decoder_layer`'s own RoPE. XLA compiles the same elementwise formula with or without
    FMAs depending on the program around it, so the same row's K could differ by an ulp between a
    step with drafts and one without; with the op it cannot, and it matches the whole-layer call."""
    if x.dtype != jnp.float32 or cos.dtype != jnp.float32 or x.shape[-1] % 2 or not available():
        return rotate_reference(x, cos, sin)
    lead, (h, d) = x.shape[:-2], x.shape[-2:]
    cos, sin = jnp.broadcast_to(cos, (*lead, d)), jnp.broadcast_to(sin, (*lead, d))
    m = int(np.prod(lead, dtype=np.int64))
    return _rope(x.reshape(m, h, d), cos.reshape(m, d), sin.reshape(m, d)).reshape(x.shape)


def decoder_layer_reference(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain,
                            gate_up_w, down_w, eps: float):
    """:func:`decoder_layer` in plain ``jnp``: -> (out [M, H], k_pages, v_pages)."""
    b, w = block_tables.shape
    kvh, _, _, d = k_pages.shape
    t = x.shape[0] // b
    qkv = fused_small_rows_reference(x, qkv_w, _rows(qkv_w), scale=in_gain, eps=eps)
    q_cols = qkv.shape[-1] - 2 * kvh * d
    q, k, v = jnp.split(qkv.reshape(b, t, -1), [q_cols, q_cols + kvh * d], axis=-1)
    cos, sin = cos.reshape(b, t, d), sin.reshape(b, t, d)
    q = rotate_reference(q.reshape(b, t, -1, d), cos, sin)
    k_pages = write_kv(k_pages, rotate_reference(k.reshape(b, t, kvh, d), cos, sin), block_tables, start, q_lens)
    v_pages = write_kv(v_pages, v.reshape(b, t, kvh, d), block_tables, start, q_lens)
    out = layer_tail_reference(q, k_pages, v_pages, block_tables, start + q_lens, q_lens, x, o_w, gain, gate_up_w,
                               down_w, eps)
    return out, k_pages, v_pages


def decoder_layer_applies(q_shape, x, qkv_w, k_pages, o_w, gate_up_w, down_w) -> bool:
    """Whether :func:`decoder_layer` runs on the kernel: :func:`applies` for queries of
    ``q_shape`` [B, T, Hq, D], and the QKV weight packed without padding."""
    b, t, hq, d = q_shape
    q = jax.ShapeDtypeStruct(q_shape, x.dtype)
    n = (hq + 2 * k_pages.shape[0]) * d
    return (packed_dims(qkv_w) == (n, x.shape[-1]) and d % 2 == 0
            and applies(q, k_pages, x, o_w, gate_up_w, down_w))


def _layer_kernel(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain, gate_up_w,
                  down_w, *, eps):
    outs = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    return tuple(jax.ffi.ffi_call(LAYER_TARGET, outs, vmap_method="sequential", input_output_aliases={5: 1, 6: 2})(
        x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain, gate_up_w, down_w,
        eps=np.float32(eps)))


def check_decoder_layer_args(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain,
                             gate_up_w, down_w) -> tuple[int, int, int, int]:
    """Raises ValueError where :func:`decoder_layer`'s operands disagree; returns the queries'
    shape [B, T, Hq, D]."""
    b = block_tables.shape[0]
    if x.ndim != 2 or x.shape[0] % b:
        raise ValueError(f"decoder_layer: x must be [B * T, H] for B = {b}, got shape {x.shape}")
    kvh, _, _, d = k_pages.shape
    check_small_rows_args(x, qkv_w, _rows(qkv_w))
    q_cols = _rows(qkv_w) - 2 * kvh * d
    if q_cols <= 0 or q_cols % d:
        raise ValueError(f"decoder_layer: qkv_w's rows ({_rows(qkv_w)}) are not (Hq + 2 KVH) x {d}")
    t = x.shape[0] // b
    q_shape = (b, t, q_cols // d, d)
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (x.shape[0], d):
            raise ValueError(f"decoder_layer: {name} must be [{x.shape[0]}, {d}], got shape {a.shape}")
    if in_gain.shape != (x.shape[-1],):
        raise ValueError(f"decoder_layer: in_gain must be [{x.shape[-1]}], got shape {in_gain.shape}")
    check_layer_tail_args(jax.ShapeDtypeStruct(q_shape, x.dtype), k_pages, v_pages, block_tables, start + q_lens,
                          q_lens, x, o_w, gain, gate_up_w, down_w)
    return q_shape


def decoder_layer(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain, gate_up_w,
                  down_w, eps: float):
    """A Llama decoder layer for a few rows in one kernel call: ``x`` [B T, H] through RMSNorm
    (``in_gain``) and the packed QKV product ``qkv_w`` [(Hq + 2 KVH) D, H], RoPE on q and k with
    ``cos`` / ``sin`` [B T, D], k and v written into the pages (rows t < ``q_lens[b]`` at
    position ``start[b] + t``, as :func:`pallas_kernels.paged_verify_attention.write_kv`), then
    :func:`layer_tail`. Returns (out [B T, H], k_pages, v_pages); on the kernel the pages are
    written in place (donate them, or XLA copies them first). Where the kernel does not apply
    (:func:`decoder_layer_applies`), and for gradients, :func:`decoder_layer_reference`."""
    q_shape = check_decoder_layer_args(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens,
                                       o_w, gain, gate_up_w, down_w)
    args = (x, qkv_w, in_gain, cos, sin, k_pages, v_pages, block_tables, start, q_lens, o_w, gain, gate_up_w, down_w)
    if not decoder_layer_applies(q_shape, x, qkv_w, k_pages, o_w, gate_up_w, down_w):
        return decoder_layer_reference(*args, eps=eps)
    return _layer(*args, float(eps))


# block_tables, start, q_lens: no cotangents
_layer = _kernel_or_reference(_layer_kernel, decoder_layer_reference, 14, (7, 8, 9))


# ---------------------------------------------------------------------------- the layers of a step
def _each_layer(layer, x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages, eps: float):
    """The layers one after another, ``layer`` (:func:`decoder_layer` or its reference) a layer."""
    k_pages, v_pages = list(k_pages), list(v_pages)
    for i, (qkv_w, in_gain, o_w, gain, gate_up_w, down_w) in enumerate(layers):
        x, k_pages[i], v_pages[i] = layer(x, qkv_w, in_gain, cos, sin, k_pages[i], v_pages[i], block_tables, start,
                                          q_lens, o_w, gain, gate_up_w, down_w, eps)
    return x, tuple(k_pages), tuple(v_pages)


def decoder_stack_reference(x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages, eps: float):
    """:func:`decoder_stack` as :func:`decoder_layer_reference` once a layer."""
    return _each_layer(decoder_layer_reference, x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages,
                       eps)


def decoder_stack_applies(q_shape, x, layers, k_pages, v_pages) -> bool:
    """Whether :func:`decoder_stack` runs on the kernel: :func:`decoder_layer_applies` for every
    layer, all with the same shapes and page dtype."""
    if not layers or len(layers) != len(k_pages) or len(layers) != len(v_pages):
        return False
    first = (layers[0][0].shape, layers[0][0].dtype, k_pages[0].shape, k_pages[0].dtype)
    return all((qkv_w.shape, qkv_w.dtype, k.shape, k.dtype) == first and v.shape == k.shape and v.dtype == k.dtype
               and decoder_layer_applies(q_shape, x, qkv_w, k, o_w, gate_up_w, down_w)
               for (qkv_w, _, o_w, _, gate_up_w, down_w), k, v in zip(layers, k_pages, v_pages))


def _stack_kernel(x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages, *, eps):
    outs = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    flat = []
    for layer, k, v in zip(layers, k_pages, v_pages):
        flat += [*layer, k, v]
        outs += [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    aliases = {}
    for i in range(len(layers)):  # operand 6 + 8 i + 6 (k) and + 7 (v) -> results 1 + 2 i, 2 + 2 i
        aliases[12 + 8 * i], aliases[13 + 8 * i] = 1 + 2 * i, 2 + 2 * i
    out, *pages = jax.ffi.ffi_call(STACK_TARGET, outs, vmap_method="sequential", input_output_aliases=aliases)(
        x, cos, sin, block_tables, start, q_lens, *flat, eps=np.float32(eps))
    return out, tuple(pages[0::2]), tuple(pages[1::2])


def decoder_stack(x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages, eps: float):
    """The decoder layers of a step in one kernel call: ``x`` [B T, H] through the layers
    ``layers`` (per layer the operands of :func:`decoder_layer`: (qkv_w, in_gain, o_w, gain,
    gate_up_w, down_w)), layer i writing its k and v into ``k_pages[i]`` / ``v_pages[i]``, each as
    :func:`decoder_layer` computes it (the same bits). Returns (out [B T, H], k_pages, v_pages),
    the pages written in place on the kernel (donate them). A step of SmolLM2-135M made 30 layer
    calls, the pool's helper thread joining each; here it joins once. Where the kernel does not
    apply (:func:`decoder_stack_applies`), :func:`decoder_layer` once a layer; for gradients,
    :func:`decoder_stack_reference`."""
    layers = tuple(tuple(layer) for layer in layers)
    k_pages, v_pages = tuple(k_pages), tuple(v_pages)
    if not layers or len(layers) != len(k_pages) or len(layers) != len(v_pages):
        raise ValueError(f"decoder_stack: {len(layers)} layers, {len(k_pages)} K and {len(v_pages)} V page arrays")
    q_shapes = [check_decoder_layer_args(x, qkv_w, in_gain, cos, sin, k, v, block_tables, start, q_lens, o_w, gain,
                                         gate_up_w, down_w)
                for (qkv_w, in_gain, o_w, gain, gate_up_w, down_w), k, v in zip(layers, k_pages, v_pages)]
    args = (x, cos, sin, block_tables, start, q_lens, layers, k_pages, v_pages)
    if not decoder_stack_applies(q_shapes[0], x, layers, k_pages, v_pages):
        return _each_layer(decoder_layer, *args, eps)
    return _stack(*args, float(eps))


# block_tables, start, q_lens: no cotangents
_stack = _kernel_or_reference(_stack_kernel, decoder_stack_reference, 9, (3, 4, 5))
