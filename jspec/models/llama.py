"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3, Mistral) in Flax, on a paged KV cache.

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

The modules here are the plain model, the same on every backend. Each creates its submodules
through a class attribute (``linear_cls``, ``attention_cls``, ``mlp_cls``, ``layer_cls``), so
that :mod:`jspec.models.cpu_path` can subclass them to run steps of a few rows on the CPU
kernels with the same parameter tree; ``module_cls`` of :func:`forward` picks the top module
(the engine picks once, through :mod:`jspec.models.path`).

Tensor parallelism (``config.tensor_parallel`` > 1; :mod:`jspec.models.tensor_parallel`, the
rules in :mod:`jspec.parallel`): the fused QKV and gate/up columns are grouped per device, the
matmuls are partitioned by GSPMD from the weights' shardings, and the KV writes and attention
run inside ``shard_map`` over the KV-head axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jspec import attention as attention_lib
from jspec import parallel
from jspec.cache.paged import PAGE_AXES, PagedKVCache, init_cache, write_kv
from jspec.config import ModelConfig


def rope_inv_freq(config: ModelConfig, layer: Optional[int] = None) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (float32, computed as Hugging Face does) of layer ``layer``
    (None: a full-attention layer). Gemma 3's sliding layers take ``local_rope_theta``; its full
    ones divide by ``rope_linear_factor``."""
    d = config.head_dim
    sliding = layer is not None and config.layer_type(layer) == "sliding"
    theta = config.local_rope_theta if sliding and config.local_rope_theta else config.rope_theta
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    if config.rope_linear_factor is not None and not sliding:
        inv = inv / np.float32(config.rope_linear_factor)
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
    """Rotate-half RoPE. x [B, T, H, D], positions int32 [B, T]; the rotation is
    :func:`jspec.attention.rotate` (on the CPU an op with the same bits in every compiled step).
    With ``tensor_parallel`` > 1 (x's ``heads`` axis sharded, ``"heads"`` or ``"kv_heads"``) each
    device rotates its own heads inside ``shard_map``: XLA's partitioner cannot split the CPU's
    custom call, and the elementwise formula moved a sharded engine's prefill K/V by an ulp
    between steps with and without drafts."""
    cos, sin = rope_cos_sin(positions, inv_freq, x.dtype)
    if tensor_parallel == 1:
        return attention_lib.rotate(x, cos, sin)
    on_heads, rep = parallel.spec(("batch", "length", heads, "head_dim")), parallel.spec(())
    return jax.shard_map(attention_lib.rotate, mesh=parallel.abstract_mesh(tensor_parallel),
                         in_specs=(on_heads, rep, rep), out_specs=on_heads, check_vma=False)(x, cos, sin)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm ``scale * x / sqrt(mean(x^2) + eps)`` over the last axis, float32 inside.
    The CPU kernels' reference (``pallas_kernels.cpu.small_rows.rms_norm_reference``) is this
    formula bit for bit (tests/test_small_row_weights.py pins it)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return scale * xf.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., H]
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        return rms_norm(x, scale, self.eps)


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
    packed: Optional[jax.Array] = None  # int32 [N]: the segment's tokens packed, N < Bs * Ts
    # (None: every grid position is a row of the forward). Row i of the segment's N rows in the
    # forward is grid position packed[i] = b * Ts + t (t < q_lens[b]); Bs * Ts marks a padding row.
    # The products then run over N rows, not the padded grid: many short prompts of different
    # lengths fill one step (vLLM's packed prefill) while attention keeps its [Bs, Ts] grid.
    tree: Optional["TreeRows"] = None  # a token tree's verification (None: rows in a chain)


class TreeRows(NamedTuple):
    """The rows of a token tree's verification (``jspec.speculative.tree``): row t sits at
    position ``start + offsets[b, t]`` (the root 0, a node its depth) and attends through the
    contract's ``tree_mask`` (its ancestors among the segment's rows); its K/V are written at
    ``start + t`` as any row's."""

    offsets: jax.Array  # int32 [Bs, Ts]
    mask: jax.Array  # int32 [Bs, Ts]: the attention contract's tree_mask


def pack_index(q_lens, width: int, tokens: int):
    """The ``packed`` index (numpy, int32 [tokens]) of a segment whose row b holds ``q_lens[b]``
    real tokens of a grid ``width`` wide: the real grid positions in order, then padding."""
    packed = np.full((tokens,), len(q_lens) * width, np.int32)
    at = 0
    for b, n in enumerate(q_lens):
        packed[at:at + n] = b * width + np.arange(n, dtype=np.int32)
        at += n
    return packed


