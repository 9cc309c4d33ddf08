"""Hugging Face checkpoint directories: ``config.json``, ``*.safetensors`` (one file or shards
with ``model.safetensors.index.json``) and ``tokenizer.json``.

Only safetensors are read. Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) can run code when
loaded, so they are refused with a clear error rather than unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from jspec.config import GEMMA_ARCHITECTURES, SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling
from jspec.errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnsupportedModelError
from jspec.loading import schema

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def refuse_pickle(path: Path) -> None:
    raise UnsupportedModelError(
        f"{path}: pickle checkpoints ({', '.join(PICKLE_SUFFIXES)}) are not loaded (they can run "
        "arbitrary code); convert to safetensors or GGUF")


MAX_JSON_BYTES = 64 << 20  # config, generation config and index files are kilobytes


def read_json(path: Path, what: str = "JSON") -> Any:
    """Parse a small JSON file; any failure is a :class:`CheckpointError` naming the file."""
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes is too large for a {what} file (limit {MAX_JSON_BYTES})")
        return json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid {what} ({type(e).__name__}: {str(e)[:200]})") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None


def config_from_hf(d: Any, source: str = "config.json", dtype: str = "float32",
                   generation: Optional[Any] = None, generation_source: str = "generation_config.json") -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` (and ``generation_config.json``)
    dictionary, both checked against their schema first (:mod:`jspec.loading.schema`)."""
    d = text_config(d, source)
    model_type = schema.check(d, schema.HF_MODEL_TYPE, source)["model_type"]
    defaults = {"gemma2": GEMMA2_DEFAULTS, "gemma3_text": GEMMA3_TEXT_DEFAULTS}.get(model_type)
    if defaults:  # keys missing altogether take transformers' defaults (null stays null)
        d = {**defaults, **d}
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {model_type!r} "
            f"(architectures={d.get('architectures')}); jspec runs {', '.join(SUPPORTED_ARCHITECTURES)}")
    c = schema.check(d, schema.HF_CONFIG, source)
    gemma = gemma_fields(d, c, model_type, source) if model_type in GEMMA_ARCHITECTURES else {}
    if gemma:
        c["rope_scaling"] = c["rope_parameters"] = None  # read per layer type by gemma_fields
    elif c["hidden_act"] != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {c['hidden_act']!r} is not silu")
    if c["mlp_bias"]:
        raise UnsupportedModelError(f"{source}: mlp_bias is not supported")
    schema.hf_consistency(c, source)
    rope = schema.hf_rope(c, source)
    if rope["rope_type"] == "llama3":
        scaling = RopeScaling(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                              rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "default":
        scaling = None
    else:
        raise UnsupportedModelError(f"{source}: rope type {rope['rope_type']!r} is not supported (default, llama3)")
    max_pos = c["max_position_embeddings"]
    window = c["sliding_window"]
    if window and not gemma and (model_type == "mistral" or c["use_sliding_window"]):
        max_pos = min(max_pos, window)  # within the window, sliding attention is full attention
    eos = c["eos_token_id"]
    if generation is not None:
        g = schema.check(generation, schema.GENERATION_CONFIG, generation_source)
        schema.check_token_ids(g, c["vocab_size"], generation_source)
        if g["eos_token_id"] is not None:
            eos = g["eos_token_id"]
    heads = c["num_attention_heads"]
    theta = c["rope_theta"] or rope["rope_theta"] or 10000.0
    if gemma:
        theta = gemma.pop("rope_theta") or theta
    try:
        return ModelConfig(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c["num_key_value_heads"] or heads,
            head_dim=c["head_dim"] or c["hidden_size"] // heads,
            rms_norm_eps=c["rms_norm_eps"],
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=gemma.pop("tie_word_embeddings", c["tie_word_embeddings"]),
            qkv_bias=model_type == "qwen2" or c["attention_bias"],
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            architecture=model_type,
            bos_token_id=c["bos_token_id"],
            eos_token_ids=eos or (),
            dtype=dtype,
            **gemma,
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


def gemma_fields(d: dict, c: dict, model_type: str, source: str) -> dict:
    """ModelConfig's Gemma fields from a checked ``config.json`` (``c``: its HF_CONFIG fields).
    Layer types come from ``layer_types``, else from Gemma 2's alternation (even layers local) or
    Gemma 3's ``sliding_window_pattern`` (every sixth layer global); RoPE from
    ``rope_parameters`` (one block, or one per layer type) or the older ``rope_theta``,
    ``rope_local_base_freq`` and ``rope_scaling`` (linear, global layers)."""
    g = schema.check(d, schema.HF_GEMMA, source)
    act = g["hidden_activation"] or g["hidden_act"] or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{source}: hidden_activation {act!r} is not gelu_pytorch_tanh")
    n = c["num_hidden_layers"]
    names = {"sliding_attention": "sliding", "full_attention": "full"}
    if g["layer_types"] is not None:
        bad = [t for t in g["layer_types"] if t not in names]
        if bad or len(g["layer_types"]) != n:
            schema.fail(source, "layer_types", f"expected {n} of sliding_attention / full_attention, "
                        f"got {len(g['layer_types'])} ({', '.join(map(repr, bad[:3]))})")
        types = tuple(names[t] for t in g["layer_types"])
    elif model_type == "gemma2":
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(n))
    else:
        pattern = g["sliding_window_pattern"] or g["_sliding_window_pattern"] or 6
        types = tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n))
    if "sliding" in types and not c["sliding_window"]:
        schema.fail(source, "sliding_window", "missing (the config has sliding-attention layers)")
    rope = c["rope_parameters"] or {}
    per_type = isinstance(rope.get("full_attention"), dict)
    full = schema.check(rope["full_attention"] if per_type else {**rope, **(c["rope_scaling"] or {})},
                        schema.HF_GEMMA_ROPE, source, "rope_parameters.full_attention." if per_type else "rope_parameters.")
    local = (schema.check(rope.get("sliding_attention") or {}, schema.HF_GEMMA_ROPE, source,
                          "rope_parameters.sliding_attention.") if per_type else {"rope_theta": None})
    if per_type and local["rope_type"] != "default":
        schema.fail(source, "rope_parameters.sliding_attention.rope_type", f"{local['rope_type']!r} is not default")
    if full["rope_type"] == "linear" and full["factor"] is None:
        schema.fail(source, "rope_parameters.factor", "missing (linear RoPE scaling)")
    return dict(hidden_act="gelu_tanh", layer_types=types, sliding_window=c["sliding_window"],
                rope_theta=full["rope_theta"] or c["rope_theta"],
                local_rope_theta=local["rope_theta"] or g["rope_local_base_freq"],
                rope_linear_factor=full["factor"] if full["rope_type"] == "linear" else None,
                query_pre_attn_scalar=g["query_pre_attn_scalar"], attn_logit_softcap=g["attn_logit_softcapping"],
                final_logit_softcap=g["final_logit_softcapping"], tie_word_embeddings=g["tie_word_embeddings"])


