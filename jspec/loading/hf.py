"""Hugging Face checkpoint directories: ``config.json``, ``*.safetensors`` (one file or shards
with ``model.safetensors.index.json``) and ``tokenizer.json``.

Only safetensors are read. Pickle checkpoints (``.bin``, ``.pt``, ``.pth``) can run code when
loaded, so they are refused with a clear error rather than unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from jspec.config import ModelConfig, RopeScaling
from jspec.errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnsupportedModelError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def refuse_pickle(path: Path) -> None:
    raise UnsupportedModelError(
        f"{path}: pickle checkpoints ({', '.join(PICKLE_SUFFIXES)}) are not loaded (they can run "
        "arbitrary code); convert to safetensors or GGUF")


def _required(d: dict, key: str, source: str) -> Any:
    if key not in d:
        raise CheckpointError(f"{source}: missing {key!r}")
    return d[key]


def config_from_hf(d: dict, source: str = "config.json", dtype: str = "float32",
                   generation: Optional[dict] = None) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face ``config.json`` dictionary."""
    model_type = d.get("model_type")
    if model_type not in ("llama", "qwen2", "mistral"):
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {model_type!r} "
            f"(architectures={d.get('architectures')}); jspec runs llama, qwen2 and mistral")
    if d.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {d.get('hidden_act')!r} is not silu")
    if d.get("mlp_bias", False):
        raise UnsupportedModelError(f"{source}: mlp_bias is not supported")
    hidden = int(_required(d, "hidden_size", source))
    heads = int(_required(d, "num_attention_heads", source))
    rope = dict(d.get("rope_parameters") or {})
    rope.update(d.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        scaling = RopeScaling(float(rope["factor"]), float(rope["low_freq_factor"]),
                              float(rope["high_freq_factor"]),
                              int(rope["original_max_position_embeddings"]))
    else:
        raise UnsupportedModelError(f"{source}: rope type {rope_type!r} is not supported (default, llama3)")
    max_pos = int(d.get("max_position_embeddings", 2048))
    window = d.get("sliding_window")
    if window and (model_type == "mistral" or d.get("use_sliding_window")):
        max_pos = min(max_pos, int(window))  # within the window, sliding attention is full attention
    eos = d.get("eos_token_id")
    if generation and generation.get("eos_token_id") is not None:
        eos = generation["eos_token_id"]
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    try:
        return ModelConfig(
            vocab_size=int(_required(d, "vocab_size", source)),
            hidden_size=hidden,
            intermediate_size=int(_required(d, "intermediate_size", source)),
            num_layers=int(_required(d, "num_hidden_layers", source)),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            architecture=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos,
            dtype=dtype,
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from None


class SafetensorsDir:
    """Lazy access to the tensors of a directory of safetensors files."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = directory
        index = directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
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
            if not path.exists():
                raise CheckpointError(f"{path}: shard named by the index is missing")
            try:
                self._handles[name] = safe_open(str(path), framework="np")
            except Exception as e:  # safetensors raises its own error type on corrupt headers
                raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
        self._where = weight_map or {k: n for n, h in self._handles.items() for k in h.keys()}

    def get(self, name: str):
        shard = self._where.get(name)
        if shard is None:
            return None
        try:
            return self._handles[shard].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{self.directory / shard}: cannot read tensor {name} ({e})") from None

    def keys(self):
        return self._where.keys()


def load_hf_config(directory: Path, dtype: str = "float32") -> ModelConfig:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointNotFoundError(f"{directory}: no config.json")
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    gen_path = directory / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    return config_from_hf(d, str(path), dtype, gen)


def load_hf_params(directory: Path, config: ModelConfig):
    from jspec.loading.convert import params_from_hf

    return params_from_hf(config, SafetensorsDir(directory).get, str(directory))


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face ``config.json`` for ``cfg`` (Llama or Qwen2; the inverse of config_from_hf)."""
    d = {
        "architectures": ["Qwen2ForCausalLM" if cfg.architecture == "qwen2" else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.architecture == "qwen2" else "llama",
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
    if cfg.bos_token_id is not None:
        d["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_ids:
        d["eos_token_id"] = cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
    return d
