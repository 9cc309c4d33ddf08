"""Token trees: several drafted continuations verified in one target forward.

A tree of one slot has up to N nodes (N <= :data:`MAX_NODES`), stored in topological order
(a parent before its children). Node i holds a drafted token and its parent: -1 for the root,
which is the slot's last committed token, else an earlier node. The verification forward runs
N + 1 rows per slot: row 0 is the root, row i + 1 is node i. A node's depth is its distance
from the root (a child of the root has depth 1), and its row sits at position
``prefix + depth`` (RoPE) while its K/V are written at storage position ``prefix + 1 + i``.

Attention (the verification contract with a tree; see :mod:`jspec.attention`): every row sees
the cached prefix; row t also sees the rows of its ancestors and itself (the root is every node's
ancestor). That set is a bitmask per row (:func:`ancestor_bits`): bit j stands for row j, so a
tree of 31 nodes and its root fit an int32. A chain (node i's parent is node i - 1) is the tree
of width one: its bits are ``(1 << (t + 1)) - 1`` for row t, exactly the causal mask, and its
acceptance is the chain's.

Acceptance walks from the root:

- greedy: at each node, the child whose token equals the target's argmax there, while one does;
  the extra token is the target's argmax at the last accepted node. Token-identical to greedy
  decoding with the target alone.
- sampled: recursive rejection over a node's children in index order (SpecInfer, Miao et al.,
  arXiv:2305.09781, section 4.3): with r the target's distribution at the node, child c drafted
  from q_c is accepted with probability min(1, r(c) / q_c(c)); on rejection r becomes
  normalize(max(0, r - q_c)) and the next child is tried. After the last accepted node the extra
  token is drawn from r (the residual when its children were all rejected, the target's
  distribution at a leaf). A deterministic candidate (the head's top-k, a lookup's
  continuation) has a one-hot q_c, so its rejection removes its token from r. Each child's draw
  depends on nothing but its ancestors, so every emitted token follows the target exactly; on a
  chain the rule and the random draws are those of
  :func:`~jspec.speculative.acceptance.rejection_sample`.

After acceptance the K/V of the accepted nodes move to consecutive positions right after the
root (:func:`path_moves`), so the slot's pages hold the committed text in order again.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from jspec.sampling import argmax, sample_from_probs

MAX_NODES = 31  # nodes past the root; with it, one bit per row in an int32 mask


class TokenTree(NamedTuple):
    """The drafted trees of a batch of slots (a pytree)."""

    tokens: jax.Array  # int32 [B, N]: node tokens, parents before children
    parents: jax.Array  # int32 [B, N]: parent node index, -1 = the root (last committed token)
    num_nodes: jax.Array  # int32 [B]: real nodes; nodes past them are padding (never accepted)
    logits: Optional[jax.Array] = None  # float32 [B, N, V]: the distribution node i was drawn
    # from (raw draft logits), or None: every node is a deterministic candidate (one-hot q)

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def chain_parents(batch: int, k: int) -> jax.Array:
    """int32 [batch, k]: the parents of a chain (node i under node i - 1, node 0 under the root)."""
    return jnp.broadcast_to(jnp.arange(-1, k - 1, dtype=jnp.int32), (batch, k))


def chain(drafts: jax.Array, num_drafts: Optional[jax.Array] = None,
          logits: Optional[jax.Array] = None) -> TokenTree:
    """A chain of drafts [B, k] as the tree of width one."""
    b, k = drafts.shape
    num = jnp.full((b,), k, jnp.int32) if num_drafts is None else num_drafts.astype(jnp.int32)
    return TokenTree(drafts.astype(jnp.int32), chain_parents(b, k), num, logits)


def _check_size(n: int) -> None:
    if n > MAX_NODES:
        raise ValueError(f"a token tree holds at most {MAX_NODES} nodes, got {n}")


def depths(parents: jax.Array) -> jax.Array:
    """int32 [B, N]: each node's distance from the root (children of the root: 1)."""
    b, n = parents.shape
    _check_size(n)
    out = jnp.zeros((b, n), jnp.int32)
    for i in range(n):  # parents come first: their depth is known when a child is reached
        up = jnp.take_along_axis(out, jnp.maximum(parents[:, i:i + 1], 0), axis=1)[:, 0]
        out = out.at[:, i].set(jnp.where(parents[:, i] >= 0, up + 1, 1))
    return out


