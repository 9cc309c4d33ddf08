"""Draft checkpoints: safetensors + a JSON card, in ``checkpoints/NAME``.

The drafts jspec ships are found by name (:func:`resolve_draft_path`) in :func:`shipped_dir`:
the top-level ``checkpoints/`` of a source checkout, or the package data ``jspec.checkpoints``
of an installed jspec.

``small-llama`` (a distilled few-layer Llama)::

    config.json          Hugging Face Llama config of the draft
    model.safetensors    its tensors under Hugging Face names, *without* the embedding: the draft
                         shares the target's (frozen) token embedding / tied LM head
    draft_vocab.safetensors   ``draft_vocab_ids``: the tokens its drafting head covers
    card.json

``eagle`` (a feature-level head; EAGLE-1 and EAGLE-3 heads published by others load too, see
:mod:`jspec.loading.eagle_formats`)::

    eagle.safetensors    ``head/...`` parameters and ``draft_vocab_ids``
    card.json            ``config.feature_layers``: the target layers an EAGLE-3 head fuses
                         (absent or empty: an EAGLE-1 head on the target's final hidden state)

The card records what the draft is and whom it drafts for::

    {"format": "jspec-draft", "version": 1, "architecture": "small-llama" | "eagle",
     "target": {"name", "weights_sha256", "vocab_size"}, "config": {...}, "data": {...},
     "training": {...}, "measured": {...}}

A draft whose card names another target (another weights hash) is refused with
:class:`DraftMismatchError`. Files are written to a temporary name and renamed into place, so
an interrupted save leaves no half-written file. ``export_hf`` writes a complete Hugging Face
directory (embedding and tokenizer included) that transformers' assisted generation loads.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jspec.errors import CheckpointError, CheckpointNotFoundError, DraftMismatchError, UnsupportedModelError
from jspec.loading import schema

CARD = "card.json"
FORMAT = "jspec-draft"
PACKAGE = "jspec.checkpoints"  # pyproject.toml maps it to the top-level checkpoints/


def shipped_dir() -> Path | None:
    """The folder of the shipped drafts, None when neither place has one.

    In a source checkout (``jspec/`` beside ``pyproject.toml``, run from the tree or installed
    editable) it is that checkout's ``checkpoints/``, where ``jspec distill --out
    checkpoints/NAME`` writes: the drafts belong to the jspec that is imported, even when
    another checkout is installed. Otherwise it is the installed package data, found through
    ``importlib.resources``."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() and (root / "checkpoints").is_dir():
        return root / "checkpoints"
    try:
        found = importlib.resources.files(PACKAGE)
    except ModuleNotFoundError:
        return None
    return found if isinstance(found, Path) and found.is_dir() else None  # a zip import has no folder


# ----------------------------------------------------------------------------- files

def flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """Nested dict of arrays -> {"a/b/c": array}."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = np.asarray(jax.device_get(v))
    return out


def unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for key, v in flat.items():
        node = tree
        *parents, leaf = key.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; checkpoints are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_tensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    from safetensors.numpy import save_file

    tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    _atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: missing")
    try:
        return load_file(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None


def write_json(path: Path, obj: Any) -> None:
    _atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


# ----------------------------------------------------------------------------- cards

def resolve_draft_path(name_or_path: str) -> Path | None:
    """A path, or the name of a draft jspec ships (:func:`shipped_dir`); None when neither
    exists (the name may still be a model name such as ``smollm2-135m``)."""
    try:
        p = Path(name_or_path).expanduser()
        if p.exists():
            return p
        shipped = shipped_dir()
        if shipped is not None and (shipped / name_or_path).exists():
            return shipped / name_or_path
    except (OSError, ValueError) as e:  # a name too long, a NUL byte
        raise CheckpointNotFoundError(f"{name_or_path!r}: not a usable draft path ({e})") from None
    return None


def read_card(directory: Path) -> dict[str, Any] | None:
    """The draft's card checked against :data:`jspec.loading.schema.DRAFT_CARD`, None without one."""
    from jspec.loading.hf import read_json

    path = directory / CARD
    if not path.exists():
        return None
    return schema.check_card(read_json(path, "draft card"), str(path))


def target_identity(target) -> dict:
    return {"name": target.source.name, "weights_sha256": target.weights_hash(),
            "vocab_size": target.config.vocab_size}


