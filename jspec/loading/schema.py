"""Declared schemas of the metadata jspec reads, one table per file kind.

Every value a checkpoint supplies goes through :func:`check` before anything uses it: its JSON
(or GGUF) type, its range, and, in the ``*_consistency`` functions, how fields relate (heads
dividing the hidden size, a complete ``rope_scaling`` block, token ids inside the vocabulary).
A failure raises :class:`CheckpointError` naming the file and the field::

    path/config.json: num_attention_heads: expected an integer in [1, 2147483647], got '8' (str)

Sizes are capped at int32 (they travel as int32 on the device); what a file *can* hold is
checked later against its tensors (:func:`jspec.loading.convert.check_checkpoint`).

Tables:
    HF_CONFIG          Hugging Face ``config.json`` (llama, qwen2, qwen3, mistral, gemma2, gemma3_text)
    HF_GEMMA           its Gemma fields (activation, layer types, window, score scale and caps, RoPE)
    HF_ROPE_LLAMA3     its ``rope_scaling`` block when ``rope_type`` is ``llama3``
    GENERATION_CONFIG  ``generation_config.json`` (only the fields jspec reads)
    SAFETENSORS_INDEX  ``model.safetensors.index.json``
    gguf_fields(arch)  GGUF metadata of a llama/qwen2/qwen3/mistral/gemma2/gemma3 file
    DRAFT_CARD         a jspec draft's ``card.json`` (and DRAFT_CARD_TARGET, DRAFT_CARD_VOCAB)
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Optional

from jspec.config import INT32_MAX
from jspec.errors import CheckpointError

KINDS = ("int", "float", "bool", "str", "object", "token_ids", "str_map", "str_list")


@dataclasses.dataclass(frozen=True)
class Field:
    """One field: ``kind`` (see KINDS), whether it must be there, and its allowed values.

    ``lo``/``hi`` bound numbers (inclusive; ``lo_open`` makes the lower bound exclusive),
    ``choices`` lists allowed strings, ``pattern`` is a regular expression strings must match.
    JSON ``null`` counts as absent (Hugging Face writes ``"head_dim": null``).
    """

    key: str
    kind: str
    required: bool = False
    default: Any = None
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    choices: Optional[tuple] = None
    pattern: Optional[str] = None

    def __post_init__(self):
        assert self.kind in KINDS, self.kind


def _size(key, required=False, lo=1, **kw) -> Field:
    return Field(key, "int", required, lo=lo, hi=INT32_MAX, **kw)


def _positive(key, **kw) -> Field:
    return Field(key, "float", lo=0.0, lo_open=True, **kw)


def _describe(v: Any) -> str:
    text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(v).__name__})"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number_ok(v, f: Field) -> bool:
    if f.lo is not None and (v <= f.lo if f.lo_open else v < f.lo):
        return False
    return f.hi is None or v <= f.hi


def _range_text(f: Field, what: str) -> str:
    if f.lo is None and f.hi is None:
        return what
    lo = "-inf" if f.lo is None else f.lo
    hi = "inf" if f.hi is None else f.hi
    return f"{what} in {'(' if f.lo_open else '['}{lo}, {hi}]"


def check_value(v: Any, f: Field, source: str, prefix: str = "") -> Any:
    """``v`` checked against ``f`` (and normalized: floats as float, token ids as a tuple)."""
    def bad(expected: str):
        raise CheckpointError(f"{source}: {prefix}{f.key}: expected {expected}, got {_describe(v)}")

    if f.kind == "int":
        if not _is_int(v) or not _number_ok(v, f):
            bad(_range_text(f, "an integer"))
        return v
    if f.kind == "float":
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not _number_ok(v, f):
            bad(_range_text(f, "a finite number"))
        return float(v)
    if f.kind == "bool":
        if not isinstance(v, bool):
            bad("true or false")
        return v
    if f.kind == "str":
        if not isinstance(v, str):
            bad("a string")
        if f.choices is not None and v not in f.choices:
            bad(f"one of {', '.join(map(repr, f.choices))}")
        if f.pattern is not None and not re.fullmatch(f.pattern, v):
            bad(f"a string matching {f.pattern}")
        return v
    if f.kind == "object":
        if not isinstance(v, dict):
            bad("an object")
        return v
    if f.kind == "token_ids":  # one id or a list of them
        ids = [v] if _is_int(v) else v
        if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in ids):
            bad("a token id or a list of token ids")
        return tuple(ids)
    if f.kind == "str_map":
        if not isinstance(v, dict) or not all(isinstance(x, str) for x in v.values()):
            bad("an object of strings")
        return v
    if f.kind == "str_list":
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            bad("a list of strings")
        return v
    raise AssertionError(f.kind)


def check(obj: Any, fields: tuple[Field, ...], source: str, prefix: str = "") -> dict[str, Any]:
    """Validate ``obj`` (a JSON object) against ``fields``; returns {key: checked value or default}.
    Keys not in the table are ignored (checkpoints carry many jspec does not use)."""
    if not isinstance(obj, dict):
        where = f"{prefix.rstrip('.')}: " if prefix else ""
        raise CheckpointError(f"{source}: {where}expected a JSON object, got {_describe(obj)}")
    out = {}
    for f in fields:
        v = obj.get(f.key)
        if v is None:
            if f.required:
                raise CheckpointError(f"{source}: missing field {prefix}{f.key}")
            out[f.key] = f.default
        else:
            out[f.key] = check_value(v, f, source, prefix)
    return out


def fail(source: str, field: str, message: str):
    raise CheckpointError(f"{source}: {field}: {message}")


# ----------------------------------------------------------------------------- Hugging Face

HF_MODEL_TYPE = (Field("model_type", "str", required=True),)  # checked first: the architecture decides

HF_CONFIG = HF_MODEL_TYPE + (
    _size("vocab_size", required=True),
    _size("hidden_size", required=True),
    _size("intermediate_size", required=True),
    _size("num_hidden_layers", required=True),
    _size("num_attention_heads", required=True),
    _size("num_key_value_heads"),
    _size("head_dim"),
    _size("max_position_embeddings", default=2048),
    _size("sliding_window"),
    Field("use_sliding_window", "bool", default=False),
    _positive("rms_norm_eps", hi=1.0, default=1e-6),
    _positive("rope_theta"),
    Field("rope_scaling", "object"),
    Field("rope_parameters", "object"),
    Field("hidden_act", "str", default="silu"),
    Field("mlp_bias", "bool", default=False),
    Field("attention_bias", "bool", default=False),
    Field("tie_word_embeddings", "bool", default=False),
    _size("bos_token_id", lo=0),
    Field("eos_token_id", "token_ids"),
)

HF_ROPE = (Field("rope_type", "str"), Field("type", "str"), _positive("rope_theta"))

HF_GEMMA = (
    Field("hidden_activation", "str"),
    Field("hidden_act", "str"),
    Field("layer_types", "str_list"),
    _size("sliding_window_pattern"),
    _size("_sliding_window_pattern"),
    _positive("query_pre_attn_scalar"),
    _positive("attn_logit_softcapping"),
    _positive("final_logit_softcapping"),
    _positive("rope_local_base_freq"),
    Field("tie_word_embeddings", "bool", default=True),
)

HF_GEMMA_ROPE = (Field("rope_type", "str", default="default", choices=("default", "linear")),
                 _positive("rope_theta"), _positive("factor"))

HF_ROPE_LLAMA3 = (
    _positive("factor", required=True),
    _positive("low_freq_factor", required=True),
    _positive("high_freq_factor", required=True),
    _size("original_max_position_embeddings", required=True),
)

GENERATION_CONFIG = (
    _size("bos_token_id", lo=0),
    Field("eos_token_id", "token_ids"),
    _size("pad_token_id", lo=0),
)

SAFETENSORS_INDEX = (
    Field("weight_map", "str_map", required=True),
    Field("metadata", "object"),
)

_SHARD_NAME = r"[^/\\]+\.safetensors"  # a file in the checkpoint directory itself


def check_index(obj: Any, source: str) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: tensor name -> shard file in the same directory."""
    weight_map = check(obj, SAFETENSORS_INDEX, source)["weight_map"]
    if not weight_map:
        fail(source, "weight_map", "is empty")
    for name, shard in weight_map.items():
        if not re.fullmatch(_SHARD_NAME, shard) or shard.startswith("."):
            fail(source, f"weight_map.{name}", f"expected a .safetensors file name in the same directory, got {shard!r}")
    return weight_map


