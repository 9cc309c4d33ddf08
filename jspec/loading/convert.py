"""Hugging Face tensor names -> jspec's Flax parameter pytree.

Both loaders end here: the GGUF loader renames llama.cpp tensors to Hugging Face names first.
Before anything is allocated, :func:`check_checkpoint` compares the config with the shapes
the file declares (the layer count first, so that an absurd one never builds per-layer
bookkeeping; then every tensor), and :func:`check_load_fits` compares the bytes the load will
allocate with the memory available. While converting, each tensor is checked for NaN/Inf (and
for float16's range when loading in float16), so a corrupt weight fails with a
:class:`CheckpointError` naming the tensor instead of generating token 0 forever.

Parameter tree (Flax ``nn.Dense`` kernels are ``[in, out]``):

    embed_tokens/embedding                [V, H]
    layers_{i}/input_layernorm/scale      [H]
    layers_{i}/self_attn/qkv_proj/kernel  [H, (Hq + 2 KVH) D]   (bias [(Hq + 2 KVH) D] for Qwen2)
    layers_{i}/self_attn/o_proj/kernel    [Hq D, H]
    layers_{i}/post_attention_layernorm/scale [H]
    layers_{i}/mlp/gate_up_proj/kernel    [H, 2 I]
    layers_{i}/mlp/down_proj/kernel       [I, H]
    norm/scale                            [H]
    lm_head/kernel                        [H, V]   (untied models only)

Gemma adds ``layers_{i}/pre_feedforward_layernorm/scale`` and ``post_feedforward_layernorm``
(its norms' weights are offsets from one, kept as stored; :mod:`jspec.models.gemma`).
"""

from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.loading import memory
from jspec.config import ModelConfig
from jspec.errors import CheckpointError
from jspec.models.cpu_path import projection_kernels
from pallas_kernels.cpu import small_rows

