"""The engine's layout: every number :class:`~jspec.engine.engine.LLMEngine` derives from its
configs before it allocates anything, in one pure function.

    layout = plan_layout(model_config, engine_config, k_max=4, draft=draft_config)
    layout.num_pages, layout.buffer_len, layout.prefill_shapes, layout.memory_bytes, ...

:func:`plan_layout` reads configs only (no device, no allocation, no measurement of free
memory): the engine calls it, and so can anything that wants to know what an engine of these
configs would hold. The rules, each written once here:

- ``max_model_len``: the config's, else the model's context; never past the context;
- a slot's token buffer (``buffer_len``): ``max_model_len + k_max + 1`` rounded up to a page:
  a request of ``max_model_len`` tokens writes ``k_max + 1`` rows in its last verification;
- the block-table width: ``buffer_len / page_size`` pages;
- the page pool: ``kv_cache_tokens`` (default: every slot at full length, ``max_num_seqs x
  buffer_len``, or, given a memory budget it does not fit in, the most whole pages that do,
  never less than one slot's buffer) in pages, plus the null page;
- the prefill budget: ``max_num_batched_tokens`` less every slot's decode rows
  (``max_num_seqs x (k_max + 1)``), at least ``MIN_CHUNK``; the chunk widths and the
  ``(rows, width)`` prefill shapes come from it;
- the slot buckets decode bursts compile for: 1, 2, 4, ... below ``max_num_seqs``, and it; the
  k values steps run with (:func:`k_candidates`, :func:`prefill_k`) and so the programs the
  engine compiles (:func:`step_variants`);
- memory: the K/V pages of the target (and of a drafter with pages of its own, in the same
  dtype), split over the tensor-parallel devices, plus the int32 token buffer.

The memory a default pool may take is :func:`memory_budget` of what is free, the engine's and
:func:`jspec.engine.plan.plan_run`'s alike.

Front ends that size an :class:`~jspec.config.EngineConfig` for a set of prompts use the same
pieces: :func:`fit_max_model_len` (lengths rounded to ``SHAPE_QUANTUM`` so that prompts of
similar length share compiled shapes), :func:`batched_tokens` (decode rows plus a prefill
budget) and :func:`full_pool_tokens` (every slot at full length).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jspec.config import EngineConfig, ModelConfig, kv_cache_array_dtype
from jspec.engine.scheduler import PrefillShape, prefill_shapes
from jspec.errors import ConfigError
from jspec.loading import memory

SHAPE_QUANTUM = 64  # tokens: granularity of a sized max_model_len (an exact fit would recompile per prompt length)
MIN_CHUNK = 16  # tokens: the narrowest prefill chunk
MAX_CHUNK = 512  # tokens of one prompt per prefill step (a bigger budget prefills more prompts per step)
DEFAULT_PREFILL_TOKENS = 256  # the CLI's prefill budget per step beside the decode rows


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def fit_max_model_len(tokens: int, context: int, quantum: int = SHAPE_QUANTUM) -> int:
    """The ``max_model_len`` that holds requests of ``tokens`` tokens (prompt + output):
    rounded up to ``quantum``, within the model's ``context``."""
    return min(round_up(tokens, quantum), context)


def slot_tokens(max_model_len: int, k_max: int, page_size: int) -> int:
    """A slot's token buffer: ``max_model_len`` and one verification's ``k_max + 1`` rows, in
    whole pages."""
    return round_up(max_model_len + k_max + 1, page_size)


def full_pool_tokens(num_slots: int, max_model_len: int, k_max: int, page_size: int) -> int:
    """A page pool (in tokens) that holds every slot at full length."""
    return num_slots * slot_tokens(max_model_len, k_max, page_size)


def decode_rows(num_slots: int, k_max: int) -> int:
    """Rows every slot's decode or verification takes in one step."""
    return num_slots * (k_max + 1)


def batched_tokens(num_slots: int, k_max: int, prefill_tokens: int = DEFAULT_PREFILL_TOKENS) -> int:
    """``max_num_batched_tokens`` for every slot's decode rows plus ``prefill_tokens`` of prefill."""
    return decode_rows(num_slots, k_max) + prefill_tokens


def chunk_widths(budget: int) -> tuple[int, ...]:
    """Prefill chunk widths (few: each is a compiled shape): the largest power of two within
    ``budget`` (at most MAX_CHUNK), and a quarter and a sixteenth of it, never below 16 tokens."""
    top = min(MAX_CHUNK, 1 << (max(budget, MIN_CHUNK).bit_length() - 1))
    return tuple(sorted({max(MIN_CHUNK, top >> s) for s in (0, 2, 4)}))