def hf_consistency(c: dict, source: str) -> None:
    """Relations between checked ``config.json`` fields (before ModelConfig is built)."""
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"] or c["num_attention_heads"]
    if heads % kv:
        fail(source, "num_key_value_heads", f"{kv} does not divide num_attention_heads = {heads}")
    if c["head_dim"] is None and c["hidden_size"] % heads:
        fail(source, "num_attention_heads", f"{heads} does not divide hidden_size = {c['hidden_size']} "
             "(and no head_dim is given)")
    head_dim = c["head_dim"] or c["hidden_size"] // heads
    if head_dim % 2:
        fail(source, "head_dim", f"{head_dim} is odd (RoPE rotates pairs)")
    check_token_ids(c, c["vocab_size"], source)


def check_token_ids(c: dict, vocab_size: int, source: str, keys=("bos_token_id", "eos_token_id", "pad_token_id")):
    for key in keys:
        v = c.get(key)
        ids = v if isinstance(v, tuple) else () if v is None else (v,)
        for t in ids:
            if t >= vocab_size:
                fail(source, key, f"token id {t} is outside the vocabulary of {vocab_size} tokens")


def hf_rope(c: dict, source: str) -> Optional[dict]:
    """The checked llama3 ``rope_scaling`` block, None for default RoPE (other types refused by
    the caller)."""
    rope = dict(c["rope_parameters"] or {})
    rope.update(c["rope_scaling"] or {})
    kinds = check(rope, HF_ROPE, source, "rope_scaling.")
    rope_type = kinds["rope_type"] or kinds["type"] or "default"
    if rope_type != "llama3":
        return {"rope_type": rope_type, "rope_theta": kinds["rope_theta"]}
    out = check(rope, HF_ROPE_LLAMA3, source, "rope_scaling.")
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        fail(source, "rope_scaling.high_freq_factor",
             f"{out['high_freq_factor']} must exceed low_freq_factor = {out['low_freq_factor']}")
    return dict(out, rope_type="llama3", rope_theta=kinds["rope_theta"])