class _Meta(NamedTuple):  # per segment, derived from the cache before the forward
    shape: tuple[int, int]  # (Bs, Ts)
    positions: jax.Array  # int32 [Bs, Ts]
    block_tables: jax.Array  # int32 [Bs, max_pages_per_seq]
    start: jax.Array  # int32 [Bs]: cache length before the forward
    q_lens: jax.Array  # int32 [Bs]
    packed: Optional[jax.Array] = None  # int32 [N]: the segment's packed rows (Segment.packed)
    unpack: Optional[jax.Array] = None  # int32 [Bs * Ts]: the packed row of each grid position
    tree_mask: Optional[jax.Array] = None  # int32 [Bs, Ts]: a tree's ancestor bits (Segment.tree)

    @property
    def num_rows(self) -> int:
        """The segment's rows in the forward: N when packed, else Bs * Ts."""
        return self.shape[0] * self.shape[1] if self.packed is None else self.packed.shape[0]

    def to_rows(self, grid: jax.Array) -> jax.Array:
        """Grid values [Bs, Ts, ...] -> the segment's rows [num_rows, ...] (padding rows 0)."""
        flat = grid.reshape(-1, *grid.shape[2:])
        return flat if self.packed is None else jnp.take(flat, self.packed, axis=0, mode="fill", fill_value=0)

    def to_grid(self, rows: jax.Array) -> jax.Array:
        """The segment's rows [num_rows, ...] -> grid values [Bs, Ts, ...] (grid padding: any row)."""
        if self.unpack is not None:
            rows = jnp.take(rows, self.unpack, axis=0)
        return rows.reshape(self.shape + rows.shape[1:])


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
    offsets = jnp.arange(ts, dtype=jnp.int32)[None, :] if seg.tree is None else seg.tree.offsets
    positions = start[:, None] + offsets
    unpack = None
    if seg.packed is not None:
        n = seg.packed.shape[0]
        unpack = jnp.zeros((bs * ts,), jnp.int32).at[seg.packed].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    return _Meta((bs, ts), positions, tables, start, seg.q_lens, seg.packed, unpack,
                 None if seg.tree is None else seg.tree.mask)


def _split(x: jax.Array, metas) -> list[jax.Array]:
    """Flat rows [M, ...] -> per segment [Bs, Ts, ...]."""
    out, at = [], 0
    for m in metas:
        out.append(m.to_grid(x[at:at + m.num_rows]))
        at += m.num_rows
    return out


def qkv_heads(cfg: ModelConfig, qkv: jax.Array, shape: tuple[int, ...], positions: jax.Array, qk_norms=None,
              inv_freq: Optional[np.ndarray] = None):
    """The fused QKV product's columns [..., (Hq + 2 KVH) D] (grouped per device: [tp, (Hq/tp +
    2 KVH/tp) D]) -> q, k rotated to ``positions`` [*shape] and v, each [*shape, heads, D].
    ``qk_norms``: (q norm, k norm) applied to each head before the rotation (Qwen3, Gemma 3), or
    None; ``inv_freq``: the layer's RoPE frequencies (default: the model's)."""
    tp = cfg.tensor_parallel
    inv_freq = rope_inv_freq(cfg) if inv_freq is None else inv_freq
    q_cols, kv_cols = cfg.q_size // tp, cfg.kv_size // tp
    part = qkv.reshape(*shape, tp, q_cols + 2 * kv_cols)
    q, k, v = jnp.split(part, [q_cols, q_cols + kv_cols], axis=-1)
    q, k = q.reshape(*shape, cfg.num_heads, cfg.head_dim), k.reshape(*shape, cfg.num_kv_heads, cfg.head_dim)
    if qk_norms is not None:
        q, k = qk_norms[0](q), qk_norms[1](k)
    return (apply_rope(q, positions, inv_freq, tp), apply_rope(k, positions, inv_freq, tp, "kv_heads"),
            v.reshape(*shape, cfg.num_kv_heads, cfg.head_dim))


def segment_qkv(cfg: ModelConfig, qkv: jax.Array, metas, qk_norms=None,
                inv_freq: Optional[np.ndarray] = None) -> tuple[tuple, tuple, tuple]:
    """The QKV product of every segment's rows [M, (Hq + 2 KVH) D] -> (qs, ks, vs), per segment
    [Bs, Ts, heads, D], q and k rotated to the segment's positions (``qk_norms``, ``inv_freq``:
    as qkv_heads)."""
    return tuple(zip(*[qkv_heads(cfg, part, m.shape, m.positions, qk_norms, inv_freq)
                       for m, part in zip(metas, _split(qkv, metas))]))