def check_card(card: dict, target, source: Path, architecture: str) -> None:
    """Refuse a draft of another architecture or trained for another target."""
    if card.get("architecture") != architecture:
        raise DraftMismatchError(f"{source}: card says architecture {card.get('architecture')!r}, "
                                 f"expected {architecture!r}")
    ident = card.get("target") or {}
    vocab = ident.get("vocab_size")
    if vocab is not None and vocab != target.config.vocab_size:
        raise DraftMismatchError(f"{source}: draft was trained for a vocabulary of {vocab} tokens, the target "
                                 f"{target.source.name} has {target.config.vocab_size}")
    want = ident.get("weights_sha256")
    if want and want != target.weights_hash():
        raise DraftMismatchError(
            f"{source}: draft was trained for target {ident.get('name')!r} "
            f"(weights sha256 {want[:12]}...), not for {target.source.name} ({target.weights_hash()[:12]}...)")


def check_vocab_ids(ids, target, card: dict, source: Path) -> np.ndarray:
    """A draft vocabulary: distinct integer ids of the target's vocabulary, as many as the card says."""
    ids = np.asarray(ids)
    v = target.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise CheckpointError(f"{source}: draft_vocab_ids must be a non-empty 1-D integer tensor, "
                              f"got {ids.dtype} of shape {ids.shape}")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= v:
        raise DraftMismatchError(f"{source}: draft_vocab_ids hold ids in [{lo}, {hi}], outside the target's "
                                 f"vocabulary [0, {v})")
    if np.unique(ids).size != ids.size:
        raise CheckpointError(f"{source}: draft_vocab_ids repeat {ids.size - np.unique(ids).size} ids")
    size = (card.get("draft_vocab") or {}).get("size")
    if size is not None and size != ids.size:
        raise CheckpointError(f"{source}: draft_vocab_ids hold {ids.size} ids, the card says draft_vocab.size = {size}")
    return ids.astype(np.int32)


# ----------------------------------------------------------------------------- small-llama

def save_small_llama(out: Path, config, params, vocab_ids, card: dict) -> None:
    """Write a distilled draft (its embedding is the target's and is not stored)."""
    from jspec.loading.convert import params_to_hf
    from jspec.loading.hf import hf_config_dict

    tensors = params_to_hf(config, params)
    tensors.pop("model.embed_tokens.weight")
    save_tensors(out / "model.safetensors", tensors, {"format": "pt"})
    save_tensors(out / "draft_vocab.safetensors", {"draft_vocab_ids": np.asarray(vocab_ids, np.int32)})
    write_json(out / "config.json", hf_config_dict(config))
    write_json(out / CARD, dict(card, format=FORMAT, version=1, architecture="small-llama",
                                shares_target_embedding=True))


def load_small_llama(path: Path, target, card: dict | None = None):
    """(LoadedModel of the draft with the target's embedding, draft vocabulary ids or None)."""
    from jspec.loading import LoadedModel
    from jspec.loading.convert import check_load_fits, params_from_hf
    from jspec.loading.hf import open_hf_checkpoint

    card = card or {}
    config, tensors = open_hf_checkpoint(path, target.config.dtype, optional=("model.embed_tokens.weight",))
    check_load_fits(config, str(path))
    embed = np.asarray(jax.device_get(target.params["embed_tokens"]["embedding"]))

    def get(name):
        t = tensors.get(name)
        return embed if t is None and name == "model.embed_tokens.weight" else t

    params = params_from_hf(config, get, str(path))
    vocab_ids = None
    vocab_file = path / "draft_vocab.safetensors"
    if vocab_file.exists():
        flat = load_tensors(vocab_file)
        if "draft_vocab_ids" not in flat:
            raise CheckpointError(f"{vocab_file}: missing tensor draft_vocab_ids")
        vocab_ids = jax.numpy.asarray(check_vocab_ids(flat["draft_vocab_ids"], target, card, vocab_file))
    elif card.get("draft_vocab") is not None:
        raise CheckpointError(f"{vocab_file}: missing (the card declares a draft vocabulary of "
                              f"{card['draft_vocab'].get('size')} tokens)")
    return LoadedModel(config, params, target.tokenizer, path, "jspec-draft"), vocab_ids


def load_draft(name_or_path: str, target):
    """A draft model for ``target``: a jspec small-llama checkpoint (card checked; returns its
    draft vocabulary too) or any model name/path (vocabulary ids None)."""
    from jspec.loading import load_model

    path = resolve_draft_path(name_or_path)
    if path is None:
        return load_model(name_or_path, dtype=target.config.dtype), None
    card = read_card(path) if path.is_dir() else None
    if card is None:
        return load_model(str(path), dtype=target.config.dtype), None
    check_card(card, target, path, "small-llama")
    return load_small_llama(path, target, card)


