"""EAGLE heads in the layouts others publish them in, read into
:class:`~jspec.models.eagle.PublishedEagle3Head` and
:class:`~jspec.models.eagle.PublishedEagle1Head` parameters (:func:`published_kind` tells which).

**EAGLE-3.** A directory is a published EAGLE-3 head when its ``config.json`` names the
architecture (``LlamaForCausalLMEagle3`` and the like: the EAGLE authors' and SpecForge's
checkpoints) or says ``"speculators_model_type": "eagle3"`` (the ``speculators`` format vLLM
documents, whose layer geometry sits under ``transformer_layer_config``). Its safetensors hold::

    fc.weight                          [H, 3H]   the three target features -> H
    {P}input_layernorm.weight          [H]       on the token embedding
    {P}hidden_norm.weight              [H]       on the feature (or the chained output)
    {P}self_attn.{q,k,v}_proj.weight   [.., 2H]  attention over [embedding; feature]
    {P}self_attn.o_proj.weight         [H, Hq D]
    {P}post_attention_layernorm.weight [H]
    {P}mlp.{gate,up,down}_proj.weight
    norm.weight                        [H]
    lm_head.weight                     [V', H]   the draft vocabulary's output rows
    d2t                                [V']      target id - draft id (absent when V' = V)
    t2d, embed_tokens.weight                     ignored (the target's embedding is used)

with ``P`` = ``midlayer.`` (EAGLE, SpecForge) or ``layers.0.`` (``speculators``, vLLM). The head
reads the residual stream entering the target's layers ``eagle_aux_hidden_state_layer_ids``
(default 2, L/2, L - 3, as vLLM and SGLang take them), which is what leaves layers one lower:
jspec's ``feature_layers``.

**EAGLE-1.** A directory is a published EAGLE-1 head when its ``config.json`` says
``"speculators_model_type": "eagle"`` (geometry under ``transformer_layer_config``) or is the
EAGLE authors' one-layer Llama config (``num_hidden_layers`` 1, no EAGLE-3 marks). It reads the
target's final hidden state and uses the target's LM head::

    {F}weight, {F}bias                 [H, 2H], [H]  [embedding; feature] -> H (the bias optional)
    {P}self_attn.{q,k,v}_proj.weight   [.., H]       (and .bias, optional)
    {P}self_attn.o_proj.weight         [H, Hq D]
    {P}post_attention_layernorm.weight [H]
    {P}mlp.{gate,up,down}_proj.weight
    embedding_layernorm.weight, {P}input_layernorm.weight, pre_lm_head_layernorm.weight
                                       [H]           only with ``speculators``' ``layernorms``
    embed_tokens.weight, lm_head.weight              ignored (the target's are used)

with ``F`` = ``fc.`` and ``P`` = ``layers.0.`` (the EAGLE authors) or ``fusion_fc.`` and
``transformer.`` (``speculators``). Pickle checkpoints (``pytorch_model.bin``) are refused with
the command that converts them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np

from jspec.errors import CheckpointError, DraftMismatchError, UnsupportedModelError

PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.")
IGNORED = ("t2d", "embed_tokens.weight", "model.embed_tokens.weight")  # the target's are used
CONVERT = ("python -c \"import torch, safetensors.torch as s; "
           "s.save_file(torch.load('pytorch_model.bin', map_location='cpu'), 'model.safetensors')\"")


def published_kind(directory: Path) -> Optional[str]:
    """``"eagle3"`` or ``"eagle"`` where ``directory`` holds a published EAGLE-3 or EAGLE-1 head
    (by its config.json), else None."""
    from jspec.loading.hf import read_json

    path = directory / "config.json"
    if not path.is_file():
        return None
    d = read_json(path)
    if not isinstance(d, dict):
        return None
    names = [str(a).lower() for a in d.get("architectures") or [] if isinstance(a, str)]
    if any("eagle3" in a for a in names) or d.get("speculators_model_type") == "eagle3":
        return "eagle3"
    if d.get("speculators_model_type") == "eagle" or (d.get("num_hidden_layers") == 1 and names):
        return "eagle"
    return None


def is_published_eagle3(directory: Path) -> bool:
    """Whether ``directory`` holds a published EAGLE-3 head (by its config.json)."""
    return published_kind(directory) == "eagle3"


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    from jspec.loading.drafts import load_tensors
    from jspec.loading.hf import PICKLE_SUFFIXES

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise UnsupportedModelError(f"{directory / pickles[0]}: pickle checkpoints are not loaded (they can run "
                                        f"code); convert it in that directory first: {CONVERT}")
        raise CheckpointError(f"{directory}: no *.safetensors weights found")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load_tensors(f))
    return out


def _geometry(d: dict) -> dict:
    """The head's layer geometry: at the top of the config, or under ``transformer_layer_config``."""
    g = d.get("transformer_layer_config") if isinstance(d.get("transformer_layer_config"), dict) else d
    return {k: g.get(k, d.get(k)) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                             "rope_theta", "rms_norm_eps")}


