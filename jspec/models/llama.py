"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Mistral) in Flax, on a paged KV cache.

RMSNorm, RoPE (with Llama-3 frequency scaling), grouped-query attention through the
verification-attention contract, SwiGLU MLP, tied or untied embeddings, optional QKV bias.
The Q/K/V projections are fused into one matmul and gate/up into another (fewer, larger
matmuls: decode on a CPU is bound by reading weights and by per-op overhead).

:func:`forward` is the pure function the rest of jspec jits:

    forward(params, config, tokens [B, T], cache, q_lens [B])
        -> logits [B, T, V] (or None), hidden [B, T, H] (after the final norm), new cache

``feature_layers`` (a tuple of layer indices) makes ``hidden`` the residual stream after those
decoder layers instead, concatenated [B, T, len * H]: the low/middle/high features an EAGLE-3
head fuses (:mod:`jspec.models.eagle`). The logits are the same either way.

Row t of sequence b sits at position ``cache.lengths[b] + t``; rows ``t < q_lens[b]`` have
their K/V written into the cache before attention, and the returned cache's lengths are
``cache.lengths + q_lens``. ``num_layers`` < config.num_layers runs only the first layers
(layer-skip self-speculation) and still applies the final norm and LM head.

:func:`forward_segments` generalizes it to several :class:`Segment` s at once (the serving
engine's mixed step: decode/verification rows of every sequence plus a prefill chunk of one):
one pass of every matmul over all rows, attention per segment.

Tensor parallelism (``config.tensor_parallel`` > 1; :mod:`jspec.models.tensor_parallel`, the
rules in :mod:`jspec.parallel`): the fused QKV and gate/up columns are grouped per device, the
matmuls are partitioned by GSPMD from the weights' shardings, and the KV writes and attention
run inside ``shard_map`` over the KV-head axis.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from jspec import attention as attention_lib
from jspec import parallel
from jspec.cache.paged import PAGE_AXES, PagedKVCache, write_kv
from jspec.config import ModelConfig
from pallas_kernels.cpu import build as cpu_kernels, layer_tail, small_rows


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float32, computed as Hugging Face does)."""
    d = config.head_dim
    inv = 1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    if config.rope_freq_factors is not None:  # llama.cpp stores Llama-3 scaling as divisors
        return (inv / np.asarray(config.rope_freq_factors, np.float32)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv.astype(np.float32)
    # Llama-3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype) -> tuple[jax.Array, jax.Array]:
    """cos and sin [..., D] of RoPE's angles at ``positions`` int32 [...]."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., D/2]
    return (jnp.concatenate([jnp.cos(angles)] * 2, axis=-1).astype(dtype),
            jnp.concatenate([jnp.sin(angles)] * 2, axis=-1).astype(dtype))


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray, tensor_parallel: int = 1,
               heads: str = "heads") -> jax.Array:
    """Rotate-half RoPE. x [B, T, H, D], positions int32 [B, T]. On the CPU the C++ op
    (``pallas_kernels.cpu.layer_tail.rotate``: the same bits in every compiled step, where XLA's
    elementwise formula compiled with FMAs in some steps and not in others). With
    ``tensor_parallel`` > 1 (x's ``heads`` axis sharded, ``"heads"`` or ``"kv_heads"``) each device
    rotates its own heads with the op inside ``shard_map``: XLA's partitioner cannot split a
    custom call, and the elementwise formula moved a sharded engine's prefill K/V by an ulp
    between steps with and without drafts."""
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    if tensor_parallel == 1:
        return layer_tail.rotate(x, cos, sin)
    on_heads, rep = parallel.spec(("batch", "length", heads, "head_dim")), parallel.spec(())
    return jax.shard_map(layer_tail.rotate, mesh=parallel.abstract_mesh(tensor_parallel),
                         in_specs=(on_heads, rep, rep), out_specs=on_heads, check_vma=False)(x, cos, sin)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., H]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return small_rows.rms_norm_reference(x, scale, self.eps)