def slot_buckets(num_slots: int) -> tuple[int, ...]:
    """Batch sizes decode bursts compile for: powers of two below ``num_slots``, and ``num_slots``."""
    return tuple(sorted({1 << i for i in range(num_slots.bit_length()) if 1 << i < num_slots} | {num_slots}))


def k_candidates(k_max: int, dynamic_k: bool, tree_depth: int = 0) -> tuple[int, ...]:
    """The k values a step may run with: 0 without a drafter, ``k_max`` with a fixed k, and with
    dynamic k also 0 (no speculation) and 1, 2, 4, 8 below ``k_max``. With a token tree of
    ``k_max`` nodes ``tree_depth`` deep, dynamic k chooses among the tree, chains of 1, 2, 4, 8
    drafts up to the tree's depth and the depth itself, and no speculation (a step at k <
    ``k_max`` runs a chain of k: :func:`jspec.speculative.drafters.base.as_chain`)."""
    if k_max == 0:
        return (0,)
    if not dynamic_k:
        return (k_max,)
    if tree_depth:
        return tuple(sorted({0, k_max, min(tree_depth, k_max)} | {k for k in (1, 2, 4, 8) if k < tree_depth}))
    return tuple(sorted({0, k_max} | {k for k in (1, 2, 4, 8) if k < k_max}))


def prefill_k(k_max: int, dynamic_k: bool) -> int:
    """The k of the step that carries prefill chunks: with a fixed k the same speculative step as
    every other (so a request's steps, and its sampled tokens, do not depend on who else is
    prefilling); with dynamic k (already batch-dependent) the plain step, one variant fewer."""
    return 0 if k_max == 0 or dynamic_k else k_max


@dataclasses.dataclass(frozen=True)
class StepVariants:
    """The jitted programs an engine compiles before it serves (``LLMEngine.warmup``): a decode
    burst for each candidate k at each slot bucket, a prefill step for each prefill shape, and
    the slot write."""

    decode: tuple[tuple[int, int], ...]  # (k, slots)
    prefill: tuple[PrefillShape, ...]  # run by the prefill_k step

    @property
    def count(self) -> int:
        return len(self.decode) + len(self.prefill) + 1  # + the slot write


def step_variants(buckets: tuple[int, ...], shapes: tuple[PrefillShape, ...], k_max: int,
                  dynamic_k: bool, tree_depth: int = 0) -> StepVariants:
    ks = sorted(set(k_candidates(k_max, dynamic_k, tree_depth)) | {prefill_k(k_max, dynamic_k)})
    return StepVariants(tuple((k, n) for k in ks for n in buckets), tuple(shapes))


def memory_budget(free_bytes: int, utilization: float, activation_bytes: int = 0) -> int:
    """Bytes one device gives the page pool and the token buffer: ``utilization`` of what is free
    once the weights are in place and a step's activations are set aside (vLLM's
    ``gpu_memory_utilization``, taken of the free memory). The engine passes what it measures
    free; :func:`jspec.engine.plan.plan_run` passes a device's size less the weights."""
    return max(0, int((free_bytes - activation_bytes) * utilization))


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """What an engine holds, derived from its configs (:func:`plan_layout`)."""

    num_slots: int  # B: slots decoded together (max_num_seqs)
    buckets: tuple[int, ...]  # slot counts a decode burst compiles for: (1, 2, 4, ..., B)
    k_max: int  # drafts per verification at most (0: no drafter)
    max_model_len: int  # prompt + output tokens of one request
    page_size: int  # tokens per page
    buffer_len: int  # L: tokens of a slot's buffer (whole pages)
    table_width: int  # W = L / page_size: pages of a slot's block table
    num_pages: int  # P: the page pool, the null page included
    prefill_budget: int  # tokens of prefill chunks one step may carry
    chunk_widths: tuple[int, ...]  # prefill chunk widths
    prefill_shapes: tuple[PrefillShape, ...]  # the prefill segments (rows, width, tokens)
    cache_dtype: str  # the pages' array dtype name
    kv_cache_bytes: int  # K/V pages of the target and a drafter's own, over all devices
    token_buffer_bytes: int  # the int32 [B, L] token buffer
    tensor_parallel_size: int  # devices the pages are split over
    sized_by_memory: bool = False  # the default pool was cut to the memory budget

    @property
    def usable_pages(self) -> int:
        """Pages requests can hold (the null page is nobody's)."""
        return self.num_pages - 1

    @property
    def pool_tokens(self) -> int:
        """Token slots of the page pool, the null page included."""
        return self.num_pages * self.page_size

    @property
    def memory_bytes(self) -> int:
        """What one device holds of the layout: its share of the pages and the token buffer."""
        return self.kv_cache_bytes // self.tensor_parallel_size + self.token_buffer_bytes

    @property
    def max_request_tokens(self) -> int:
        """Prompt + output tokens the longest request can have: within ``max_model_len``, and
        within the whole page pool beside its last verification's rows."""
        return min(self.max_model_len, self.usable_pages * self.page_size - self.k_max - 1)

    def describe(self) -> str:
        """What the memory check names: ``a KV cache of N tokens and B slots of L tokens``."""
        return f"a KV cache of {self.pool_tokens:,} tokens and {self.num_slots} slots of {self.buffer_len} tokens"