def _config(directory: Path, cfg, kind: str) -> dict:
    """A published head's config.json, its attention geometry checked against the target's."""
    from jspec.loading.hf import read_json

    source = str(directory / "config.json")
    d = read_json(directory / "config.json")
    geo = _geometry(d)
    for key, want in (("hidden_size", cfg.hidden_size), ("num_attention_heads", cfg.num_heads),
                      ("num_key_value_heads", cfg.num_kv_heads), ("head_dim", cfg.head_dim)):
        if geo[key] is not None and geo[key] != want:
            raise DraftMismatchError(f"{source}: {key} {geo[key]} differs from the target's {want} (jspec runs a "
                                     f"published {kind} head with the target's attention geometry)")
    if geo["rope_theta"] is not None and float(geo["rope_theta"]) != cfg.rope_theta:
        raise DraftMismatchError(f"{source}: rope_theta {geo['rope_theta']} differs from the target's {cfg.rope_theta}")
    return d


def _check_tensors(directory: Path, flat: dict, shapes: dict, names: set, cfg, kind: str) -> None:
    """Every tensor of ``names`` present and none other (beyond IGNORED); those of ``shapes`` of
    that shape and finite."""
    from jspec.loading.convert import check_finite

    missing = sorted(names - set(flat))
    if missing:
        raise CheckpointError(f"{directory}: missing tensor(s) {', '.join(missing)} of an {kind} head")
    extra = sorted(set(flat) - names - set(IGNORED))
    if extra:
        raise CheckpointError(f"{directory}: unexpected tensor(s) {', '.join(extra[:5])} in an {kind} head")
    for name, shape in shapes.items():
        if tuple(flat[name].shape) != shape:
            raise DraftMismatchError(f"{directory}: tensor {name} has shape {tuple(flat[name].shape)}, the "
                                     f"target's geometry implies {shape}")
        check_finite(np.asarray(flat[name], np.float32), name, str(directory), cfg.dtype)


def _layer_shapes(prefix: str, h: int, q: int, kv: int, inter, attn_in: int, qkv_bias: bool) -> dict:
    """Names and shapes of a published head's decoder layer (attention reading ``attn_in``)."""
    out = {f"{prefix}post_attention_layernorm.weight": (h,),
           f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
           f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (h, q),
           f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
           f"{prefix}mlp.down_proj.weight": (h, inter)}
    if qkv_bias:
        out.update({f"{prefix}self_attn.q_proj.bias": (q,), f"{prefix}self_attn.k_proj.bias": (kv,),
                    f"{prefix}self_attn.v_proj.bias": (kv,)})
    return out


def _scale(flat: dict, name: str, dtype) -> dict:
    import jax.numpy as jnp

    return {"scale": jnp.asarray(np.asarray(flat[name], np.float32), dtype)}


