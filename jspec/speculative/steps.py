"""The decode steps, on the device: one plain-token step and one speculative step, and a burst
of either inside ``lax.while_loop``.

Both steps take the :class:`~jspec.speculative.state.DecodeState` of every slot and return the
next one; slots that are not running take no part (q_len 0). Either step can carry a prefill
chunk of one more slot (a :class:`~jspec.models.llama.Segment` of its prompt tokens): the chunk
rides in the same target forward as the decode/verification rows (one pass over the weights),
its K/V are written, the drafter digests it, and a slot whose prompt is fully in the cache
starts decoding at the next step.

The plain-token step is the autoregressive baseline and also the speculative step's branch for
steps where no slot has a draft (n-gram lookup without a match, or every slot capped at 0).

The target runs through the steps' ``path`` (:class:`~jspec.models.path.ModelPath`: the plain
modules, or the CPU kernels' where the engine chose them), a static field like ``attention``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jspec import sampling as sampling_lib
from jspec.config import ModelConfig
from jspec.models.llama import Segment
from jspec.models.path import PLAIN, ModelPath
from jspec.cache.paged import move_positions
from jspec.models.llama import TreeRows
from jspec.speculative import tree as tree_lib
from jspec.speculative.acceptance import greedy_accept, rejection_sample
from jspec.speculative.control import cond_in_place
from jspec.speculative.drafters.base import feature_layers
from jspec.speculative.state import DecodeState, commit, last_tokens, step_keys

SALT_ACCEPT = 1  # step_keys salt of the token draws (drafters use other salts)


def sample_next(state: DecodeState, logits: jax.Array) -> jax.Array:
    """The next token of each slot from its target logits [B, V] when no draft is verified.

    It is drawn exactly as rejection sampling draws the bonus token after zero drafts (the same
    key, the same function of p), so a slot's token does not depend on whether the step it is
    in verifies other slots' drafts: sampled output is reproducible alone and batched.
    """
    rs = state.sampling
    best = sampling_lib.argmax(logits)

    def draw(_):
        keys = jax.vmap(lambda k: jax.random.split(k)[1])(step_keys(state, SALT_ACCEPT))
        tok = jax.vmap(sampling_lib.sample_from_probs)(keys, sampling_lib.probs(logits, rs))
        return jnp.where(rs.greedy, best, tok)

    return jax.lax.cond(jnp.all(rs.greedy | state.done), lambda _: best, draw, None)


def plain_token_step(params, config: ModelConfig, attention: str, state: DecodeState, cache,
                     prefill: Optional[Segment] = None, num_rows: int = 1, features: tuple[int, ...] = (),
                     path: ModelPath = PLAIN, mask: Optional[jax.Array] = None):
    """One target forward over the last token of every running slot (and ``prefill``); ``mask``
    (int32 [B, words], structured output) removes tokens before the next one is chosen.

    Returns (cache, hidden [B, num_rows, F] (row 0 real, the rest zero padding), next token
    [B], the prefill chunk's hidden states or None); hidden means the target's ``features``
    (see :func:`~jspec.models.llama.forward_segments`), by default its final hidden states.
    """
    q_lens = (~state.done).astype(jnp.int32)
    segments = (Segment(last_tokens(state), q_lens),) + ((prefill,) if prefill is not None else ())
    logits, hidden, cache = path.forward_segments(params, config, segments, cache, attention=attention,
                                                  logits_for=(True,) + (False,) * (len(segments) - 1),
                                                  feature_layers=features)
    last = logits[0][:, 0]
    nxt = sample_next(state, last if mask is None else sampling_lib.apply_token_masks(last, mask))
    h = jnp.pad(hidden[0], ((0, 0), (0, num_rows - 1), (0, 0)))
    return cache, h, nxt, (hidden[1] if prefill is not None else None)


def finish_prefill(state: DecodeState, prefill: Optional[Segment]) -> DecodeState:
    """Slots whose whole ``prompt[:-1]`` is now in the cache start decoding."""
    if prefill is None:
        return state
    rows = prefill.rows  # padding rows (q_len 0) may point past the end: read clipped, never written
    get = lambda x: jnp.take(x, rows, mode="clip")  # noqa: E731
    complete = (prefill.q_lens > 0) & (get(state.cache.lengths) == get(state.seq_lens) - 1)
    return state.replace(done=state.done.at[rows].set(jnp.where(complete, False, get(state.done)), mode="drop"))


@dataclasses.dataclass(frozen=True)
class PlainStep:
    """One token per target forward: the autoregressive baseline (hashable: a jit static arg).
    With a stateful ``drafter`` (a plain step inside a speculative engine, when speculation is
    turned off) the drafter still follows the committed tokens (``catch_up``)."""

    config: ModelConfig
    eos_ids: tuple[int, ...]
    attention: str
    drafter: Any = None
    path: ModelPath = PLAIN
    constraint: Any = None  # a jspec.sampling.structured.ConstraintTable: masks from the host each step

    @property
    def k(self) -> int:
        return 0

    def __call__(self, params, drafter_params, state: DecodeState, prefill: Optional[Segment] = None) -> DecodeState:
        running = ~state.done
        mask = None
        if self.constraint is not None:
            b = running.shape[0]
            none = jnp.zeros((b,), jnp.int32)
            masks = self.constraint.device_masks(state, jnp.zeros((b, 0), jnp.int32), none, none, False)[0]
            mask = masks[:, 0]
        cache, hidden, nxt, pre_hidden = plain_token_step(params, self.config, self.attention, state, state.cache,
                                                          prefill, features=feature_layers(self.drafter),
                                                          path=self.path, mask=mask)
        new = state.replace(cache=cache, steps=state.steps + 1, num_steps=state.num_steps + running)
        new = commit(new, nxt[:, None], running.astype(jnp.int32), self.eos_ids)
        if self.drafter is not None:
            new = new.replace(drafter=self.drafter.catch_up(drafter_params, params, state, new, hidden))
            if prefill is not None:
                new = new.replace(drafter=self.drafter.prefill(drafter_params, params, new.drafter, new.cache,
                                                               prefill, pre_hidden))
        return finish_prefill(new, prefill)


def conditioned_draft_probs(q: jax.Array, masks: jax.Array) -> jax.Array:
    """The law of a verified draft under a structured-output constraint: drafts the grammar
    refuses are cut before verification, so a draft that reaches it was drawn from q [..., V]
    conditioned on the mask [..., words]; that is the q rejection sampling must divide by (with
    q itself the output would lean toward the drafter's refused mass)."""
    q = q * sampling_lib.token_mask_bits(masks, q.shape[-1])
    return q / jnp.maximum(jnp.sum(q, axis=-1, keepdims=True), jnp.finfo(q.dtype).tiny)


@dataclasses.dataclass(frozen=True)
class SpecStep:
    config: ModelConfig
    eos_ids: tuple[int, ...]
    attention: str
    drafter: Any  # a hashable drafter (see jspec.speculative.drafters.base)
    path: ModelPath = PLAIN
    # a jspec.sampling.structured.ConstraintTable: each step, after drafting, the host gives every slot
    # the masks of its verified rows and cuts its drafts where the grammar refuses one
    constraint: Any = None

    @property
    def k(self) -> int:
        return self.drafter.k

    def __call__(self, params, drafter_params, state: DecodeState, prefill: Optional[Segment] = None) -> DecodeState:
        k = self.drafter.k
        running = ~state.done
        b = running.shape[0]

        # 1. Draft: up to k proposals per slot (the drafter's real ones, capped per slot).
        with jax.named_scope("draft"):
            prop = self.drafter.propose(drafter_params, params, state, state.sampling)
        real = jnp.full((b,), k, jnp.int32) if prop.num_drafts is None else prop.num_drafts
        num = jnp.where(running, jnp.minimum(real, state.spec_k), 0)  # [B]
        masks = forced = None
        if self.constraint is not None:
            if prop.parents is not None:
                raise ValueError("structured output does not take token trees")
            with jax.named_scope("constraint"):
                limit = jnp.where(running, jnp.minimum(state.spec_k, k), 0)
                masks, drafts, forced, num = self.constraint.device_masks(
                    state, prop.drafts, num, limit, getattr(self.drafter, "follows_committed_tokens", False))
            prop = prop._replace(drafts=drafts, num_drafts=num)

        # 2-3. Verify and accept: n drafts survive, one recovered/bonus token follows them. When no
        #      slot has a draft, a plain one-token forward replaces the (k + 1)-token verification
        #      (chosen on the device without copying the page pool: see cond_in_place).
        if prop.num_drafts is None:  # the drafter always proposes: a step without drafts is rare
            cache, (hidden, n, cand, pre_hidden) = self._verify(params, state, prop, num, prefill, prop.target_cache,
                                                                masks, forced)
        else:
            cache, (hidden, n, cand, pre_hidden) = cond_in_place(
                jnp.any(num > 0),
                lambda c: self._verify(params, state, prop, num, prefill, c, masks, forced),
                lambda c: self._plain(params, state, prefill, c, masks),
                prop.target_cache)

        # 4. Commit d_1..d_n and the extra token (``cand``: the accepted path of a tree); commit()
        #    cuts at EOS and the token budget and rolls the target cache back to seq_len - 1 (the
        #    K/V of rejected drafts go stale). Counters: accepted[j] counts steps that accepted a
        #    (j+1)-th token, proposed[j] steps with a (j+1)-th draft (a tree's: node).
        pos = jnp.arange(k)[None, :]
        new = state.replace(
            cache=cache, drafter=prop.drafter_state, steps=state.steps + 1, num_steps=state.num_steps + running,
            num_drafts=state.num_drafts + (num > 0),
            accepted=state.accepted.at[:, :k].add((running[:, None] & (pos < n[:, None])).astype(jnp.int32)),
            proposed=state.proposed.at[:, :k].add((pos < num[:, None]).astype(jnp.int32)))
        new = commit(new, cand, n + 1, self.eos_ids)

        # 5. The drafter catches up with what was committed (its own rollback, true features)
        #    and digests the prefill chunk.
        with jax.named_scope("draft_observe"):
            dstate = self.drafter.observe(drafter_params, params, state, new, hidden, n)
            if prefill is not None:
                dstate = self.drafter.prefill(drafter_params, params, dstate, new.cache, prefill, pre_hidden)
        return finish_prefill(new.replace(drafter=dstate), prefill)

    def _verify(self, params, state: DecodeState, prop, num, prefill, cache, masks=None, forced=None):
        """The target scores [last token, d_1..d_k] in one forward (q_len = drafts + 1), writing
        their K/V at positions seq_len - 1 .. of ``cache``; acceptance picks n and the extra token.
        A tree's rows attend through its ancestor mask, and the K/V of its accepted path move to
        consecutive positions after the root. Returns (cache, (hidden in the order of the
        committed tokens, n, the tokens to commit [B, k + 1], the prefill chunk's hidden or None))."""
        b, k = prop.drafts.shape
        tree = None if prop.parents is None else tree_lib.TokenTree(prop.drafts, prop.parents, num, prop.draft_logits)
        with jax.named_scope("verify"):
            q_lens = jnp.where(state.done, 0, num + 1).astype(jnp.int32)
            inp = jnp.concatenate([last_tokens(state), prop.drafts], axis=1)  # [B, k + 1]
            rows = None if tree is None else TreeRows(tree_lib.row_positions(tree.parents),
                                                      tree_lib.ancestor_bits(tree.parents))
            segments = (Segment(inp, q_lens, tree=rows),) + ((prefill,) if prefill is not None else ())
            logits, hidden, cache = self.path.forward_segments(params, self.config, segments, cache,
                                                               attention=self.attention,
                                                     logits_for=(True,) + (False,) * (len(segments) - 1),
                                                     feature_layers=feature_layers(self.drafter))
            logits = logits[0]  # [B, k + 1, V]
            if masks is not None:  # structured output: the constrained target, at every row
                logits = sampling_lib.apply_token_masks(logits, masks)
        with jax.named_scope("accept"):
            rs = state.sampling

            def q_of(p):
                if prop.draft_logits is None:  # deterministic drafter: one-hot q
                    return None if tree is not None else jax.nn.one_hot(prop.drafts, p.shape[-1], dtype=p.dtype)
                q = sampling_lib.probs(prop.draft_logits, rs)
                if masks is None:
                    return q
                # a forced (jump-forward) draft is the grammar's, deterministic: one-hot q
                return jnp.where(forced[..., None], jax.nn.one_hot(prop.drafts, q.shape[-1], dtype=q.dtype),
                                 conditioned_draft_probs(q, masks[:, :k]))

            if tree is None:
                def greedy(_):
                    return greedy_accept(prop.drafts, logits, num)

                def sampled(_):
                    p = sampling_lib.probs(logits, rs)  # [B, k + 1, V]
                    return rejection_sample(step_keys(state, SALT_ACCEPT), prop.drafts, q_of(p), p, num)

                n, nxt = jax.lax.cond(jnp.all(rs.greedy | state.done), greedy, sampled, None)
                j = jnp.arange(k + 1)[None, :]
                drafts_pad = jnp.concatenate([prop.drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
                return cache, (hidden[0], n, jnp.where(j < n[:, None], drafts_pad, nxt[:, None]),
                               (hidden[1] if prefill is not None else None))

            def greedy_tree(_):
                return tree_lib.greedy_accept_tree(tree, logits)

            def sampled_tree(_):
                p = sampling_lib.probs(logits, rs)
                return tree_lib.rejection_sample_tree(step_keys(state, SALT_ACCEPT), tree, q_of(p), p)

            acc = jax.lax.cond(jnp.all(rs.greedy | state.done), greedy_tree, sampled_tree, None)
        with jax.named_scope("tree_commit"):
            root = state.cache.lengths  # the root's position; node i was written at root + 1 + i
            src, count = tree_lib.path_moves(acc)
            dst = jnp.arange(k, dtype=jnp.int32)[None, :]
            cache = move_positions(cache, root[:, None] + 1 + src, root[:, None] + 1 + dst,
                                   jnp.where(state.done, 0, count))
            h = jnp.take_along_axis(hidden[0], tree_lib.path_rows(acc)[..., None], axis=1)
        return cache, (h, acc.num_accepted, tree_lib.path_tokens(tree, acc),
                       (hidden[1] if prefill is not None else None))

    def _plain(self, params, state: DecodeState, prefill, cache, masks=None):
        """No drafts anywhere: one token from the target, as plain decoding would do."""
        cache, hidden, nxt, pre_hidden = plain_token_step(params, self.config, self.attention, state, cache,
                                                          prefill, num_rows=self.drafter.k + 1,
                                                          features=feature_layers(self.drafter), path=self.path,
                                                          mask=None if masks is None else masks[:, 0])
        return cache, (hidden, jnp.zeros_like(nxt), jnp.broadcast_to(nxt[:, None], (nxt.shape[0], self.drafter.k + 1)),
                       pre_hidden)


def burst(step, params, drafter_params, state: DecodeState, prefill: Optional[Segment], limit,
          stop_on_finish) -> DecodeState:
    """Run ``step`` on the device: one step carrying ``prefill`` when there is a chunk, else
    until every slot is done, ``limit`` steps ran, or (with ``stop_on_finish``) a slot that was
    running has finished, so the host can hand its slot to a waiting request. (A prefill step
    runs alone: one compiled copy of the step per variant, and the host hears at once of a
    prompt that is ready.)"""
    if prefill is not None:
        return step(params, drafter_params, state, prefill)
    was_running = ~state.done
    i0 = jnp.int32(0)

    def cond(carry):
        s, i = carry
        finished = jnp.any(was_running & s.done)
        return (i < limit) & ~jnp.all(s.done) & ~(stop_on_finish & finished)

    def body(carry):
        s, i = carry
        return step(params, drafter_params, s), i + 1

    return jax.lax.while_loop(cond, body, (state, i0))[0]


burst_jit = jax.jit(burst, static_argnums=0, donate_argnums=3)
