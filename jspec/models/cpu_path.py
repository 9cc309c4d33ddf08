"""The CPU path: the Llama modules and the EAGLE head on the C++ CPU kernels for steps of a few rows.

On the CPU a decode or verification step is bound by reading the weights and by per-op
overhead. This module subclasses the plain modules of :mod:`jspec.models.llama` and
:mod:`jspec.models.eagle` (same parameter trees: Flax names parameters by the submodules'
names) so that, where a step's rows fit the kernels, they run on ``pallas_kernels.cpu``:

- :class:`Linear` reads a packed copy ``weight`` beside its ``kernel``
  (:func:`with_small_row_weights`: float32 packed rows, or a GGUF file's Q4_1 / Q8_0 blocks, or
  those in the int8 dot layout) on the small-row kernel (``pallas_kernels.cpu.small_rows``),
  and folds an RMSNorm before it and a residual add after it into that call;
- :class:`DecoderLayer` folds its norms and residual adds into its projections' calls, and
  :class:`Attention` runs attention, the output projection and the MLP as one call after the
  K/V write (``pallas_kernels.cpu.layer_tail.layer_tail``), or the layer runs as one call
  (``layer_tail.decoder_layer``);
- :class:`LlamaForCausalLM` runs all of a step's layers as one call (``layer_tail.decoder_stack``)
  and its LM head of a few rows on the small-row kernel (the tied embedding read as it is, or
  the quantized rows ``lm_head_rows``);
- :class:`EagleHead` is the EAGLE head on these layers; :meth:`CpuPath.times_rows` a draft
  vocabulary's LM head.

Everything else falls back to the plain module (``super()``): more rows than the kernels take,
no packed copy, tensor parallelism, other dtypes or backends. Results equal the plain model's up
to float rounding (another summation order), the same bits whichever of the calls a step takes.
The engine picks this path once (:data:`CPU`, a :class:`jspec.models.path.ModelPath`) where the
small-row kernel applies, and prepares the parameters with :func:`with_small_row_weights`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import ClassVar, Optional

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp

from jspec import attention as attention_lib
from jspec.cache.paged import write_kv
from jspec.config import ModelConfig
from jspec.models import eagle, llama
from jspec.models.llama import DenseContext, qkv_heads, rms_norm, rope_cos_sin, rope_inv_freq, segment_qkv, swiglu
from jspec.models.path import ModelPath
from pallas_kernels.cpu import build as cpu_kernels, layer_tail, small_rows

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
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # a decoder layer's
# The EAGLE head's projections: drafting runs them on a few rows, so the engine packs them
# (``with_small_row_weights(params, HEAD_PROJECTIONS)``) like the target's.
HEAD_PROJECTIONS = PROJECTIONS + ("fuse", "fc")


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


# ---------------------------------------------------------------------------- the weights' forms
def with_small_row_weights(params, names: tuple[str, ...] = PROJECTIONS, quantized=None, int8_dot: bool = False):
    """``params`` with a packed copy ``weight`` (``pallas_kernels.cpu.small_rows.pack_rows`` of the
    kernel's transpose) beside the ``kernel`` of every :class:`Linear` called one of ``names``
    (by default a decoder layer's projections), which it reads for products of a few rows on the
    CPU small-row kernel. The copy costs the projections' memory once more (425 MB for
    SmolLM2-135M in float32). Outputs equal the plain parameters' up to float rounding (another
    summation order); the plain model ignores the copies.

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


def times_rows(x: jax.Array, rows: jax.Array, quantized: Optional[jax.Array] = None) -> jax.Array:
    """``x`` [..., K] times ``rows`` [N, K] transposed -> float32 [..., N] (a tied LM head, a draft
    vocabulary's embedding rows): a few float32 rows go through the CPU small-row kernel, which
    reads ``rows`` as they are (no packed copy), or ``quantized``, the same rows in its quantized
    layout, where given; anything else through XLA's product."""
    if _few_rows(x, rows.dtype, () if quantized is None else (quantized,)):
        return small_rows.small_rows_matmul(x.astype(jnp.float32), rows if quantized is None else quantized,
                                            rows.shape[0])
    return jnp.einsum("...k,nk->...n", x, rows, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------- the modules
class Linear(llama.Linear):
    """:class:`jspec.models.llama.Linear` (``nn.Dense``'s parameters) that also reads a packed copy
    ``weight`` beside ``kernel`` for products of :data:`KERNEL_ROWS` rows (quantized:
    :data:`QUANTIZED_KERNEL_ROWS`) on the CPU small-row kernel (see :func:`with_small_row_weights`)."""

    @nn.compact
    def __call__(self, x, norm: Optional[tuple[jax.Array, float]] = None, residual: Optional[jax.Array] = None):
        """``x @ kernel (+ bias)``; with ``norm`` = (gain, eps) ``x`` goes through RMSNorm first, with
        ``residual`` it is added to the result. On the small-row kernel both fold into its call."""
        x = x.astype(self.dtype)
        packed = self.get_variable("params", "weight") if self.has_variable("params", "weight") else None
        if packed is None or not _few_rows(x, self.dtype, (packed,)):
            y = super().__call__(x if norm is None else rms_norm(x, *norm))
            return y if residual is None else y + residual
        if norm is not None or residual is not None:
            y = small_rows.fused_small_rows(x, packed, self.features, scale=None if norm is None else norm[0],
                                            eps=0.0 if norm is None else norm[1], residual=residual)
            residual = None
        else:
            y = small_rows.small_rows_matmul(x, packed, self.features)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,), self.dtype)
        return y if residual is None else y + residual


