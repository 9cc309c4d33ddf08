"""EAGLE-style feature-level drafting (see :mod:`jspec.models.eagle` for the heads).

``feature_layers`` names what the head reads of the target: () the final hidden state (EAGLE-1),
or the residual stream after those target layers (EAGLE-3's fused low/middle/high features);
the steps ask the target forward for exactly that (``forward_segments(feature_layers=...)``).

State: the head's own one-layer pages (the target's pool geometry, read through the target's
block tables) whose entry t was computed from (token_t, f_{t-1}) with the target's *true*
feature, for t < seq_len - 1; per slot ``last_feature`` = f_{seq_len - 2}, the input that goes
with the pending last token; per page the feature at its last slot (``page_feature``), so a
slot that starts from a prefix-cache hit continues from the true feature before its first
uncached token instead of from garbage.

- ``prefill``: entries of a prompt chunk from the target's hidden states of that chunk;
- ``propose``: entry seq_len - 1 from (last token, last_feature) gives f^ and d_1; then k - 1
  more entries chain on predicted features (d_j, f^). With a tree budget (``tree_width`` > 0)
  it drafts a token tree instead, as EAGLE-2 does (Li et al., arXiv:2406.16858): the root's top
  ``tree_width`` tokens, then at each further depth the head runs on the ``tree_width`` most
  probable nodes of the last depth at once (tree rows: each sees its ancestors), each offering
  its top ``tree_width`` children; the ``k`` most probable of all candidates, by cumulative draft
  log-probability, form the tree (``tree_depth`` deep at most). Candidates are deterministic
  (q one-hot), so acceptance stays exact under sampling;
- ``observe``: the verification pass computed the true features of [last, d_1..d_k]; the
  entries built on predicted features for the tokens now committed are recomputed with true
  ones, the rest rolled back, and ``last_feature`` becomes the true feature before the new
  pending token; ``catch_up`` does the same after a plain one-token step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.path import PLAIN, ModelPath
from jspec.speculative.drafters.base import Proposal, cache_view, draft_vocab_logits, expand_tree, sample_chain
from jspec.speculative.state import DecodeState, last_tokens, step_keys

SALT_DRAFT = 300


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    k_pages: tuple[jax.Array]  # the head's one layer [KVH, P, S, D]
    v_pages: tuple[jax.Array]
    lengths: jax.Array  # int32 [B]: == seq_len - 1 for running slots
    last_feature: jax.Array  # [B, F]: the target's feature f_{seq_len - 2} (F = H, or H * feature layers)
    page_feature: jax.Array  # [P, F]: the target's feature at the last slot of each prefilled page

    SLOT_FIELDS = ("lengths", "last_feature")  # pages and page_feature belong to the pool


def _embed(target_params, tokens):
    return jnp.take(target_params["embed_tokens"]["embedding"], tokens, axis=0)


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    k: int
    config: ModelConfig  # the target's
    attention: str = "reference"
    feature_layers: tuple[int, ...] = ()  # () EAGLE-1: the target's final hidden state
    path: ModelPath = PLAIN
    tree_depth: int = 0  # with tree_width > 0: a token tree of k nodes, tree_depth deep at most
    tree_width: int = 0  # 0: a chain of k drafts
    # observe() rebuilds the head's entries from the committed tokens and the target's true
    # features, not from its own drafts: a step may replace drafts (structured output's forced tokens)
    follows_committed_tokens = True

    @property
    def feature_dim(self) -> int:
        return self.config.hidden_size * max(len(self.feature_layers), 1)

    @property
    def cache_config(self) -> ModelConfig:
        """The shape of the pages this drafter keeps (one layer of the target's shape)."""
        return dataclasses.replace(self.config, num_layers=1)

    def _view(self, d: EagleState, target_cache, lengths=None):
        return cache_view(target_cache, d.k_pages, d.v_pages, d.lengths if lengths is None else lengths)

    def init_state(self, target_params, drafter_params, cache) -> EagleState:
        c = self.config
        shape = (c.num_kv_heads, cache.num_pages, cache.page_size, c.head_dim)
        dtype = jnp.dtype(c.dtype)
        pages = cache.k_pages[0].dtype  # the target's page dtype (EngineConfig.kv_cache_dtype)
        b = cache.lengths.shape[0]
        return EagleState((jnp.zeros(shape, pages),), (jnp.zeros(shape, pages),), jnp.zeros_like(cache.lengths),
                          jnp.zeros((b, self.feature_dim), dtype), jnp.zeros((cache.num_pages, self.feature_dim), dtype))

    def admit(self, d: EagleState, mask, start, cache) -> EagleState:
        """A slot restarting at ``start`` (a prefix-cache hit covers positions < start): its
        previous feature f_{start - 1} is the one stored with the last cached page."""
        ps = cache.page_size
        page = jnp.take_along_axis(cache.block_tables, jnp.maximum(start - 1, 0)[:, None] // ps, axis=1)[:, 0]
        feat = jnp.where((start > 0)[:, None], d.page_feature[page], 0.0)
        return dataclasses.replace(d, lengths=jnp.where(mask, start, d.lengths),
                                   last_feature=jnp.where(mask[:, None], feat, d.last_feature))

    def prefill(self, drafter_params, target_params, d: EagleState, cache, segment, hidden):
        rows, q_lens = segment.rows, segment.q_lens
        p, t = segment.tokens.shape
        hidden = hidden.astype(d.last_feature.dtype)
        old_last = jnp.take(d.last_feature, rows, axis=0, mode="clip")  # padding rows (past the end) clip
        prev = jnp.concatenate([old_last[:, None], hidden[:, :-1]], axis=1)  # f_{pos - 1}
        head_cache = self.path.eagle_forward(drafter_params["head"], self.config,
                                             _embed(target_params, segment.tokens), prev, self._view(d, cache),
                                             q_lens, self.attention, rows=rows).context
        last = jnp.take_along_axis(hidden, jnp.maximum(q_lens - 1, 0)[:, None, None], axis=1)[:, 0]
        last_feature = d.last_feature.at[rows].set(jnp.where((q_lens > 0)[:, None], last, old_last), mode="drop")
        # remember the feature at the last slot of each page this chunk completes
        ps = cache.page_size
        pos = jnp.take(d.lengths, rows, mode="clip")[:, None] + jnp.arange(t)[None, :]  # [P, T]
        ends = (pos % ps == ps - 1) & (jnp.arange(t)[None, :] < q_lens[:, None])
        page = jnp.take_along_axis(jnp.take(cache.block_tables, rows, axis=0, mode="clip"), pos // ps, axis=1,
                                   mode="clip")
        page = jnp.where(ends, page, d.page_feature.shape[0])  # out of range: dropped
        page_feature = d.page_feature.at[page.reshape(-1)].set(hidden.reshape(p * t, -1), mode="drop")
        return EagleState(head_cache.k_pages, head_cache.v_pages, head_cache.lengths, last_feature, page_feature)

    def _step(self, dparams, target_params, q_lens, fused: bool):
        c = self.config

        def step(tok, carry):  # tok [B, 1]; carry = (cache, previous feature [B, F] or chained output [B, H])
            cache, feat = carry
            out = self.path.eagle_forward(dparams["head"], c, _embed(target_params, tok), feat[:, None], cache,
                                          q_lens, self.attention, fused=fused)
            logits = draft_vocab_logits(out.normed[:, 0], dparams, c.vocab_size, self.path)
            return logits, (out.context, out.chained[:, 0])

        return step

    def _first(self, drafter_params, target_params, state: DecodeState):
        """The head's entry seq_len - 1 from (last token, last_feature): (the chain's step, logits
        of d_1, carry)."""
        d = state.drafter
        q_lens = (~state.done).astype(jnp.int32)
        first, carry = self._step(drafter_params, target_params, q_lens, False)(
            last_tokens(state), (self._view(d, state.cache), d.last_feature))
        return self._step(drafter_params, target_params, q_lens, True), first, carry

    @staticmethod
    def _with_cache(d: EagleState, cache) -> EagleState:
        return dataclasses.replace(d, k_pages=cache.k_pages, v_pages=cache.v_pages, lengths=cache.lengths)

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        if self.tree_width:
            return self._propose_tree(drafter_params, target_params, state)
        step, first, carry = self._first(drafter_params, target_params, state)
        drafts, logits, (cache, _) = sample_chain(step, carry, first, step_keys(state, SALT_DRAFT), self.k, sampling)
        return Proposal(drafts, logits, self._with_cache(state.drafter, cache), state.cache)

    def _propose_tree(self, drafter_params, target_params, state: DecodeState) -> Proposal:
        """An EAGLE-2 tree (:func:`~jspec.speculative.drafters.base.expand_tree`): the head's
        rows of depths 1 .. tree_depth - 1 sit after the root's entry, each row's input feature
        its parent's chained output."""
        c, w = self.config, self.tree_width
        _, first, (cache, root_feat) = self._first(drafter_params, target_params, state)
        b = first.shape[0]
        new_cache = [cache]

        def run_rows(buf_tok, buf_feat, tree_rows, q_lens, lo):
            out = self.path.eagle_forward(drafter_params["head"], c, _embed(target_params, buf_tok), buf_feat,
                                          new_cache[0], q_lens, self.attention, fused=True, tree=tree_rows)
            new_cache[0] = out.context.replace(lengths=cache.lengths)  # the next depth writes these rows again
            hid = out.normed[:, lo:lo + w].reshape(b * w, -1)
            logits = draft_vocab_logits(hid, drafter_params, c.vocab_size, self.path).reshape(b, w, -1)
            return logits, out.chained[:, lo:lo + w]

        nodes, parents, num = expand_tree(first, self.k, self.tree_depth, w, ~state.done, run_rows, root_feat)
        return Proposal(nodes, None, self._with_cache(state.drafter, new_cache[0]), state.cache, num, parents)

    def advance(self, drafter_params, target_params, state: DecodeState) -> EagleState:
        """The state ``propose`` leaves as far as ``observe`` reads it, without drafting: only the
        entry of the pending last token (built from true inputs). ``observe`` rebuilds every later
        entry from true features and resets the running slots' lengths, so the chain's other
        entries are never read (for a caller whose drafts come from elsewhere this step)."""
        _, _, (cache, _) = self._first(drafter_params, target_params, state)
        return self._with_cache(state.drafter, cache)

    def _recompute(self, drafter_params, target_params, prev_state, state, feats, base_shift: int):
        """Recompute head entries from ``base`` = prev seq_len - ``base_shift`` up to the new
        seq_len - 2 with the target's true features ``feats`` [B, M, H] (f_{base - 1} first)."""
        d = state.drafter
        ran = ~prev_state.done
        base = prev_state.seq_lens - base_shift
        todo = jnp.where(ran, state.seq_lens - 1 - base, 0)
        m = feats.shape[1]
        idx = jnp.minimum(base[:, None] + jnp.arange(m)[None, :], state.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(state.tokens, idx, axis=1)
        view = self._view(d, state.cache, jnp.where(ran, base, d.lengths))
        cache = self.path.eagle_forward(drafter_params["head"], self.config, _embed(target_params, toks),
                                        feats.astype(d.last_feature.dtype), view, todo, self.attention).context
        # the new last feature f_{seq_len - 2} sits at feats index seq_len - 1 - base
        new_last = jnp.take_along_axis(feats, jnp.clip(todo, 0, m - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where((ran & (state.seq_lens > prev_state.seq_lens))[:, None], new_last, d.last_feature)
        return dataclasses.replace(d, k_pages=cache.k_pages, v_pages=cache.v_pages, lengths=cache.lengths,
                                   last_feature=last.astype(d.last_feature.dtype))

    def observe(self, drafter_params, target_params, prev_state, state: DecodeState, verify_hidden, num_accepted):
        # propose already built entry seq_len - 1 from true inputs; entries seq_len .. are
        # rebuilt from the verification pass's true features (verify_hidden[:, j] = f_{seq_len-1+j})
        return self._recompute(drafter_params, target_params, prev_state, state, verify_hidden, 0)

    def catch_up(self, drafter_params, target_params, prev_state, state: DecodeState, hidden):
        # no proposal ran: build entry seq_len - 1 from (last token, f_{seq_len - 2}) as well
        feats = jnp.concatenate([prev_state.drafter.last_feature[:, None].astype(hidden.dtype), hidden], axis=1)
        return self._recompute(drafter_params, target_params, prev_state, state, feats, 1)


def make_eagle_drafter(spec, target, attention: str = "reference"):
    """(EagleDrafter, drafter params) from a shipped or trained EAGLE checkpoint (EAGLE-1, or
    EAGLE-3 reading the target layers its card names); with a tree budget, a tree drafter of
    ``tree_nodes`` nodes, ``num_speculative_tokens`` deep."""
    from jspec.loading.drafts import read_eagle

    params, feature_layers = read_eagle(spec.draft, target)
    if spec.tree:
        return EagleDrafter(spec.tree_nodes, target.config, attention, feature_layers, tree_depth=spec.tree_depth,
                            tree_width=spec.tree_width), params
    return EagleDrafter(spec.num_speculative_tokens, target.config, attention, feature_layers), params