class Segment(NamedTuple):
    """Query rows of one forward for a set of cache rows (sequences).

    A forward takes one or more segments and runs every matmul once over all their tokens
    (so a chunk of prefill rides along a decode or verification step), while each segment's
    attention is the verification-attention contract on its own ``[Bs, Ts]`` grid. A cache row
    may have ``q_lens > 0`` in at most one segment of a forward.
    """

    tokens: jax.Array  # int32 [Bs, Ts]
    q_lens: jax.Array  # int32 [Bs]: rows t < q_lens[b] are real; the rest are padding
    rows: Optional[jax.Array] = None  # int32 [Bs]: cache rows; None = 0 .. Bs-1 (every row).
    # A padding row (q_len 0) may name a row past the end: it is read clipped and never written.


class _Meta(NamedTuple):  # per segment, derived from the cache before the forward
    shape: tuple[int, int]  # (Bs, Ts)
    positions: jax.Array  # int32 [Bs, Ts]
    block_tables: jax.Array  # int32 [Bs, max_pages_per_seq]
    start: jax.Array  # int32 [Bs]: cache length before the forward
    q_lens: jax.Array  # int32 [Bs]


class DenseContext(NamedTuple):
    """Attention without pages, for training: a layer called with a DenseContext instead of
    segment metadata projects and rotates Q/K/V of rows [B, T] at ``positions`` as always, then
    ``attend(q [B, T, Hq, D], k [B, T, KVH, D], v) -> [B, T, Hq, D]`` decides what each query
    sees (any mask, keys of earlier passes included), and the layer returns (x, k, v) in place of
    the pages. The EAGLE head's training-time test runs its layer this way."""

    positions: jax.Array  # int32 [B, T]
    attend: Callable


def segment_meta(seg: Segment, cache: PagedKVCache) -> _Meta:
    bs, ts = seg.tokens.shape
    if seg.rows is None:
        tables, start = cache.block_tables, cache.lengths
    else:
        tables = jnp.take(cache.block_tables, seg.rows, axis=0, mode="clip")
        start = jnp.take(cache.lengths, seg.rows, mode="clip")
    positions = start[:, None] + jnp.arange(ts, dtype=jnp.int32)[None, :]
    return _Meta((bs, ts), positions, tables, start, seg.q_lens)


def _split(x: jax.Array, metas) -> list[jax.Array]:
    """Flat rows [M, ...] -> per segment [Bs, Ts, ...]."""
    out, at = [], 0
    for m in metas:
        n = m.shape[0] * m.shape[1]
        out.append(x[at:at + n].reshape(m.shape + x.shape[1:]))
        at += n
    return out


def _write_and_attend(cfg: ModelConfig, attention: str, metas, qs, ks, vs, k_pages, v_pages):
    """Every segment's K/V into the pages, then attention per segment (q/k/v per segment
    [Bs, Ts, heads, D], pages [KVH, P, S, D]); returns (outputs [Bs, Ts, Hq, D] per segment,
    k_pages, v_pages). Under tensor parallelism this runs per device inside ``shard_map`` on
    the device's heads and its slice of the pages: heads are independent, nothing is gathered."""
    attn = attention_lib.get(attention)
    tables = [m.block_tables for m in metas]
    starts = [m.start for m in metas]
    q_lens = [m.q_lens for m in metas]

    def run(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens):
        with jax.named_scope("kv_write"):  # every segment's K/V lands before any attention
            for k, v, bt, st, ql in zip(ks, vs, tables, starts, q_lens):
                k_pages = write_kv(k_pages, k, bt, st, ql)
                v_pages = write_kv(v_pages, v, bt, st, ql)
        with jax.named_scope("verify_attention"):
            outs = [attn(q, k_pages, v_pages, bt, st + ql, ql) for q, bt, st, ql in zip(qs, tables, starts, q_lens)]
        return outs, k_pages, v_pages

    if cfg.tensor_parallel == 1:
        return run(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens)
    n = len(metas)
    heads = parallel.spec(("batch", "length", "heads", "head_dim"))
    kv = parallel.spec(("batch", "length", "kv_heads", "head_dim"))
    pages = parallel.spec(PAGE_AXES)
    rep = parallel.spec(())
    sharded = jax.shard_map(run, mesh=parallel.abstract_mesh(cfg.tensor_parallel),
                            in_specs=([heads] * n, [kv] * n, [kv] * n, pages, pages, [rep] * n, [rep] * n, [rep] * n),
                            out_specs=([heads] * n, pages, pages), check_vma=False)
    return sharded(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens)