class Attention(llama.Attention):
    linear_cls = Linear

    def __call__(self, x, metas, k_pages, v_pages, norm=None, residual=None, mlp=None):
        """The plain attention, or with ``norm`` (gain, eps): RMSNorm before the QKV projection;
        ``residual``: added to the output projection's result (both folded into the projections,
        see :class:`DecoderLayer`). ``mlp`` (the post-attention norm's gain, eps, and the MLP's
        packed gate/up and down weights): where :meth:`_tail_fuses`, the layer's attention, output
        projection and MLP run as one kernel call (pallas_kernels.cpu.layer_tail) after the K/V
        write. With ``mlp`` the result is (out, k_pages, v_pages, whether the MLP ran)."""
        if norm is None and residual is None and mlp is None:
            return super().__call__(x, metas, k_pages, v_pages)
        cfg = self.config
        qkv = self.qkv_proj(x, norm=norm)  # [M, (Hq + 2 KVH) D]
        if isinstance(metas, DenseContext):  # training: no pages, the context's own mask
            q, k, v = qkv_heads(cfg, qkv, metas.positions.shape, metas.positions, self.qk_norms)
            out = self.o_proj(metas.attend(q, k, v).reshape(-1, cfg.q_size), residual=residual)
            return (out, k, v) if mlp is None else (out, k, v, False)
        qs, ks, vs = segment_qkv(cfg, qkv, metas, self.qk_norms)
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
        o, k_pages, v_pages = llama.write_and_attend(cfg, self.attention, metas, qs, ks, vs, k_pages, v_pages)
        out = self.o_proj(o, residual=residual)
        return (out, k_pages, v_pages) if mlp is None else (out, k_pages, v_pages, False)

    def _tail_fuses(self, metas, q, k_pages, residual, o_w, mlp) -> bool:
        """Whether the layer after the K/V write runs as one kernel call: :meth:`_one_call` and the
        packed weights fitting the kernel (pallas_kernels.cpu.layer_tail.applies)."""
        return self._one_call(metas, residual, o_w) and layer_tail.applies(q, k_pages, residual, o_w, mlp[2], mlp[3])

    def _one_call(self, metas, residual, o_w) -> bool:
        """What pallas_kernels.cpu.layer_tail's call needs of the step (:func:`_one_kernel_step`), a
        residual and the packed o_proj."""
        return _one_kernel_step(self.config, self.attention, metas) and residual is not None and o_w is not None


class MLP(llama.MLP):
    linear_cls = Linear

    def __call__(self, x, norm=None, residual=None):  # as Attention's
        y = self.gate_up_proj(x, norm=norm)  # [M, 2 I]
        return self.down_proj(swiglu(self.config, y), residual=residual)


class DecoderLayer(llama.DecoderLayer):
    attention_cls = Attention
    mlp_cls = MLP

    def trace_context(self) -> bool:
        """What else this layer's trace depends on (jspec.models.llama.call_layer keys on it):
        whether it is traced for the CPU only (its kernels' CPU branch alone)."""
        return cpu_kernels.tracing_for_cpu_only()

    def __call__(self, x, metas, k_pages, v_pages):  # x: [M, H]; metas: per-segment metadata, or a DenseContext
        if not self._folds(x):
            return super().__call__(x, metas, k_pages, v_pages)
        # the norms and residual adds inside the projections' kernel calls
        cfg = self.config
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
        x, k_pages, v_pages, mlp_ran = self.self_attn(x, metas, k_pages, v_pages,
                                                      norm=(p["input_layernorm"]["scale"], eps), residual=x, mlp=mlp)
        if not mlp_ran:
            x = self.mlp(x, norm=post, residual=x)
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
    """Whether a step's rows can go through pallas_kernels.cpu.layer_tail's calls: one unpacked
    segment of rows the cpu attention's kernel takes (no tree), on one device, without per-head q/k norms (the kernels
    rotate the raw projection)."""
    return (not isinstance(metas, DenseContext) and len(metas) == 1 and metas[0].packed is None
            and metas[0].tree_mask is None
            and attention == "cpu" and not cfg.qk_norm and cfg.tensor_parallel == 1
            and metas[0].shape[1] <= attention_lib.CPU_KERNEL_MAX_ROWS)


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