def ancestor_bits(parents: jax.Array) -> jax.Array:
    """int32 [B, N + 1]: the verification rows each row sees besides the prefix; bit j of entry
    t stands for row j (the root is row 0, node i row i + 1)."""
    b, n = parents.shape
    _check_size(n)
    bits = jnp.ones((b, n + 1), jnp.int32)  # the root sees itself
    for i in range(n):
        up = jnp.take_along_axis(bits, (parents[:, i:i + 1] + 1), axis=1)[:, 0]  # the parent's row
        own = jnp.left_shift(jnp.int32(1), jnp.int32(i + 1)) if i + 1 < 31 else jnp.int32(-2**31)
        bits = bits.at[:, i + 1].set(up | own)
    return bits


def row_positions(parents: jax.Array) -> jax.Array:
    """int32 [B, N + 1]: each verification row's offset from the root's position (its depth)."""
    return jnp.concatenate([jnp.zeros((parents.shape[0], 1), jnp.int32), depths(parents)], axis=1)


class TreeAcceptance(NamedTuple):
    num_accepted: jax.Array  # int32 [B]: accepted nodes (the depth of the last one)
    path: jax.Array  # int32 [B, N]: path[b, j] = the node accepted at depth j + 1 (j < n), else -1
    next_token: jax.Array  # int32 [B]: the recovered or bonus token after the path


def _real_nodes(tree: TokenTree):
    """bool [B, N]: the real nodes."""
    return jnp.arange(tree.size)[None, :] < tree.num_nodes[:, None]


def greedy_accept_tree(tree: TokenTree, target_logits: jax.Array) -> TreeAcceptance:
    """Walk from the root through the children equal to the target's argmax (``target_logits``
    [B, N + 1, V], row 0 the root's)."""
    b, n = tree.tokens.shape
    best = argmax(target_logits)  # [B, N + 1]
    real = _real_nodes(tree)
    rows = jnp.arange(b)

    def body(i, carry):  # node i may extend the path when its parent is the path's end
        cur, num, path = carry
        want = best[rows, cur + 1]  # the target's token after the current node
        hit = real[:, i] & (tree.parents[:, i] == cur) & (tree.tokens[:, i] == want)
        path = path.at[rows, num].set(jnp.where(hit, i, path[rows, num]), mode="drop")
        return jnp.where(hit, i, cur), num + hit, path

    init = (jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), jnp.int32), jnp.full((b, n), -1, jnp.int32))
    cur, num, path = jax.lax.fori_loop(0, n, body, init)
    return TreeAcceptance(num, path, best[rows, cur + 1])


def rejection_sample_tree(keys: jax.Array, tree: TokenTree, q: Optional[jax.Array], p: jax.Array) -> TreeAcceptance:
    """Recursive rejection sampling over the tree (see the module doc). ``keys`` [B] PRNG keys,
    ``q`` [B, N, V] the processed draft distribution of each node (None: one-hot candidates),
    ``p`` [B, N + 1, V] the processed target distributions of the rows."""
    b, n = tree.tokens.shape
    real = _real_nodes(tree)
    u_keys, r_keys = jax.vmap(lambda kk: tuple(jax.random.split(kk)))(keys)  # as rejection_sample's
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (n,)))(u_keys)  # [B, N]: one per node
    rows = jnp.arange(b)

    def body(i, carry):
        cur, num, path, r = carry
        tok = tree.tokens[:, i]
        here = real[:, i] & (tree.parents[:, i] == cur)  # a child of the path's end, not yet tried
        r_tok = jnp.take_along_axis(r, tok[:, None], axis=1)[:, 0]
        if q is None:
            q_i = jax.nn.one_hot(tok, r.shape[-1], dtype=r.dtype)
        else:
            q_i = q[:, i]
        q_tok = jnp.take_along_axis(q_i, tok[:, None], axis=1)[:, 0]
        accept = here & (u[:, i] * q_tok < r_tok)  # u < r/q without dividing; q > 0 for a drafted token
        # accepted: move to the child, whose row's distribution is p there; rejected: the
        # residual, normalized (r stays a distribution, so r(c) is a probability)
        residual = jnp.maximum(r - q_i, 0.0)
        mass = jnp.sum(residual, -1, keepdims=True)
        residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), r)  # rounding guard
        r = jnp.where(accept[:, None], p[:, i + 1], jnp.where((here & ~accept)[:, None], residual, r))
        path = path.at[rows, num].set(jnp.where(accept, i, path[rows, num]), mode="drop")
        return jnp.where(accept, i, cur), num + accept, path, r

    init = (jnp.full((b,), -1, jnp.int32), jnp.zeros((b,), jnp.int32), jnp.full((b, n), -1, jnp.int32),
            p[:, 0].astype(jnp.float32))
    _, num, path, r = jax.lax.fori_loop(0, n, body, init)
    nxt = jax.vmap(sample_from_probs)(r_keys, r)
    return TreeAcceptance(num, path, nxt)


