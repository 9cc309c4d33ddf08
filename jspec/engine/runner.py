"""The device side of the engine: the decode state of every slot and the jitted calls on it.

Shapes never change while the engine lives (``max_num_seqs`` slots, a token buffer of
``max_model_len`` per slot, a fixed page pool and block-table width), so requests coming and
going cause no recompilation. What varies from burst to burst is static and few-valued: the
step (plain or speculative at one of a few k) and whether a prefill chunk rides along (at one
of a few chunk widths); each such variant compiles once.

**Slot buckets.** A decode burst runs on the live slots only: their rows of the state are
gathered into a batch of S rows, S the smallest of a few bucket sizes (1, 2, 4, ... up to
``max_num_seqs``: :func:`~jspec.engine.layout.slot_buckets`) that holds them, padded with idle
slots; the steps run on that sub-state and its rows are scattered back, all inside the one
jitted call (:func:`run_burst_slots`). Only per-slot rows move
(:func:`~jspec.speculative.state.take_slots`); the page pools are shared and addressed through
the block tables. So one live request pays for one slot's rows (k + 1 query rows when
speculating), not for ``max_num_seqs`` of them. Bursts that carry a prefill chunk run on every
slot (the chunk's rows name slots of the full state; one variant per chunk shape).

Host -> device: one slot's new contents when a request is admitted (``set_slot``), a slot
released, and each burst's block tables and per-slot draft caps. Device -> host after each
burst: a snapshot of tokens, lengths, flags and counters.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache import init_cache
from jspec.config import ModelConfig
from jspec.models.llama import Segment
from jspec.parallel import to_host
from jspec.sampling import RowSampling
from jspec.speculative.state import DecodeState, put_slots, take_slots
from jspec.speculative.steps import burst


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotUpdate:
    """The new contents of one slot (a request admitted, or re-admitted after preemption)."""

    slot: jax.Array  # int32 []
    tokens: jax.Array  # int32 [L]: prompt (+ output so far, when recomputing)
    table: jax.Array  # int32 [W]: its block-table row
    seq_len: jax.Array  # int32 []: committed tokens
    max_len: jax.Array  # int32 []
    start: jax.Array  # int32 []: tokens already in the cache (prefix-cache hit)
    done: jax.Array  # bool []: True while its prompt is still to be prefilled
    ignore_eos: jax.Array  # bool []
    key_data: jax.Array  # uint32 [2]
    temperature: jax.Array  # float32 []
    top_k: jax.Array  # int32 []
    top_p: jax.Array  # float32 []
    spec_k: jax.Array  # int32 []
    constraint: jax.Array  # int32 []: structured-output handle (-1: none)


class Snapshot(NamedTuple):
    """Host copies after a burst (numpy)."""

    tokens: np.ndarray  # [B, L]
    seq_lens: np.ndarray  # [B]
    done: np.ndarray  # [B]
    eos_hit: np.ndarray  # [B]
    cache_lengths: np.ndarray  # [B]
    num_steps: np.ndarray  # [B]
    num_drafts: np.ndarray  # [B]
    accepted: np.ndarray  # [B, K]
    proposed: np.ndarray  # [B, K]
    steps: np.ndarray  # []: loop iterations since the state was created


def init_decode_state(config: ModelConfig, batch: int, max_len: int, table_width: int, num_pages: int,
                      page_size: int, max_k: int, drafter=None, target_params=None, drafter_params=None,
                      cache_dtype=None) -> DecodeState:
    """An engine's empty state: every slot done, every table slot at the null page."""
    cache = init_cache(config.num_layers, config.num_kv_heads, config.head_dim,
                       np.zeros((batch, table_width), np.int32), num_pages, page_size,
                       cache_dtype or jnp.dtype(config.dtype))
    k = max(max_k, 1)
    state = DecodeState(
        tokens=jnp.zeros((batch, max_len), jnp.int32), seq_lens=jnp.zeros((batch,), jnp.int32),
        max_lens=jnp.zeros((batch,), jnp.int32), done=jnp.ones((batch,), bool), eos_hit=jnp.zeros((batch,), bool),
        ignore_eos=jnp.zeros((batch,), bool), key_data=jnp.zeros((batch, 2), jnp.uint32),
        sampling=RowSampling(jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.int32),
                             jnp.ones((batch,), jnp.float32)),
        spec_k=jnp.zeros((batch,), jnp.int32), cache=cache, drafter=None,
        num_steps=jnp.zeros((batch,), jnp.int32), num_drafts=jnp.zeros((batch,), jnp.int32),
        accepted=jnp.zeros((batch, k), jnp.int32), proposed=jnp.zeros((batch, k), jnp.int32),
        steps=jnp.int32(0), constraint=jnp.full((batch,), -1, jnp.int32))
    if drafter is not None:
        state = state.replace(drafter=drafter.init_state(target_params, drafter_params, cache))
    return state


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def set_slot(drafter, state: DecodeState, u: SlotUpdate) -> DecodeState:
    s = u.slot
    cache = state.cache.replace(block_tables=state.cache.block_tables.at[s].set(u.table),
                                lengths=state.cache.lengths.at[s].set(u.start))
    rs = state.sampling
    state = state.replace(
        tokens=state.tokens.at[s].set(u.tokens), seq_lens=state.seq_lens.at[s].set(u.seq_len),
        max_lens=state.max_lens.at[s].set(u.max_len), done=state.done.at[s].set(u.done),
        eos_hit=state.eos_hit.at[s].set(False), ignore_eos=state.ignore_eos.at[s].set(u.ignore_eos),
        key_data=state.key_data.at[s].set(u.key_data),
        sampling=RowSampling(rs.temperature.at[s].set(u.temperature), rs.top_k.at[s].set(u.top_k),
                             rs.top_p.at[s].set(u.top_p)),
        spec_k=state.spec_k.at[s].set(u.spec_k), cache=cache, constraint=state.constraint.at[s].set(u.constraint),
        num_steps=state.num_steps.at[s].set(0), num_drafts=state.num_drafts.at[s].set(0),
        accepted=state.accepted.at[s].set(0), proposed=state.proposed.at[s].set(0))
    if drafter is not None:
        mask = jnp.arange(state.batch) == s
        start = jnp.full((state.batch,), u.start, jnp.int32)
        state = state.replace(drafter=drafter.admit(state.drafter, mask, start, cache))
    return state


