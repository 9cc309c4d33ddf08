"""Tokenizers through ``transformers``.

For GGUF files transformers builds the tokenizer from the GGUF metadata, which takes seconds;
the result is saved once under ``$JSPEC_CACHE_DIR`` (default ``~/.cache/jspec``) keyed by the
file's path, size and mtime, and read from there afterwards. The save is atomic (a temporary
directory renamed into place), so an interrupted run leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
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
    AutoTokenizer = _quiet_auto_tokenizer()
    if fmt == "hf":
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
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:
            shutil.rmtree(cached, ignore_errors=True)  # stale or broken: rebuild below
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
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