class LlamaForCausalLM(llama.LlamaForCausalLM):
    layer_cls = DecoderLayer

    def head(self, hidden):  # [..., H] (after the final norm) -> float32 logits [..., V]
        rows = self.variables.get("params", {}).get("lm_head_rows")  # quantized (with_small_row_weights)
        if self.config.tie_word_embeddings:
            # the tied table is already rows [V, H]: a few rows go through the CPU kernel, no copy
            if _few_rows(hidden, self.config.dtype, () if rows is None else (rows,)):
                return times_rows(hidden, self.embed_tokens.embedding, rows).astype(jnp.float32)
        elif rows is not None and _few_rows(hidden, self.config.dtype, (rows,)):
            return small_rows.small_rows_matmul(hidden.astype(jnp.float32), rows, self.config.vocab_size)
        return super().head(hidden)

    def run_layers(self, x, metas, k_pages, v_pages, n: int, feature_layers: tuple[int, ...]):
        """All ``n`` layers as one kernel call (pallas_kernels.cpu.layer_tail.decoder_stack) where
        each of them would run as one decoder_layer call and no feature layer is asked for; else
        layer by layer."""
        stack = None if feature_layers else self._stack(x, metas, k_pages[:n], n)
        if stack is None:
            return super().run_layers(x, metas, k_pages, v_pages, n, feature_layers)
        k_pages, v_pages = list(k_pages), list(v_pages)
        (m,) = metas
        cos, sin = rope_cos_sin(m.positions.reshape(-1), rope_inv_freq(self.config), x.dtype)
        with jax.named_scope("decoder_stack"):
            x, k_pages[:n], v_pages[:n] = layer_tail.decoder_stack(x, cos, sin, m.block_tables, m.start, m.q_lens,
                                                                   stack, k_pages[:n], v_pages[:n],
                                                                   self.config.rms_norm_eps)
        return x, k_pages, v_pages, {}

    def _stack(self, x, metas, k_pages, n: int) -> Optional[list]:
        """The operands of the first ``n`` layers for pallas_kernels.cpu.layer_tail.decoder_stack, where
        each of them would run as one decoder_layer call (:func:`_whole_layer_operands`); else None."""
        if n == 0 or self.is_initializing():
            return None
        params = self.variables["params"]
        layers = [_whole_layer_operands(self.config, self.attention, metas, x, params[f"layers_{i}"], k_pages[i])
                  for i in range(n)]
        return None if any(layer is None for layer in layers) else layers


class EagleHead(eagle.EagleHead):
    """The EAGLE head with its fusion, ``fc`` and decoder layer on the CPU kernels."""

    linear_cls = Linear
    layer_cls = DecoderLayer


def _for_cpu(method):
    """``method`` traced inside pallas_kernels.cpu.build.tracing_for_cpu (see :class:`CpuPath`)."""
    @functools.wraps(method)
    def traced_for_cpu(*args, **kwargs):
        with cpu_kernels.tracing_for_cpu():
            return method(*args, **kwargs)

    return traced_for_cpu


@dataclasses.dataclass(frozen=True)
class CpuPath(ModelPath):
    """The models on the CPU kernels (see the module docstring). The engine picks this path for
    a CPU backend only, so its calls trace the kernels' CPU branch alone
    (``pallas_kernels.cpu.build.tracing_for_cpu``: no plain-XLA twin of the model is traced
    beside it); a program traced through it lowers for the CPU only."""

    causal_lm: ClassVar[type] = LlamaForCausalLM
    eagle_head: ClassVar[type] = EagleHead

    forward = _for_cpu(ModelPath.forward)
    forward_segments = _for_cpu(ModelPath.forward_segments)
    eagle_forward = _for_cpu(ModelPath.eagle_forward)

    @_for_cpu
    def times_rows(self, x: jax.Array, rows: jax.Array, quantized: Optional[jax.Array] = None) -> jax.Array:
        return times_rows(x, rows, quantized)


CPU = CpuPath()