# Products of this many rows (a decoding step of a few slots, a verification step; not a prefill
# chunk or a large batch) run on the CPU small-row kernel (pallas_kernels.cpu.small_rows) when the
# parameters carry a packed copy ``weight`` of a projection (with_small_row_weights) and the
# kernel is built: it reads the weight once for any number of rows, where XLA's CPU dot re-packs
# it for 2 or more. Up to 16 rows the kernel measured faster than XLA's product (a k = 4 step's 5
# rows ~1.1x one row, 16 rows ~1.5-2x; XLA 1.3-1.9x); beyond, XLA's (measured 2026-12-02).
# Where the copy is a GGUF file's Q4_1 / Q8_0 blocks, up to 32: XLA's product then reads the
# float32 weights, 4.8x the bytes (a k = 4 step at 4 slots, 20 rows: 71.9 ms through XLA, 36.6 on
# the kernel; measured 2026-12-05).
KERNEL_ROWS = range(1, 17)
QUANTIZED_KERNEL_ROWS = range(1, 33)
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def small_rows_apply(dtype) -> bool:
    """Whether a product in ``dtype`` runs on the CPU small-row kernel (float32, the CPU backend,
    kernel built and tuned for this CPU: ``cpu_kernels.preferred``; a GPU machine never builds it)."""
    return jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu" and cpu_kernels.preferred("small_rows")


def _few_rows(x, dtype, weights=()) -> bool:
    """Whether ``x`` [..., in] has the rows for products by ``weights`` (their small-row forms; none:
    a float32 table read as it is) that the kernel runs: :data:`KERNEL_ROWS`, or
    :data:`QUANTIZED_KERNEL_ROWS` where all are in a quantized layout. Where all are in the int8 dot
    layout (``pallas_kernels.cpu.small_rows.pack_int8_dot``), any number of rows: those products (x
    rounded to 8 bits) have no float32 twin in XLA, and a row's result must not depend on how many
    rows its step has, or speculative output would part from plain decoding."""
    n = math.prod(x.shape[:-1])
    if weights and all(small_rows.int8_dot(w) for w in weights):
        return n >= 1 and small_rows_apply(dtype)
    quantized = bool(weights) and all(small_rows.quantized_type(w) is not None for w in weights)
    return n in (QUANTIZED_KERNEL_ROWS if quantized else KERNEL_ROWS) and small_rows_apply(dtype)


