"""``LLMEngine``: continuous batching with speculative decoding on a paged KV cache.

Requests join (``add_request``) and leave between bursts; ``step()`` plans a burst with the
:class:`~jspec.engine.scheduler.Scheduler`, writes admitted requests into their slots, runs the
burst on the device (one jitted call: up to ``max_burst_steps`` plain or speculative steps in a
``lax.while_loop``; a step carrying prefill chunks runs alone, and so does the step after a
request's prefill, so that its first token comes back at once), and turns the
snapshot that comes back into :class:`~jspec.engine.request.RequestOutput` s: new tokens,
detokenized text, stop strings, finish reasons and metrics.

Speculation is per request: each request's ``num_speculative_tokens`` caps its drafts (0 turns
it off for that request); with ``SpecConfig.dynamic_k`` the engine picks the step's k (0 = no
speculation) per burst from a cost model measured on this machine
(:mod:`jspec.engine.cost`), one per slot bucket.

A decode burst runs on the running slots only, gathered into the smallest slot bucket
(1, 2, 4, ... ``max_num_seqs``) that holds them (see :mod:`jspec.engine.runner`): at a low
request rate one request pays for its own rows, not for every slot's.

How the models run is chosen once, here (``LLMEngine.path``, a :class:`~jspec.models.path.ModelPath`
the steps and the drafter carry): on the CPU kernels (:mod:`jspec.models.cpu_path`, with the
parameters' packed copies where ``EngineConfig.small_row_weights`` keeps them) where the CPU
small-row kernel applies, the plain modules elsewhere.

**A request's failure is that request's.** A fault in one request's host-side work (writing its
slot, detokenizing, stop strings, building its output) finishes that request alone, with finish
reason ``"error"`` and the message in ``RequestOutput.error``, its pages freed. A fault of a
device call (a slot write or a burst), which no one request can be blamed for, finishes every
request holding a slot the same way; the device state is rebuilt when the call consumed it (its
buffers are donated), and the waiting requests run on it. Both are logged with the request ids;
``step()`` itself raises only on what it cannot recover from.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from typing import Callable, Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jspec import attention as attention_lib
from jspec import parallel
from jspec.cache import PageAllocator
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine import sharded
from jspec.engine.cost import AcceptancePrior, CostModel
from jspec.engine.layout import (StepVariants, k_candidates, memory_budget, plan_layout, prefill_k,
                                 step_variants)
from jspec.engine.request import EngineStats, Request, RequestMetrics, RequestOutput, Status
from jspec.engine.runner import Runner, init_decode_state, slot_update
from jspec.engine.scheduler import Plan, PrefillShape, Scheduler
from jspec.errors import ConfigError, PromptError
from jspec.loading import memory
from jspec.loading.convert import quantized_drafter_weights
from jspec.models import cpu_path
from jspec.models.cpu_path import HEAD_PROJECTIONS, with_small_row_weights
from jspec.models.llama import Segment, pack_index
from jspec.models.path import PLAIN, ModelPath
from jspec.models.tensor_parallel import tp_config
from jspec.speculative.drafters import make_drafter, on_path
from jspec.speculative.drafters.base import as_chain, tree_depth_of
from jspec.speculative.steps import PlainStep, SpecStep
from jspec.sampling.structured import NO_CONSTRAINT, ConstraintTable, GrammarCompiler
from jspec.timing import compile_seconds

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


CALIBRATION_SENTENCE = "The quick brown fox jumps over the lazy dog. "


def encode_prompt(tokenizer, prompt: Prompt, chat: bool = False) -> list[int]:
    """Token ids of one prompt (text needs a tokenizer; ``chat`` applies its chat template)."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt is empty")
        if tokenizer is None:
            raise ConfigError("text prompts need a tokenizer; pass token ids instead")
        if chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        try:
            ids = [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise PromptError("a token-id prompt must be a sequence of integers") from None
        if any(isinstance(t, bool) or (isinstance(t, float) and not float(t).is_integer()) for t in prompt):
            raise PromptError("a token-id prompt must be a sequence of integers")
    else:
        raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise PromptError("prompt is empty (no tokens)")
    return list(ids)


def prefill_segment(shape: PrefillShape, chunks: Sequence[tuple[int, Sequence[int]]], pad_row: int) -> Segment:
    """The prefill segment of ``shape`` whose row i prefills ``chunks[i]`` = (slot, its tokens);
    the rows after them are padding (q_len 0, slot ``pad_row``: past the last one). A packed
    shape's tokens fill its first rows of the forward (:func:`jspec.models.llama.pack_index`)."""
    tokens = np.zeros((shape.rows, shape.width), np.int32)
    q_lens = np.zeros((shape.rows,), np.int32)
    rows = np.full((shape.rows,), pad_row, np.int32)
    for i, (slot, ids) in enumerate(chunks):
        tokens[i, :len(ids)], q_lens[i], rows[i] = ids, len(ids), slot
    return Segment(tokens, q_lens, rows, pack_index(q_lens, shape.width, shape.tokens) if shape.packed else None)


# On the CPU a prefill chunk is compute-bound: a step costs about what 16 more prompt tokens cost
# (SmolLM2-135M: a one-token step ~21 ms, ~1.9 ms per prefill token at 256 rows), so the
# scheduler picks chunk widths that waste little padding (Scheduler.chunk_width). Elsewhere
# tokens are cheap next to a step: the smallest width that holds the prompt.
CPU_STEP_OVERHEAD_TOKENS = 16


class LLMEngine:
    @staticmethod
    def _model_path(mc, device) -> ModelPath:
        """How the steps and the drafter run the models, chosen once: on the CPU kernels
        (:mod:`jspec.models.cpu_path`) where the small-row kernel applies (the CPU backend, a float32
        model, the kernel built and tuned for this CPU), the plain modules elsewhere."""
        return cpu_path.CPU if LLMEngine._cpu_kernels_apply(mc, device) else PLAIN

    @staticmethod
    def _cpu_kernels_apply(mc, device) -> bool:
        """The CPU backend, a model dtype the small-row kernel runs, and Llama's layer (the kernels
        fuse it; Gemma's layers run on the plain modules)."""
        return device.platform == "cpu" and not mc.is_gemma and cpu_path.small_rows_apply(mc.dtype)

    @staticmethod
    def _small_row_weights(config: EngineConfig, mc, device) -> bool:
        """Whether the target keeps the packed copy for the CPU small-row kernel (see EngineConfig)."""
        applies = config.tensor_parallel_size == 1 and LLMEngine._cpu_kernels_apply(mc, device)
        if config.small_row_weights and not applies:
            log.warning("small_row_weights: the CPU small-row kernel does not apply here (%s backend, %s, or "
                        "the kernel is not built); the engine runs without the copy", device.platform, mc.dtype)
        return applies and config.small_row_weights is not False

    def __init__(self, model, config: EngineConfig = EngineConfig(), spec: SpecConfig = SpecConfig(), *,
                 drafter=None, drafter_params=None):
        """Build the engine in the order below: each step checks what it can before the next
        one allocates (the heads against ``tensor_parallel_size`` before anything is placed,
        the layout against the context, the memory before the state is built)."""
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.model, self.config, self.spec = model, config, SpecConfig.from_dict(spec)
        if self.spec.tree and "sliding" in (model.config.layer_types or ()):
            raise ConfigError(f"{model.config.architecture} has sliding-window layers, which token trees do not "
                              "take (a tree row's position is not its place in the pages): drop the tree budget")
        attention = self._attention()
        loaded_drafter = drafter is None and self.spec.enabled  # built here from a checkpoint or lookup
        drafter, drafter_params = self._place(attention, drafter, drafter_params)
        device = jax.local_devices()[0]
        self.layout = plan_layout(self.model.config, config, k_max=drafter.k if drafter is not None else 0,
                                  draft=getattr(drafter, "cache_config", None),  # drafters with pages of their own
                                  memory_budget=self._memory_budget(device))
        if self.layout.sized_by_memory:
            log.info("the KV cache holds %d tokens (%s of the free memory), not every slot at max_model_len: "
                     "requests are admitted as pages allow", self.layout.pool_tokens - config.page_size,
                     f"{config.memory_utilization:.0%}")
        self._build_steps(attention)
        self._build_scheduler(device)
        # the pages (a drafter's own too) and the token buffer against the memory available, before
        # anything is built
        memory.check_fits(self.layout.memory_bytes, self.layout.describe(),
                          device=None if device.platform == "cpu" else device)
        params, drafter_params = self._step_weights(device, drafter_params, loaded_drafter)
        self.runner = self._build_runner(params, drafter_params)
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        self._last_steps = 0
        self.constraints: Optional[ConstraintTable] = None  # built with the first constrained request
        self._constraints_lock = threading.Lock()
        self._constrained_steps: dict[int, object] = {}
        self.stats = EngineStats(self.k_max, bursts_by_slots={n: 0 for n in self.buckets})

    # ------------------------------------------------------------------ construction
    def _memory_budget(self, device) -> Optional[int]:
        """Bytes the default page pool and token buffer may take on one device: the configured
        fraction of what is free now, less a step's activations (None when it cannot be read, or
        the pool is given)."""
        if self.config.kv_cache_tokens is not None:
            return None
        free = memory.available_bytes(None if device.platform == "cpu" else device)
        if free is None:
            return None
        c = self.config  # the same budget as jspec.engine.plan.plan_run's
        activations = memory.activation_bytes(self.model.config, c.max_num_batched_tokens, c.tensor_parallel_size)
        return memory_budget(free, c.memory_utilization, activations)

    def _attention(self) -> str:
        """The attention implementation: the config's, resolved for the backend; fp8 pages,
        which the Triton kernel does not read, take the xla path under ``auto``."""
        config = self.config
        attention = attention_lib.resolve(config.attention)
        if config.kv_cache_dtype.startswith("fp8") and attention in ("pallas", "interpret"):
            if config.attention != "auto":
                raise ConfigError(f"attention {attention!r} (the Triton kernel) does not read fp8 pages "
                                  f"(kv_cache_dtype {config.kv_cache_dtype!r}); use 'xla', or 16-bit pages")
            attention = "xla"  # the xla path reads them on a GPU
        return attention

    def _place(self, attention: str, drafter, drafter_params):
        """(drafter, drafter params): the given drafter, or the one ``spec`` names; with
        ``tensor_parallel_size`` > 1, ``self.model`` and the drafter sharded over ``self.mesh``; and
        ``self.path``, how the steps and the drafter run the models, chosen once for the device."""
        tp = self.config.tensor_parallel_size
        if tp > 1:  # check the heads before anything is loaded or placed
            tp_config(self.model.config, tp)
        self.mesh = parallel.make_mesh(tp) if tp > 1 else None
        if drafter is None and self.spec.enabled:
            drafter, drafter_params = make_drafter(self.spec, self.model, attention)
        if self.mesh is not None:
            one_device = self.model.config
            self.model = sharded.shard_target(self.model, self.mesh)
            drafter, drafter_params = sharded.shard_drafter(drafter, drafter_params, one_device, self.model.config,
                                                            self.mesh)
        self.path = self._model_path(self.model.config, jax.local_devices()[0])
        self.drafter = on_path(drafter, self.path)
        return self.drafter, drafter_params

    def _build_steps(self, attention: str) -> None:
        """The steps ``step()`` picks from (plain, and speculative at each candidate k), the
        cost models that choose k per slot bucket, and the k of the step that carries prefill."""
        mc, drafter, k_max = self.model.config, self.drafter, self.k_max
        eos = tuple(mc.eos_token_ids)
        self._steps = {0: PlainStep(mc, eos, attention, drafter, self.path)}
        candidates = k_candidates(k_max, self.spec.dynamic_k, self.tree_depth)
        for k in candidates:
            if k > 0:  # a tree drafter's steps below its node budget run chains (dynamic k)
                d = as_chain(drafter, k) if self.tree_depth and k < k_max else dataclasses.replace(drafter, k=k)
                self._steps[k] = SpecStep(mc, eos, attention, d, self.path)
        # a step's time depends on the rows it runs, so each bucket keeps its own measurements;
        # what finished requests accepted is the prior of every bucket's estimates (a tree's
        # acceptance is pooled apart from the chains')
        self.acceptance = AcceptancePrior()
        self.tree_acceptance = AcceptancePrior()
        tree = (k_max, self.tree_depth) if self.tree_depth and k_max in candidates else None
        self.costs = {n: CostModel(candidates, prior=self.acceptance, tree=tree, tree_prior=self.tree_acceptance)
                      for n in self.buckets}
        self.calibration_drafted: dict[int, dict[int, float]] = {}  # filled by calibrate()
        self._cost_bucket = self.buckets[-1]
        self._prefill_k = prefill_k(k_max, self.spec.dynamic_k)  # the step that carries prefill chunks

    def _build_scheduler(self, device) -> None:
        """The page allocator over the layout's pool and the scheduler over its slots."""
        layout, config = self.layout, self.config
        self.allocator = PageAllocator(layout.num_pages, layout.page_size, reserve_null=True,
                                       shuffle_seed=config.seed if config.shuffle_pages else None)
        salt = f"{self.model.source}:{self.model.config}:{type(self.drafter).__name__}".encode()
        self.scheduler = Scheduler(num_slots=layout.num_slots, table_width=layout.table_width, allocator=self.allocator,
                                   shapes=layout.prefill_shapes, max_burst_steps=config.max_burst_steps,
                                   prefix_caching=config.enable_prefix_caching, salt=salt,
                                   step_overhead_tokens=CPU_STEP_OVERHEAD_TOKENS if device.platform == "cpu" else None,
                                   prefill_k=self._prefill_k)

    def _step_weights(self, device, drafter_params, loaded_drafter: bool):
        """(target params, drafter params) as the steps read them: with the CPU small-row
        kernel's packed copies (of the GGUF blocks, or a drafter's Q8_0 blocks) where it applies."""
        config, model, mc = self.config, self.model, self.model.config
        copy = self._small_row_weights(config, mc, device)
        quantized = getattr(model, "quantized", None) if config.quantized_weights else None
        int8 = config.quantized_activations
        if int8 and copy and not quantized:
            log.warning("quantized_activations: the model has no Q4_1 / Q8_0 blocks to multiply (not a GGUF file?); "
                        "its products stay float32")
        params = with_small_row_weights(model.params, quantized=quantized, int8_dot=int8) if copy else model.params
        if copy and isinstance(drafter_params, dict):  # a draft model's layers, an EAGLE head's projections
            q = self.spec.draft_quantization
            q = ("q8_0" if loaded_drafter else None) if q == "auto" else q
            drafter_params = with_small_row_weights(
                drafter_params, HEAD_PROJECTIONS,
                quantized=q and quantized_drafter_weights(drafter_params, HEAD_PROJECTIONS, q), int8_dot=int8)
        return params, drafter_params

    def _build_runner(self, params, drafter_params) -> Runner:
        """The decode state of every slot and the runner of the jitted calls on it."""
        return Runner(params, drafter_params, self._initial_state(params, drafter_params), self.layout.buffer_len)

    def _initial_state(self, params, drafter_params):
        """Every slot empty (built straight into its shardings on a mesh)."""
        layout, mc, drafter = self.layout, self.model.config, self.drafter

        def make(params, dparams):
            return init_decode_state(mc, layout.num_slots, layout.buffer_len, layout.table_width, layout.num_pages,
                                     layout.page_size, layout.k_max, drafter, params, dparams,
                                     cache_dtype=jnp.dtype(layout.cache_dtype))

        return (make(params, drafter_params) if self.mesh is None else
                sharded.build_state(make, self.mesh, drafter, params, drafter_params))

    # the layout's numbers the engine reads most (EngineLayout has the rest)
    @property
    def k_max(self) -> int:
        return self.layout.k_max

    @property
    def tree_depth(self) -> int:
        """How deep the drafter's token trees grow (0: it drafts chains)."""
        return tree_depth_of(self.drafter) if self.drafter is not None else 0

    @property
    def max_model_len(self) -> int:
        return self.layout.max_model_len

    @property
    def buffer_len(self) -> int:
        return self.layout.buffer_len

    @property
    def prefill_shapes(self) -> tuple[PrefillShape, ...]:
        return self.layout.prefill_shapes

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.layout.buckets

    @property
    def step_variants(self) -> StepVariants:
        """The programs :meth:`warmup` compiles (:func:`jspec.engine.layout.step_variants`)."""
        return step_variants(self.buckets, self.prefill_shapes, self.k_max, self.spec.dynamic_k, self.tree_depth)

    # ------------------------------------------------------------------ requests
    @property
    def tokenizer(self):
        return self.model.tokenizer

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams = SamplingParams(), *,
                    chat: bool = False, arrival_time: Optional[float] = None) -> Request:
        """Queue a request; raises PromptError / ConfigError (and queues nothing) if it is bad
        or could never fit (longer than ``max_model_len`` or than the whole page pool)."""
        if not isinstance(params, SamplingParams):
            raise ConfigError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(request_id)
        if request_id in self.requests:
            raise ConfigError(f"request id {request_id!r} is already in use")
        ids = encode_prompt(self.tokenizer, prompt, chat)
        vocab = self.model.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"request {request_id}: token ids outside [0, {vocab})")
        self.check_length(request_id, len(ids), params.max_tokens)
        if params.structured_outputs is not None:
            self.check_constraint(params)
        order = next(self._order)
        seed = params.seed if params.seed is not None else (self.config.seed * 1_000_003 + order) % (2**63)
        now = time.perf_counter() if arrival_time is None else arrival_time
        r = Request(request_id, prompt if isinstance(prompt, str) else None, ids, params, seed,
                    RequestMetrics(now, num_prompt_tokens=len(ids), num_accepted_tokens_per_pos=[0] * max(self.k_max, 1),
                                   num_draft_tokens_per_pos=[0] * max(self.k_max, 1)), order)
        self.requests[request_id] = r
        self.scheduler.waiting.append(r)
        return r

    def check_constraint(self, params: SamplingParams) -> None:
        """ConfigError unless ``params.structured_outputs`` compiles for this model (the grammar
        is cached: a schema compiles once) and this engine can constrain requests."""
        if self.spec.tree:
            raise ConfigError("structured output does not take token trees: drop the tree budget (tree_nodes)")
        if self.config.tensor_parallel_size > 1:
            raise ConfigError("structured output runs with tensor_parallel_size 1 only")
        self._constraint_table().compiler.grammar(params.structured_outputs)

    def _constraint_table(self) -> ConstraintTable:
        with self._constraints_lock:  # the server checks requests on other threads
            return self._make_constraint_table()

    def _make_constraint_table(self) -> ConstraintTable:
        if self.constraints is None:
            if self.tokenizer is None:
                raise ConfigError("structured output needs the model's tokenizer; this model was loaded without one")
            compiler = GrammarCompiler(self.tokenizer, self.model.config.vocab_size, self.model.config.eos_token_ids)
            self.constraints = ConstraintTable(compiler, window=max(self.k_max, 1) + 1)
        return self.constraints

    def _step(self, k: int):
        """The step at ``k``; while a constrained request holds a slot, its constrained twin
        (masks from the host each step: see jspec.sampling.structured), compiled when first needed."""
        if not any(r is not None and r.constraint != NO_CONSTRAINT for r in self.scheduler.slots):
            return self._steps[k]
        if k not in self._constrained_steps:
            self._constrained_steps[k] = dataclasses.replace(self._steps[k], constraint=self.constraints)
        return self._constrained_steps[k]

    def check_length(self, request_id: str, num_prompt_tokens: int, max_tokens: int) -> None:
        """PromptError unless a request of this many prompt tokens and ``max_tokens`` can ever
        run: within ``max_model_len`` and within the whole page pool. Reads only the engine's
        fixed layout, so any thread may call it (the server does, before the engine sees a request)."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            context = self.model.config.max_position_embeddings
            limit = (f"the model's context of {context} tokens" if self.max_model_len >= context
                     else f"max_model_len={self.max_model_len}")
            raise PromptError(f"request {request_id}: prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} "
                              f"exceeds {limit}")
        need = self.allocator.pages_for(total + self.k_max + 1)
        if need > self.allocator.num_usable:
            raise PromptError(f"request {request_id}: needs {need} pages of {self.config.page_size} tokens, the KV "
                              f"cache has {self.allocator.num_usable} (raise kv_cache_tokens)")

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        r = self.requests.get(str(request_id))
        if r is None or r.status is Status.FINISHED:
            return None
        self.scheduler.abort(r)
        r.finish_reason = "abort"
        r.metrics.finished_time = time.perf_counter()
        self._finished(r)
        return r.to_output()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step_until_done(self, until: Optional[Callable[[], bool]] = None) -> Iterator[list[RequestOutput]]:
        """Step until no request is unfinished, yielding what each ``step()`` returns; with
        ``until``, stop also once ``until()`` holds (checked before each step). The one loop that
        runs the engine to the end: callers keep their per-step bookkeeping (progress, streaming,
        first-token times) between the yields, a step's outputs together."""
        while self.has_unfinished_requests() and not (until is not None and until()):
            yield self.step()

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache (vLLM's name); False, and nothing changed, while requests are
        unfinished."""
        return not self.scheduler.has_work() and self.allocator.reset_prefix_cache()

    def reset_lookup_history(self) -> None:
        """Forget the finished requests' text that n-gram lookup searches (``ngram_history``);
        benchmarks call it between runs of the same prompts."""
        if getattr(self.drafter, "history", 0):
            self.runner.drafter_params = self.drafter.forget(self.runner.drafter_params)

    def pop_finished(self) -> None:
        """Forget finished requests (a long-running server calls this to bound memory)."""
        for rid in [rid for rid, r in self.requests.items() if r.status is Status.FINISHED]:
            del self.requests[rid]

    # ------------------------------------------------------------------ one burst
    @property
    def cost(self) -> CostModel:
        """The cost model of the bucket that last chose a k."""
        return self.costs[self._cost_bucket]

    def _bucket(self, live: int) -> int:
        return next(n for n in self.buckets if n >= live)

    def _choose_k(self) -> int:
        if len(self.cost.candidates) == 1:
            return self.cost.candidates[0]
        rows = []
        for r in self.scheduler.running:
            m = r.metrics
            cap = self._cap(r)
            rows.append((cap, m.num_accepted_tokens, m.num_draft_tokens, m.num_drafts, m.num_steps,
                         r.chain_accepted_per_pos(), r.eligible_per_pos,
                         (r.tree_accepted_per_pos, r.tree_drafted_steps)))
        if rows:
            self._cost_bucket = self._bucket(len(rows))
        return self.cost.choose(rows)

    def _cap(self, r: Request) -> int:
        k = r.params.num_speculative_tokens
        return self.k_max if k is None else min(k, self.k_max)

    def step(self) -> list[RequestOutput]:
        """Run one burst; returns the outputs of requests that got new tokens or finished
        (failed ones too: finish reason ``"error"``, see the module docstring)."""
        if not self.scheduler.has_work():
            return []
        plan = self.scheduler.plan(self._choose_k())
        failed: list[RequestOutput] = []
        try:
            self._apply_slot_changes(failed)
            if not self.scheduler.running and plan.prefill is None:
                return failed
            slots = self._burst_slots() if plan.prefill is None else None
            t0 = time.perf_counter()
            step = self._step(self._step_k(plan))
            caps = self._spec_caps(plan.k)
            snap = self.runner.burst(step, self.scheduler.tables(), caps, self._segment(plan),
                                     plan.num_steps, plan.stop_on_finish, slots)
        except BaseException as e:  # an interrupt too: the state is made whole before it goes on
            failed += self._device_failed(e)
            if not isinstance(e, Exception):
                raise
            return failed
        t1 = time.perf_counter()
        bucket = len(self.scheduler.slots) if slots is None else len(slots)
        self.stats.bursts += 1
        self.stats.bursts_by_slots[bucket] += 1
        return failed + self._collect(plan, snap, caps, t0, t1, bucket)

    def _step_k(self, plan: Plan) -> int:
        """The k of the step a burst runs: a burst carrying prefill chunks runs the prefill step."""
        return self._prefill_k if plan.prefill is not None else plan.k

    def _burst_slots(self) -> np.ndarray:
        """The slots a decode burst runs on: the running ones, padded with idle slots (their
        device rows are done: they take no part) up to the smallest bucket that holds them."""
        live = sorted(r.slot for r in self.scheduler.running)
        idle = sorted(set(range(len(self.scheduler.slots))) - set(live))
        return np.asarray(live + idle[:self._bucket(len(live)) - len(live)], np.int32)

    def _apply_slot_changes(self, failed: list[RequestOutput]) -> None:
        """Tell the device of released slots and admitted requests; an admitted request whose
        slot contents cannot be built fails alone (its output appended to ``failed``)."""
        s = self.scheduler
        for slot in s.released:
            self.runner.release(slot)
        s.released.clear()
        tables = s.tables()
        admitted, s.admitted = s.admitted, []
        for r in admitted:
            if r.status is Status.FINISHED:  # aborted since it was admitted (a step cut short)
                continue
            now = time.perf_counter()
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            try:
                r.base = dataclasses.replace(r.metrics,
                                             num_accepted_tokens_per_pos=list(r.metrics.num_accepted_tokens_per_pos),
                                             num_draft_tokens_per_pos=list(r.metrics.num_draft_tokens_per_pos))
                if r.params.structured_outputs is not None and r.constraint == NO_CONSTRAINT:
                    r.constraint = self._constraint_table().register(r.params.structured_outputs, len(r.prompt_ids))
                update = slot_update(r.slot, r.all_ids, tables[r.slot], r.max_len, r.computed, r.params, r.seed,
                                     self._cap(r), self.buffer_len, r.constraint)
            except Exception as e:
                failed.append(self._fail(r, e))
                continue
            self.runner.set_slot(self.drafter, update)

    def _spec_caps(self, k: int) -> np.ndarray:
        caps = np.zeros((len(self.scheduler.slots),), np.int32)
        for i, r in enumerate(self.scheduler.slots):
            if r is not None:
                caps[i] = min(self._cap(r), k)
        return caps

    def _segment(self, plan: Plan) -> Optional[Segment]:
        pf = plan.prefill
        if pf is None:
            return None
        # a request that failed at admission keeps its row as padding
        return prefill_segment(pf.shape, [(c.request.slot, c.request.all_ids[c.start:c.start + c.length])
                                          for c in pf.chunks if c.request.status is not Status.FINISHED],
                               len(self.scheduler.slots))

    def _collect(self, plan: Plan, snap, caps: np.ndarray, t0: float, t1: float, bucket: int) -> list[RequestOutput]:
        """``caps``: the k each slot's steps ran at in this burst."""
        outputs, texts = [], []
        if plan.prefill is not None:
            for c in plan.prefill.chunks:
                if c.request.status is not Status.FINISHED:
                    outputs += self._isolated(c.request, self.scheduler.prefilled, c.request, c.length)
        for slot, r in enumerate(list(self.scheduler.slots)):
            if r is not None and r.status is Status.RUNNING:
                outputs += self._isolated(r, self._collect_one, r, slot, plan, snap, caps, t1, texts)
        if texts and getattr(self.drafter, "history", 0):
            try:  # the lookup history only feeds drafts: without it the outputs are the same
                self.runner.drafter_params = self.drafter.remember(self.runner.drafter_params, texts)
            except Exception:
                log.exception("the lookup history could not take finished requests' text; it goes on without it")
        self._observe_cost(plan, snap, t0, t1, bucket)
        return outputs

    def _isolated(self, r: Request, fn, *args) -> list[RequestOutput]:
        """``fn(*args)``, a piece of ``r``'s host-side work, returning ``r``'s output or None;
        if it raises, ``r`` fails alone. The outputs to hand back: none or one."""
        try:
            out = fn(*args)
        except Exception as e:
            out = self._fail(r, e)
        return [] if out is None else [out]

    def _collect_one(self, r: Request, slot: int, plan: Plan, snap, caps: np.ndarray, now: float,
                     texts: list[list[int]]) -> Optional[RequestOutput]:
        """Request ``r``'s new tokens, counters, text, stop strings and finish from the snapshot;
        its output if it got new tokens or finished."""
        ran_k = self._step_k(plan)  # the step that ran (plain: 0)
        before = len(r.all_ids)
        new = snap.tokens[slot, before:snap.seq_lens[slot]].tolist()
        drafts_before, steps_before = r.metrics.num_drafts, r.metrics.num_steps
        accepted_before = list(r.metrics.num_accepted_tokens_per_pos)
        self._update_counters(r, snap, slot)
        if self.tree_depth and ran_k == self.k_max:  # a tree step: counted apart from the chains
            ran = r.metrics.num_steps - steps_before if caps[slot] > 0 else 0  # (as spec_steps counts them)
            r.count_tree_step(accepted_before, r.metrics.num_drafts - drafts_before, ran)
        else:
            self._count_eligible(r, r.metrics.num_drafts - drafts_before, int(caps[slot]))
        if caps[slot] > 0 and ran_k > 0:
            r.spec_steps += r.metrics.num_steps - steps_before
        if new:
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.last_token_time = now
            r.output_ids.extend(new)
            r.metrics.num_output_tokens = len(r.output_ids)
        finished = bool(snap.done[slot])
        if new or finished:
            stop_hit = self._detokenize(r, before - len(r.prompt_ids))
            if stop_hit:
                self.scheduler.finish(r, device_running=not finished)
            elif finished:
                r.finish_reason = "stop" if snap.eos_hit[slot] else "length"
                why = self.constraints.dead_end(r.constraint) if r.constraint != NO_CONSTRAINT else None
                if why is not None:
                    r.stop_reason = f"grammar: {why}"
                self.scheduler.finish(r, device_running=False)
            if r.status is Status.FINISHED:
                r.metrics.finished_time = now
                self._finished(r)
                texts.append(r.prompt_ids + r.output_ids)
            return r.to_output()
        return None

    def _fail(self, r: Request, e: BaseException, alone: bool = True) -> RequestOutput:
        """Finish ``r`` with finish reason "error" for ``e``: its pages freed, its slot released
        (the device stops it, whatever it was doing). ``alone``: its own fault, logged here with
        its id and the traceback (a device fault is logged once for all its requests)."""
        if alone:
            log.error("request %s failed (%s: %s); the others go on", r.request_id, type(e).__name__, e, exc_info=e)
        first = r.status is not Status.FINISHED
        if first:
            self.scheduler.finish(r, device_running=True)
        r.finish_reason, r.stop_reason, r.error = "error", None, f"{type(e).__name__}: {e}"
        if first:
            r.metrics.finished_time = time.perf_counter()
            self._finished(r)
        return r.to_output()

    def _device_failed(self, e: BaseException) -> list[RequestOutput]:
        """A device call failed (or was interrupted) and no one request can be blamed: every
        request holding a slot fails, and the device state is rebuilt when the call consumed it
        (its donated buffers deleted, or holding the failed call's results), the prefix cache's
        pages with it. The waiting requests stay queued; the engine serves on."""
        held = [r for r in self.scheduler.slots if r is not None]
        log.error("a device call failed (%s: %s); failing the requests holding slots: %s", type(e).__name__, e,
                  [r.request_id for r in held], exc_info=e)
        outs = [self._fail(r, e, alone=False) for r in held]
        self.scheduler.admitted.clear()
        if not self.runner.usable():
            self.scheduler.released.clear()  # the new state's slots are all empty
            self.runner.state = None  # let the old buffers go before the new ones are allocated
            self.runner.state = self._initial_state(self.runner.params, self.runner.drafter_params)
            self._last_steps = 0
            self.allocator.reset_prefix_cache()  # no page is held now
        return outs

    def _observe_cost(self, plan: Plan, snap, t0: float, t1: float, bucket: int) -> None:
        steps, self._last_steps = int(snap.steps) - self._last_steps, int(snap.steps)
        self.stats.steps_run += steps
        if plan.prefill is None and steps > 0 and compile_seconds(t0, t1) == 0.0:
            self.costs[bucket].observe(plan.k, steps, t1 - t0)

    def _update_counters(self, r: Request, snap, slot: int) -> None:
        m, base = r.metrics, r.base
        k = snap.accepted.shape[1]
        m.num_steps = base.num_steps + int(snap.num_steps[slot])
        m.num_drafts = base.num_drafts + int(snap.num_drafts[slot])
        m.num_draft_tokens = base.num_draft_tokens + int(snap.proposed[slot].sum())
        m.num_accepted_tokens = base.num_accepted_tokens + int(snap.accepted[slot].sum())
        m.num_accepted_tokens_per_pos = [base.num_accepted_tokens_per_pos[j] + int(snap.accepted[slot, j])
                                         for j in range(k)]
        m.num_draft_tokens_per_pos = [base.num_draft_tokens_per_pos[j] + int(snap.proposed[slot, j]) for j in range(k)]

    def _finished(self, r: Request) -> None:
        if r.constraint != NO_CONSTRAINT:
            self.constraints.release(r.constraint)
        self.stats.finished(r)
        m = r.metrics
        # over the steps that could have drafted: a request run at k = 0 throughout teaches nothing
        # (counted as steps without a proposal, dynamic k's choice of k = 0 would feed itself), but
        # ages the pool, so that what turned speculation off is tried again later
        self.acceptance.learn(r.chain_accepted_per_pos(), r.eligible_per_pos, m.num_drafts - r.tree_drafted_steps,
                              r.spec_steps - r.tree_steps)
        if r.tree_steps:
            self.tree_acceptance.learn(r.tree_accepted_per_pos, [r.tree_drafted_steps] * len(r.tree_accepted_per_pos),
                                       r.tree_drafted_steps, r.tree_steps)

    def _count_eligible(self, r: Request, drafted: int, k: int) -> None:
        """``drafted`` steps with a proposal ran at ``k``: each could have proposed drafts 1..k."""
        if len(r.eligible_per_pos) < self.k_max:
            r.eligible_per_pos.extend([0] * (self.k_max - len(r.eligible_per_pos)))
        for j in range(min(k, self.k_max)):
            r.eligible_per_pos[j] += max(drafted, 0)

    def _detokenize(self, r: Request, new_from: int) -> bool:
        """Update ``r.text``; on a stop string, cut text (and token ids after the token that
        completed it), set the finish reason and return True."""
        tok = self.tokenizer
        if tok is None:
            return False
        r.text = tok.decode(r.output_ids, skip_special_tokens=True)
        if not r.params.stop:
            return False
        hits = [(r.text.find(s), s) for s in r.params.stop if s in r.text]
        if not hits:
            return False
        at, s = min(hits)
        for m in range(max(new_from, 0) + 1, len(r.output_ids) + 1):
            if s in tok.decode(r.output_ids[:m], skip_special_tokens=True):
                del r.output_ids[m:]
                break
        r.text = r.text[:at]
        r.metrics.num_output_tokens = len(r.output_ids)
        r.finish_reason, r.stop_reason = "stop", s
        return True

    # ------------------------------------------------------------------ warm-up
    def warmup(self, reuse_calibration: bool = False) -> None:
        """Compile every step variant that ``step()`` can pick (each candidate k at each slot
        bucket, and the prefill step with each prefill width) and the slot updates, so that
        serving compiles nothing more. (With a fixed k the plain step is never picked: it is not
        compiled.) With dynamic k, then :meth:`calibrate` (``reuse_calibration``: its saved
        timings where this engine was calibrated on this machine before; ``jspec serve`` asks)."""
        if self.scheduler.has_work():
            raise ConfigError("warmup() runs on an empty engine")
        s = self.scheduler
        tables = s.tables()
        caps = np.zeros((len(s.slots),), np.int32)
        variants = self.step_variants
        for k, n in variants.decode:
            self.runner.burst(self._steps[k], tables, caps, None, 1, False, np.arange(n, dtype=np.int32))
        for shape in variants.prefill:
            seg = prefill_segment(shape, [], len(s.slots))
            self.runner.burst(self._steps[self._prefill_k], tables, caps, seg, 1, False)
        dummy = slot_update(0, [0], tables[0], 1, 0, SamplingParams(), 0, 0, self.buffer_len)
        self.runner.set_slot(self.drafter, dummy)
        self.runner.release(0)
        if len(self.cost.candidates) > 1:
            self.calibrate(reuse=reuse_calibration)

    def _calibration_file(self, steps: int, context: int):
        """Where a calibration of this engine on this machine is kept: a file under
        ``JSPEC_CACHE_DIR/calibration`` named by a hash of everything its timings depend on (the
        model and its parameters' shapes, the engine's shapes and options, the drafter, the
        machine, the software)."""
        import hashlib

        from jspec.loading.tokenizer import cache_dir
        from jspec.timing import describe_machine

        c = self.config
        params = [(str(p), x.shape, str(x.dtype)) for p, x in jax.tree_util.tree_leaves_with_path(self.runner.params)]
        what = repr((self.model.config, str(self.model.source), params, self.layout, c.attention, c.kv_cache_dtype,
                     c.quantized_weights, c.quantized_activations, c.small_row_weights, self.path, self.drafter,
                     self.spec, steps, context, describe_machine(), [str(d) for d in jax.local_devices()],
                     jax.__version__))
        return cache_dir() / "calibration" / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.json"

    def calibrate(self, steps: int = 8, context: int = 96, reuse: bool = False) -> dict[int, dict[int, float]]:
        """Time each dynamic-k candidate at each slot bucket on the real batch shape, before any
        request. A pattern of ``context`` tokens (a repeated sentence, so a lookup drafter always
        proposes and the target, attending to it, continues it) is prefilled once for real,
        through slot 0 with the compiled prefill step; then every slot of a bucket runs greedily
        from the end of that context, all of them on the same page table (identical sequences
        write identical K/V to the same places, and a position is always written before any
        query reads it), one untimed burst of ``steps`` steps (the first run of a program pays
        one-time costs) and one timed; each slot restarts at the same length for every k.

        The prefill matters: verification attending to pages that were never written made the
        target's choices garbage, the lookup lost its match after one step, and the "speculative"
        steps timed were plain ones (measured 2026-12-02: k = 4 at 16 slots timed 60 ms a step against
        165 ms in use). The times seed the buckets' cost models (single bursts measured while
        serving were too noisy to rank k). Nothing is left behind: the slots are released and the
        pages were never the allocator's (empty engine: no page is held). Returns
        {bucket: {k: seconds per step}}; empty when the pool cannot hold the context. What share of
        the slots' steps verified drafts (1.0 when the target kept to the pattern; 0 for k = 0) is
        kept in ``calibration_drafted`` ({bucket: {k: share}}).

        ``reuse``: take the timings an earlier calibration of the same
        engine on the same machine saved (:meth:`_calibration_file`) instead of measuring, and
        save these when there are none; a restarted server then skips most of a minute. The
        cost models keep refreshing their estimates from the bursts they see either way."""
        if self.scheduler.has_work():
            raise ConfigError("calibrate() runs on an empty engine")
        saved = self._calibration_file(steps, context) if reuse else None
        if saved is not None and saved.is_file():
            try:
                record = json.loads(saved.read_text())
                out = {int(n): {int(k): float(v) for k, v in ks.items()} for n, ks in record["seconds"].items()}
                drafted = {int(n): {int(k): float(v) for k, v in ks.items()} for n, ks in record["drafted"].items()}
                if set(out) == set(self.buckets) and all(set(ks) == set(self.cost.candidates) for ks in out.values()):
                    for n, ks in out.items():
                        for k, seconds in ks.items():
                            self.costs[n].observe(k, steps, seconds * steps)
                    self.calibration_drafted.update(drafted)
                    return out
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # unreadable or from another layout: measure again
        out = self._measure_calibration(steps, context)
        if saved is not None and out:
            try:
                saved.parent.mkdir(parents=True, exist_ok=True)
                tmp = saved.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"seconds": out, "drafted": self.calibration_drafted}))
                tmp.replace(saved)
            except OSError as e:  # a read-only cache only costs the next start its measurement
                log.warning("calibration not saved (%s): %s", saved, e)
        return out

    def _measure_calibration(self, steps: int, context: int) -> dict[int, dict[int, float]]:
        """:meth:`calibrate`'s measurement."""
        k_max = max(self.cost.candidates)
        context = min(context, self.buffer_len - 2 * steps * (k_max + 1) - 1)
        length = context + 2 * steps * (k_max + 1) + 1
        pages = self.allocator.pages_for(length)
        tables = np.zeros_like(self.scheduler.tables())
        if context < 8 or pages > self.allocator.num_usable or pages > tables.shape[1]:
            return {}
        tables[:, :pages] = self.allocator.reserved + np.arange(pages)
        pattern = self._calibration_pattern(context)
        sp = SamplingParams(max_tokens=1, ignore_eos=True)
        self._prefill_pattern(pattern, tables, length, sp)
        out = {}
        for n in self.buckets:
            out[n] = {}
            slots = np.arange(n, dtype=np.int32)
            for k in self.cost.candidates:
                caps = np.full((len(self.scheduler.slots),), k, np.int32)
                for i in range(n):
                    self.runner.set_slot(self.drafter, slot_update(i, pattern, tables[i], length, context - 1, sp,
                                                                   0, k, self.buffer_len))
                self.runner.burst(self._steps[k], tables, caps, None, steps, False, slots)
                t0 = time.perf_counter()
                snap = self.runner.burst(self._steps[k], tables, caps, None, steps, False, slots)
                seconds = time.perf_counter() - t0
                self.costs[n].observe(k, steps, seconds)
                out[n][k] = seconds / steps
                self.calibration_drafted.setdefault(n, {})[k] = (
                    float(snap.num_drafts[:n].sum() / max(int(snap.num_steps[:n].sum()), 1)))
            for i in range(n):
                self.runner.release(i)
            self._last_steps = int(snap.steps)
        return out

    def _calibration_pattern(self, context: int) -> list[int]:
        """``context`` tokens that the target continues exactly: a sentence repeated. (A cycle of
        token ids 2..8, the earlier choice, is SmolLM2's special tokens, which it does not copy:
        the lookup lost its match after a step.) Without a tokenizer, such a cycle of ids."""
        if self.tokenizer is not None:
            ids = encode_prompt(self.tokenizer, CALIBRATION_SENTENCE * (context // 4 + 1))
            if len(ids) >= context:
                return [int(t) for t in ids[:context]]
        return [int(t) for t in (np.arange(context) % 7 + 2) % self.model.config.vocab_size]

    def _prefill_pattern(self, pattern: list[int], tables: np.ndarray, length: int, sp: SamplingParams) -> None:
        """Write the K/V (and the drafter's state) of ``pattern[:-1]`` into ``tables[0]``'s pages
        through slot 0, in chunks of the widest compiled prefill shape, then free the slot."""
        shape = min(self.prefill_shapes, key=lambda s: (-s.width, s.rows))
        pad = len(self.scheduler.slots)
        caps = np.zeros((pad,), np.int32)
        self.runner.set_slot(self.drafter, slot_update(0, pattern, tables[0], length, 0, sp, 0, 0, self.buffer_len))
        for start in range(0, len(pattern) - 1, shape.width):
            seg = prefill_segment(shape, [(0, pattern[start:min(start + shape.width, len(pattern) - 1)])], pad)
            self.runner.burst(self._steps[self._prefill_k], tables, caps, seg, 1, False)
        self.runner.release(0)
