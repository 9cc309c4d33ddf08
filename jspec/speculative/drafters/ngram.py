"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

For n from ``ngram_max`` down to ``ngram_min``, find the latest position i < seq_len - n where
``tokens[i:i+n]`` equals the last n committed tokens; the first n with a match wins and its
continuation ``tokens[i+n : i+n+k]`` is proposed, cut at the end of the committed text: the
proposal has ``num_drafts <= k`` real tokens, 0 without any match (the step then runs a plain
one-token forward instead of a verification). Deterministic, so q is one-hot. Runs on the device:
matching is a fixed-shape comparison over the token buffer.

**Lookup history** (``history`` > 0; ``SpecConfig.ngram_history``): the text of recently finished
requests, the last ``history`` tokens of it, is searched too, as vLLM's suffix decoding searches
earlier responses: a model's outputs repeat across requests (the same idioms, the same
boilerplate) far more than its prompts do. For each n, a match in the request's own text wins;
else a match of n >= ``HISTORY_MIN_MATCH`` tokens in the history, whose continuation is cut at
the end of the request it came from. The history is a parameter of the drafter (int32
[history], requests separated by -1, which no token equals), not state: the engine replaces it
between bursts when requests finish (:meth:`NgramDrafter.remember`), without recompiling. Drafts
only propose, so greedy output stays the target's; what the history changes is how many steps
it takes (and, sampled, which random draws a request's tokens come from).

**Token trees** (``tree_width`` W > 0; ``SpecConfig.tree_nodes``): the continuations of up to W
matches, the longest n first and the latest first within an n, merged into a trie: matches
whose continuations share a prefix share its nodes, and where they part the tree branches. Nodes
are numbered match by match (the first match's chain, then what each further match adds), which
is an order with parents first; a budget of ``k`` nodes keeps the first k. Each continuation is
``tree_depth`` tokens deep at most and cut at the end of the committed text. A request's own text
only (no history).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jspec.speculative.drafters.base import Proposal, StatelessDrafter
from jspec.speculative.state import DecodeState

HISTORY_MIN_MATCH = 2  # matches in the history: 2 tokens or more (2 beat 3 in a replay of HumanEval's drafts, 2026-12-03; 1 untried)
SEPARATOR = -1  # between requests in the history, and its empty filling


def _match_runs(buf: jax.Array, tokens: jax.Array, seq_len, n_max: int, limit,
                followed: bool = False) -> list[jax.Array]:
    """For n = 1..n_max (entry n - 1): bool [len(buf)], whether m has ``buf[m-n:m]`` equal to the
    last n committed tokens (``tokens[seq_len-n:seq_len]``) and ``m < limit`` (the continuation
    token ``buf[m]`` lies inside the limit; with ``followed``, it is no separator either).

    Matches are aligned at their ends, so the n-token match is the (n-1)-token one that also
    agrees one token further back: one comparison of the buffer per n, n_max in all (aligned at
    their starts, each n would compare n times)."""
    pos = jnp.arange(buf.shape[0])
    run = pos < limit
    if followed:
        run &= buf != SEPARATOR
    runs = []
    for d in range(1, n_max + 1):
        back = tokens[jnp.maximum(seq_len - d, 0)]  # the d-th committed token from the end
        run &= (pos >= d) & (jnp.roll(buf, d) == back)  # buf[m - d] == back (no wrap: m >= d)
        runs.append(run)
    return runs


def _latest_ends(buf: jax.Array, tokens: jax.Array, seq_len, n_max: int, limit,
                 followed: bool = False) -> list[jax.Array]:
    """For n = 1..n_max (entry n - 1): the latest match end m of :func:`_match_runs`, or -1."""
    pos = jnp.arange(buf.shape[0])
    return [jnp.max(jnp.where(run, pos, -1)) for run in _match_runs(buf, tokens, seq_len, n_max, limit, followed)]


def ngram_trie_propose(tokens: jax.Array, seq_len: jax.Array, nodes: int, width: int, depth: int,
                       n_max: int, n_min: int):
    """(node tokens int32 [nodes], parents int32 [nodes], num_nodes int32 []) for one sequence: the
    trie of up to ``width`` matches' continuations (the module docstring), parents -1 for the
    root; padding nodes past num_nodes have token 0 and parent -1."""
    pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    runs = _match_runs(tokens, tokens, seq_len, n_max, seq_len)
    cands = []  # match ends, longest n first, latest first within an n (-1: none)
    for n in range(n_max, n_min - 1, -1):
        ends = jnp.where(runs[n - 1] & (seq_len >= n + 1), pos, -1)
        cands.append(jax.lax.top_k(ends, min(width, ends.shape[0]))[0])
    cands = jnp.concatenate(cands)
    # the first `width` candidates that are matches and not an earlier candidate's position
    earlier = jnp.tril(cands[:, None] == cands[None, :], -1).any(axis=1)
    ok = (cands >= 0) & ~earlier
    order = jnp.argsort(jnp.where(ok, jnp.arange(cands.shape[0]), cands.shape[0] + jnp.arange(cands.shape[0])))
    starts = cands[order[:width]]  # [W]
    live = ok[order[:width]]
    d = jnp.arange(depth, dtype=jnp.int32)
    at = starts[:, None] + d[None, :]  # [W, D]
    real = live[:, None] & (at < seq_len)
    cont = jnp.where(real, tokens[jnp.clip(at, 0, tokens.shape[0] - 1)], -1)  # [W, D]
    # same[j, i, d]: continuations j and i agree through depth d (both real there)
    agree = (cont[:, None, :] == cont[None, :, :]) & real[:, None, :] & real[None, :, :]
    same = jnp.cumprod(agree.astype(jnp.int32), axis=2).astype(bool)
    first = jnp.argmax(same, axis=1)  # [W, D]: the first match sharing j's prefix through d (j itself at most)
    keep = real & (first == jnp.arange(width)[:, None])  # a node of its own
    index = jnp.cumsum(keep.reshape(-1)).reshape(width, depth) - 1  # node number in (match, depth) order
    parent_of = jnp.where(d[None, :] == 0, -1,
                          index[first[:, jnp.maximum(d - 1, 0)], jnp.maximum(d - 1, 0)[None, :]])  # [W, D]
    slot = jnp.where(keep & (index < nodes), index, nodes)  # past the budget: dropped (with its subtree)
    node_tokens = jnp.zeros((nodes + 1,), jnp.int32).at[slot.reshape(-1)].set(cont.reshape(-1), mode="drop")
    parents = jnp.full((nodes + 1,), -1, jnp.int32).at[slot.reshape(-1)].set(parent_of.reshape(-1), mode="drop")
    num = jnp.minimum(jnp.sum(keep), nodes).astype(jnp.int32)
    return node_tokens[:nodes], parents[:nodes], num


def ngram_propose(tokens: jax.Array, seq_len: jax.Array, k: int, n_max: int, n_min: int,
                  history: Optional[jax.Array] = None):
    """(drafts int32 [k], num_drafts int32 []) for one sequence: tokens int32 [N], seq_len int32 [];
    ``history`` int32 [H] (see the module docstring) or None."""
    start, found = jnp.int32(-1), jnp.bool_(False)  # own text
    hstart, hfound = jnp.int32(-1), jnp.bool_(False)  # history, taken only where the own text had no match
    own = _latest_ends(tokens, tokens, seq_len, n_max, seq_len)  # m < seq_len: not the suffix itself
    hist = None if history is None else _latest_ends(history, tokens, seq_len, n_max, history.shape[0], followed=True)
    for n in range(n_max, n_min - 1, -1):  # longest n first
        latest = jnp.where(seq_len >= n + 1, own[n - 1], -1)
        take = ~found & ~hfound & (latest >= 0)
        start = jnp.where(take, latest, start)
        found |= take
        if hist is not None and n >= HISTORY_MIN_MATCH:
            hl = jnp.where(seq_len >= n, hist[n - 1], -1)
            htake = ~found & ~hfound & (hl >= 0)
            hstart = jnp.where(htake, hl, hstart)
            hfound |= htake
    steps = jnp.arange(k)
    idx = jnp.minimum(jnp.where(found, start, seq_len - 1) + steps, seq_len - 1)
    drafts = tokens[idx]
    num = jnp.where(found, jnp.minimum(k, seq_len - start), 0)  # committed tokens only
    if history is not None:
        h = history.shape[0]
        hidx = jnp.minimum(jnp.maximum(hstart, 0) + steps, h - 1)
        real = (jnp.maximum(hstart, 0) + steps < h) & (history[hidx] != SEPARATOR)
        hnum = jnp.sum(jnp.cumprod(real.astype(jnp.int32)))  # up to the end of that request's text
        drafts = jnp.where(hfound, history[hidx], drafts)
        num = jnp.where(hfound, hnum, num)
    return drafts, num.astype(jnp.int32)


def _placed_like(drafter_params: dict, history: np.ndarray) -> dict:
    """``drafter_params`` with a new "history", placed as the old one was: a committed array
    where there was an uncommitted one (or the reverse) would recompile every step."""
    was = drafter_params["history"]
    return {**drafter_params, "history": jax.device_put(history, was.sharding if was.committed else None)}


@dataclasses.dataclass(frozen=True)
class NgramDrafter(StatelessDrafter):
    k: int
    n_max: int = 4
    n_min: int = 1
    history: int = 0  # tokens of finished requests' text searched too (0: none; params {"history": int32 [H]})
    tree_width: int = 0  # > 0: propose a trie of up to this many matches' continuations, k nodes
    tree_depth: int = 0  # each continuation's tokens at most (with tree_width)
    # no state of its own follows its drafts (drafts depend on the committed tokens only), so a
    # step may replace drafts it cannot use (structured output's forced tokens)
    follows_committed_tokens = True

    def init_params(self):
        """The drafter's parameters: None, or an empty history."""
        return None if not self.history else {"history": jnp.full((self.history,), SEPARATOR, jnp.int32)}

    def remember(self, drafter_params: dict, texts: Sequence[Sequence[int]]) -> dict:
        """``drafter_params`` (a dict with "history", other keys kept) with ``texts`` (finished
        requests' token ids, oldest first) appended to the history, its oldest tokens dropped; on
        the host, one transfer."""
        if not self.history or not texts:
            return drafter_params
        old = np.asarray(drafter_params["history"])
        new = np.concatenate([old] + [np.asarray([SEPARATOR, *t], np.int32) for t in texts])[-self.history:]
        return _placed_like(drafter_params, new)

    def forget(self, drafter_params: dict) -> dict:
        """``drafter_params`` with an empty history."""
        if not self.history:
            return drafter_params
        return _placed_like(drafter_params, np.full((self.history,), SEPARATOR, np.int32))

    def propose(self, drafter_params, target_params, state: DecodeState, sampling) -> Proposal:
        if self.tree_width:
            drafts, parents, num = jax.vmap(lambda t, s: ngram_trie_propose(
                t, s, self.k, self.tree_width, self.tree_depth, self.n_max, self.n_min))(state.tokens, state.seq_lens)
            return Proposal(drafts, None, state.drafter, state.cache, num, parents)
        history = drafter_params["history"] if self.history else None
        drafts, num = jax.vmap(lambda t, s: ngram_propose(t, s, self.k, self.n_max, self.n_min, history))(
            state.tokens, state.seq_lens)
        return Proposal(drafts.astype(jnp.int32), None, state.drafter, state.cache, num)
