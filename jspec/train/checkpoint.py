"""Draft checkpoints: safetensors + a JSON card, in ``checkpoints/NAME``.

A ``small-llama`` draft is a complete Hugging Face Llama directory (``config.json`` +
``model.safetensors``) plus ``card.json``, so transformers' assisted generation can load the
very same draft. An ``eagle`` head is ``eagle.safetensors`` + ``card.json``.

The card records what the draft is and whom it drafts for:

    {"format": "jspec-draft", "version": 1, "architecture": "small-llama" | "eagle",
     "target": {"name": ..., "weights_sha256": ..., "vocab_size": ...},
     "config": {...}, "data": {...}, "training": {...}, "measured": {...}}

Loading a draft whose card names another target (a different weights hash) is refused with
:class:`DraftMismatchError`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jspec.errors import CheckpointError, DraftMismatchError

CARD = "card.json"
FORMAT = "jspec-draft"


SHIPPED = Path(__file__).resolve().parents[2] / "checkpoints"


def resolve_draft_path(name_or_path: str) -> Path | None:
    """A path, or the name of a draft shipped in this project's ``checkpoints/``; None when
    neither exists (the name may still be a model name such as ``smollm2-135m``)."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if (SHIPPED / name_or_path).exists():
        return SHIPPED / name_or_path
    return None


def read_card(directory: Path) -> dict[str, Any] | None:
    path = directory / CARD
    if not path.exists():
        return None
    try:
        card = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if card.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a jspec draft card (format {card.get('format')!r})")
    return card


def check_card_target(card: dict, target, source: Path) -> None:
    """Refuse a draft trained for another target."""
    want = card.get("target", {}).get("weights_sha256")
    if want and want != target.weights_hash():
        raise DraftMismatchError(
            f"{source}: draft was trained for target {card['target'].get('name')!r} "
            f"(weights sha256 {want[:12]}...), not for {target.source.name} ({target.weights_hash()[:12]}...)")


def load_draft(name_or_path: str, target, expect_arch: str):
    """Load a draft for ``target``: a jspec draft checkpoint (card checked) or any model."""
    from jspec.loading import load_model

    path = resolve_draft_path(name_or_path)
    if path is None:
        return load_model(name_or_path, dtype=target.config.dtype)
    card = read_card(path) if path.is_dir() else None
    if card is not None:
        if card.get("architecture") != expect_arch:
            raise DraftMismatchError(f"{path}: card says architecture {card.get('architecture')!r}, "
                                     f"expected {expect_arch!r}")
        check_card_target(card, target, path)
    return load_model(str(path), dtype=target.config.dtype)