TensorGetter = Callable[[str], "np.ndarray | None"]
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
FLOAT16_MAX = 65504.0


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` must hold, in Hugging Face layout ([out, in])."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        })
        if cfg.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (cfg.head_dim,), p + "self_attn.k_norm.weight": (cfg.head_dim,)})
        for norm in layer_norm_names(cfg)[2:]:
            shapes[p + norm + ".weight"] = (h,)
    return shapes


def layer_norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    """A decoder layer's norms (the same names in Hugging Face's checkpoints and jspec's tree)."""
    names = ("input_layernorm", "post_attention_layernorm")
    return names + (("pre_feedforward_layernorm", "post_feedforward_layernorm") if cfg.is_gemma else ())


def layers_present(names) -> int:
    """How many distinct decoder layers (``model.layers.N.``) the tensor names cover."""
    return len({int(m.group(1)) for n in names if (m := _LAYER.match(n))})


def check_checkpoint(cfg: ModelConfig, shapes: Mapping[str, Optional[tuple]], source: str,
                     layers_field: str = "num_layers", optional: tuple[str, ...] = ()) -> None:
    """The config against the tensor shapes a file declares, before any data is read.

    The layer count is compared with the layers the file holds before anything per layer is
    built (a config claiming 10^9 layers fails here, in microseconds); then every expected
    tensor must be present (``optional`` ones may be missing) with its exact shape.
    """
    present = layers_present(shapes)
    if cfg.num_layers > present:
        raise CheckpointError(f"{source}: {layers_field} is {cfg.num_layers} but the weights hold "
                              f"{present} layer{'s' if present != 1 else ''}")
    for name, want in expected_hf_shapes(cfg).items():
        got = shapes.get(name)
        if got is None:
            if name in optional:
                continue
            raise CheckpointError(f"{source}: missing tensor {name}")
        if tuple(got) != want:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(got)}, expected {want}")


def load_bytes(cfg: ModelConfig) -> tuple[int, int]:
    """(device bytes, host bytes) a load allocates: the parameters in the model's dtype, and
    float32 staging of up to three copies of the largest tensor (read, concatenated, transposed)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    largest = max(v * h, h * (cfg.q_size + 2 * cfg.kv_size), 2 * cfg.intermediate_size * h)
    return memory.weights_bytes(cfg), 3 * 4 * largest


def check_load_fits(cfg: ModelConfig, source: str, extra_bytes: int = 0) -> None:
    """Refuse a load that cannot fit (:class:`jspec.InsufficientMemoryError`), before it starts.
    ``extra_bytes``: what the load keeps in host memory beside the parameters (a GGUF file's
    quantized blocks, numpy until an engine on the CPU places them)."""
    device_bytes, host_bytes = load_bytes(cfg)
    host_bytes += extra_bytes
    what = f"loading {source} ({cfg.num_params():,} parameters in {cfg.dtype})"
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        memory.check_fits(device_bytes + host_bytes, what)
    else:
        memory.check_fits(device_bytes, what, device=device)
        memory.check_fits(host_bytes, f"{what}: host staging")


def check_finite(t: np.ndarray, name: str, source: str, dtype: str = "float32") -> None:
    """Refuse a tensor holding NaN or Inf, or values float16 cannot hold when loading in float16.
    One float64 sum per tensor: it cannot overflow from float32 inputs, and NaN/Inf propagate."""
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.sum(t, dtype=np.float64)
    if not np.isfinite(total):
        bad = int(np.size(t) - np.count_nonzero(np.isfinite(t)))
        raise CheckpointError(f"{source}: tensor {name} holds {bad} non-finite values (NaN or Inf)")
    if dtype == "float16" and t.size and float(np.max(np.abs(t))) > FLOAT16_MAX:
        raise CheckpointError(f"{source}: tensor {name} holds values beyond float16's range "
                              f"(max |x| = {float(np.max(np.abs(t))):.4g}); load it in float32 or bfloat16")


def params_from_hf(cfg: ModelConfig, get: TensorGetter, source: str = "checkpoint"):
    """Build the parameter pytree from a getter of Hugging Face-named numpy tensors."""
    shapes = expected_hf_shapes(cfg)
    dtype = jnp.dtype(cfg.dtype)

    def take(name: str) -> np.ndarray:
        t = get(name)
        if t is None:
            raise CheckpointError(f"{source}: missing tensor {name}")
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(t.shape)}, expected {shapes[name]}")
        if np.asarray(t).dtype.kind in "biucOSU":  # bfloat16 (ml_dtypes) has kind "V"
            raise CheckpointError(f"{source}: tensor {name} has dtype {np.asarray(t).dtype}, expected floating point")
        t = np.asarray(t, np.float32)
        check_finite(t, name, source, cfg.dtype)
        return t

    def dev(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, dtype)

    params = {"embed_tokens": {"embedding": dev(take("model.embed_tokens.weight"))},
              "norm": {"scale": dev(take("model.norm.weight"))}}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"kernel": dev(take("lm_head.weight").T)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        layer = {"self_attn": {}, "mlp": {}}
        for (module, name), sources in layer_projections(n):
            layer[module][name] = {"kernel": dev(np.concatenate([take(s) for s in sources], axis=0).T)}
        if cfg.qkv_bias:
            layer["self_attn"]["qkv_proj"]["bias"] = dev(np.concatenate([take(p + f"self_attn.{x}_proj.bias")
                                                                         for x in "qkv"]))
        if cfg.qk_norm:
            for x in "qk":
                layer["self_attn"][f"{x}_norm"] = {"scale": dev(take(p + f"self_attn.{x}_norm.weight"))}
        for norm in layer_norm_names(cfg):
            layer[norm] = {"scale": dev(take(p + norm + ".weight"))}
        params[f"layers_{n}"] = layer
    return params


def layer_projections(n: int) -> tuple[tuple[tuple[str, str], tuple[str, ...]], ...]:
    """Layer ``n``'s projections: (module, name) in the parameter tree, and the Hugging Face
    weights whose rows they stack, in order (Q, K, V into ``qkv_proj``; gate, up into
    ``gate_up_proj``: fewer, larger products)."""
    p = f"model.layers.{n}."
    return ((("self_attn", "qkv_proj"), tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
            (("self_attn", "o_proj"), (p + "self_attn.o_proj.weight",)),
            (("mlp", "gate_up_proj"), (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
            (("mlp", "down_proj"), (p + "mlp.down_proj.weight",)))


def quantized_weights(cfg: ModelConfig, get_blocks) -> dict[tuple[str, ...], np.ndarray]:
    """The projections a GGUF file stores as Q4_1 or Q8_0 blocks, in the CPU small-row kernel's
    quantized layout (``pallas_kernels.cpu.small_rows.pack_quantized``), keyed by their place in the
    parameter tree: ``("layers_{n}", "self_attn" | "mlp", "qkv_proj" | ...)`` (fused as the
    float32 kernels are; a fused projection only when all its parts share one type) and
    ``("lm_head_rows",)`` (the LM head's rows [V, H]: the tied embedding, or ``lm_head``).
    ``get_blocks(hf_name) -> (qtype, uint8 [rows, row bytes]) | None`` (GGUFFile.blocks_getter).
    Empty for a model not in float32 (the kernel's dtype). The values are the dequantized
    parameters' exactly; :func:`jspec.models.cpu_path.with_small_row_weights` reads them."""
    if jnp.dtype(cfg.dtype) != jnp.float32:
        return {}
    shapes = expected_hf_shapes(cfg)
    out = {}

    def pack(path, names):
        parts = [get_blocks(n) for n in names]
        if any(p is None for p in parts) or len({q for q, _ in parts}) != 1:
            return
        qtype = parts[0][0]
        rows, k = sum(shapes[n][0] for n in names), shapes[names[0]][1]
        blocks = np.concatenate([b for _, b in parts], axis=0)
        if k % small_rows.QUANT_BLOCK or blocks.shape != (rows, k // small_rows.QUANT_BLOCK *
                                                           small_rows.GGUF_BLOCK_BYTES[qtype]):
            return
        out[path] = small_rows.pack_quantized(blocks, qtype)

    for n in range(cfg.num_layers):
        for where, sources in layer_projections(n):
            pack((f"layers_{n}", *where), sources)
    pack(("lm_head_rows",), ["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"])
    return out


def quantize_rows(rows, qtype: str = "q8_0") -> np.ndarray:
    """Float rows [N, K] (K a multiple of 32) quantized as llama.cpp does (the ``gguf`` package's
    Q8_0 quantizer: per 32 weights d = max |w| / 127 in float16, q = round(w / d)), in the CPU
    small-row kernel's quantized layout. Lossy (~0.4% of a block's largest weight at most), except
    for rows that are Q8_0 values already, which come back bit for bit."""
    import gguf

    if qtype != "q8_0":
        raise ValueError(f"quantize_rows: qtype must be 'q8_0', got {qtype!r}")
    w = np.asarray(jax.device_get(rows), np.float32)
    if w.ndim != 2 or w.shape[1] % small_rows.QUANT_BLOCK:
        raise ValueError(f"quantize_rows: rows must be [N, K] with K a multiple of {small_rows.QUANT_BLOCK}, "
                         f"got {w.shape}")
    return small_rows.pack_quantized(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), qtype)


def quantized_drafter_weights(params, names: tuple[str, ...], qtype: str = "q8_0") -> dict[tuple[str, ...], np.ndarray]:
    """A drafter's float32 weights quantized for the small-row kernel (:func:`quantize_rows`), keyed
    as :func:`quantized_weights` keys a GGUF file's: every projection called one of ``names``
    (``kernel`` [in, out], so its transpose) whose input width is a multiple of 32, and as
    ``("lm_head_rows",)`` the rows its logits read: a draft vocabulary's ``lm_head`` [V', H]
    (EAGLE heads, jspec draft models) or a whole draft model's output embedding. Drafts only
    propose, so the output stays exact (verification decides); what changes is which tokens are
    proposed, by Q8_0's rounding. The target's own Q8_0 LM-head rows quantize to themselves."""
    out = {where: quantize_rows(np.asarray(jax.device_get(kernel)).T, qtype)
           for where, kernel in projection_kernels(params, names).items()
           if kernel.ndim == 2 and kernel.shape[0] % small_rows.QUANT_BLOCK == 0}
    if "vocab_ids" in params:
        rows = params["lm_head"]
    elif "embed_tokens" in params:
        rows = params["lm_head"]["kernel"].T if "lm_head" in params else params["embed_tokens"]["embedding"]
    else:
        rows = None
    if rows is not None and rows.shape[-1] % small_rows.QUANT_BLOCK == 0:
        out[("lm_head_rows",)] = quantize_rows(rows, qtype)
    return out


def params_to_hf(cfg: ModelConfig, params) -> dict[str, np.ndarray]:
    """The inverse of :func:`params_from_hf` (export to a Hugging Face directory)."""
    q, kv, i = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    f = lambda x: np.asarray(jax.device_get(x), np.float32)  # noqa: E731
    out = {"model.embed_tokens.weight": f(params["embed_tokens"]["embedding"]),
           "model.norm.weight": f(params["norm"]["scale"])}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = f(params["lm_head"]["kernel"]).T
    for n in range(cfg.num_layers):
        lp, p = params[f"layers_{n}"], f"model.layers.{n}."
        qkv = f(lp["self_attn"]["qkv_proj"]["kernel"]).T
        out[p + "self_attn.q_proj.weight"] = qkv[:q]
        out[p + "self_attn.k_proj.weight"] = qkv[q:q + kv]
        out[p + "self_attn.v_proj.weight"] = qkv[q + kv:]
        if cfg.qkv_bias:
            b = f(lp["self_attn"]["qkv_proj"]["bias"])
            out[p + "self_attn.q_proj.bias"], out[p + "self_attn.k_proj.bias"] = b[:q], b[q:q + kv]
            out[p + "self_attn.v_proj.bias"] = b[q + kv:]
        if cfg.qk_norm:
            for x in "qk":
                out[p + f"self_attn.{x}_norm.weight"] = f(lp["self_attn"][f"{x}_norm"]["scale"])
        out[p + "self_attn.o_proj.weight"] = f(lp["self_attn"]["o_proj"]["kernel"]).T
        gu = f(lp["mlp"]["gate_up_proj"]["kernel"]).T
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gu[:i], gu[i:]
        out[p + "mlp.down_proj.weight"] = f(lp["mlp"]["down_proj"]["kernel"]).T
        for norm in layer_norm_names(cfg):
            out[p + norm + ".weight"] = f(lp[norm]["scale"])
    return {k: np.ascontiguousarray(v) for k, v in out.items()}
