"""Tokenizers through ``transformers``.

For GGUF files transformers builds the tokenizer from the GGUF metadata, which takes seconds;
the result is saved once under ``$JSPEC_CACHE_DIR`` (default ``~/.cache/jspec``) keyed by the
file's path, size and mtime, and read from there afterwards. The save is atomic (a temporary
directory renamed into place), so an interrupted run leaves nothing half-written.

transformers' own GGUF route (``AutoTokenizer.from_pretrained(gguf_file=...)``) reads the
metadata with a reader that imports PyTorch, which is not among jspec's dependencies. Where
PyTorch does not import, :func:`gguf_tokenizer_without_torch` reads the same metadata with
jspec's GGUF reader and hands it to transformers' GGUF tokenizer converter: the same
tokenizer.json, chat template and special tokens (tests/test_tokenizer.py compares the two).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from jspec.errors import CheckpointError


def cache_dir() -> Path:
    return Path(os.environ.get("JSPEC_CACHE_DIR", Path.home() / ".cache" / "jspec"))


def _quiet_auto_tokenizer():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(fmt: str, path: Path):
    """The tokenizer of a checkpoint, or None for a Hugging Face directory without one."""
    if fmt == "hf":
        AutoTokenizer = _quiet_auto_tokenizer()
        if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            return None
        try:
            return AutoTokenizer.from_pretrained(str(path))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").exists():
        try:
            return _cached_fast_tokenizer(cached)
        except Exception:
            shutil.rmtree(cached, ignore_errors=True)  # stale or broken: rebuild below
    AutoTokenizer = _quiet_auto_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if importlib.util.find_spec("torch") is None:
                tok = gguf_tokenizer_without_torch(path)
            else:
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata ({e})") from None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tok.save_pretrained(str(tmp))
        os.replace(tmp, cached)
    except OSError:
        shutil.rmtree(locals().get("tmp", ""), ignore_errors=True)  # cache is an optimisation only
    return tok


def _cached_fast_tokenizer(directory: Path):
    """A tokenizer this module saved, read as the fast tokenizer it is (a tokenizer.json). Not
    through AutoTokenizer: its config machinery imports PyTorch where it is installed, ~1.6 s of a
    warm start's ~10 (measured 2026-12-07), for a class the cache already names."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)


# GGUF tokenizer.ggml.* ids -> the special-token names transformers' tokenizers take
SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}


def gguf_tokenizer_without_torch(path: Path):
    """The tokenizer of a GGUF file as ``AutoTokenizer.from_pretrained(gguf_file=...)`` builds it
    (transformers >= 5), its metadata read by :class:`jspec.loading.gguf_loader.GGUFFile` instead
    of transformers' reader, which imports PyTorch."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from jspec.loading.gguf_loader import GGUFFile

    gguf = GGUFFile(path)
    groups = {group: {name: value for key, name in renames.items()
                      if (value := gguf.field(f"tokenizer.{key}")) is not None}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for a sentencepiece vocabulary
    for name, key in SPECIAL_TOKENS.items():
        token_id = gguf.field(f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(gguf.arch, tokenizer)
    return TokenizersBackend(tokenizer_object=backend, **config, **extra)
