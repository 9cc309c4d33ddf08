"""Layer-skip self-speculation: the target's first L layers, its final norm and LM head draft.

No weights are copied: the draft runs the target's own parameters with ``num_layers=L``. It
also shares the target's cache pages for those L layers: the K/V the draft writes for a token
in layer l < L is exactly what the target computes for that token in layer l (same weights,
same inputs), and verification rewrites all layers for the drafted positions anyway, so the
sharing is sound and needs no extra memory. The draft starts from the target cache
(``lengths == seq_len - 1``) and hands it back at the same lengths for verification.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models.path import PLAIN, ModelPath
from jspec.speculative.drafters.base import Proposal, StatelessDrafter, sample_chain
from jspec.speculative.state import DecodeState, last_tokens, step_keys

SALT_DRAFT = 100


@dataclasses.dataclass(frozen=True)
class LayerSkipDrafter(StatelessDrafter):
    k: int
    config: ModelConfig  # the target's
    num_layers: int
    attention: str = "reference"
    path: ModelPath = PLAIN

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        q_lens = (~state.done).astype(jnp.int32)

        def step(tok, cache):
            out = self.path.forward(target_params, self.config, tok, cache, q_lens, attention=self.attention,
                                    num_layers=self.num_layers)
            return out.logits[:, -1], out.cache

        first, cache = step(last_tokens(state), state.cache)
        drafts, logits, cache = sample_chain(step, cache, first, step_keys(state, SALT_DRAFT), self.k, sampling)
        return Proposal(drafts, logits, state.drafter, cache.replace(lengths=state.cache.lengths))