class Linear(nn.Module):
    """``nn.Dense`` with the same parameters (``kernel`` [in, out], optional ``bias``), which also
    reads a packed copy ``weight`` beside ``kernel`` for products of :data:`KERNEL_ROWS` rows on the
    CPU small-row kernel (see :func:`with_small_row_weights`)."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, norm: Optional[tuple[jax.Array, float]] = None, residual: Optional[jax.Array] = None):
        """``x @ kernel (+ bias)``; with ``norm`` = (gain, eps) ``x`` goes through RMSNorm first, with
        ``residual`` it is added to the result. On the small-row kernel both fold into its call."""
        x = x.astype(self.dtype)
        packed = self.get_variable("params", "weight") if self.has_variable("params", "weight") else None
        kernel_path = packed is not None and _few_rows(x, self.dtype, (packed,))
        if kernel_path and (norm is not None or residual is not None):
            y = small_rows.fused_small_rows(x, packed, self.features, scale=None if norm is None else norm[0],
                                            eps=0.0 if norm is None else norm[1], residual=residual)
            residual = None
        else:
            if norm is not None:
                x = small_rows.rms_norm_reference(x, norm[0], norm[1])
            if kernel_path:
                y = small_rows.small_rows_matmul(x, packed, self.features)
            else:
                kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
                y = jnp.dot(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
        return y if residual is None else y + residual


def times_rows(x: jax.Array, rows: jax.Array, quantized: Optional[jax.Array] = None) -> jax.Array:
    """``x`` [..., K] times ``rows`` [N, K] transposed -> float32 [..., N] (a tied LM head, a draft
    vocabulary's embedding rows): a few float32 rows go through the CPU small-row kernel, which
    reads ``rows`` as they are (no packed copy), or ``quantized``, the same rows in its quantized
    layout, where given; anything else through XLA's product."""
    if _few_rows(x, rows.dtype, () if quantized is None else (quantized,)):
        return small_rows.small_rows_matmul(x.astype(jnp.float32), rows if quantized is None else quantized,
                                            rows.shape[0])
    return jnp.einsum("...k,nk->...n", x, rows, preferred_element_type=jnp.float32)


def with_small_row_weights(params, names: tuple[str, ...] = PROJECTIONS, quantized=None, int8_dot: bool = False):
    """``params`` with a packed copy ``weight`` (``pallas_kernels.cpu.small_rows.pack_rows`` of the
    kernel's transpose) beside the ``kernel`` of every :class:`Linear` called one of ``names``
    (by default a decoder layer's projections), which it reads for products of a few rows on the
    CPU small-row kernel. The copy costs the projections' memory once more (425 MB for
    SmolLM2-135M in float32). Outputs equal the plain parameters' up to float rounding (another
    summation order).

    ``quantized`` (``LoadedModel.quantized``: a GGUF file's Q4_1 / Q8_0 projections in the kernel's
    quantized layout, keyed by their path in ``params``): those projections' ``weight`` is their
    quantized form instead (SmolLM2-135M's 66 MB of Q4_1 instead of 425 MB of floats), and
    ``("lm_head_rows",)`` becomes ``params["lm_head_rows"]``, which :meth:`LlamaForCausalLM.head`
    reads for a few rows in place of the float32 table. The kernel gives the same bits from either
    form of a weight (``pallas_kernels.cpu.small_rows``), reading a fifth of the bytes or less.

    ``int8_dot``: the quantized weights go in the integer dot-product layout instead
    (``pallas_kernels.cpu.small_rows.pack_int8_dot``, :func:`int8_dot_weights`): their products
    quantize x to 8 bits a block of 32 (llama.cpp's way), for any number of rows."""
    quantized = int8_dot_weights(quantized or {}) if int8_dot else (quantized or {})
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=True)
    for where, kernel in projection_kernels(params, names).items():
        w = quantized.get(where)
        flat[(*where, "weight")] = jnp.asarray(w) if w is not None else small_rows.pack_rows(jnp.asarray(kernel).T)
    if ("lm_head_rows",) in quantized:
        flat[("lm_head_rows",)] = jnp.asarray(quantized[("lm_head_rows",)])
    return traverse_util.unflatten_dict(flat)


def int8_dot_weights(quantized: dict) -> dict:
    """Quantized-layout weights (keyed as :func:`with_small_row_weights` takes them) in the int8
    dot-product layout: the LM head's rows, and every projection whose rows are a multiple of 16
    (the layout's unit; the decoder-layer kernels take unpadded weights). Others stay as they are."""
    def fits(k, w):
        return k == ("lm_head_rows",) or small_rows.packed_dims(w)[0] % small_rows.DOT_ROWS == 0

    return {k: small_rows.pack_int8_dot(w) if fits(k, w) else w for k, w in quantized.items()}


def projection_kernels(params, names: tuple[str, ...] = PROJECTIONS) -> dict[tuple[str, ...], jax.Array]:
    """The ``kernel`` [in, out] of every :class:`Linear` called one of ``names`` in a parameter
    tree (a model's, a drafter's), keyed by the Linear's path."""
    return {path[:-1]: leaf for path, leaf in traverse_util.flatten_dict(params).items()
            if len(path) >= 2 and path[-1] == "kernel" and path[-2] in names}