def _stored_elements(directory: Path) -> dict[str, int]:
    """Elements of each floating-point tensor in a directory's safetensors files (headers only)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="np") as h:
                for name in h.keys():
                    sl = h.get_slice(name)
                    if not sl.get_dtype().startswith(("I", "U", "BOOL")):
                        out[name] = int(np.prod(sl.get_shape(), dtype=np.int64))
        except Exception as e:  # safetensors raises its own error type on corrupt headers
            raise CheckpointError(f"{f}: cannot read safetensors header ({str(e)[:200]})") from None
    return out


def drafter_geometry(method: str, name_or_path: str | None, target_config, dtype: str):
    """(config of the pages the drafter keeps, or None; its parameter count) for a speculative
    ``method`` over a target of ``target_config``, from headers and cards alone: what
    :func:`jspec.engine.plan.plan_run` needs. A draft model keeps pages of its own geometry, an
    EAGLE head (alone or in the hybrid) one layer of the target's; lookup and layer skipping
    keep none."""
    import dataclasses

    from jspec.loading import read_config

    if method == "draft":
        path = resolve_draft_path(name_or_path)
        if path is not None and path.is_dir() and read_card(path) is not None:
            config = read_config(str(path / "config.json"), dtype)
            return config, sum(_stored_elements(path).values())  # the embedding is the target's
        config = read_config(name_or_path, dtype)
        return config, config.num_params()
    if method in ("eagle", "hybrid"):
        path = resolve_draft_path(name_or_path)
        if path is None or not path.is_dir():
            raise CheckpointNotFoundError(f"{name_or_path}: no such EAGLE checkpoint directory")
        card = read_card(path) or {}
        vocab = (card.get("draft_vocab") or {}).get("size") or target_config.vocab_size
        head = sum(_stored_elements(path).values()) + vocab * target_config.hidden_size  # + its LM head rows
        return dataclasses.replace(target_config, num_layers=1), head
    return None, 0


def export_eagle(path: Path, target, out: Path, layout: str = "eagle") -> Path:
    """A head with a published architecture written in the layout of the EAGLE authors and
    SpecForge (``layout="eagle"``) or of vLLM's ``speculators`` (``"speculators"``), for those
    engines to serve: a head ``jspec distill --arch eagle3-published`` trained, or a published
    head read from either layout (which converts it to the other). jspec's own EAGLE heads have
    no published layout and are refused with what to train instead."""
    from jspec.loading.eagle_formats import write_published_eagle1, write_published_eagle3
    from jspec.models.eagle import is_published, is_published_eagle3

    params, layers = read_eagle(str(path), target)
    head = params["head"]
    if not is_published(head):
        kind = "EAGLE-3" if layers else "EAGLE-1"
        raise UnsupportedModelError(f"{path}: jspec's own {kind} head (fc in front of a standard decoder layer) has "
                                    "no published layout; train one vLLM and SGLang serve with "
                                    "`jspec distill --arch eagle3-published`")
    if is_published_eagle3(head):
        return write_published_eagle3(out, head, params["lm_head"], params["vocab_ids"], target.config, layers, layout)
    return write_published_eagle1(out, head, target.config, layout)


def export_hf(path: Path, target, out: Path) -> Path:
    """A complete Hugging Face Llama directory of a small-llama draft (embedding and the
    target's tokenizer included) for transformers' assisted generation."""
    from jspec.loading.convert import params_to_hf
    from jspec.loading.hf import hf_config_dict

    draft, _ = load_draft(str(path), target)
    save_tensors(out / "model.safetensors", params_to_hf(draft.config, draft.params), {"format": "pt"})
    write_json(out / "config.json", hf_config_dict(draft.config))
    if target.tokenizer is not None:
        target.tokenizer.save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------- eagle

def save_eagle(out: Path, head_params, vocab_ids, card: dict) -> None:
    tensors = {f"head/{k}": v for k, v in flatten(head_params).items()}
    tensors["draft_vocab_ids"] = np.asarray(vocab_ids, np.int32)
    save_tensors(out / "eagle.safetensors", tensors)
    write_json(out / CARD, dict(card, format=FORMAT, version=1, architecture="eagle"))


def load_eagle(name_or_path: str, target) -> dict:
    """Drafter params ``{"head", "lm_head", "vocab_ids"}`` of an EAGLE checkpoint for ``target``."""
    return read_eagle(name_or_path, target)[0]


def eagle_feature_layers(card: dict, target, source: Path) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads (``config.feature_layers``), checked against the
    target: distinct layer indices below its layer count; () for an EAGLE-1 head."""
    layers = (card.get("config") or {}).get("feature_layers") or []
    n = target.config.num_layers
    if (not isinstance(layers, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            or len(set(layers)) != len(layers)):
        raise CheckpointError(f"{source}: config.feature_layers must be a list of distinct layer indices, "
                              f"got {layers!r}")
    if any(not 0 <= i < n for i in layers):
        raise DraftMismatchError(f"{source}: config.feature_layers {layers} name layers outside the target's "
                                 f"{n} (0..{n - 1})")
    return tuple(layers)


def read_eagle(name_or_path: str, target) -> tuple[dict, tuple[int, ...]]:
    """(drafter params ``{"head", "lm_head", "vocab_ids"}``, the target layers the head reads)
    of an EAGLE checkpoint for ``target``: jspec's own, or a published EAGLE-1 or EAGLE-3 head
    (:mod:`jspec.loading.eagle_formats`)."""
    import jax.numpy as jnp

    from jspec.models.llama import output_embedding

    path = resolve_draft_path(name_or_path)
    if path is None or not path.is_dir():
        raise CheckpointNotFoundError(f"{name_or_path}: no such EAGLE checkpoint directory")
    card = read_card(path)
    if card is None:
        from jspec.loading.eagle_formats import published_kind, read_published_eagle1, read_published_eagle3

        kind = published_kind(path)
        if kind == "eagle3":
            return read_published_eagle3(path, target)
        if kind == "eagle":
            return read_published_eagle1(path, target)
        raise CheckpointError(f"{path}: neither a jspec head ({CARD}) nor a published EAGLE-1 or EAGLE-3 head "
                              "(config.json naming an Eagle3 architecture, a speculators type, or one Llama layer)")
    check_card(card, target, path, "eagle")
    feature_layers = eagle_feature_layers(card, target, path)
    file = path / "eagle.safetensors"
    flat = load_tensors(file)
    if "draft_vocab_ids" not in flat:
        raise CheckpointError(f"{file}: missing tensor draft_vocab_ids")
    vocab_ids = jnp.asarray(check_vocab_ids(flat.pop("draft_vocab_ids"), target, card, file), jnp.int32)
    published = (card.get("config") or {}).get("head") == "eagle3-published"
    head = _check_eagle_tensors(flat, target.config, file, len(feature_layers), published)
    dtype = jnp.dtype(target.config.dtype)
    head = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), unflatten(head))
    lm_head = jnp.take(output_embedding(target.params, target.config), vocab_ids, axis=0)
    return {"head": head, "lm_head": lm_head, "vocab_ids": vocab_ids}, feature_layers