@functools.partial(jax.jit, donate_argnums=0)
def release_slot(state: DecodeState, slot) -> DecodeState:
    """Stop a slot (preempted, aborted, or finished by a stop string): it takes no more part."""
    return state.replace(done=state.done.at[slot].set(True))


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def run_burst(step, params, drafter_params, state: DecodeState, tables, spec_k, prefill: Optional[Segment],
              limit, stop_on_finish) -> DecodeState:
    state = state.replace(cache=state.cache.replace(block_tables=tables), spec_k=spec_k)
    return burst(step, params, drafter_params, state, prefill, limit, stop_on_finish)


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def run_burst_slots(step, params, drafter_params, state: DecodeState, slots, tables, spec_k, limit,
                    stop_on_finish) -> DecodeState:
    """A decode burst (no prefill) on slots ``slots`` (int32 [S], distinct; S is the bucket)
    only: gather their rows, run, scatter them back. Other slots are untouched."""
    state = state.replace(cache=state.cache.replace(block_tables=tables), spec_k=spec_k)
    sub = burst(step, params, drafter_params, take_slots(state, slots), None, limit, stop_on_finish)
    return put_slots(state, sub, slots)


def snapshot(state: DecodeState) -> Snapshot:
    # to_host: on a mesh over several processes each reads its own replica
    return Snapshot(*[to_host(x) for x in
                      (state.tokens, state.seq_lens, state.done, state.eos_hit, state.cache.lengths, state.num_steps,
                       state.num_drafts, state.accepted, state.proposed, state.steps)])


def slot_update(slot: int, ids: list[int], table: np.ndarray, max_len: int, start: int, params, seed: int,
                spec_k: int, buffer_len: int, constraint: int = -1) -> SlotUpdate:
    tokens = np.zeros((buffer_len,), np.int32)
    tokens[:len(ids)] = ids
    key = _key_data(seed)
    return SlotUpdate(
        slot=np.int32(slot), tokens=tokens, table=np.asarray(table, np.int32), seq_len=np.int32(len(ids)),
        max_len=np.int32(max_len), start=np.int32(start), done=np.bool_(start < len(ids) - 1),
        ignore_eos=np.bool_(params.ignore_eos), key_data=key, temperature=np.float32(params.temperature),
        top_k=np.int32(params.top_k), top_p=np.float32(params.top_p), spec_k=np.int32(spec_k),
        constraint=np.int32(constraint))


def _key_data(seed: int) -> np.ndarray:
    """The raw threefry key of ``seed`` (as ``jax.random.key(seed)`` makes it), computed on
    the host so admitting a request dispatches no device work of its own."""
    seed = int(seed)
    return np.asarray([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)


@dataclasses.dataclass
class Runner:
    """Holds the device state and the parameters; every method but ``usable`` is one jitted call."""

    params: Any
    drafter_params: Any
    state: DecodeState
    buffer_len: int

    def usable(self) -> bool:
        """Whether the state can still be used after a call on it failed: not donated away to
        the failed call (deleted), not the failed computation's result (which raises when read),
        not dropped (None)."""
        if self.state is None:
            return False
        try:
            leaves = jax.tree_util.tree_leaves(self.state)
            if any(x.is_deleted() for x in leaves if isinstance(x, jax.Array)):
                return False
            jax.block_until_ready(leaves)
        except Exception:
            return False
        return True

    def set_slot(self, drafter, update: SlotUpdate) -> None:
        self.state = set_slot(drafter, self.state, update)

    def release(self, slot: int) -> None:
        self.state = release_slot(self.state, np.int32(slot))

    def burst(self, step, tables: np.ndarray, spec_k: np.ndarray, prefill: Optional[Segment], limit: int,
              stop_on_finish: bool, slots: Optional[np.ndarray] = None) -> Snapshot:
        """Run a burst on every slot, or (``slots``, int32 [S], distinct, no prefill) on those only."""
        if slots is None or len(slots) == self.state.batch:
            self.state = run_burst(step, self.params, self.drafter_params, self.state, tables, spec_k, prefill,
                                   np.int32(limit), np.bool_(stop_on_finish))
        else:
            assert prefill is None, "a burst carrying a prefill chunk runs on every slot"
            self.state = run_burst_slots(step, self.params, self.drafter_params, self.state,
                                         np.asarray(slots, np.int32), tables, spec_k, np.int32(limit),
                                         np.bool_(stop_on_finish))
        return snapshot(self.state)
