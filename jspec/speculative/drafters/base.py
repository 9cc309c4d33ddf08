"""The drafter interface: drafters only propose.

A drafter is a frozen, hashable dataclass (a static argument of the jitted steps) with ``k``,
the most drafts it proposes per step; its parameters, if any, travel separately as a pytree,
and its changing state lives in ``DecodeState.drafter``. It never decides acceptance and never
owns the target's buffers: the layer-skip drafter may write the K/V of the target's first
layers (identical to what the target writes for them) and hands the cache back for
verification. Drafters with caches of their own (a draft model, an EAGLE head) keep their
pages in the same pool geometry as the target and use the target's block tables, so a slot's
pages (and a prefix-cache hit's shared pages) mean the same positions for both.

Every slot's drafter state follows the target: admitted at the length of its cached prefix,
prefilled chunk by chunk in the same steps as the target, and after each step back at
``seq_len - 1`` like the target cache. The methods (all pure; the engine jits them):

    init_state(target_params, drafter_params, cache) -> state      for an empty engine
    admit(state, mask [B], start [B], cache) -> state              slots restarting at ``start``
    prefill(drafter_params, target_params, dstate, tables_cache, segment, hidden) -> state
        a prefill chunk of some slots (``segment`` rows/tokens/q_lens; ``hidden`` [P, T, H]:
        the target's final hidden states of those tokens)
    propose(drafter_params, target_params, state, sampling) -> Proposal
    observe(drafter_params, target_params, prev_state, state, verify_hidden, num_accepted) -> state
        after a speculative step committed (``prev_state``: the state the step started from)
    catch_up(drafter_params, target_params, prev_state, state, hidden) -> state
        after a plain one-token step (no proposal ran): stay in step with the target

Drafters that run a model (the target's first layers, a draft model, an EAGLE head) run it
through their ``path`` field (:class:`~jspec.models.path.ModelPath`), which the engine sets to
its own choice (:func:`on_path`). Drafters with pages of their own also have ``cache_config``:
the ModelConfig of those pages (for the engine's memory estimate). Drafters that read the
target's hidden states may name which in ``feature_layers``: the residual stream after those
target layers, concatenated (an EAGLE-3 head's low/middle/high features); without it (or empty)
``hidden`` is the target's final hidden state after its norm.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import dataclasses

import jax
import jax.numpy as jnp

from jspec import sampling as sampling_lib
from jspec.cache.paged import PagedKVCache
from jspec.models.path import PLAIN, ModelPath


class Proposal(NamedTuple):
    drafts: jax.Array  # int32 [B, k]
    draft_logits: Optional[jax.Array]  # float32 [B, k, V]: the draft's raw distributions, or None (deterministic drafter)
    drafter_state: Any
    target_cache: PagedKVCache  # the target cache to verify on (unchanged except layer-skip)
    num_drafts: Optional[jax.Array] = None  # int32 [B]: real drafts (<= k); None = k for all
    parents: Optional[jax.Array] = None  # int32 [B, k]: a token tree (jspec.speculative.tree):
    # drafts are its nodes, parents[b, i] node i's parent (-1: the last committed token); None: a chain


def feature_layers(drafter) -> tuple[int, ...]:
    """The target layers whose residual stream ``drafter`` reads as its ``hidden`` (() = the
    final hidden state; also for drafters that read none)."""
    return tuple(getattr(drafter, "feature_layers", ()) or ())


def on_path(drafter, path: ModelPath):
    """``drafter`` running its model on ``path``: its ``path`` field and its ``head``'s (a hybrid's
    EAGLE head) replaced; a drafter without a model (or None) comes back as it is."""
    if drafter is None or not dataclasses.is_dataclass(drafter):
        return drafter
    fields = {f.name for f in dataclasses.fields(drafter)}
    changes = {"path": path} if "path" in fields else {}
    if "head" in fields:
        changes["head"] = on_path(drafter.head, path)
    return dataclasses.replace(drafter, **changes) if changes else drafter


class StatelessDrafter:
    """Mixin for drafters without state of their own."""

    def init_state(self, target_params, drafter_params, cache):
        return None

    def admit(self, dstate, mask, start, cache):
        return dstate

    def prefill(self, drafter_params, target_params, dstate, cache, segment, hidden):
        return dstate

    def observe(self, drafter_params, target_params, prev_state, state, verify_hidden, num_accepted):
        return state.drafter

    def catch_up(self, drafter_params, target_params, prev_state, state, hidden):
        return state.drafter


def cache_view(target_cache: PagedKVCache, k_pages, v_pages, lengths) -> PagedKVCache:
    """A drafter's pages seen through the target's block tables."""
    return PagedKVCache(tuple(k_pages), tuple(v_pages), target_cache.block_tables, lengths)


def sample_chain(step_fn, carry, first_logits: jax.Array, keys: jax.Array, k: int, sampling):
    """Draft k tokens autoregressively from ``first_logits`` [B, V] (the distribution of d_1).

    ``step_fn(tokens [B, 1], carry) -> (logits [B, V], carry)`` runs the draft one token
    further (``carry`` is its cache, or any pytree); it runs k - 1 times inside ``lax.scan``
    (traced once, whatever k is). Each row samples with its own parameters (argmax for greedy
    rows). Returns (drafts int32 [B, k], logits float32 [B, k, V], carry).
    """

    def pick(j, logits):
        sub = jax.vmap(lambda kk: jax.random.fold_in(kk, j))(keys)
        return sampling_lib.sample(sub, logits, sampling), logits.astype(jnp.float32)

    d0, l0 = pick(0, first_logits)

    def body(c, j):
        tok, inner = c
        logits, inner = step_fn(tok[:, None], inner)
        d, lg = pick(j, logits)
        return (d, inner), (d, lg)

    (_, carry), (ds, ls) = jax.lax.scan(body, (d0, carry), jnp.arange(1, k))
    drafts = jnp.concatenate([d0[:, None], ds.T], axis=1).astype(jnp.int32)  # [B, k]
    logits = jnp.concatenate([l0[:, None], jnp.swapaxes(ls, 0, 1)], axis=1)  # [B, k, V]
    return drafts, logits, carry


def draft_vocab_logits(hidden: jax.Array, dparams: dict, vocab_size: int, path: ModelPath = PLAIN) -> jax.Array:
    """Logits over the full vocabulary [B, V] from a head over a draft vocabulary.

    ``dparams["lm_head"]`` [V', H] holds the target's output embedding rows of the V' tokens
    ``dparams["vocab_ids"]`` (the most frequent ones in the training data, as EAGLE-3's draft
    vocabulary): the draft reads a V'/V share of the LM head per token. Tokens outside it get
    ``-inf``: never drafted, q = 0 there, which rejection sampling handles exactly (the target
    still emits them). ``dparams["lm_head_rows"]``, where the engine quantized the drafter
    (``jspec.loading.convert.quantized_drafter_weights``): the same rows as Q8_0 blocks, which the
    CPU path's product (``path.times_rows``: the small-row kernel, for a few rows) reads instead.
    """
    head, vocab_ids = dparams["lm_head"], dparams["vocab_ids"]
    small = path.times_rows(hidden, head, dparams.get("lm_head_rows"))  # [B, V']
    full = jnp.full((hidden.shape[0], vocab_size), -jnp.inf, jnp.float32)
    return full.at[:, vocab_ids].set(small)


def expand_tree(first_logits: jax.Array, k: int, depth: int, width: int, running: jax.Array, run_rows,
                root_input: Optional[jax.Array] = None):
    """A token tree of ``k`` nodes as EAGLE-2 grows one (Li et al., arXiv:2406.16858): the root's
    ``width`` most probable tokens under ``first_logits`` [B, V]; then at each further depth the
    drafter runs once on the ``width`` most probable nodes of the last depth (tree rows: each sees
    its ancestors), each offering its ``width`` best children; the ``k`` most probable of all
    candidates by cumulative draft log-probability form the tree, ``depth`` deep at most.

    The frontiers sit in one buffer of (depth - 1) * width rows after the slot's prefix, and each
    depth's run covers the buffer so far (earlier rows again: the same inputs, the same K/V):
    ``run_rows(tokens [B, R], inputs [B, R, F] or None, tree_rows, q_lens [B], lo)`` returns the
    logits [B, width, V] of rows lo .. lo + width and what each of those rows hands its
    children as input ([B, width, F], or None). ``root_input`` [B, F]: the root's children's
    input (an EAGLE head's feature), or None for a drafter that takes tokens only.

    Returns (nodes int32 [B, k], parents int32 [B, k], num int32 [B]); candidates are
    deterministic (q one-hot), so acceptance stays exact under sampling."""
    from jspec.models.llama import TreeRows
    from jspec.speculative import tree as tree_lib

    b, w = first_logits.shape[0], width
    score, tok = jax.lax.top_k(jax.nn.log_softmax(first_logits), w)  # the root's children [B, W]
    toks, scores, parents, depths = [tok], [score], [jnp.full((b, w), -1, jnp.int32)], [jnp.ones((w,), jnp.int32)]
    rows = (depth - 1) * w
    front_idx = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (b, w))  # candidate index of each frontier node
    front_bits = jnp.zeros((b, w), jnp.int32)  # the frontier's parents' rows (the root: in the prefix)
    buf_tok = jnp.zeros((b, rows), jnp.int32)
    buf_bits = jnp.zeros((b, rows), jnp.int32)
    buf_off = jnp.zeros((b, rows), jnp.int32)
    front_in = buf_in = None
    if root_input is not None:
        front_in = jnp.broadcast_to(root_input[:, None], (b, w, root_input.shape[-1]))
        buf_in = jnp.zeros((b, rows, root_input.shape[-1]), root_input.dtype)
    total = w
    for d in range(2, depth + 1):  # the frontier (depth d - 1) goes in as rows lo .. lo + W
        lo = (d - 2) * w
        own = jnp.left_shift(jnp.int32(1), lo + jnp.arange(w, dtype=jnp.int32))
        buf_tok = buf_tok.at[:, lo:lo + w].set(tok)
        buf_bits = buf_bits.at[:, lo:lo + w].set(front_bits | own[None, :])
        buf_off = buf_off.at[:, lo:lo + w].set(d - 2)  # depth d - 1, one past the root's position
        if buf_in is not None:
            buf_in = buf_in.at[:, lo:lo + w].set(front_in)
        q_lens = jnp.where(running, lo + w, 0).astype(jnp.int32)
        logits, outputs = run_rows(buf_tok, buf_in, TreeRows(buf_off, buf_bits), q_lens, lo)
        s, t = jax.lax.top_k(jax.nn.log_softmax(logits), w)  # [B, W (parent), W (child)]
        child_score = (score[:, :, None] + s).reshape(b, w * w)
        child_tok = t.reshape(b, w * w).astype(jnp.int32)
        toks.append(child_tok)
        scores.append(child_score)
        parents.append(jnp.repeat(front_idx, w, axis=1))
        depths.append(jnp.full((w * w,), d, jnp.int32))
        # the next frontier: the W best children; a child's input is its parent's output
        score, pick = jax.lax.top_k(child_score, w)
        parent_row = pick // w  # [B, W] within this depth's rows
        tok = jnp.take_along_axis(child_tok, pick, axis=1)
        front_idx = total + pick.astype(jnp.int32)
        if outputs is not None:
            front_in = jnp.take_along_axis(outputs, parent_row[..., None], axis=1)
        front_bits = jnp.take_along_axis(buf_bits[:, lo:lo + w], parent_row, axis=1)
        total += w * w
    keep = min(k, total)  # a narrow, shallow budget may offer fewer candidates than k nodes
    nodes, node_parents = tree_lib.select_nodes(jnp.concatenate(toks, 1), jnp.concatenate(scores, 1),
                                                jnp.concatenate(parents, 1), jnp.concatenate(depths), keep)
    pad = ((0, 0), (0, k - keep))
    nodes, node_parents = jnp.pad(nodes, pad), jnp.pad(node_parents, pad, constant_values=-1)
    return nodes, node_parents, jnp.where(running, keep, 0).astype(jnp.int32)


def tree_depth_of(drafter) -> int:
    """How deep ``drafter``'s token trees grow (its head's, for the hybrid); 0 for a chain drafter."""
    head = getattr(drafter, "head", drafter)
    return getattr(head, "tree_depth", 0) if getattr(head, "tree_width", 0) else 0


def as_chain(drafter, k: int):
    """``drafter`` proposing a chain of ``k`` drafts instead of its token tree (the other arms of
    a tree drafter under dynamic k). The chain keeps the tree's depth where the drafter reads it
    outside drafting (a draft model feeds up to depth + 1 committed tokens after a tree step);
    a chain drafter comes back at ``k``."""
    if dataclasses.is_dataclass(drafter) and "head" in {f.name for f in dataclasses.fields(drafter)}:
        return dataclasses.replace(drafter, k=k, head=as_chain(drafter.head, k))  # the hybrid
    if getattr(drafter, "tree_width", 0):
        return dataclasses.replace(drafter, k=k, tree_width=0)
    return dataclasses.replace(drafter, k=k)