def _shapes(tree, prefix: str = "") -> dict[str, tuple]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_shapes(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = tuple(v.shape)
    return out


def _check_eagle_tensors(flat: dict[str, np.ndarray], config, file: Path, num_features: int = 0,
                         published: bool = False) -> dict[str, np.ndarray]:
    """The ``head/...`` tensors of an EAGLE file, named and shaped as the target's config and the
    card's feature layers and head architecture (jspec's, or ``published``: the published EAGLE-3
    one) imply, each one finite; returns them without the ``head/`` prefix."""
    from jspec.loading.convert import check_finite
    from jspec.models.eagle import init_eagle_params, init_published_eagle3_params

    init = init_published_eagle3_params if published else init_eagle_params
    want = _shapes(jax.eval_shape(lambda: init(config, jax.random.key(0), num_features=num_features)))
    got = {k[len("head/"):]: v for k, v in flat.items() if k.startswith("head/")}
    extra = sorted(set(flat) - {f"head/{k}" for k in got})
    missing = sorted(set(want) - set(got))
    if missing:
        raise CheckpointError(f"{file}: missing tensor head/{missing[0]} (an EAGLE head has {len(want)} tensors, "
                              f"{len(missing)} missing)")
    extra += sorted(f"head/{k}" for k in set(got) - set(want))
    if extra:
        raise CheckpointError(f"{file}: unexpected tensor {extra[0]} in an EAGLE head")
    for k, shape in want.items():
        if tuple(got[k].shape) != shape:
            raise DraftMismatchError(f"{file}: tensor head/{k} has shape {tuple(got[k].shape)}, the target's "
                                     f"config implies {shape}")
        if got[k].dtype.kind in "biucOSU":
            raise CheckpointError(f"{file}: tensor head/{k} has dtype {got[k].dtype}, expected floating point")
        check_finite(np.asarray(got[k], np.float32), f"head/{k}", str(file), config.dtype)
    return got
