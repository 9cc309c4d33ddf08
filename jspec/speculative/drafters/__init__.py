"""Drafters: n-gram prompt lookup, layer-skip self-speculation, a draft model, an EAGLE head,
and the hybrid of lookup and head."""

from __future__ import annotations

import jax.numpy as jnp

from jspec.config import SpecConfig
from jspec.errors import ConfigError, DraftMismatchError
from jspec.models.llama import output_embedding
from jspec.speculative.drafters.base import Proposal, on_path
from jspec.speculative.drafters.draft_model import DraftModelDrafter
from jspec.speculative.drafters.layerskip import LayerSkipDrafter
from jspec.speculative.drafters.ngram import NgramDrafter


def check_same_vocab(target, draft) -> None:
    """A draft must share the target's vocabulary: same size and, where both have tokenizers,
    the same token -> id map."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise DraftMismatchError(f"draft {draft.source} has a vocabulary of {dv} tokens, the target {tv}")
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise DraftMismatchError(f"draft {draft.source} has another vocabulary than the target")


def make_drafter(spec: SpecConfig, target, attention: str = "reference"):
    """(drafter, drafter_params) for ``spec`` and the loaded ``target`` model."""
    k = spec.num_speculative_tokens
    if spec.method == "ngram":
        if spec.tree:  # a trie of tree_width matches, tree_nodes nodes, k deep
            drafter = NgramDrafter(spec.tree_nodes, spec.ngram_max, spec.ngram_min, tree_width=spec.tree_width,
                                   tree_depth=k)
        else:
            drafter = NgramDrafter(k, spec.ngram_max, spec.ngram_min, spec.ngram_history)
        return drafter, drafter.init_params()
    if spec.method == "layerskip":
        n = target.config.num_layers
        if not 1 <= spec.layerskip_layers < n:
            raise ConfigError(f"layerskip:L needs 1 <= L < {n} (the target's layers), got {spec.layerskip_layers}")
        return LayerSkipDrafter(k, target.config, spec.layerskip_layers, attention), None
    if spec.method == "draft":
        from jspec.loading.drafts import load_draft

        draft, vocab_ids = load_draft(spec.draft, target)
        check_same_vocab(target, draft)
        tree = {}
        if spec.tree:  # top-k expansion: tree_nodes nodes, k deep at most
            tree = {"tree_width": spec.tree_width, "tree_depth": spec.tree_depth}
            k = spec.tree_nodes
        if vocab_ids is None:
            return DraftModelDrafter(k, draft.config, attention, **tree), draft.params
        head = jnp.take(output_embedding(draft.params, draft.config), vocab_ids, axis=0)
        return (DraftModelDrafter(k, draft.config, attention, draft_vocab=True, **tree),
                {"model": draft.params, "lm_head": head, "vocab_ids": vocab_ids})
    if spec.method == "eagle":
        from jspec.speculative.drafters.eagle import make_eagle_drafter

        return make_eagle_drafter(spec, target, attention)
    if spec.method == "hybrid":
        from jspec.speculative.drafters.hybrid import make_hybrid_drafter

        return make_hybrid_drafter(spec, target, attention)
    raise ConfigError(f"no drafter for spec method {spec.method!r}")


__all__ = ["Proposal", "NgramDrafter", "LayerSkipDrafter", "DraftModelDrafter", "make_drafter", "check_same_vocab",
           "on_path"]