def path_tokens(tree: TokenTree, acc: TreeAcceptance) -> jax.Array:
    """int32 [B, N + 1]: the accepted nodes' tokens then the extra token (the first n + 1 are
    the tokens the step emits; the rest repeat the extra token)."""
    b, n = tree.tokens.shape
    toks = jnp.take_along_axis(tree.tokens, jnp.maximum(acc.path, 0), axis=1)
    j = jnp.arange(n + 1)[None, :]
    toks = jnp.concatenate([toks, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return jnp.where(j < acc.num_accepted[:, None], toks, acc.next_token[:, None])


def path_rows(acc: TreeAcceptance) -> jax.Array:
    """int32 [B, N + 1]: the verification rows of the root and the accepted nodes (row 0, then
    path + 1), padded with row 0: the rows whose hidden states a drafter reads as the chain."""
    b = acc.path.shape[0]
    return jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(acc.path + 1, 0)], axis=1)


def path_moves(acc: TreeAcceptance) -> tuple[jax.Array, jax.Array]:
    """(source, count): the accepted node at depth j + 1 sits in storage at root + 1 + path[j]
    and belongs at root + 1 + j; ``source`` int32 [B, N] is path[j] (j < count), ``count`` the
    accepted nodes. On a chain every move is to itself."""
    return jnp.maximum(acc.path, 0), acc.num_accepted


def select_nodes(tokens: jax.Array, scores: jax.Array, parents: jax.Array, depth: jax.Array, n: int):
    """The ``n`` best of C candidates by cumulative draft log-probability (EAGLE-2's selection),
    as a tree in topological order: (tokens int32 [B, n], parents int32 [B, n]).

    ``tokens``, ``scores``, ``parents`` (candidate index, -1 the root) and ``depth`` are [B, C]
    (depth [C] or [B, C]). A child's score is its parent's plus a log-probability <= 0, and ties
    go to the shallower candidate, so the chosen set holds every chosen node's parent."""
    b, c = tokens.shape
    _check_size(n)
    depth = jnp.broadcast_to(depth, (b, c))
    key = jnp.maximum(scores, -1e3) - 1e-3 * depth  # -inf (outside a draft vocabulary) stays ordered
    _, chosen = jax.lax.top_k(key, n)  # [B, n] candidate indices
    order = jnp.argsort(jnp.take_along_axis(depth, chosen, axis=1) * c + chosen, axis=1)  # by depth: parents first
    chosen = jnp.take_along_axis(chosen, order, axis=1)
    slot_of = jnp.full((b, c + 1), -1, jnp.int32)  # candidate index + 1 -> its node (0: the root, -1)
    slot_of = slot_of.at[jnp.arange(b)[:, None], chosen + 1].set(jnp.arange(n, dtype=jnp.int32)[None, :])
    par = jnp.take_along_axis(parents, chosen, axis=1)
    return (jnp.take_along_axis(tokens, chosen, axis=1).astype(jnp.int32),
            jnp.take_along_axis(slot_of, par + 1, axis=1))