class Attention(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    @nn.compact
    def __call__(self, x, metas, k_pages, v_pages, norm=None, residual=None, mlp=None):  # x: [M, H] rows of every segment
        """``norm`` (gain, eps): RMSNorm before the QKV projection; ``residual``: added to the output
        projection's result (both folded into the projections, see DecoderLayer). ``mlp`` (the
        post-attention norm's gain, eps, and the MLP's packed gate/up and down weights): where
        :func:`_tail_fuses`, the layer's attention, output projection and MLP run as one kernel call
        (pallas_kernels.cpu.layer_tail) after the K/V write. With ``mlp`` the result is (out, k_pages,
        v_pages, whether the MLP ran)."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        tp = cfg.tensor_parallel
        # columns grouped per device: [tp, (Hq/tp + 2 KVH/tp) D] (tp = 1: [Q | K | V])
        qkv = Linear(cfg.q_size + 2 * cfg.kv_size, use_bias=cfg.qkv_bias, dtype=dtype,
                     name="qkv_proj")(x, norm=norm)  # [M, (Hq + 2 KVH) D]
        inv_freq = rope_inv_freq(cfg)
        q_cols, kv_cols = cfg.q_size // tp, cfg.kv_size // tp

        def qkv_of(part, shape, positions):  # [..., columns] -> rotated q, k and v [*shape, heads, D]
            part = part.reshape(*shape, tp, q_cols + 2 * kv_cols)
            q, k, v = jnp.split(part, [q_cols, q_cols + kv_cols], axis=-1)
            return (apply_rope(q.reshape(*shape, cfg.num_heads, cfg.head_dim), positions, inv_freq, tp),
                    apply_rope(k.reshape(*shape, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq, tp, "kv_heads"),
                    v.reshape(*shape, cfg.num_kv_heads, cfg.head_dim))

        if isinstance(metas, DenseContext):  # training: no pages, the context's own mask
            q, k, v = qkv_of(qkv, metas.positions.shape, metas.positions)
            o = metas.attend(q, k, v).reshape(-1, cfg.q_size)
            out = Linear(cfg.hidden_size, dtype=dtype, name="o_proj")(o, residual=residual)
            return (out, k, v) if mlp is None else (out, k, v, False)
        qs, ks, vs = zip(*[qkv_of(part, m.shape, m.positions) for m, part in zip(metas, _split(qkv, metas))])
        if mlp is not None:
            o_w = self.variables["params"]["o_proj"].get("weight")
            if self._tail_fuses(metas, qs[0], k_pages, residual, o_w, mlp):
                (m,), (k,), (v,) = metas, ks, vs
                gain, eps, gate_up_w, down_w = mlp
                with jax.named_scope("kv_write"):
                    k_pages = write_kv(k_pages, k, m.block_tables, m.start, m.q_lens)
                    v_pages = write_kv(v_pages, v, m.block_tables, m.start, m.q_lens)
                with jax.named_scope("layer_tail"):
                    out = layer_tail.layer_tail(qs[0], k_pages, v_pages, m.block_tables, m.start + m.q_lens, m.q_lens,
                                                residual, o_w, gain, gate_up_w, down_w, eps)
                return out, k_pages, v_pages, True
        outs, k_pages, v_pages = _write_and_attend(cfg, self.attention, metas, list(qs), list(ks), list(vs),
                                                   k_pages, v_pages)
        outs = [o.reshape(-1, cfg.q_size) for o in outs]
        o = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        out = Linear(cfg.hidden_size, dtype=dtype, name="o_proj")(o, residual=residual)
        return (out, k_pages, v_pages) if mlp is None else (out, k_pages, v_pages, False)

    def _tail_fuses(self, metas, q, k_pages, residual, o_w, mlp) -> bool:
        """Whether the layer after the K/V write runs as one kernel call: :meth:`_one_call` and the
        packed weights fitting the kernel (pallas_kernels.cpu.layer_tail.applies)."""
        return self._one_call(metas, residual, o_w) and layer_tail.applies(q, k_pages, residual, o_w, mlp[2], mlp[3])

    def _one_call(self, metas, residual, o_w) -> bool:
        """What pallas_kernels.cpu.layer_tail's call needs of the step (:func:`_one_kernel_step`), a
        residual and the packed o_proj."""
        return _one_kernel_step(self.config, self.attention, metas) and residual is not None and o_w is not None


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, norm=None, residual=None):  # as Attention's
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        gate_up = Linear(2 * cfg.intermediate_size, dtype=dtype, name="gate_up_proj")(x, norm=norm)  # [M, 2 I]
        # columns grouped per device: [tp, 2, I/tp] (tp = 1: [gate | up])
        gate_up = gate_up.reshape(*x.shape[:-1], cfg.tensor_parallel, 2, -1)
        gate = gate_up[..., 0, :].reshape(*x.shape[:-1], cfg.intermediate_size)
        up = gate_up[..., 1, :].reshape(*x.shape[:-1], cfg.intermediate_size)
        return Linear(cfg.hidden_size, dtype=dtype, name="down_proj")(nn.silu(gate) * up, residual=residual)


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    @nn.compact
    def __call__(self, x, metas, k_pages, v_pages):  # x: [M, H]; metas: per-segment metadata, or a DenseContext
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        if self._folds(x):  # the norms and residual adds inside the projections' kernel calls
            p, eps = self.variables["params"], cfg.rms_norm_eps
            whole = _whole_layer_operands(cfg, self.attention, metas, x, p, k_pages)
            if whole is not None:
                (m,) = metas
                cos, sin = rope_cos_sin(m.positions.reshape(-1), rope_inv_freq(cfg), x.dtype)
                qkv_w, in_gain, o_w, gain, gate_up_w, down_w = whole
                with jax.named_scope("decoder_layer"):
                    return layer_tail.decoder_layer(x, qkv_w, in_gain, cos, sin, k_pages, v_pages, m.block_tables,
                                                    m.start, m.q_lens, o_w, gain, gate_up_w, down_w, eps)
            post = (p["post_attention_layernorm"]["scale"], eps)
            mlp = (*post, p["mlp"]["gate_up_proj"]["weight"], p["mlp"]["down_proj"]["weight"])
            x, k_pages, v_pages, mlp_ran = Attention(cfg, self.attention, name="self_attn")(
                x, metas, k_pages, v_pages, norm=(p["input_layernorm"]["scale"], eps), residual=x, mlp=mlp)
            if not mlp_ran:
                x = MLP(cfg, name="mlp")(x, norm=post, residual=x)
            return x, k_pages, v_pages
        h, k_pages, v_pages = Attention(cfg, self.attention, name="self_attn")(
            RMSNorm(cfg.rms_norm_eps, dtype, name="input_layernorm")(x), metas, k_pages, v_pages)
        x = x + h
        x = x + MLP(cfg, name="mlp")(RMSNorm(cfg.rms_norm_eps, dtype, name="post_attention_layernorm")(x))
        return x, k_pages, v_pages

    def _folds(self, x) -> bool:
        """Whether this step folds the layer's norms and residual adds into the small-row kernel's
        calls (pallas_kernels.cpu.small_rows.fused_small_rows): a few rows on the CPU kernel, the
        projections' packed weights present, one device. Same values up to float rounding."""
        if self.is_initializing() or self.config.tensor_parallel != 1:
            return False
        weights = _packed_projections(self.variables.get("params", {}))
        return weights is not None and _few_rows(x, self.config.dtype, weights)


def _packed_projections(p) -> Optional[list]:
    """A decoder layer's packed (small-row) qkv, o, gate/up and down weights from its parameters
    ``p``, or None where one is missing."""
    names = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))
    weights = [p.get(a, {}).get(b, {}).get("weight") for a, b in names]
    return None if any(w is None for w in weights) else weights


