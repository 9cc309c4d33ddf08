"""Hybrid drafting: n-gram prompt lookup where the context has a match, the EAGLE head elsewhere.

Per row and per step: if n-gram lookup (:mod:`.ngram`) finds an earlier occurrence of the
context's suffix, its continuation is proposed (``num_drafts <= k``); otherwise the head's
drafts are, k of them or ``head_k`` (``SpecConfig.head_tokens``) when that is smaller: on prose
the head's drafts after the first are rarely accepted, and each costs a head forward. The choice is a function of the committed tokens only, never of a random draw, so
each row's proposal is an ordinary drafter's proposal and verification stays lossless.

- Draft distributions: head rows keep the head's logits; n-gram rows get logits that are 0 at
  the drafted token and ``-inf`` elsewhere, whose processed softmax (any temperature, top-k,
  top-p; greedy rows take its argmax) is exactly one-hot on that token: the q a deterministic
  drafter has (``draft_logits=None`` means the same one-hot q in :class:`~.steps.SpecStep`).
  Positions past an n-gram row's ``num_drafts`` are masked by acceptance (q = 0 there).
- State: the head's (:class:`~.eagle.EagleState`). The head builds the entry of the pending
  last token on every step (its chain of k drafts only when some running row has no match), and
  ``observe``/``catch_up``/``prefill``/``admit`` are the head's. That stays exact whichever
  drafts were verified: ``propose`` builds the head entry of the pending last token from true
  inputs, and ``observe`` rebuilds every later committed entry from the committed tokens and
  the verification pass's true features of them, never from the proposal (entries the chain
  built on predicted features are overwritten or rolled back). The n-gram half is stateless: it
  reads the token buffer (and, with ``history``, the lookup history that rides in the head's
  parameters under "history").

Token trees (a head with a tree budget): a row with a match proposes the lookup's continuation
as a chain (up to the head's depth) and, beside it under the root, the head's tree cut to the
remaining nodes (its shallowest first, which keeps every node's parent); a row without a match
proposes the head's whole tree. All are deterministic candidates, so q is one-hot for every row
(a head node that repeats a lookup node is rejected with it: harmless).

Cost: a step in which every running row has a match pays the lookup and one head forward (the
entry ``observe`` needs); a step with any row without one pays the head's whole chain (k, or
``head_k``, head forwards), as an EAGLE step does.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.speculative.control import cond_in_place
from jspec.speculative.drafters.base import Proposal
from jspec.speculative.drafters.eagle import EagleDrafter, EagleState, make_eagle_drafter
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.state import DecodeState


def one_hot_logits(drafts: jax.Array, vocab_size: int) -> jax.Array:
    """float32 [B, k, V]: 0 at each drafted token, ``-inf`` elsewhere (a deterministic draft's q)."""
    hit = drafts[..., None] == jnp.arange(vocab_size, dtype=drafts.dtype)
    return jnp.where(hit, 0.0, -jnp.inf).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class HybridDrafter:
    k: int
    head: EagleDrafter  # proposes where lookup finds nothing; owns the state
    n_max: int = 3  # n-gram lookup: longest suffix tried first ...
    n_min: int = 2  # ... down to this length
    history: int = 0  # the lookup's history (ngram.py); its "history" rides in the head's params dict
    head_k: Optional[int] = None  # the head drafts at most this many tokens (None: k); the lookup up to k
    follows_committed_tokens = True  # the lookup's drafts and the head's (EagleDrafter) both do

    def __post_init__(self):  # the head drafts min(head_k, k), also after dataclasses.replace(hybrid, k=...)
        k = self.k if self.head_k is None or self.head.tree_width else min(self.head_k, self.k)
        if self.head.k != k:  # (the engine makes one drafter per k it may run: dynamic k)
            object.__setattr__(self, "head", dataclasses.replace(self.head, k=k))

    @property
    def config(self) -> ModelConfig:
        return self.head.config

    @property
    def cache_config(self) -> ModelConfig:
        return self.head.cache_config

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    @property
    def lookup(self) -> NgramDrafter:
        """The n-gram half: k drafts, or with a tree the head's depth (within its k nodes)."""
        k = min(self.head.tree_depth, self.k) if self.head.tree_width else self.k
        return NgramDrafter(k, self.n_max, self.n_min, self.history)

    def remember(self, drafter_params: dict, texts) -> dict:
        return self.lookup.remember(drafter_params, texts)

    def forget(self, drafter_params: dict) -> dict:
        return self.lookup.forget(drafter_params)

    def init_state(self, target_params, drafter_params, cache) -> EagleState:
        return self.head.init_state(target_params, drafter_params, cache)

    def admit(self, d: EagleState, mask, start, cache) -> EagleState:
        return self.head.admit(d, mask, start, cache)

    def prefill(self, drafter_params, target_params, d: EagleState, cache, segment, hidden) -> EagleState:
        return self.head.prefill(drafter_params, target_params, d, cache, segment, hidden)

    def observe(self, drafter_params, target_params, prev_state, state, verify_hidden, num_accepted) -> EagleState:
        return self.head.observe(drafter_params, target_params, prev_state, state, verify_hidden, num_accepted)

    def catch_up(self, drafter_params, target_params, prev_state, state, hidden) -> EagleState:
        return self.head.catch_up(drafter_params, target_params, prev_state, state, hidden)

    def _propose_tree(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        """The lookup's chain beside the head's tree (see the module doc)."""
        found = self.lookup.propose(drafter_params, target_params, state, sampling)  # drafts [B, depth]
        tree = self.head.propose(drafter_params, target_params, state, sampling)  # k nodes
        n = self.k
        m = found.num_drafts[:, None]  # [B, 1]: lookup nodes first
        j = jnp.arange(n, dtype=jnp.int32)[None, :]
        chain = jnp.pad(found.drafts, ((0, 0), (0, n - found.drafts.shape[1])))
        head = jnp.clip(j - m, 0, n - 1)  # the head's node at merged position j >= m
        head_tok = jnp.take_along_axis(tree.drafts, head, axis=1)
        head_par = jnp.take_along_axis(tree.parents, head, axis=1)
        drafts = jnp.where(j < m, chain, head_tok)
        parents = jnp.where(j < m, j - 1, jnp.where(head_par >= 0, head_par + m, -1))
        num = jnp.where(state.done, 0, jnp.minimum(m[:, 0] + tree.num_drafts, n)).astype(jnp.int32)
        return Proposal(drafts.astype(jnp.int32), None, tree.drafter_state, state.cache, num, parents)

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        if self.head.tree_width:
            return self._propose_tree(drafter_params, target_params, state, sampling)
        found = self.lookup.propose(drafter_params, target_params, state, sampling)  # drafts [B, k], num [B]
        use = found.num_drafts > 0  # [B]: the context has a match
        lookup_q = one_hot_logits(found.drafts, self.config.vocab_size)  # [B, k, V]

        # the head's state (its pages) goes through the branch in place, not copied
        def lookup_only(d):  # every running row has a match: the head only keeps in step
            return self.head.advance(drafter_params, target_params, state.replace(drafter=d)), (found.drafts, lookup_q)

        hk = self.head.k

        def mixed(d):
            chain = self.head.propose(drafter_params, target_params, state.replace(drafter=d), sampling)
            # the head's hk drafts, then (past num_drafts: masked by acceptance) the lookup's columns
            head_drafts = jnp.concatenate([chain.drafts, found.drafts[:, hk:]], axis=1)  # [B, k]
            head_q = jnp.concatenate([chain.draft_logits, lookup_q[:, hk:]], axis=1)  # [B, k, V]
            drafts = jnp.where(use[:, None], found.drafts, head_drafts)
            logits = jnp.where(use[:, None, None], lookup_q, head_q)
            return chain.drafter_state, (drafts, logits)

        dstate, (drafts, logits) = cond_in_place(jnp.all(use | state.done), lookup_only, mixed, state.drafter)
        num = jnp.where(use, found.num_drafts, hk).astype(jnp.int32)  # [B]
        return Proposal(drafts.astype(jnp.int32), logits, dstate, state.cache, num)


def make_hybrid_drafter(spec, target, attention: str = "reference"):
    """(HybridDrafter, the head's params) from an EAGLE checkpoint and the spec's n-gram settings."""
    head, params = make_eagle_drafter(spec, target, attention)
    drafter = HybridDrafter(head.k if spec.tree else spec.num_speculative_tokens, head, spec.ngram_max, spec.ngram_min,
                            spec.ngram_history, spec.head_tokens)
    if spec.ngram_history:
        params = {**params, **drafter.lookup.init_params()}
    return drafter, params