def write_and_attend(cfg: ModelConfig, attention: str, metas, qs, ks, vs, k_pages, v_pages, **options):
    """Every segment's K/V into the pages, then attention per segment (q/k/v per segment
    [Bs, Ts, heads, D], pages [KVH, P, S, D]); returns (the outputs of every segment's rows
    [M, Hq D], k_pages, v_pages). Under tensor parallelism the writes and attention run per
    device inside ``shard_map`` on the device's heads and its slice of the pages: heads are
    independent, nothing is gathered. ``options``: the attention contract's layer options that
    are set (``sliding_window``, ``sm_scale``, ``soft_cap``)."""
    attn = attention_lib.get(attention)
    qs, ks, vs = list(qs), list(ks), list(vs)
    tables = [m.block_tables for m in metas]
    starts = [m.start for m in metas]
    q_lens = [m.q_lens for m in metas]
    masks = [m.tree_mask for m in metas]

    def run(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens, masks):
        with jax.named_scope("kv_write"):  # every segment's K/V lands before any attention
            for k, v, bt, st, ql in zip(ks, vs, tables, starts, q_lens):
                k_pages = write_kv(k_pages, k, bt, st, ql)
                v_pages = write_kv(v_pages, v, bt, st, ql)
        with jax.named_scope("verify_attention"):
            outs = [attn(q, k_pages, v_pages, bt, st + ql, ql, **options, **({} if tm is None else {"tree_mask": tm}))
                    for q, bt, st, ql, tm in zip(qs, tables, starts, q_lens, masks)]
        return outs, k_pages, v_pages

    if cfg.tensor_parallel == 1:
        outs, k_pages, v_pages = run(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens, masks)
    else:
        n = len(metas)
        heads = parallel.spec(("batch", "length", "heads", "head_dim"))
        kv = parallel.spec(("batch", "length", "kv_heads", "head_dim"))
        pages = parallel.spec(PAGE_AXES)
        rep = parallel.spec(())
        sharded = jax.shard_map(run, mesh=parallel.abstract_mesh(cfg.tensor_parallel),
                                in_specs=([heads] * n, [kv] * n, [kv] * n, pages, pages, [rep] * n, [rep] * n,
                                          [rep] * n, [None if tm is None else rep for tm in masks]),
                                out_specs=([heads] * n, pages, pages), check_vma=False)
        outs, k_pages, v_pages = sharded(qs, ks, vs, k_pages, v_pages, tables, starts, q_lens, masks)
    outs = [m.to_rows(o.reshape(*m.shape, cfg.q_size)) for m, o in zip(metas, outs)]
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)), k_pages, v_pages