def _one_kernel_step(cfg: ModelConfig, attention: str, metas) -> bool:
    """Whether a step's rows can go through pallas_kernels.cpu.layer_tail's calls: one segment of
    rows the cpu attention's kernel takes, on one device."""
    return (not isinstance(metas, DenseContext) and len(metas) == 1 and attention == "cpu"
            and cfg.tensor_parallel == 1 and metas[0].shape[1] <= attention_lib.CPU_KERNEL_MAX_ROWS)


def _whole_layer_operands(cfg: ModelConfig, attention: str, metas, x, p, k_pages) -> Optional[tuple]:
    """(qkv_w, in_gain, o_w, gain, gate_up_w, down_w) of the decoder layer with parameters ``p``
    where it runs as one kernel call (pallas_kernels.cpu.layer_tail.decoder_layer) on ``x``: a step
    :func:`_one_kernel_step` takes, no QKV bias, the packed projections present for these rows
    (:func:`_few_rows`) and fitting the kernel (layer_tail.decoder_layer_applies); else None."""
    if not _one_kernel_step(cfg, attention, metas) or cfg.qkv_bias:
        return None
    weights = _packed_projections(p)
    if weights is None or not _few_rows(x, cfg.dtype, weights):
        return None
    qkv_w, o_w, gate_up_w, down_w = weights
    q_shape = (*metas[0].shape, cfg.num_heads, cfg.head_dim)
    if not layer_tail.decoder_layer_applies(q_shape, x, qkv_w, k_pages, o_w, gate_up_w, down_w):
        return None
    return qkv_w, p["input_layernorm"]["scale"], o_w, p["post_attention_layernorm"]["scale"], gate_up_w, down_w


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    attention: str = "reference"

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                     embedding_init=nn.initializers.normal(0.02))
        self.layers = [DecoderLayer(cfg, self.attention) for _ in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def embed(self, tokens):  # int32 [...] -> [..., H]
        return self.embed_tokens(tokens)

    def head(self, hidden):  # [..., H] (after the final norm) -> float32 logits [..., V]
        rows = self.variables.get("params", {}).get("lm_head_rows")  # quantized (with_small_row_weights)
        if self.config.tie_word_embeddings:
            # the tied table is already rows [V, H]: a few rows go through the CPU kernel, no copy
            if _few_rows(hidden, self.config.dtype, () if rows is None else (rows,)):
                logits = times_rows(hidden, self.embed_tokens.embedding, rows)
            else:
                logits = self.embed_tokens.attend(hidden)
        elif rows is not None and _few_rows(hidden, self.config.dtype, (rows,)):
            logits = small_rows.small_rows_matmul(hidden.astype(jnp.float32), rows, self.config.vocab_size)
        else:
            logits = self.lm_head(hidden)
        return logits.astype(jnp.float32)

    def _stack(self, x, metas, k_pages, n: int) -> Optional[list]:
        """The operands of the first ``n`` layers for pallas_kernels.cpu.layer_tail.decoder_stack, where
        each of them would run as one decoder_layer call (:func:`_whole_layer_operands`); else None."""
        if n == 0 or self.is_initializing():
            return None
        params = self.variables["params"]
        layers = [_whole_layer_operands(self.config, self.attention, metas, x, params[f"layers_{i}"], k_pages[i])
                  for i in range(n)]
        return None if any(layer is None for layer in layers) else layers

    def __call__(self, segments: tuple[Segment, ...], cache: PagedKVCache, num_layers: Optional[int] = None,
                 logits_for: tuple[bool, ...] = (True,), feature_layers: tuple[int, ...] = ()):
        n = self.config.num_layers if num_layers is None else num_layers
        metas = [segment_meta(s, cache) for s in segments]
        x = jnp.concatenate([self.embed(s.tokens).reshape(-1, self.config.hidden_size) for s in segments], 0) \
            if len(segments) > 1 else self.embed(segments[0].tokens).reshape(-1, self.config.hidden_size)
        k_all, v_all = list(cache.k_pages), list(cache.v_pages)
        taken = {}
        stack = None if feature_layers else self._stack(x, metas, k_all[:n], n)
        if stack is not None:
            (m,) = metas
            cos, sin = rope_cos_sin(m.positions.reshape(-1), rope_inv_freq(self.config), x.dtype)
            with jax.named_scope("decoder_stack"):
                x, k_all[:n], v_all[:n] = layer_tail.decoder_stack(x, cos, sin, m.block_tables, m.start, m.q_lens,
                                                                   stack, k_all[:n], v_all[:n],
                                                                   self.config.rms_norm_eps)
        for i in range(0 if stack is None else n, n):
            with jax.named_scope(f"layer_{i}"):
                x, k_all[i], v_all[i] = self.layers[i](x, metas, k_all[i], v_all[i])
            if i in feature_layers:
                taken[i] = x
        hidden = _split(self.norm(x), metas)
        logits = [self.head(h) if want else None for h, want in zip(hidden, logits_for)]
        if feature_layers:  # [M, len * H] in the order asked for
            hidden = _split(jnp.concatenate([taken[i] for i in feature_layers], axis=-1), metas)
        lengths = cache.lengths
        for s, m in zip(segments, metas):
            lengths = lengths + m.q_lens if s.rows is None else lengths.at[s.rows].add(m.q_lens, mode="drop")
        cache = cache.replace(k_pages=tuple(k_all), v_pages=tuple(v_all), lengths=lengths)
        return logits, hidden, cache


class ForwardOutput(NamedTuple):
    logits: Optional[jax.Array]  # float32 [B, T, V]
    hidden: jax.Array  # [B, T, H], after the final norm (or [B, T, len * H]: the feature layers)
    cache: PagedKVCache


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig, attention: str) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, attention_lib.resolve(attention))