def plan_layout(model: ModelConfig, config: EngineConfig, *, k_max: int = 0,
                draft: Optional[ModelConfig] = None, memory_budget: Optional[int] = None) -> EngineLayout:
    """The layout of an engine over ``model`` (the target's config as the engine runs it: on
    several devices, :func:`jspec.models.tensor_parallel.tp_config`'s) with ``config``, a drafter
    of up to ``k_max`` drafts and, when the drafter keeps pages of its own (a draft model, an
    EAGLE head), ``draft``: their geometry. ``memory_budget``: bytes one device may give the
    pages and the token buffer; without ``kv_cache_tokens`` the pool is cut to it (the engine
    passes ``memory_utilization`` of the free memory). Pure. Raises ConfigError when
    ``max_model_len`` exceeds the model's context or ``max_num_batched_tokens`` leaves no
    prefill chunk."""
    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    context = model.max_position_embeddings
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the model's context ({context})")
    ps, b = config.page_size, config.max_num_seqs
    buffer_len = slot_tokens(max_model_len, k_max, ps)
    cache_dtype = kv_cache_array_dtype(config.kv_cache_dtype, model.dtype)

    def pool_bytes(tokens: int) -> int:  # over all devices
        kv = memory.kv_cache_bytes(model, tokens, cache_dtype)
        return kv + (memory.kv_cache_bytes(draft, tokens, cache_dtype) if draft is not None else 0)

    kv_tokens, cut = config.kv_cache_tokens, False
    if kv_tokens is None:
        kv_tokens = full_pool_tokens(b, max_model_len, k_max, ps)
        if memory_budget is not None:
            room = memory_budget - memory.token_buffer_bytes(b, buffer_len)
            per_page = pool_bytes(ps) // config.tensor_parallel_size
            fits = max(buffer_len, (room // per_page - 1) * ps if per_page else kv_tokens)  # - the null page
            kv_tokens, cut = min(kv_tokens, fits), fits < kv_tokens
    num_pages = -(-kv_tokens // ps) + 1  # + the null page
    budget = config.max_num_batched_tokens - decode_rows(b, k_max)
    if budget < MIN_CHUNK:
        raise ConfigError(f"max_num_batched_tokens ({config.max_num_batched_tokens}) must hold every slot's "
                          f"decode rows ({b} x {k_max + 1}) plus a prefill chunk of >= {MIN_CHUNK} tokens")
    widths = chunk_widths(budget)
    kv = pool_bytes(num_pages * ps)  # a drafter's own pages too, of the same dtype and count
    return EngineLayout(num_slots=b, buckets=slot_buckets(b), k_max=k_max, max_model_len=max_model_len,
                        page_size=ps, buffer_len=buffer_len, table_width=buffer_len // ps, num_pages=num_pages,
                        prefill_budget=budget, chunk_widths=widths, prefill_shapes=prefill_shapes(budget, b, widths),
                        cache_dtype=cache_dtype, kv_cache_bytes=kv,
                        token_buffer_bytes=memory.token_buffer_bytes(b, buffer_len),
                        tensor_parallel_size=config.tensor_parallel_size, sized_by_memory=cut)


__all__ = ["DEFAULT_PREFILL_TOKENS", "EngineLayout", "MAX_CHUNK", "MIN_CHUNK", "SHAPE_QUANTUM", "StepVariants",
           "batched_tokens", "chunk_widths", "decode_rows", "fit_max_model_len", "full_pool_tokens", "k_candidates",
           "memory_budget", "plan_layout", "prefill_k", "round_up", "slot_buckets", "slot_tokens", "step_variants"]
