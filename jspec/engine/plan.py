"""What a run will hold on each device, from configs alone, before anything loads.

    from jspec.engine.plan import plan_run
    plan = plan_run(read_config("docs/configs/llama-3.1-70b.json", "bfloat16"),
                    EngineConfig(max_num_seqs=16, max_model_len=8192, tensor_parallel_size=4),
                    device_memory=80 << 30)
    print(plan.describe())      # or plan.to_dict(); ``jspec plan`` prints the same

The arithmetic is the engine's own, so the plan is what the run does:

- weights: one device's share of the target's parameters
  (:func:`jspec.loading.memory.weights_bytes_per_device`), and of a drafter's, split the same way;
- activations: one step of ``max_num_batched_tokens`` rows
  (:func:`jspec.loading.memory.activation_bytes`), set aside before the KV cache is sized;
- the KV cache: :func:`jspec.engine.layout.memory_budget` of what the weights leave free, cut
  into pages by :func:`jspec.engine.layout.plan_layout` (the engine passes what it measures
  free once the weights are in place, and the same activation estimate);
- the programs to compile: :func:`jspec.engine.layout.step_variants`, what
  ``LLMEngine.warmup`` compiles.

A plan that cannot run is refused, with the reason: weights and activations alone past the
device (:class:`~jspec.errors.InsufficientMemoryError`, naming the smallest tensor-parallel size
that would hold them, where one does), one request of ``max_model_len`` tokens past what is left
for the KV cache, or heads that ``tensor_parallel_size`` does not divide
(:class:`~jspec.errors.ConfigError`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from jspec.config import EngineConfig, ModelConfig
from jspec.engine.layout import EngineLayout, StepVariants, memory_budget, plan_layout, step_variants
from jspec.errors import ConfigError, InsufficientMemoryError
from jspec.loading import memory
from jspec.loading.memory import format_bytes

TP_SIZES = (1, 2, 4, 8, 16, 32, 64)  # tensor-parallel sizes a refusal may suggest


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Bytes per device and programs of an engine over ``model`` with ``config``
    (:func:`plan_run`)."""

    model: ModelConfig  # the target's one-device config
    config: EngineConfig
    device_memory: Optional[int]  # bytes of one device (None: not given; the pool is not cut)
    weight_bytes: int  # one device's share of the target's and the drafter's parameters
    drafter_weight_bytes: int  # of which the drafter's
    activation_bytes: int  # one step's transient memory, set aside
    kv_bytes_per_token: int  # K/V of one token on one device, the target's and a drafter's own pages
    layout: EngineLayout
    variants: StepVariants
    budget: Optional[int] = None  # bytes the pages and the token buffer may take on one device
    dynamic_k: bool = False

    @property
    def kv_tokens(self) -> int:
        """Tokens of K/V the pool holds for requests (the null page excluded)."""
        return self.layout.usable_pages * self.layout.page_size

    @property
    def fit_tokens(self) -> Optional[int]:
        """Tokens of K/V the memory would hold (None without a device size): more than
        :attr:`kv_tokens` when every slot at full length takes less (the engine allocates no more
        than that unless ``kv_cache_tokens`` asks)."""
        if self.device_memory is None:
            return None
        room = self.budget - self.layout.token_buffer_bytes
        return max(0, room // (self.kv_bytes_per_token * self.layout.page_size) - 1) * self.layout.page_size

    @property
    def full_length_requests(self) -> int:
        """Requests of ``max_model_len`` tokens the pool holds at once."""
        return self.kv_tokens // self.layout.buffer_len

    @property
    def device_bytes(self) -> int:
        """What one device holds: weights, activations, its share of the pages, the token buffer."""
        return self.weight_bytes + self.activation_bytes + self.layout.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        m, c, lay = self.model, self.config, self.layout
        return {
            "model": {"architecture": m.architecture, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                      "num_heads": m.num_heads, "num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim,
                      "vocab_size": m.vocab_size, "num_params": m.num_params(), "dtype": m.dtype,
                      "context": m.max_position_embeddings},
            "tensor_parallel_size": c.tensor_parallel_size,
            "device_memory_bytes": self.device_memory,
            "memory_utilization": c.memory_utilization,
            "weight_bytes_per_device": self.weight_bytes,
            "drafter_weight_bytes_per_device": self.drafter_weight_bytes,
            "activation_bytes_per_device": self.activation_bytes,
            "kv_bytes_per_token_per_device": self.kv_bytes_per_token,
            "kv_cache_bytes_per_device": lay.kv_cache_bytes // lay.tensor_parallel_size,
            "kv_cache_dtype": lay.cache_dtype,
            "kv_tokens": self.kv_tokens,
            "kv_tokens_that_fit": self.fit_tokens,
            "max_model_len": lay.max_model_len,
            "max_num_seqs": lay.num_slots,
            "full_length_requests": self.full_length_requests,
            "kv_cut_to_memory": lay.sized_by_memory,
            "device_bytes": self.device_bytes,
            "k_max": lay.k_max,
            "step_variants": {"count": self.variants.count,
                              "decode": [{"k": k, "slots": n} for k, n in self.variants.decode],
                              "prefill": [{"rows": s.rows, "width": s.width, "tokens": s.tokens}
                                          for s in self.variants.prefill]},
        }

    def describe(self) -> str:
        m, c, lay, v = self.model, self.config, self.layout, self.variants
        tp = c.tensor_parallel_size
        where = (f"{format_bytes(self.device_memory)} each" if self.device_memory is not None else "size not given")
        ks = sorted({k for k, _ in v.decode})
        lines = [
            f"model        {m.architecture}: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
            f"({m.num_kv_heads} KV) x {m.head_dim}, vocabulary {m.vocab_size:,}, "
            f"{m.num_params() / 1e9:.2f}B parameters in {m.dtype}",
            f"devices      {tp} ({where}), memory utilization {c.memory_utilization:g}",
            f"weights      {format_bytes(self.weight_bytes)} per device"
            + (f" (drafter {format_bytes(self.drafter_weight_bytes)})" if self.drafter_weight_bytes else ""),
            f"activations  {format_bytes(self.activation_bytes)} per device "
            f"({c.max_num_batched_tokens} token rows per step)",
            f"KV cache     {format_bytes(self.kv_bytes_per_token)} per token per device ({lay.cache_dtype} pages); "
            f"{self.kv_tokens:,} tokens in {format_bytes(lay.kv_cache_bytes // tp)} per device"
            + (" (cut to the memory)" if lay.sized_by_memory else
               f" ({self.fit_tokens:,} would fit: --kv-cache-tokens)" if self.fit_tokens else ""),
            f"requests     {self.full_length_requests:,} of {lay.max_model_len:,} tokens at once; "
            f"{lay.num_slots} slots decode together",
            f"compile      {v.count} programs: decode at slot buckets {', '.join(map(str, lay.buckets))} "
            f"for k = {', '.join(map(str, ks))}; prefill "
            f"{', '.join(f'{s.rows}x{s.width}' + (f' packed in {s.tokens}' if s.packed else '') for s in v.prefill)}; "
            "the slot write",
        ]
        if self.device_memory is not None:
            lines.append(f"total        {format_bytes(self.device_bytes)} of {format_bytes(self.device_memory)} "
                         "per device")
        return "\n".join(lines)


def _smallest_tp(model: ModelConfig, need: Any, device_memory: int, start: int) -> Optional[int]:
    """The smallest tensor-parallel size past ``start`` whose heads fit and ``need(tp)`` fits."""
    from jspec.models.tensor_parallel import tp_config

    for tp in TP_SIZES:
        if tp <= start:
            continue
        try:
            tp_config(model, tp)
        except ConfigError:
            continue
        if need(tp) < device_memory:
            return tp
    return None


def plan_run(model: ModelConfig, config: EngineConfig = EngineConfig(), *, k_max: int = 0, dynamic_k: bool = False,
             draft: Optional[ModelConfig] = None, drafter_params: int = 0,
             device_memory: Optional[int] = None, tree_depth: int = 0) -> RunPlan:
    """The plan of an engine over a target of config ``model`` (one-device, in the dtype it runs
    in) with ``config``: ``k_max`` drafts per verification (``dynamic_k``: the engine picks k
    per burst; ``tree_depth``: the depth of a token tree of ``k_max`` nodes), a drafter keeping
    pages of geometry ``draft`` and ``drafter_params`` parameters, on devices of
    ``device_memory`` bytes (None: the pool is not cut to a memory).
    Raises InsufficientMemoryError or ConfigError for a plan that cannot run (module docstring)."""
    from jspec.models.tensor_parallel import tp_config

    if not isinstance(config, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig, got {type(config).__name__}")
    tp = config.tensor_parallel_size
    run_model = tp_config(model, tp) if tp > 1 else model  # ConfigError when the heads do not divide
    run_draft = tp_config(draft, tp) if draft is not None and tp > 1 else draft
    rows = config.max_num_batched_tokens

    def per_device(n: int) -> tuple[int, int, int]:  # (weights, the drafter's share, activations) at tp n
        drafter = -(-drafter_params * memory.itemsize(model.dtype) // n)
        return (memory.weights_bytes_per_device(model, n) + drafter, drafter,
                memory.activation_bytes(tp_config(model, n) if n > 1 else model, rows, n))

    def weights_and_activations(n: int) -> int:
        w, _, a = per_device(n)
        return w + a

    weights, drafter_bytes, activations = per_device(tp)
    budget = None
    if device_memory is not None:
        if weights + activations >= device_memory:
            better = _smallest_tp(model, weights_and_activations, device_memory, tp)
            hint = f"; --tp {better} would hold them" if better else ""
            raise InsufficientMemoryError(
                f"the weights ({format_bytes(weights)} per device at tp {tp}) and one step's activations "
                f"({format_bytes(activations)}) do not fit in {format_bytes(device_memory)}{hint}")
        budget = memory_budget(device_memory - weights, config.memory_utilization, activations)
    layout = plan_layout(run_model, config, k_max=k_max, draft=run_draft, memory_budget=budget)
    if budget is not None and layout.memory_bytes > budget:
        raise InsufficientMemoryError(
            f"{layout.describe()} needs {format_bytes(layout.memory_bytes)} per device, but "
            f"{config.memory_utilization:g} of what the weights and activations leave is "
            f"{format_bytes(budget)}; lower --max-model-len or --max-num-seqs, or raise --tp")
    per_token = (memory.kv_cache_bytes(run_model, 1, layout.cache_dtype)
                 + (memory.kv_cache_bytes(run_draft, 1, layout.cache_dtype) if run_draft is not None else 0)) // tp
    variants = step_variants(layout.buckets, layout.prefill_shapes, k_max, dynamic_k, tree_depth)
    return RunPlan(model, config, device_memory, weights, drafter_bytes, activations, per_token, layout, variants,
                   budget, dynamic_k)


__all__ = ["RunPlan", "TP_SIZES", "plan_run"]