# Where a multimodal checkpoint (Gemma 3's Gemma3ForConditionalGeneration) keeps its language
# model's "model.*" tensors: the layout of the published files, and transformers' current one.
LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
# transformers' Gemma2Config / Gemma3TextConfig defaults: what a Gemma config.json may leave out
# (a multimodal Gemma 3's text_config leaves out most of them) means these values there
GEMMA2_DEFAULTS = dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                       rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096, max_position_embeddings=8192,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1)
GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
                            rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=1e4, sliding_window=4096,
                            sliding_window_pattern=6, max_position_embeddings=131072,
                            hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1)


def text_config(d: Any, source: str) -> Any:
    """A multimodal Gemma 3 ``config.json`` (model_type gemma3) -> its language model's config
    (``text_config``, the top level's token ids kept; :func:`config_from_hf` fills in
    Gemma3TextConfig's defaults); any other config as it is. The vision tower is not run: jspec
    generates from text."""
    if not isinstance(d, dict) or d.get("model_type") != "gemma3":
        return d
    text = d.get("text_config")
    if not isinstance(text, dict):
        schema.fail(source, "text_config", "missing (a gemma3 config keeps its language model there)")
    out = {**text, "model_type": "gemma3_text"}  # config_from_hf fills in the defaults
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if d.get(key) is not None and key not in text:
            out[key] = d[key]
    return out


