"""EAGLE-style feature-level drafting (see :mod:`jspec.models.eagle` for the head).

State: the head's own one-layer paged cache (same page geometry as the target's) whose entry
t was computed from (token_t, f_{t-1}) with the target's *true* feature, for t < seq_len - 1,
and ``last_feature`` = f_{seq_len - 2}, the input that goes with the pending last token.

- ``init``: entries 0 .. prompt_len - 2 from the target's prefill hidden states (f_{-1} = 0);
- ``propose``: entry seq_len - 1 from (last token, last_feature) gives f^ and d_1; then k - 1
  more entries chain on predicted features (d_j, f^);
- ``observe``: the verification pass computed the true features of [last, d_1..d_k]; the n
  entries built on predicted features for the tokens now committed are recomputed with true
  ones, the rest rolled back, and ``last_feature`` becomes the true feature before the new
  pending token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jspec.cache.paged import PagedKVCache, init_cache
from jspec.config import ModelConfig
from jspec.models.eagle import eagle_forward
from jspec.speculative.drafters.base import Proposal, draft_vocab_logits, sample_chain
from jspec.speculative.state import GenState, last_tokens, step_keys

SALT_DRAFT = 300


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EagleState:
    cache: PagedKVCache  # the head's one-layer cache; lengths == seq_len - 1
    last_feature: jax.Array  # [B, H]: the target's feature f_{seq_len - 2}


def _embed(target_params, tokens):
    return jnp.take(target_params["embed_tokens"]["embedding"], tokens, axis=0)


@functools.partial(jax.jit, static_argnames=("config", "attention"))
def _head_prefill(head_params, target_params, tokens, hidden, cache, q_lens, *, config, attention):
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)  # f_{t-1}
    return eagle_forward(head_params, config, _embed(target_params, tokens), prev, cache, q_lens, attention)[1]


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    k: int
    config: ModelConfig  # the target's
    attention: str = "reference"
    needs_prefill_hidden = True  # class attribute: generate() hands init the prefill features

    def init(self, target_params, drafter_params, tokens, prompt_lens, state: GenState, cache_config,
             prefill_hidden=None):
        c, tc = self.config, state.cache
        b = tokens.shape[0]
        cache = init_cache(1, c.num_kv_heads, c.head_dim, jnp.copy(tc.block_tables), tc.num_pages,
                           tc.page_size, jnp.dtype(c.dtype))
        n = 0 if prefill_hidden is None else prefill_hidden.shape[1]
        last = jnp.zeros((b, c.hidden_size), jnp.dtype(c.dtype))
        if n > 0:
            q_lens = jnp.asarray(prompt_lens - 1, jnp.int32)
            cache = _head_prefill(drafter_params["head"], target_params, jnp.asarray(tokens[:, :n]),
                                  prefill_hidden, cache, q_lens, config=c, attention=self.attention)
            idx = jnp.maximum(q_lens - 1, 0)
            last = jnp.where((q_lens > 0)[:, None], prefill_hidden[jnp.arange(b), idx], 0.0)
        return EagleState(cache, last)

    def _step(self, dparams, target_params, q_lens):
        c = self.config

        def step(tok, carry):  # tok [B, 1]; carry = (cache, previous feature [B, H])
            cache, feat = carry
            f_hat, cache = eagle_forward(dparams["head"], c, _embed(target_params, tok), feat[:, None],
                                         cache, q_lens, self.attention)
            logits = draft_vocab_logits(f_hat[:, 0], dparams["lm_head"], dparams["vocab_ids"], c.vocab_size)
            return logits, (cache, f_hat[:, 0])

        return step

    def propose(self, drafter_params, target_params, state: GenState, sampling) -> Proposal:
        step = self._step(drafter_params, target_params, (~state.done).astype(jnp.int32))
        first, carry = step(last_tokens(state), (state.drafter.cache, state.drafter.last_feature))
        drafts, q, (cache, _) = sample_chain(step, carry, first, step_keys(state, SALT_DRAFT), self.k, sampling)
        return Proposal(drafts, q, EagleState(cache, state.drafter.last_feature), state.cache)

    def observe(self, drafter_params, target_params, prev_state: GenState, state: GenState, verify_hidden,
                num_accepted):
        k, b = self.k, verify_hidden.shape[0]
        ran = ~prev_state.done
        old = prev_state.seq_lens
        committed = state.seq_lens - old  # n + 1, less when cut at EOS or the budget
        redo = jnp.where(ran, jnp.maximum(committed - 1, 0), 0)  # entries old .. seq_len - 2
        cache = state.drafter.cache
        cache = cache.replace(lengths=jnp.where(ran, old, cache.lengths))  # entry old - 1 is true
        idx = jnp.minimum(old[:, None] + jnp.arange(k)[None, :], state.tokens.shape[1] - 1)
        toks = jnp.take_along_axis(state.tokens, idx, axis=1)  # the committed drafts d_1..
        _, cache = eagle_forward(drafter_params["head"], self.config, _embed(target_params, toks),
                                 verify_hidden[:, :k], cache, redo, self.attention)
        new_last = verify_hidden[jnp.arange(b), jnp.maximum(committed - 1, 0)]
        last = jnp.where((ran & (committed > 0))[:, None], new_last, state.drafter.last_feature)
        return EagleState(cache, last.astype(state.drafter.last_feature.dtype))


def make_eagle_drafter(spec, target, attention: str = "reference"):
    """(EagleDrafter, drafter params) from a shipped or trained EAGLE checkpoint."""
    from jspec.loading.drafts import load_eagle

    params = load_eagle(spec.draft, target)
    return EagleDrafter(spec.num_speculative_tokens, target.config, attention), params