def _layer(flat: dict, prefix: str, dtype) -> dict:
    """A published head's decoder layer as jspec's fused parameters (``self_attn``, ``mlp``,
    ``post_attention_layernorm``)."""
    import jax.numpy as jnp

    def cat(names):  # PyTorch [out, in] rows of each, stacked: [sum out, in]
        return np.concatenate([np.asarray(flat[prefix + n], np.float32) for n in names])

    kernel = lambda x: {"kernel": jnp.asarray(x.T, dtype)}  # noqa: E731  [in, out]
    qkv = kernel(cat(["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]))
    if prefix + "self_attn.q_proj.bias" in flat:
        qkv["bias"] = jnp.asarray(cat(["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]),
                                  dtype)
    return {"self_attn": {"qkv_proj": qkv, "o_proj": kernel(cat(["self_attn.o_proj.weight"]))},
            "post_attention_layernorm": _scale(flat, prefix + "post_attention_layernorm.weight", dtype),
            "mlp": {"gate_up_proj": kernel(cat(["mlp.gate_proj.weight", "mlp.up_proj.weight"])),
                    "down_proj": kernel(cat(["mlp.down_proj.weight"]))}}


def _layer_tensors(head: dict, prefix: str, config) -> dict:
    """The inverse of :func:`_layer`: the decoder layer's tensors as published heads name them."""
    f = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    q, kv = config.q_size, config.kv_size
    qkv = f(head["self_attn"]["qkv_proj"]["kernel"]).T
    gu = f(head["mlp"]["gate_up_proj"]["kernel"]).T
    inter = gu.shape[0] // 2
    out = {prefix + "post_attention_layernorm.weight": f(head["post_attention_layernorm"]["scale"]),
           prefix + "self_attn.q_proj.weight": qkv[:q], prefix + "self_attn.k_proj.weight": qkv[q:q + kv],
           prefix + "self_attn.v_proj.weight": qkv[q + kv:],
           prefix + "self_attn.o_proj.weight": f(head["self_attn"]["o_proj"]["kernel"]).T,
           prefix + "mlp.gate_proj.weight": gu[:inter], prefix + "mlp.up_proj.weight": gu[inter:],
           prefix + "mlp.down_proj.weight": f(head["mlp"]["down_proj"]["kernel"]).T}
    bias = head["self_attn"]["qkv_proj"].get("bias")
    if bias is not None:
        bias = f(bias)
        out.update({prefix + "self_attn.q_proj.bias": bias[:q], prefix + "self_attn.k_proj.bias": bias[q:q + kv],
                    prefix + "self_attn.v_proj.bias": bias[q + kv:]})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _geometry_dict(config, inter: int) -> dict:
    return {"hidden_size": config.hidden_size, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate_size": inter, "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "vocab_size": config.vocab_size, "num_hidden_layers": 1, "hidden_act": "silu"}


def feature_layers_of(d: dict, num_layers: int, source: str) -> tuple[int, ...]:
    """jspec's feature layers (the residual stream *leaving* them) of a published head reading
    the stream *entering* ``eagle_aux_hidden_state_layer_ids`` (default 2, L/2, L - 3)."""
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    if ids is None and isinstance(d.get("eagle_config"), dict):
        ids = d["eagle_config"].get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = [2, num_layers // 2, num_layers - 3]
    if (not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) and not isinstance(i, bool)
                                                               for i in ids)):
        raise CheckpointError(f"{source}: eagle_aux_hidden_state_layer_ids must be three layer indices, got {ids!r}")
    if any(not 1 <= i < num_layers for i in ids) or len(set(ids)) != 3:
        raise DraftMismatchError(f"{source}: the head reads the target's layers {ids}, which a target of "
                                 f"{num_layers} layers does not have (1..{num_layers - 1}, distinct)")
    return tuple(i - 1 for i in ids)


def read_published_eagle3(directory: Path, target) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(drafter params ``{"head", "lm_head", "vocab_ids"}``, feature layers) of a published EAGLE-3
    head for ``target``: every tensor named and shaped as the target's geometry implies (a missing
    or unexpected one named), the vocabulary map checked, the weights in the target's dtype."""
    import jax.numpy as jnp

    from jspec.loading.convert import check_finite
    from jspec.loading.hf import read_json

    cfg = target.config
    d = _config(directory, cfg, "EAGLE-3")
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    flat = _tensors(directory)
    prefix = next((p for p in PREFIXES if f"{p}self_attn.q_proj.weight" in flat), None)
    if prefix is None:
        raise CheckpointError(f"{directory}: missing tensor midlayer.self_attn.q_proj.weight (or layers.0.…): not "
                              "an EAGLE-3 head's layout")
    gate = flat.get(f"{prefix}mlp.gate_proj.weight")
    inter = gate.shape[0] if gate is not None and gate.ndim == 2 else None
    lm = flat.get("lm_head.weight")
    vocab = lm.shape[0] if lm is not None and lm.ndim == 2 else None
    want = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (vocab, h),
            f"{prefix}input_layernorm.weight": (h,), f"{prefix}hidden_norm.weight": (h,),
            **_layer_shapes(prefix, h, q, kv, inter, 2 * h, False)}
    if vocab != cfg.vocab_size or "d2t" in flat:
        want["d2t"] = (vocab,)
    _check_tensors(directory, flat, {k: v for k, v in want.items() if k != "d2t"}, set(want), cfg, "EAGLE-3")
    offsets = np.asarray(flat["d2t"], np.int64) if "d2t" in want else np.zeros((vocab,), np.int64)
    if offsets.shape != (vocab,):
        raise DraftMismatchError(f"{directory}: d2t has shape {offsets.shape}, expected ({vocab},)")
    vocab_ids = np.arange(vocab, dtype=np.int64) + offsets
    if vocab_ids.min() < 0 or vocab_ids.max() >= cfg.vocab_size or len(np.unique(vocab_ids)) != vocab:
        raise DraftMismatchError(f"{directory}: d2t maps the draft vocabulary outside the target's "
                                 f"{cfg.vocab_size} tokens or onto one token twice")
    dtype = jnp.dtype(cfg.dtype)
    head = {"fc": {"kernel": jnp.asarray(np.asarray(flat["fc.weight"], np.float32).T, dtype)},
            "input_layernorm": _scale(flat, prefix + "input_layernorm.weight", dtype),
            "hidden_norm": _scale(flat, prefix + "hidden_norm.weight", dtype),
            **_layer(flat, prefix, dtype), "norm": _scale(flat, "norm.weight", dtype)}
    params = {"head": head, "lm_head": jnp.asarray(np.asarray(flat["lm_head.weight"], np.float32), dtype),
              "vocab_ids": jnp.asarray(vocab_ids, jnp.int32)}
    return params, feature_layers_of(d, cfg.num_layers, str(directory / "config.json"))


def write_published_eagle3(directory: Path, head: dict, lm_head, vocab_ids, config, feature_layers: tuple[int, ...],
                           layout: str = "eagle") -> Path:
    """The inverse of :func:`read_published_eagle3`: a :class:`PublishedEagle3Head`'s parameters
    written as the EAGLE authors lay them out (``layout="eagle"``: ``midlayer.``) or as the
    ``speculators`` format does (``"speculators"``: ``layers.0.``, geometry under
    ``transformer_layer_config``). ``config``: the target's."""
    from jspec.loading.drafts import save_tensors, write_json

    if layout not in ("eagle", "speculators"):
        raise ValueError(f"layout must be 'eagle' or 'speculators', got {layout!r}")
    p = "midlayer." if layout == "eagle" else "layers.0."
    f = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    vocab_ids = np.asarray(vocab_ids, np.int64)
    tensors = {"fc.weight": f(head["fc"]["kernel"]).T, "norm.weight": f(head["norm"]["scale"]),
               "lm_head.weight": f(lm_head), p + "input_layernorm.weight": f(head["input_layernorm"]["scale"]),
               p + "hidden_norm.weight": f(head["hidden_norm"]["scale"]), **_layer_tensors(head, p, config),
               "d2t": vocab_ids - np.arange(len(vocab_ids))}
    t2d = np.zeros((config.vocab_size,), bool)
    t2d[vocab_ids] = True
    tensors["t2d"] = t2d
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / "model.safetensors", {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                 {"format": "pt"})
    geometry = _geometry_dict(config, head["mlp"]["down_proj"]["kernel"].shape[0])
    aux = [i + 1 for i in feature_layers]
    if layout == "eagle":
        d = dict(geometry, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=len(vocab_ids),
                 eagle_aux_hidden_state_layer_ids=aux)
    else:
        d = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
             "draft_vocab_size": len(vocab_ids), "transformer_layer_config": geometry,
             "eagle_aux_hidden_state_layer_ids": aux}
    write_json(directory / "config.json", d)
    return directory


def read_published_eagle1(directory: Path, target) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(drafter params ``{"head", "lm_head", "vocab_ids"}``, no feature layers: the head reads the
    target's final hidden state) of a published EAGLE-1 head for ``target``, every tensor named
    and shaped as the target's geometry implies (a missing or unexpected one named), the
    weights in the target's dtype; the LM head and vocabulary are the target's."""
    import jax.numpy as jnp

    from jspec.models.llama import output_embedding

    cfg = target.config
    _config(directory, cfg, "EAGLE-1")
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    flat = _tensors(directory)
    flat.pop("lm_head.weight", None)  # the target's LM head is used
    fc, prefix = ("fusion_fc.", "transformer.") if "fusion_fc.weight" in flat else ("fc.", "layers.0.")
    if f"{prefix}self_attn.q_proj.weight" not in flat:
        raise CheckpointError(f"{directory}: missing tensor {prefix}self_attn.q_proj.weight: not an EAGLE-1 head's "
                              "layout")
    gate = flat.get(f"{prefix}mlp.gate_proj.weight")
    inter = gate.shape[0] if gate is not None and gate.ndim == 2 else None
    layernorms = "embedding_layernorm.weight" in flat or f"{prefix}input_layernorm.weight" in flat
    shapes = {fc + "weight": (h, 2 * h),
              **_layer_shapes(prefix, h, q, kv, inter, h, f"{prefix}self_attn.q_proj.bias" in flat)}
    if fc + "bias" in flat:
        shapes[fc + "bias"] = (h,)
    if layernorms:
        shapes.update({"embedding_layernorm.weight": (h,), f"{prefix}input_layernorm.weight": (h,),
                       "pre_lm_head_layernorm.weight": (h,)})
    _check_tensors(directory, flat, shapes, set(shapes), cfg, "EAGLE-1")
    dtype = jnp.dtype(cfg.dtype)
    head = {"fc": {"kernel": jnp.asarray(np.asarray(flat[fc + "weight"], np.float32).T, dtype)},
            **_layer(flat, prefix, dtype)}
    if fc + "bias" in flat:
        head["fc"]["bias"] = jnp.asarray(np.asarray(flat[fc + "bias"], np.float32), dtype)
    if layernorms:
        head.update({"embedding_layernorm": _scale(flat, "embedding_layernorm.weight", dtype),
                     "input_layernorm": _scale(flat, f"{prefix}input_layernorm.weight", dtype),
                     "pre_lm_head_layernorm": _scale(flat, "pre_lm_head_layernorm.weight", dtype)})
    params = {"head": head, "lm_head": output_embedding(target.params, cfg),
              "vocab_ids": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}
    return params, ()


def write_published_eagle1(directory: Path, head: dict, config, layout: str = "eagle") -> Path:
    """The inverse of :func:`read_published_eagle1`: a :class:`PublishedEagle1Head`'s parameters
    written as the EAGLE authors lay them out (``layout="eagle"``: ``fc.``, ``layers.0.``, a
    one-layer Llama config) or as the ``speculators`` format does (``"speculators"``:
    ``fusion_fc.``, ``transformer.``, geometry under ``transformer_layer_config``). ``config``:
    the target's."""
    from jspec.loading.drafts import save_tensors, write_json

    if layout not in ("eagle", "speculators"):
        raise ValueError(f"layout must be 'eagle' or 'speculators', got {layout!r}")
    fc, p = ("fc.", "layers.0.") if layout == "eagle" else ("fusion_fc.", "transformer.")
    f = lambda x: np.ascontiguousarray(np.asarray(x, np.float32))  # noqa: E731
    tensors = {fc + "weight": f(head["fc"]["kernel"]).T, **_layer_tensors(head, p, config)}
    if "bias" in head["fc"]:
        tensors[fc + "bias"] = f(head["fc"]["bias"])
    layernorms = "embedding_layernorm" in head
    if layernorms:
        tensors.update({"embedding_layernorm.weight": f(head["embedding_layernorm"]["scale"]),
                        p + "input_layernorm.weight": f(head["input_layernorm"]["scale"]),
                        "pre_lm_head_layernorm.weight": f(head["pre_lm_head_layernorm"]["scale"])})
    directory.mkdir(parents=True, exist_ok=True)
    save_tensors(directory / "model.safetensors", {k: np.ascontiguousarray(v) for k, v in tensors.items()},
                 {"format": "pt"})
    geometry = _geometry_dict(config, head["mlp"]["down_proj"]["kernel"].shape[0])
    if layout == "eagle":
        d = dict(geometry, architectures=["LlamaForCausalLM"], bias="bias" in head["fc"])
    else:
        d = {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
             "transformer_layer_config": geometry, "layernorms": layernorms, "fusion_bias": "bias" in head["fc"]}
    write_json(directory / "config.json", d)
    return directory


__all__ = ["IGNORED", "PREFIXES", "feature_layers_of", "is_published_eagle3", "published_kind",
           "read_published_eagle1", "read_published_eagle3", "write_published_eagle1", "write_published_eagle3"]