# ----------------------------------------------------------------------------- GGUF

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3")


def gguf_fields(arch: str) -> tuple[Field, ...]:
    """GGUF metadata keys jspec reads for architecture ``arch`` (keys are ``{arch}.…``)."""
    a = f"{arch}."
    return (
        _size(a + "block_count", required=True),
        _size(a + "embedding_length", required=True),
        _size(a + "feed_forward_length", required=True),
        _size(a + "attention.head_count", required=True),
        _size(a + "attention.head_count_kv"),
        _size(a + "attention.key_length"),
        _size(a + "attention.value_length"),
        _positive(a + "attention.layer_norm_rms_epsilon", hi=1.0, default=1e-5),
        _positive(a + "rope.freq_base", default=10000.0),
        Field(a + "rope.scaling.type", "str", choices=("none", "linear") if arch == "gemma3" else ("none",)),
        _positive(a + "rope.scaling.factor"),
        _size(a + "attention.sliding_window"),
        _positive(a + "attn_logit_softcapping"),
        _positive(a + "final_logit_softcapping"),
        _size(a + "context_length", default=2048),
        _size(a + "vocab_size"),
        _size("tokenizer.ggml.bos_token_id", lo=0),
        _size("tokenizer.ggml.eos_token_id", lo=0),
        Field("tokenizer.ggml.tokens", "str_list"),
    )


def gguf_consistency(m: dict, arch: str, source: str) -> dict:
    """Relations between GGUF fields; returns the resolved sizes (vocab, heads, kv heads, head_dim)."""
    a = f"{arch}."
    heads = m[a + "attention.head_count"]
    kv = m[a + "attention.head_count_kv"] or heads
    hidden = m[a + "embedding_length"]
    if heads % kv:
        fail(source, a + "attention.head_count_kv", f"{kv} does not divide attention.head_count = {heads}")
    head_dim = m[a + "attention.key_length"]
    if head_dim is None:
        if hidden % heads:
            fail(source, a + "attention.head_count", f"{heads} does not divide embedding_length = {hidden} "
                 "(and no attention.key_length is given)")
        head_dim = hidden // heads
    if head_dim % 2:
        fail(source, a + "attention.key_length", f"{head_dim} is odd (RoPE rotates pairs)")
    value_length = m[a + "attention.value_length"]
    if value_length is not None and value_length != head_dim:
        fail(source, a + "attention.value_length", f"{value_length} differs from key_length = {head_dim}")
    tokens = m["tokenizer.ggml.tokens"]
    vocab = m[a + "vocab_size"] or (len(tokens) if tokens else None)
    if vocab is None:
        fail(source, a + "vocab_size", "missing (and no tokenizer.ggml.tokens to count)")
    if tokens and len(tokens) > vocab:
        fail(source, "tokenizer.ggml.tokens", f"{len(tokens)} tokens for a vocab_size of {vocab}")
    check_token_ids(m, vocab, source, ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"))
    return {"vocab_size": vocab, "num_heads": heads, "num_kv_heads": kv, "head_dim": head_dim}


# ----------------------------------------------------------------------------- draft cards

DRAFT_ARCHITECTURES = ("small-llama", "eagle")

DRAFT_CARD = (
    Field("format", "str", required=True, choices=("jspec-draft",)),
    Field("version", "int", required=True, lo=1, hi=1),
    Field("architecture", "str", required=True, choices=DRAFT_ARCHITECTURES),
    Field("target", "object", required=True),
    Field("draft_vocab", "object"),
    Field("config", "object"),
    Field("data", "object"),
    Field("training", "object"),
    Field("measured", "object"),
    Field("shares_target_embedding", "bool"),
)

DRAFT_CARD_TARGET = (
    Field("name", "str"),
    Field("weights_sha256", "str", pattern=r"[0-9a-f]{64}"),
    _size("vocab_size"),
)

DRAFT_CARD_VOCAB = (
    _size("size"),
    Field("coverage_of_target_choices", "float", lo=0.0, hi=1.0),
)


def check_card(obj: Any, source: str) -> dict:
    """A draft card checked against DRAFT_CARD and its ``target`` and ``draft_vocab`` blocks;
    returns it unchanged (fields jspec does not read are kept: they document the draft)."""
    card = check(obj, DRAFT_CARD, source)
    check(card["target"], DRAFT_CARD_TARGET, source, "target.")
    if card["draft_vocab"] is not None:
        check(card["draft_vocab"], DRAFT_CARD_VOCAB, source, "draft_vocab.")
    return obj


__all__ = ["Field", "check", "check_value", "check_index", "check_card", "gguf_fields", "gguf_consistency",
           "hf_consistency", "hf_rope", "HF_CONFIG", "HF_GEMMA", "GENERATION_CONFIG", "SAFETENSORS_INDEX", "DRAFT_CARD"]
