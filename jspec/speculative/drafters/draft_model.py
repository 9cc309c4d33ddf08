"""A separate draft model (any Llama-family checkpoint sharing the target's vocabulary).

The draft keeps its own pages (the target's pool geometry, its own arrays) read through the
target's block tables, and per slot a length that follows the committed tokens:

- admitted at the length of the slot's cached prefix, prefilled chunk by chunk with the target
  (so it holds K/V for ``prompt[:-1]``, ``lengths == seq_len - 1``, like the target);
- ``propose`` first feeds the tokens it has not seen yet -- 1, or 2 when the previous step
  accepted all k drafts, since d_k itself was never fed -- as one forward with q_len 1 or 2,
  then drafts k tokens, feeding d_1..d_{k-1} back (k draft forwards in all). With a tree budget
  (``tree_width`` > 0) it drafts a token tree instead, by top-k expansion as an EAGLE head does
  (:func:`~jspec.speculative.drafters.base.expand_tree`: one draft forward per depth over tree
  rows that see their ancestors); the tree's rows are scratch past the slot's length, so the next
  ``propose`` feeds the whole accepted path (up to ``tree_depth`` + 1 tokens);
- ``observe`` rolls it back to the committed text: ``min(lengths, seq_len - 1)``;
- ``catch_up`` after a plain step feeds what it has not seen, back to ``seq_len - 1``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.llama import Segment
from jspec.models.path import PLAIN, ModelPath
from jspec.speculative.drafters.base import Proposal, cache_view, draft_vocab_logits, expand_tree, sample_chain
from jspec.speculative.state import DecodeState, step_keys

SALT_DRAFT = 200


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModelState:
    k_pages: tuple[jax.Array, ...]  # per draft layer [KVH', P, S, D']
    v_pages: tuple[jax.Array, ...]
    lengths: jax.Array  # int32 [B]: in {seq_len - 2, seq_len - 1} for running slots

    SLOT_FIELDS = ("lengths",)  # the pages are the shared pool


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """``drafter_params`` is the draft's parameter pytree, or with ``draft_vocab`` a dict
    ``{"model": params, "lm_head": [V', H], "vocab_ids": int32 [V']}`` whose LM head covers only
    a draft vocabulary (see :func:`jspec.speculative.drafters.base.draft_vocab_logits`; the engine
    may add ``"lm_head_rows"``, those rows as Q8_0 blocks: ``SpecConfig.draft_quantization``)."""

    k: int
    config: ModelConfig  # the draft's
    attention: str = "reference"
    draft_vocab: bool = False
    path: ModelPath = PLAIN
    tree_depth: int = 0  # with tree_width > 0: a token tree of k nodes, tree_depth deep at most
    tree_width: int = 0  # 0: a chain of k drafts

    @property
    def cache_config(self) -> ModelConfig:
        """The shape of the pages this drafter keeps (memory estimates)."""
        return self.config

    def _model(self, dparams):
        return dparams["model"] if self.draft_vocab else dparams

    def _view(self, dstate: DraftModelState, target_cache, lengths=None):
        return cache_view(target_cache, dstate.k_pages, dstate.v_pages, dstate.lengths if lengths is None else lengths)

    def _forward(self, dparams, tokens, cache, q_lens, row):
        """Draft forward; logits [B, V] of row ``row`` [B] (full vocabulary, -inf outside the
        draft vocabulary), and the new cache."""
        logits, cache = self._forward_rows(dparams, tokens, cache, q_lens, row[:, None])
        return logits[:, 0], cache

    def _forward_rows(self, dparams, tokens, cache, q_lens, rows, tree=None):
        """Draft forward of ``tokens`` [B, T] (tree rows ``tree``, or a causal chunk); logits
        [B, R, V] of the rows ``rows`` [B, R] and the new cache."""
        (logits,), (hidden,), cache = self.path.forward_segments(
            self._model(dparams), self.config, (Segment(tokens, q_lens, tree=tree),), cache,
            attention=self.attention, logits_for=(not self.draft_vocab,))
        if self.draft_vocab:
            h = jnp.take_along_axis(hidden, rows[..., None], axis=1)
            b, r = rows.shape
            return draft_vocab_logits(h.reshape(b * r, -1), dparams, self.config.vocab_size,
                                      self.path).reshape(b, r, -1), cache
        return jnp.take_along_axis(logits, rows[..., None], axis=1), cache

    def init_state(self, target_params, drafter_params, cache) -> DraftModelState:
        c = self.config
        shape = (c.num_kv_heads, cache.num_pages, cache.page_size, c.head_dim)
        dtype = cache.k_pages[0].dtype  # the target's page dtype (EngineConfig.kv_cache_dtype)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(c.num_layers))  # noqa: E731
        return DraftModelState(zeros(), zeros(), jnp.zeros_like(cache.lengths))

    def admit(self, dstate: DraftModelState, mask, start, cache) -> DraftModelState:
        return dataclasses.replace(dstate, lengths=jnp.where(mask, start, dstate.lengths))

    def prefill(self, drafter_params, target_params, dstate, cache, segment, hidden):
        # the chunk's K/V only: no logits (a packed segment stays packed)
        _, _, out = self.path.forward_segments(self._model(drafter_params), self.config, (segment,),
                                               self._view(dstate, cache), attention=self.attention,
                                               logits_for=(False,))
        return DraftModelState(out.k_pages, out.v_pages, out.lengths)

    def _feed_pending(self, dparams, state: DecodeState, seq_lens, running):
        """Feed tokens [lengths, seq_lens - 1] of running slots (1 or 2 after a chain, up to
        tree_depth + 1 after a tree); returns (logits after the last one [B, V], cache)."""
        cache = self._view(state.drafter, state.cache)
        pending = jnp.where(running, seq_lens - cache.lengths, 0)
        width = max(2, self.tree_depth + 1)  # a chain of a tree drafter (dynamic k) follows its trees
        idx = jnp.minimum(cache.lengths[:, None] + jnp.arange(width)[None, :], state.tokens.shape[1] - 1)
        inp = jnp.take_along_axis(state.tokens, idx, axis=1)  # [B, width]
        return self._forward(dparams, inp, cache, pending, jnp.maximum(pending - 1, 0))

    def _propose_tree(self, drafter_params, state: DecodeState) -> Proposal:
        """A token tree by top-k expansion (:func:`~jspec.speculative.drafters.base.expand_tree`);
        the slot's length stays after its last committed token."""
        running = ~state.done
        first, cache = self._feed_pending(drafter_params, state, state.seq_lens, running)
        new_cache = [cache]
        w = self.tree_width

        def run_rows(buf_tok, _, tree_rows, q_lens, lo):
            rows = jnp.broadcast_to(lo + jnp.arange(w, dtype=jnp.int32), (buf_tok.shape[0], w))
            logits, out = self._forward_rows(drafter_params, buf_tok, new_cache[0], q_lens, rows, tree_rows)
            new_cache[0] = out.replace(lengths=cache.lengths)  # the next depth writes these rows again
            return logits, None

        nodes, parents, num = expand_tree(first, self.k, self.tree_depth, w, running, run_rows)
        c = new_cache[0]
        return Proposal(nodes, None, DraftModelState(c.k_pages, c.v_pages, c.lengths), state.cache, num, parents)

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        if self.tree_width:
            return self._propose_tree(drafter_params, state)
        running = ~state.done
        first, cache = self._feed_pending(drafter_params, state, state.seq_lens, running)  # logits of d_1
        one = running.astype(jnp.int32)
        zero = jnp.zeros_like(one)

        def step(tok, c):
            return self._forward(drafter_params, tok, c, one, zero)

        drafts, logits, cache = sample_chain(step, cache, first, step_keys(state, SALT_DRAFT), self.k, sampling)
        return Proposal(drafts, logits, DraftModelState(cache.k_pages, cache.v_pages, cache.lengths), state.cache)

    def observe(self, drafter_params, target_params, prev_state, state: DecodeState, verify_hidden, num_accepted):
        d = state.drafter
        ran = ~prev_state.done
        return dataclasses.replace(d, lengths=jnp.where(ran, jnp.minimum(d.lengths, state.seq_lens - 1), d.lengths))

    def catch_up(self, drafter_params, target_params, prev_state, state: DecodeState, hidden):
        ran = ~prev_state.done
        # feed up to the new last token's predecessor: seq_len - 1 - lengths tokens (1 or 2)
        _, cache = self._feed_pending(drafter_params, state, state.seq_lens - 1, ran)
        return DraftModelState(cache.k_pages, cache.v_pages, cache.lengths)