class Linear(nn.Module):
    """``nn.Dense`` without its options: ``x @ kernel (+ bias)``, parameters ``kernel`` [in, out]
    and optional ``bias`` [out], as ``nn.Dense`` names and initializes them."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):  # [..., in] -> [..., out]
        x = x.astype(self.dtype)
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), self.dtype)
        y = jnp.dot(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
        return y


class Attention(nn.Module):
    config: ModelConfig
    attention: str = "reference"
    linear_cls = Linear  # the projections' module
    norm_cls = RMSNorm  # the q/k norms' module (Qwen3; Gemma 3 its own)

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        # columns grouped per device: [tp, (Hq/tp + 2 KVH/tp) D] (tp = 1: [Q | K | V])
        self.qkv_proj = self.linear_cls(cfg.q_size + 2 * cfg.kv_size, use_bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = self.linear_cls(cfg.hidden_size, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = self.norm_cls(cfg.rms_norm_eps, dtype)
            self.k_norm = self.norm_cls(cfg.rms_norm_eps, dtype)

    @property
    def qk_norms(self):
        """(q norm, k norm) of a Qwen3 layer, else None."""
        return (self.q_norm, self.k_norm) if self.config.qk_norm else None

    def __call__(self, x, metas, k_pages, v_pages):
        """x [M, H]: the rows of every segment (``metas``), or of a :class:`DenseContext`.
        Returns (out [M, H], k_pages, v_pages), with a DenseContext (out, k, v)."""
        cfg = self.config
        qkv = self.qkv_proj(x)  # [M, (Hq + 2 KVH) D]
        if isinstance(metas, DenseContext):  # training: no pages, the context's own mask
            q, k, v = qkv_heads(cfg, qkv, metas.positions.shape, metas.positions, self.qk_norms)
            return self.o_proj(metas.attend(q, k, v).reshape(-1, cfg.q_size)), k, v
        qs, ks, vs = segment_qkv(cfg, qkv, metas, self.qk_norms)
        o, k_pages, v_pages = write_and_attend(cfg, self.attention, metas, qs, ks, vs, k_pages, v_pages)
        return self.o_proj(o), k_pages, v_pages


def swiglu(cfg: ModelConfig, gate_up: jax.Array) -> jax.Array:
    """act(gate) * up [..., I] from the gate/up product [..., 2 I], whose columns are grouped per
    device: [tp, 2, I/tp] (tp = 1: [gate | up]); act is silu, or for Gemma the tanh
    approximation of gelu (GeGLU)."""
    lead = gate_up.shape[:-1]
    gate_up = gate_up.reshape(*lead, cfg.tensor_parallel, 2, -1)
    gate = gate_up[..., 0, :].reshape(*lead, cfg.intermediate_size)
    up = gate_up[..., 1, :].reshape(*lead, cfg.intermediate_size)
    if cfg.hidden_act == "gelu_tanh":
        return nn.gelu(gate, approximate=True) * up
    return nn.silu(gate) * up


class MLP(nn.Module):
    config: ModelConfig
    linear_cls = Linear

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.gate_up_proj = self.linear_cls(2 * cfg.intermediate_size, dtype=dtype)
        self.down_proj = self.linear_cls(cfg.hidden_size, dtype=dtype)

    def __call__(self, x):  # [M, H] -> [M, H]
        return self.down_proj(swiglu(self.config, self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    config: ModelConfig
    attention: str = "reference"
    attention_cls = Attention
    mlp_cls = MLP

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.input_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.self_attn = self.attention_cls(cfg, self.attention)
        self.post_attention_layernorm = RMSNorm(cfg.rms_norm_eps, dtype)
        self.mlp = self.mlp_cls(cfg)

    def __call__(self, x, metas, k_pages, v_pages):  # x: [M, H]; metas: per-segment metadata, or a DenseContext
        h, k_pages, v_pages = self.self_attn(self.input_layernorm(x), metas, k_pages, v_pages)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_pages, v_pages


# Decoder layers of one kind are traced once per program, not once per layer (call_layer):
# tracing and lowering 30 layers one by one was most of a warm start's compile time. Off: every
# layer traced inline (the tests compare the two).
TRACE_LAYERS_ONCE = True


def call_layer(layer: nn.Module, params, *args):
    """``layer(*args)`` with parameters ``params``, as a nested ``jax.jit`` keyed by the layer's
    class and fields and the non-array parts of ``args`` (a segment's shape, which options are
    None): the layers of a model share one trace and one lowered function that each layer calls.
    The results are the inline trace's bits (tests/test_layer_trace.py) and a step runs as fast
    (BENCHMARKS.md, start-up). The arrays of ``args`` (and the parameters) are the jitted
    function's operands; a layer's ``trace_fields`` / ``trace_context`` adjust the key."""
    fields = tuple((f.name, getattr(layer, f.name)) for f in dataclasses.fields(layer)
                   if f.name not in ("parent", "name"))
    if hasattr(layer, "trace_fields"):  # a layer whose fields differ where its program does not
        fields = layer.trace_fields(fields)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    is_array = tuple(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)
    static = tuple(leaf for leaf, a in zip(leaves, is_array) if not a)
    context = layer.trace_context() if hasattr(layer, "trace_context") else None
    program = _layer_program(type(layer), fields, treedef, is_array, static, context)
    return program(params, *[leaf for leaf, a in zip(leaves, is_array) if a])


@functools.lru_cache(maxsize=None)
def _layer_program(cls: type, fields: tuple, treedef, is_array: tuple, static: tuple, context):
    del context  # a key only: what else the layer's trace depends on (its trace_context())

    def layer(params, *arrays):
        given, fixed = iter(arrays), iter(static)
        args = jax.tree_util.tree_unflatten(treedef, [next(given) if a else next(fixed) for a in is_array])
        return cls(**dict(fields), parent=None).apply({"params": params}, *args)

    return jax.jit(layer)


class LlamaForCausalLM(nn.Module):
    config: ModelConfig
    attention: str = "reference"
    layer_cls = DecoderLayer

    def setup(self):
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        self.embed_tokens = nn.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype,
                                     embedding_init=nn.initializers.normal(0.02))
        self.layers = [self.layer_cls(cfg, self.attention) for _ in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Dense(cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def embed(self, tokens):  # int32 [...] -> [..., H]
        return self.embed_tokens(tokens)

    def head(self, hidden):  # [..., H] (after the final norm) -> float32 logits [..., V]
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def run_layers(self, x, metas, k_pages: list, v_pages: list, n: int, feature_layers: tuple[int, ...]):
        """The first ``n`` decoder layers over the rows x [M, H] (``k_pages`` / ``v_pages``: every
        layer's pages); returns (x, k_pages, v_pages, {layer in ``feature_layers``: the residual
        stream after it [M, H]})."""
        k_pages, v_pages, taken = list(k_pages), list(v_pages), {}
        # inline where Flax must see each layer: initialising, or a caller collecting intermediates
        once = TRACE_LAYERS_ONCE and not self.is_initializing() and not self.is_mutable_collection("intermediates") \
            and self.config.tensor_parallel == 1 and not isinstance(metas, DenseContext)
        for i in range(n):
            with jax.named_scope(f"layer_{i}"):
                if once:
                    x, k_pages[i], v_pages[i] = call_layer(self.layers[i], self.variables["params"][f"layers_{i}"],
                                                           x, metas, k_pages[i], v_pages[i])
                else:
                    x, k_pages[i], v_pages[i] = self.layers[i](x, metas, k_pages[i], v_pages[i])
            if i in feature_layers:
                taken[i] = x
        return x, k_pages, v_pages, taken

    def __call__(self, segments: tuple[Segment, ...], cache: PagedKVCache, num_layers: Optional[int] = None,
                 logits_for: tuple[bool, ...] = (True,), feature_layers: tuple[int, ...] = ()):
        n = self.config.num_layers if num_layers is None else num_layers
        metas = [segment_meta(s, cache) for s in segments]
        xs = [self.embed(m.to_rows(s.tokens)) for s, m in zip(segments, metas)]
        x = jnp.concatenate(xs, 0) if len(xs) > 1 else xs[0]
        x, k_all, v_all, taken = self.run_layers(x, metas, cache.k_pages, cache.v_pages, n, feature_layers)
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
def _module(config: ModelConfig, attention: str, module_cls: type = LlamaForCausalLM) -> LlamaForCausalLM:
    if config.is_gemma:  # Gemma's decoder on every path (the CPU path's kernels fuse Llama's layer)
        from jspec.models.gemma import GemmaForCausalLM

        module_cls = GemmaForCausalLM
    return module_cls(config, attention_lib.resolve(attention))


def forward(params, config: ModelConfig, tokens, cache: PagedKVCache, q_lens, *,
            attention: str = "auto", num_layers: Optional[int] = None,
            compute_logits: bool = True, feature_layers: tuple[int, ...] = (),
            module_cls: type = LlamaForCausalLM) -> ForwardOutput:
    """Run the model over ``tokens`` [B, T] on top of ``cache`` (every row; pure, jit it)."""
    logits, hidden, cache = forward_segments(params, config, (Segment(tokens, q_lens),), cache,
                                             attention=attention, num_layers=num_layers,
                                             logits_for=(compute_logits,), feature_layers=feature_layers,
                                             module_cls=module_cls)
    return ForwardOutput(logits[0], hidden[0], cache)


def forward_segments(params, config: ModelConfig, segments: tuple[Segment, ...], cache: PagedKVCache, *,
                     attention: str = "auto", num_layers: Optional[int] = None,
                     logits_for: Optional[tuple[bool, ...]] = None, feature_layers: tuple[int, ...] = (),
                     module_cls: type = LlamaForCausalLM):
    """Run the model over several segments at once (see :class:`Segment`); returns (logits per
    segment, float32 [Bs, Ts, V] or None where ``logits_for`` is False; per segment the final
    hidden states [Bs, Ts, H], or with ``feature_layers`` the residual stream after those layers
    [Bs, Ts, len * H]; the new cache). ``module_cls``: :class:`LlamaForCausalLM` or a subclass
    with the same parameters (``jspec.models.cpu_path.LlamaForCausalLM``)."""
    logits_for = tuple(logits_for) if logits_for is not None else (True,) * len(segments)
    feature_layers = tuple(feature_layers)
    n = config.num_layers if num_layers is None else num_layers
    if any(not 0 <= i < n for i in feature_layers) or len(set(feature_layers)) != len(feature_layers):
        raise ValueError(f"feature_layers {feature_layers} must be distinct layers of the {n} that run")
    with jax.named_scope("model_forward"):
        return _module(config, attention, module_cls).apply({"params": params}, tuple(segments), cache, num_layers,
                                                            logits_for, feature_layers)


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
    tables = jnp.zeros((1, 1), jnp.int32)
    cache = init_cache(config.num_layers, config.num_kv_heads, config.head_dim, tables, 1, 16,
                       jnp.dtype(config.dtype))
    seg = Segment(jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32))
    return _module(config, "reference").init(key, (seg,), cache)["params"]
