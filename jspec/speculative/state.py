"""The decode state pytree (one row per slot) and the token-commit rule every step shares.

A slot is a row of every per-slot array. Invariant while slot b runs (``done[b]`` False):
``tokens[b, :seq_lens[b]]`` are committed (prompt + new tokens), the target cache holds K/V for
all of them but the last (``cache.lengths[b] == seq_lens[b] - 1``), and the last committed
token is the next forward's input. A slot that is empty, finished, or still being prefilled
has ``done[b]`` True and takes no part in decode steps (its q_len is 0).

Everything that changes lives here and goes through the jitted steps, donated: the token
buffer, lengths, per-slot sampling parameters and PRNG key data, the per-slot caps on drafts,
the target cache, the drafter's state, and per-slot counters that the engine reads as metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jspec.cache.paged import PagedKVCache
from jspec.sampling import RowSampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    tokens: jax.Array  # int32 [B, L]: prompt + generated, padded
    seq_lens: jax.Array  # int32 [B]: committed tokens
    max_lens: jax.Array  # int32 [B]: prompt_len + max_tokens
    done: jax.Array  # bool [B]: not decoding (finished, empty, or still prefilling)
    eos_hit: jax.Array  # bool [B]: finished by an EOS token
    ignore_eos: jax.Array  # bool [B]
    key_data: jax.Array  # uint32 [B, 2]: raw PRNG key of each slot (one stream per request)
    sampling: RowSampling  # [B] each
    spec_k: jax.Array  # int32 [B]: cap on drafts per step for the slot (0 = no speculation)
    cache: PagedKVCache  # the target's; block tables [B, pages], lengths [B]
    drafter: Any  # the drafter's own state pytree (None for stateless drafters)
    # counters (per slot, since the slot's request was admitted)
    num_steps: jax.Array  # int32 [B]: target forwards the slot took part in
    num_drafts: jax.Array  # int32 [B]: steps in which >= 1 draft was proposed for the slot
    accepted: jax.Array  # int32 [B, K]: accepted[b, j] = steps where draft j + 1 was accepted
    proposed: jax.Array  # int32 [B, K]: proposed[b, j] = steps where draft j + 1 was proposed
    steps: jax.Array  # int32 []: loop iterations since the state was created
    # int32 [B]: the slot's structured-output handle (jspec.sampling.structured; -1: none), or None for
    # a state whose steps never constrain
    constraint: Any = None

    # the fields with one row per slot (leading axis B); ``cache`` and ``drafter`` declare their
    # own, everything else (``steps``) is shared by all slots; see take_slots / put_slots
    SLOT_FIELDS = ("tokens", "seq_lens", "max_lens", "done", "eos_hit", "ignore_eos", "key_data", "sampling",
                   "spec_k", "num_steps", "num_drafts", "accepted", "proposed", "constraint")

    def replace(self, **kw) -> "DecodeState":
        return dataclasses.replace(self, **kw)

    @property
    def batch(self) -> int:
        return self.seq_lens.shape[0]


GenState = DecodeState  # the name of earlier releases


def _map_slots(rows, shared, x, *more):
    """Rebuild state ``x`` field by field: fields it lists in ``SLOT_FIELDS`` through ``rows``
    (leaf by leaf, with the matching leaves of ``more``), nested states (dataclasses) recursively,
    everything else (page pools, counters shared by all slots, None) through ``shared``. A
    dataclass that does not declare ``SLOT_FIELDS`` is refused: guessing per-slot leaves by shape
    would take EAGLE's per-page ``page_feature`` [P, H] for a per-slot array when P == B."""
    if x is None:
        return None
    names = getattr(type(x), "SLOT_FIELDS", None)
    if names is None:
        raise TypeError(f"{type(x).__name__} does not declare its per-slot fields (SLOT_FIELDS)")
    out = {}
    for f in dataclasses.fields(x):
        vals = [getattr(t, f.name) for t in (x,) + more]
        if f.name in names:
            out[f.name] = jax.tree.map(rows, *vals)
        elif dataclasses.is_dataclass(vals[0]):
            out[f.name] = _map_slots(rows, shared, *vals)
        else:
            out[f.name] = jax.tree.map(shared, *vals) if vals[0] is not None else None
    return dataclasses.replace(x, **out)


def take_slots(state: DecodeState, slots: jax.Array) -> DecodeState:
    """The state of slots ``slots`` (int32 [S], distinct) alone, a batch of S: every per-slot
    row gathered (tokens, lengths, block tables, a drafter's per-slot rows...); the page pools
    (the target's and a drafter's, addressed through the block tables) pass through whole."""
    return _map_slots(lambda a: jnp.take(a, slots, axis=0), lambda a: a, state)


def put_slots(state: DecodeState, sub: DecodeState, slots: jax.Array) -> DecodeState:
    """Write back a sub-state from :func:`take_slots` after steps ran on it: its rows go to
    ``slots``, its shared leaves (pools the steps wrote, the step counter) replace the old ones."""
    return _map_slots(lambda a, b: a.at[slots].set(b, unique_indices=True), lambda a, b: b, state, sub)


def last_tokens(state: DecodeState) -> jax.Array:
    """The last committed token of each slot, int32 [B, 1]."""
    idx = jnp.maximum(state.seq_lens - 1, 0)[:, None]
    return jnp.take_along_axis(state.tokens, idx, axis=1)


def step_keys(state: DecodeState, salt: int = 0) -> jax.Array:
    """Per-slot keys [B] for this step, a function of (request seed, position, salt) only, so a
    request samples the same whether it runs alone or in a batch, and after a preemption."""
    keys = jax.random.wrap_key_data(state.key_data)
    return jax.vmap(lambda k, n: jax.random.fold_in(jax.random.fold_in(k, n), salt))(keys, state.seq_lens)


def commit(state: DecodeState, cand: jax.Array, counts: jax.Array, eos_ids: tuple[int, ...]) -> DecodeState:
    """Append the first ``counts[b]`` tokens of ``cand[b]`` (int32 [B, M]) to each running
    slot, cut at the first EOS and at the token budget; roll the cache back to match."""
    b, m = cand.shape
    counts = jnp.where(state.done, 0, jnp.minimum(counts, state.max_lens - state.seq_lens))
    j = jnp.arange(m, dtype=jnp.int32)[None, :]
    eos_hit = jnp.zeros((b,), bool)
    if eos_ids:
        is_eos = jnp.isin(cand, jnp.asarray(eos_ids, jnp.int32)) & (j < counts[:, None]) & ~state.ignore_eos[:, None]
        eos_hit = jnp.any(is_eos, axis=1)
        counts = jnp.where(eos_hit, jnp.argmax(is_eos, axis=1).astype(jnp.int32) + 1, counts)
    pos = jnp.where(j < counts[:, None], state.seq_lens[:, None] + j, state.tokens.shape[1])
    tokens = state.tokens.at[jnp.arange(b)[:, None], pos].set(cand, mode="drop")
    seq_lens = state.seq_lens + counts
    done = state.done | eos_hit | (seq_lens >= state.max_lens)
    running = ~state.done
    lengths = jnp.where(running, seq_lens - 1, state.cache.lengths)
    return state.replace(tokens=tokens, seq_lens=seq_lens, done=done, eos_hit=state.eos_hit | eos_hit,
                         cache=state.cache.replace(lengths=lengths))