def forward(params, config: ModelConfig, tokens, cache: PagedKVCache, q_lens, *,
            attention: str = "auto", num_layers: Optional[int] = None,
            compute_logits: bool = True, feature_layers: tuple[int, ...] = ()) -> ForwardOutput:
    """Run the model over ``tokens`` [B, T] on top of ``cache`` (every row; pure, jit it)."""
    logits, hidden, cache = forward_segments(params, config, (Segment(tokens, q_lens),), cache,
                                             attention=attention, num_layers=num_layers,
                                             logits_for=(compute_logits,), feature_layers=feature_layers)
    return ForwardOutput(logits[0], hidden[0], cache)


def forward_segments(params, config: ModelConfig, segments: tuple[Segment, ...], cache: PagedKVCache, *,
                     attention: str = "auto", num_layers: Optional[int] = None,
                     logits_for: Optional[tuple[bool, ...]] = None, feature_layers: tuple[int, ...] = ()):
    """Run the model over several segments at once (see :class:`Segment`); returns (logits per
    segment, float32 [Bs, Ts, V] or None where ``logits_for`` is False; per segment the final
    hidden states [Bs, Ts, H], or with ``feature_layers`` the residual stream after those layers
    [Bs, Ts, len * H]; the new cache)."""
    logits_for = tuple(logits_for) if logits_for is not None else (True,) * len(segments)
    feature_layers = tuple(feature_layers)
    n = config.num_layers if num_layers is None else num_layers
    if any(not 0 <= i < n for i in feature_layers) or len(set(feature_layers)) != len(feature_layers):
        raise ValueError(f"feature_layers {feature_layers} must be distinct layers of the {n} that run")
    with jax.named_scope("model_forward"):
        return _module(config, attention).apply({"params": params}, tuple(segments), cache, num_layers, logits_for,
                                                feature_layers)


def output_embedding(params, config: ModelConfig) -> jax.Array:
    """The LM head as rows [V, H]: logits = hidden @ rows.T (the tied embedding, or lm_head)."""
    if config.tie_word_embeddings:
        return params["embed_tokens"]["embedding"]
    return params["lm_head"]["kernel"].T


def embed(params, config: ModelConfig, tokens) -> jax.Array:
    return _module(config, "reference").apply({"params": params}, tokens, method="embed")


def lm_head(params, config: ModelConfig, hidden) -> jax.Array:
    return _module(config, "reference").apply({"params": params}, hidden, method="head")


def init_params(config: ModelConfig, key: jax.Array):
    """Random parameters (tiny test models, drafts trained from scratch)."""
    from jspec.cache.paged import init_cache

    tables = jnp.zeros((1, 1), jnp.int32)
    cache = init_cache(config.num_layers, config.num_kv_heads, config.head_dim, tables, 1, 16,
                       jnp.dtype(config.dtype))
    seg = Segment(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    return _module(config, "reference").init(key, (seg,), cache)["params"]
