"""A separate draft model (any Llama-family checkpoint sharing the target's vocabulary).

The draft keeps its own paged cache (same page geometry and block tables as the target's,
separate arrays) and stays in step with the committed tokens:

- after prefill it holds K/V for ``prompt[:-1]`` (like the target: ``lengths == seq_len - 1``);
- ``propose`` first feeds the tokens it has not seen yet -- 1, or 2 when the previous step
  accepted all k drafts, since d_k itself was never fed -- as one forward with q_len 1 or 2,
  then drafts k tokens, feeding d_1..d_{k-1} back (k draft forwards in all);
- ``observe`` rolls its cache back to the committed text: ``min(lengths, seq_len - 1)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.cache.paged import PagedKVCache, init_cache
from jspec.config import ModelConfig
from jspec.models.llama import forward
from jspec.models.prefill import prefill
from jspec.speculative.drafters.base import Proposal, draft_vocab_logits, sample_chain
from jspec.speculative.state import GenState, step_keys

SALT_DRAFT = 200


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftModelState:
    cache: PagedKVCache  # the draft's own cache; lengths[b] in {seq_len - 2, seq_len - 1}


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter:
    """``drafter_params`` is the draft's parameter pytree, or with ``draft_vocab`` a dict
    ``{"model": params, "lm_head": [V', H], "vocab_ids": int32 [V']}`` whose LM head covers only
    a draft vocabulary (see :func:`jspec.speculative.drafters.base.draft_vocab_logits`)."""

    k: int
    config: ModelConfig  # the draft's
    attention: str = "reference"
    draft_vocab: bool = False

    def _model(self, dparams):
        return dparams["model"] if self.draft_vocab else dparams

    def _forward(self, dparams, tokens, cache, q_lens, row):
        """Draft forward; logits [B, V] of row ``row`` [B] (full vocabulary, -inf outside the
        draft vocabulary)."""
        out = forward(self._model(dparams), self.config, tokens, cache, q_lens, attention=self.attention,
                      compute_logits=not self.draft_vocab)
        if self.draft_vocab:
            h = jnp.take_along_axis(out.hidden, row[:, None, None], axis=1)[:, 0]
            logits = draft_vocab_logits(h, dparams["lm_head"], dparams["vocab_ids"], self.config.vocab_size)
        else:
            logits = jnp.take_along_axis(out.logits, row[:, None, None], axis=1)[:, 0]
        return logits, out.cache

    def init(self, target_params, drafter_params, tokens, prompt_lens, state: GenState, cache_config,
             prefill_hidden=None):
        c = self.config
        tc = state.cache
        cache = init_cache(c.num_layers, c.num_kv_heads, c.head_dim, jnp.copy(tc.block_tables), tc.num_pages,
                           tc.page_size, jnp.dtype(c.dtype))
        cache = prefill(self._model(drafter_params), c, tokens, prompt_lens, cache, cache_config, self.attention)
        return DraftModelState(cache)

    def propose(self, drafter_params, target_params, state: GenState, sampling) -> Proposal:
        running = ~state.done
        cache = state.drafter.cache
        pending = state.seq_lens - cache.lengths  # 1 or 2 tokens the draft has not seen
        idx = jnp.minimum(cache.lengths[:, None] + jnp.arange(2)[None, :], state.tokens.shape[1] - 1)
        inp = jnp.take_along_axis(state.tokens, idx, axis=1)  # [B, 2]
        first, cache = self._forward(drafter_params, inp, cache, jnp.where(running, pending, 0),
                                     jnp.maximum(pending - 1, 0))  # logits of d_1 [B, V]
        one = running.astype(jnp.int32)
        zero = jnp.zeros_like(one)

        def step(tok, c):
            return self._forward(drafter_params, tok, c, one, zero)

        drafts, q, cache = sample_chain(step, cache, first, step_keys(state, SALT_DRAFT), self.k, sampling)
        return Proposal(drafts, q, DraftModelState(cache), state.cache)

    def observe(self, drafter_params, target_params, prev_state, state: GenState, verify_hidden, num_accepted):
        cache = state.drafter.cache
        return DraftModelState(cache.replace(lengths=jnp.minimum(cache.lengths, state.seq_lens - 1)))