class SafetensorsDir:
    """Lazy access to the tensors of a directory of safetensors files (headers read at once,
    tensor data only by :meth:`get`)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = schema.check_index(read_json(index, "safetensors index"), str(index))
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            weight_map = None
        if not files:
            pickles = [p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
            if pickles:
                refuse_pickle(directory / pickles[0])
            raise CheckpointNotFoundError(f"{directory}: no *.safetensors weights found")
        self._handles = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise CheckpointError(f"{path}: shard named by the index is missing")
            try:
                self._handles[name] = safe_open(str(path), framework="np")
            except Exception as e:  # safetensors raises its own error type on corrupt headers
                raise CheckpointError(f"{path}: cannot read safetensors file ({str(e)[:200]})") from None
        if weight_map is None:
            self._where = {}
            for n, h in self._handles.items():
                for k in h.keys():
                    if k in self._where:
                        raise CheckpointError(f"{directory}: tensor {k} is in both {self._where[k]} and {n}")
                    self._where[k] = n
        else:
            self._where = weight_map
            for k, n in weight_map.items():
                if k not in self._handles[n].keys():
                    raise CheckpointError(f"{index}: tensor {k} is not in {n}, the shard the index names")
        self._stored = {}  # exposed name -> the name in the file, where they differ
        for prefix in LANGUAGE_MODEL_PREFIXES:  # a multimodal checkpoint: its language model only
            if prefix + "embed_tokens.weight" in self._where:
                self._stored = {"model." + k[len(prefix):]: k for k in self._where if k.startswith(prefix)}
                if "lm_head.weight" in self._where:
                    self._stored["lm_head.weight"] = "lm_head.weight"
                self._where = {k: self._where[v] for k, v in self._stored.items()}
                break

    def shape(self, name: str) -> Optional[tuple[int, ...]]:
        """Shape of a tensor from its file's header (no data read), None when absent."""
        shard = self._where.get(name)
        if shard is None:
            return None
        name = self._stored.get(name, name)
        try:
            return tuple(int(x) for x in self._handles[shard].get_slice(name).get_shape())
        except Exception as e:
            raise CheckpointError(f"{self.directory / shard}: cannot read the header of tensor {name} ({e})") from None

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: self.shape(k) for k in self._where}

    def get(self, name: str):
        shard = self._where.get(name)
        if shard is None:
            return None
        name = self._stored.get(name, name)
        try:
            return self._handles[shard].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.directory / shard}: cannot read tensor {name} ({str(e)[:200]})") from None

    def keys(self):
        return self._where.keys()


def load_hf_config(directory: Path, dtype: str = "float32") -> ModelConfig:
    """The config of a Hugging Face directory (``config.json`` + ``generation_config.json``),
    schema-checked; the weights are not looked at (see :func:`open_hf_checkpoint`)."""
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointNotFoundError(f"{directory}: no config.json")
    d = read_json(path)
    gen_path = directory / "generation_config.json"
    gen = read_json(gen_path) if gen_path.exists() else None
    return config_from_hf(d, str(path), dtype, gen, str(gen_path))


def open_hf_checkpoint(directory: Path, dtype: str = "float32", optional: tuple[str, ...] = ()):
    """(config, SafetensorsDir) with the config checked against the tensors' headers: layer
    count and every shape, before any tensor data is read (``optional``: names that may be
    missing, such as a draft's shared embedding)."""
    from jspec.loading.convert import check_checkpoint

    config = load_hf_config(directory, dtype)
    tensors = SafetensorsDir(directory)
    check_checkpoint(config, tensors.shapes(), str(directory), layers_field="num_hidden_layers",
                     optional=optional)
    return config, tensors


def load_hf_params(directory: Path, config: ModelConfig, tensors: Optional[SafetensorsDir] = None):
    from jspec.loading.convert import params_from_hf

    return params_from_hf(config, (tensors or SafetensorsDir(directory)).get, str(directory))


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` for ``cfg`` (Llama, Qwen2, Qwen3, Gemma 2 or Gemma 3; the
    inverse of config_from_hf)."""
    arch = cfg.architecture if cfg.architecture in ("qwen2", "qwen3") else "llama"
    d = {
        "architectures": [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(arch, "LlamaForCausalLM")],
        "model_type": arch,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.qkv_bias,
        "mlp_bias": False, "torch_dtype": cfg.dtype,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                             "high_freq_factor": rs.high_freq_factor,
                             "original_max_position_embeddings": rs.original_max_position_embeddings}
    if cfg.is_gemma:
        d.update(gemma_config_dict(cfg))
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        d["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return d


def gemma_config_dict(cfg: ModelConfig) -> dict:
    """The Gemma part of :func:`hf_config_dict` (transformers' current layout: ``layer_types``,
    one RoPE block per layer type for Gemma 3)."""
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_linear_factor is not None:
        full = {"rope_type": "linear", "factor": cfg.rope_linear_factor, "rope_theta": cfg.rope_theta}
    if cfg.architecture == "gemma3_text":
        rope = {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                              "rope_theta": cfg.local_rope_theta or cfg.rope_theta}}
    else:
        rope = full
    types = cfg.layer_types or ("full",) * cfg.num_layers
    d = {"architectures": [{"gemma2": "Gemma2ForCausalLM"}.get(cfg.architecture, "Gemma3ForCausalLM")],
         "model_type": cfg.architecture, "hidden_activation": "gelu_pytorch_tanh", "rope_parameters": rope,
         "layer_types": [f"{t}_attention" for t in types], "sliding_window": cfg.sliding_window,
         "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
         "attn_logit_softcapping": cfg.attn_logit_softcap, "final_logit_softcapping": cfg.final_logit_softcap}
    d["hidden_act"] = d["hidden_activation"]
    return d
