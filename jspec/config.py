"""Frozen, hashable configuration dataclasses.

They are passed to ``jax.jit`` as static arguments, so every field is an immutable scalar or
tuple, and each validates itself in ``__post_init__`` (raising :class:`ConfigError`).

- :class:`ModelConfig`: the shape of a Llama-family transformer (Llama 2/3, SmolLM2, Qwen2,
  Mistral without sliding window).
- :class:`CacheConfig`: paged KV cache geometry.
- :class:`SamplingParams`: temperature, top-k, top-p, seed, token budget, EOS handling.
- :class:`SpecConfig`: which drafter and how many speculative tokens.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from typing import Optional

from jspec.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text")
# Gemma's decoder (jspec.models.gemma): (1 + w) RMSNorms before and after attention and the MLP,
# the embedding scaled by sqrt(hidden), GeGLU, local (sliding-window) and global layers.
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full", "sliding")
MAX_SPECULATIVE_TOKENS = 16
MAX_TREE_NODES = 31  # drafted nodes of a token tree: with its root, one bit per row of an int32 mask
DEFAULT_TREE_WIDTH = 4  # each expansion's best tokens when a tree budget names no width
TREE_METHODS = ("draft", "eagle", "hybrid", "ngram")  # drafters that propose token trees


def tree_buffer_depth(nodes: int, width: int, depth: int) -> int:
    """The deepest tree whose drafting buffer fits the rows a verification reserves: expanding
    ``depth`` levels ``width`` wide writes (depth - 1) * width rows of the drafter's pages after
    the slot's prefix, where the engine holds pages for the ``nodes`` + 1 rows of a verification
    (rows past them would land on the shared null page and read back another slot's K/V)."""
    return max(1, min(depth, 1 + (nodes + 1) // width))
MAX_TOKENS = 1 << 20  # per request; the model's context bounds it further
INT32_MAX = 2**31 - 1  # sizes and token ids travel as int32 on the device
MAX_PAGE_SIZE = 1 << 12  # tokens per KV page
MAX_NGRAM = 64  # n-gram lookup unrolls one comparison per suffix token
MAX_NGRAM_HISTORY = 1 << 20  # tokens of lookup history: every step compares each n-gram against all of them


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 2.0**-126  # the smallest normal float32 (~1.18e-38)


def _float(x) -> Optional[float]:
    """x as a Python float, or None where it is not a real number a float can hold (a bool, a
    string, an integer or fraction past 1.8e308)."""
    if not _is_real(x):
        return None
    try:
        return float(x)
    except (OverflowError, ValueError, TypeError):
        return None


def float32(x: float) -> float:
    """x as the device holds it (rounded to the nearest float32): +-inf past float32's range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # rounds past FLOAT32_MAX
        return math.copysign(math.inf, x)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: llama3``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"rope_scaling {name} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError("rope_scaling high_freq_factor must exceed low_freq_factor")
        n = self.original_max_position_embeddings
        if not _is_int(n) or not 1 <= n <= INT32_MAX:
            raise ConfigError(f"rope_scaling original_max_position_embeddings must be an integer in "
                              f"[1, {INT32_MAX}], got {n!r}")
        object.__setattr__(self, "original_max_position_embeddings", int(n))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder-only transformer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rope_freq_factors: Optional[tuple[float, ...]] = None  # GGUF llama3: per-frequency divisors
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k (gains [head_dim]) before RoPE
    architecture: str = "llama"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # parameter and activation dtype; softmax and norms run in float32
    # Tensor-parallel layout of the weights (jspec.parallel): the fused QKV and gate/up columns
    # are grouped per device, and attention runs per device inside shard_map. 1 = one device.
    tensor_parallel: int = 1
    # Gemma 2 / 3 (None and defaults elsewhere): the MLP's activation; each layer's attention,
    # "full" or "sliding" over the last ``sliding_window`` keys; RoPE's base of the sliding layers
    # (Gemma 3; default rope_theta) and a linear RoPE scaling of the full ones (Gemma-3-27B: 8);
    # the score scale query_pre_attn_scalar ** -0.5 (default head_dim ** -0.5); tanh caps of the
    # attention scores and the final logits (Gemma 2).
    hidden_act: str = "silu"
    layer_types: Optional[tuple[str, ...]] = None
    sliding_window: Optional[int] = None
    local_rope_theta: Optional[float] = None
    rope_linear_factor: Optional[float] = None
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            if not _is_int(v) or not 1 <= v <= INT32_MAX:
                raise ConfigError(f"{name} must be an integer in [1, {INT32_MAX}], got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{name} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, name, float(v))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architecture {self.architecture!r} is not one of {SUPPORTED_ARCHITECTURES}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.rope_freq_factors is not None:
            factors = tuple(self.rope_freq_factors)
            if len(factors) != self.head_dim // 2:
                raise ConfigError(f"rope_freq_factors needs head_dim/2 = {self.head_dim // 2} entries")
            if not all(_is_real(f) and math.isfinite(f) and f > 0 for f in factors):
                raise ConfigError("rope_freq_factors must be finite numbers > 0")
            object.__setattr__(self, "rope_freq_factors", tuple(float(f) for f in factors))
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        eos = (self.eos_token_ids,) if _is_int(self.eos_token_ids) else self.eos_token_ids
        if not isinstance(eos, (tuple, list)) or not all(_is_int(t) and 0 <= t < self.vocab_size for t in eos):
            raise ConfigError(f"eos_token_ids must be token ids in [0, {self.vocab_size}), got {self.eos_token_ids!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in eos))
        bos = self.bos_token_id
        if bos is not None and (not _is_int(bos) or not 0 <= bos < self.vocab_size):
            raise ConfigError(f"bos_token_id must be a token id in [0, {self.vocab_size}) or None, got {bos!r}")
        object.__setattr__(self, "bos_token_id", None if bos is None else int(bos))
        self._check_gemma_fields()
        tp = self.tensor_parallel
        if not _is_int(tp) or tp < 1:
            raise ConfigError(f"tensor_parallel must be an integer >= 1, got {tp!r}")
        for name in ("num_heads", "num_kv_heads", "intermediate_size"):
            if getattr(self, name) % tp:
                raise ConfigError(f"tensor_parallel {tp} does not divide {name} ({getattr(self, name)})")

    def _check_gemma_fields(self):
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.layer_types is not None:
            types = tuple(self.layer_types)
            if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
                raise ConfigError(f"layer_types must name one of {LAYER_TYPES} for each of the {self.num_layers} "
                                  f"layers, got {self.layer_types!r}")
            object.__setattr__(self, "layer_types", types)
            if "sliding" in types and self.sliding_window is None:
                raise ConfigError("sliding layers need a sliding_window")
        w = self.sliding_window
        if w is not None and (not _is_int(w) or not 1 <= w <= INT32_MAX):
            raise ConfigError(f"sliding_window must be an integer in [1, {INT32_MAX}] or None, got {w!r}")
        for name in ("local_rope_theta", "rope_linear_factor", "query_pre_attn_scalar", "attn_logit_softcap",
                     "final_logit_softcap"):
            v = getattr(self, name)
            if v is not None:
                if not _is_real(v) or not math.isfinite(v) or v <= 0:
                    raise ConfigError(f"{name} must be a finite number > 0 or None, got {v!r}")
                object.__setattr__(self, name, float(v))

    @property
    def is_gemma(self) -> bool:
        """Whether the decoder is Gemma's (jspec.models.gemma) rather than Llama's."""
        return self.architecture in GEMMA_ARCHITECTURES

    def layer_type(self, i: int) -> str:
        """"full" or "sliding": what layer ``i`` attends to."""
        return "full" if self.layer_types is None else self.layer_types[i]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * i + (4 if self.is_gemma else 2) * h + (2 * self.head_dim if self.qk_norm else 0)
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry.

    ``page_size`` tokens share one page; ``prefill_chunk`` bounds how many prompt tokens one
    prefill forward processes (long prompts are prefilled in chunks).
    """

    page_size: int = 16
    prefill_chunk: int = 512
    shuffle_pages: bool = False  # give sequences a random permutation of pages (tests)

    def __post_init__(self):
        ps = self.page_size
        if not _is_int(ps) or not 1 <= ps <= MAX_PAGE_SIZE or ps & (ps - 1):
            raise ConfigError(f"page_size must be a power of two in [1, {MAX_PAGE_SIZE}], got {ps!r}")
        if not _is_int(self.prefill_chunk) or not 1 <= self.prefill_chunk <= MAX_TOKENS:
            raise ConfigError(f"prefill_chunk must be an integer in [1, {MAX_TOKENS}], got {self.prefill_chunk!r}")
        if not isinstance(self.shuffle_pages, bool):
            raise ConfigError(f"shuffle_pages must be a bool, got {self.shuffle_pages!r}")


MAX_SEED = 2**63 - 1
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema, regex or grammar's text


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a request's output text, vLLM's ``StructuredOutputsParams``: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text): the output is one JSON value that
      follows it;
    - ``json_object``: True: the output is any JSON object (OpenAI's ``json_object`` format);
    - ``regex``: a regular expression the whole output matches (Rust ``regex`` syntax);
    - ``choice``: a list of strings: the output is one of them;
    - ``grammar``: a context-free grammar, in Lark syntax or llama.cpp's GBNF.

    The schema is kept as compact JSON text (its keys in the given order: a schema's property
    order is the order the output writes them), so the parameters stay hashable and equal
    schemas share one compiled grammar. The values are checked for their types here;
    whether they compile (a valid schema, regex or grammar) is checked against the model's
    tokenizer when a request is queued (:mod:`jspec.sampling.structured`), before anything runs.
    """

    json: Optional[object] = None
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None
    json_object: bool = False

    def __post_init__(self):
        import json as json_lib

        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object is not False:
            if self.json_object is not True:
                raise ConfigError(f"structured output json_object must be a bool, got {self.json_object!r}")
            given.append("json_object")
        if len(given) != 1:
            raise ConfigError("structured output takes exactly one of json, json_object, regex, choice, grammar; "
                              f"got {', '.join(given) if given else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json_lib.loads(schema)
                except ValueError as e:
                    raise ConfigError(f"structured output json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ConfigError(f"structured output json must be a JSON schema (an object), got "
                                  f"{type(schema).__name__}")
            object.__setattr__(self, "json", json_lib.dumps(schema, separators=(",", ":")))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConfigError(f"structured output {name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str) or not isinstance(c, (list, tuple)) or not c or \
                    not all(isinstance(x, str) and x for x in c):
                raise ConfigError(f"structured output choice must be a non-empty list of non-empty strings, got {c!r}")
            object.__setattr__(self, "choice", tuple(c))
        size = len(self.json or self.regex or self.grammar or "") + sum(map(len, self.choice or ()))
        if size > MAX_CONSTRAINT_CHARS:
            raise ConfigError(f"structured output is {size} characters, more than {MAX_CONSTRAINT_CHARS}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    @classmethod
    def from_dict(cls, d) -> "StructuredOutputsParams":
        """From vLLM's request fields (``{"json": ...}``, ``{"regex": ...}``, ...): unknown keys
        are refused by name."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"structured outputs must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"structured outputs: unknown field(s) {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(known))})")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen, with vLLM's names where jspec has the concept.

    ``temperature == 0`` means greedy (argmax; jspec's default, where vLLM's is 1.0). The same
    logits processing (temperature -> top-k -> top-p) shapes plain sampling and both the target
    (p) and draft (q) distributions of speculative verification. In a batch every request keeps
    its own parameters (they travel as per-slot arrays, not as compile-time constants).

    - ``max_tokens``: new tokens at most (``max_new_tokens`` is read as the same number);
    - ``stop``: strings that end the request when they appear in its output text (the text is
      cut before the stop string, finish reason ``"stop"``);
    - ``seed``: the request's own random stream (sampling depends only on the seed and the
      token position, so a request samples the same alone or batched); None: the engine picks;
    - ``ignore_eos``: keep generating past the model's EOS tokens;
    - ``num_speculative_tokens``: this request's cap on drafts per step (0: no speculation;
      None: the engine's setting). A jspec extension;
    - ``structured_outputs``: a :class:`StructuredOutputsParams` (or a dict of its fields): the
      output follows a JSON schema, a regex, a choice or a grammar (:mod:`jspec.sampling.structured`).

    The checks are those of the values the device computes with: temperature and top-p travel as
    float32, top-k and token counts as int32, the seed as the two uint32 words of a threefry key.
    So every accepted value has a defined result, never an empty candidate set or a NaN
    distribution (:mod:`jspec.sampling`):

    - ``temperature``: a finite number in [0, FLOAT32_MAX] (one that float32 rounds to infinity
      is refused). One below float32's smallest normal number (``FLOAT32_TINY``, ~1.2e-38) is
      stored as 0, greedy: the limit of softmax(logits / T) as T -> 0 is the argmax, and devices
      disagree about subnormal numbers (XLA's CPU flushes them to zero). A larger one so small
      that a row's largest logit over it leaves float32's range also samples that row greedily;
    - ``top_p``: in (0, 1]; one that float32 rounds to 0 keeps the most likely token (and its
      ties), as any top-p below that token's probability does (vLLM and Hugging Face keep at
      least one token); one that rounds to 1 keeps every token;
    - ``top_k``: an integer in [-1, 2^31 - 1]; 0 or -1 is off, and so is any k >= the vocabulary;
    - ``seed``: an integer in [0, 2^63); ``max_tokens``: an integer in [1, 2^20];
      ``num_speculative_tokens``: in [0, 16] or None; ``stop``: non-empty strings.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # 1 = off
    seed: Optional[int] = None
    max_tokens: int = 128
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    num_speculative_tokens: Optional[int] = None
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self):
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_dict(self.structured_outputs))
        t = _float(self.temperature)
        if t is None or not 0 <= t < math.inf or math.isinf(float32(t)):
            raise ConfigError(f"temperature must be a finite number in [0, {FLOAT32_MAX:.4g}] (float32), "
                              f"got {self.temperature!r}")
        p = _float(self.top_p)
        if p is None or not 0 < p <= 1:
            raise ConfigError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT32_MAX:
            raise ConfigError(f"top_k must be an integer in [-1, {INT32_MAX}] (0 or -1 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ConfigError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ConfigError(f"max_tokens must be an integer in [1, {MAX_TOKENS}], got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise ConfigError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        k = self.num_speculative_tokens
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError(f"num_speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        object.__setattr__(self, "temperature", 0.0 if float32(t) < FLOAT32_TINY else t)
        object.__setattr__(self, "top_p", p)
        object.__setattr__(self, "top_k", max(0, int(self.top_k)))
        for name in ("seed", "max_tokens", "num_speculative_tokens"):  # numpy integers -> int
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_new_tokens(self) -> int:
        """The token budget under its earlier jspec name (same as ``max_tokens``)."""
        return self.max_tokens


SPEC_METHODS = ("none", "ngram", "layerskip", "draft", "eagle", "hybrid")
DRAFT_QUANTIZATIONS = ("auto", "q8_0", None)  # SpecConfig.draft_quantization
# EngineConfig.kv_cache_dtype (vLLM's names): "fp8" is "fp8_e4m3", OCP E4M3 (float8_e4m3fn)
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
_KV_CACHE_ARRAY_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
CHECKPOINT_METHODS = ("draft", "eagle", "hybrid")  # spec methods that load a draft checkpoint (SpecConfig.draft)
HEAD_METHODS = ("eagle", "hybrid")  # ... an EAGLE head directory


def kv_cache_array_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The pages' array dtype name (``"float8_e4m3fn"``) for an ``EngineConfig.kv_cache_dtype``
    and the model's dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return _KV_CACHE_ARRAY_DTYPES.get(kv_cache_dtype, kv_cache_dtype)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Which drafter proposes and how many tokens it proposes per verification step."""

    method: str = "none"
    num_speculative_tokens: int = 4
    # n-gram prompt lookup (ngram, hybrid): longest suffix tried first (8: a longer match predicts
    # more; 3 -> 8 added 0.02-0.05 to the hybrid's accepted length in a replay of HumanEval's
    # drafts, 2026-12-03) ...
    ngram_max: int = 8
    # ... down to this length; None: 1 for ngram (a one-token match is worth verifying where a
    # verification costs little more than a decode step; measured 2026-12-03),
    # 2 for hybrid (a one-token match falls to the head there)
    ngram_min: Optional[int] = None
    # ngram, hybrid: also search the last this many tokens of finished requests' text (0: off; see
    # jspec.speculative.drafters.ngram, "lookup history")
    ngram_history: int = 0
    layerskip_layers: int = 0  # layer-skip: how many of the target's first layers draft
    draft: Optional[str] = None  # draft / eagle / hybrid: name or path of the draft checkpoint
    dynamic_k: bool = False  # the engine picks k per burst (0 .. num_speculative_tokens) by measured cost
    # hybrid: the EAGLE head drafts at most this many tokens where lookup finds no match (None: k);
    # lookup matches still propose up to k. The head's chain costs a head forward per draft, and
    # on text it drafts poorly (prose) its later drafts rarely pay for themselves
    head_tokens: Optional[int] = None
    # Where the CPU small-row kernel runs the drafter (CPU, float32): "q8_0" keeps its projections
    # and its (draft-vocabulary) LM head as Q8_0 blocks (llama.cpp's quantizer, at load), reading
    # ~0.28x the bytes a draft token. Drafts only propose: the output is exactly the same
    # (verification decides); which tokens are proposed may differ by Q8_0's rounding. None:
    # float32. "auto": "q8_0" for the drafters jspec loads from a checkpoint (draft, eagle,
    # hybrid), None for drafter parameters passed to the engine as they are.
    draft_quantization: Optional[str] = "auto"
    # a token tree instead of a chain: up to tree_nodes drafted nodes per verification,
    # num_speculative_tokens deep at most; an EAGLE head's expansions keep their tree_width best
    # tokens (jspec.speculative.tree; EAGLE-2's dynamic tree), n-gram lookup merges tree_width
    # matches' continuations into a trie. 0: a chain of num_speculative_tokens
    tree_nodes: int = 0
    tree_width: int = 0

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"spec method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.ngram_min is None:
            object.__setattr__(self, "ngram_min", 2 if self.method == "hybrid" else 1)
        for name in ("num_speculative_tokens", "ngram_max", "ngram_min", "ngram_history", "layerskip_layers",
                     "tree_nodes", "tree_width"):
            if not _is_int(getattr(self, name)) or not 0 <= getattr(self, name) <= INT32_MAX:
                raise ConfigError(f"{name} must be a non-negative integer, got {getattr(self, name)!r}")
        if self.draft is not None and not isinstance(self.draft, str):
            raise ConfigError(f"draft must be a name or path (str), got {self.draft!r}")
        if self.ngram_history and self.method not in ("ngram", "hybrid"):
            raise ConfigError(f"ngram_history applies to spec methods 'ngram' and 'hybrid', not {self.method!r}")
        if self.head_tokens is not None:
            if self.method != "hybrid":
                raise ConfigError(f"head_tokens applies to spec method 'hybrid', not {self.method!r}")
            if not _is_int(self.head_tokens) or not 1 <= self.head_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ConfigError(f"head_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {self.head_tokens!r}")
        if self.draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ConfigError(f"draft_quantization must be one of {DRAFT_QUANTIZATIONS}, got {self.draft_quantization!r}")
        if self.ngram_history > MAX_NGRAM_HISTORY:
            raise ConfigError(f"ngram_history must be <= {MAX_NGRAM_HISTORY} tokens, got {self.ngram_history}")
        if self.method == "none":
            return
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        if self.method in ("ngram", "hybrid") and not 1 <= self.ngram_min <= self.ngram_max <= MAX_NGRAM:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max <= {MAX_NGRAM}, got {self.ngram_min}, {self.ngram_max}")
        if self.method == "layerskip" and self.layerskip_layers < 1:
            raise ConfigError(f"layerskip needs >= 1 draft layer, got {self.layerskip_layers}")
        if self.method in CHECKPOINT_METHODS and not self.draft:
            raise ConfigError(f"spec method {self.method!r} needs a draft checkpoint")
        if self.tree_nodes or self.tree_width:
            if self.method not in TREE_METHODS:
                raise ConfigError(f"a token tree applies to spec methods {TREE_METHODS}, not {self.method!r}")
            if not 1 <= self.tree_nodes <= MAX_TREE_NODES:
                raise ConfigError(f"tree max_nodes must be in [1, {MAX_TREE_NODES}], got {self.tree_nodes}")
            if not 1 <= self.tree_width <= self.tree_nodes:
                raise ConfigError(f"tree max_width must be in [1, max_nodes = {self.tree_nodes}], got {self.tree_width}")
            if self.head_tokens is not None:
                raise ConfigError("head_tokens caps a chain; a token tree's budget is max_nodes")
            if self.method == "ngram" and self.ngram_history:
                raise ConfigError("an n-gram token tree searches the request's own text: drop ngram_history")

    @property
    def drafts_per_step(self) -> int:
        """The most drafted tokens one verification scores: a tree's nodes, else k (0: off)."""
        if not self.enabled:
            return 0
        return self.tree_nodes if self.tree else self.num_speculative_tokens

    @property
    def tree(self) -> bool:
        """Whether the drafter proposes token trees (``tree_nodes`` > 0)."""
        return self.tree_nodes > 0

    @property
    def tree_depth(self) -> int:
        """How deep a tree drafter's trees grow (0: chains): ``num_speculative_tokens``, cut to
        what its drafting buffer may hold (:func:`tree_buffer_depth`); n-gram tries are not
        expanded level by level and keep the whole depth."""
        if not self.tree:
            return 0
        if self.method == "ngram":
            return self.num_speculative_tokens
        return tree_buffer_depth(self.tree_nodes, self.tree_width, self.num_speculative_tokens)

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    # vLLM's ``speculative_config`` keys -> jspec's
    _VLLM_METHODS = {"ngram": "ngram", "layerskip": "layerskip", "draft_model": "draft", "draft": "draft",
                     "eagle": "eagle", "hybrid": "hybrid", "none": "none"}

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> "SpecConfig":
        """A SpecConfig from vLLM's ``speculative_config`` dictionary: ``method`` (ngram,
        layerskip, draft_model, eagle; and jspec's hybrid: n-gram lookup, else the EAGLE head
        ``model``), ``num_speculative_tokens``, ``model`` (draft path or shipped name),
        ``prompt_lookup_max`` / ``prompt_lookup_min`` (n-gram and hybrid), ``layers``
        (layer-skip), ``dynamic_k``; and jspec's ``ngram_history`` (n-gram, hybrid) and
        ``head_tokens`` (hybrid)."""
        if d is None:
            return cls()
        if isinstance(d, SpecConfig):
            return d
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        known = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
                 "layers", "dynamic_k", "ngram_history", "head_tokens", "quantization", "tree"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"speculative_config: unknown keys {unknown} (known: {sorted(known)})")
        method = d.get("method", "ngram" if "prompt_lookup_max" in d else None)
        if method not in cls._VLLM_METHODS:
            raise ConfigError(f"speculative_config method must be one of {sorted(cls._VLLM_METHODS)}, got {method!r}")
        kw = dict(method=cls._VLLM_METHODS[method], num_speculative_tokens=d.get("num_speculative_tokens", 4),
                  draft=d.get("model"), dynamic_k=bool(d.get("dynamic_k", False)))
        if "prompt_lookup_max" in d:
            kw["ngram_max"] = d["prompt_lookup_max"]
        if "prompt_lookup_min" in d:
            kw["ngram_min"] = d["prompt_lookup_min"]
        if "layers" in d:
            kw["layerskip_layers"] = d["layers"]
        if "ngram_history" in d:
            kw["ngram_history"] = d["ngram_history"]
        if d.get("head_tokens") is not None:
            kw["head_tokens"] = d["head_tokens"]
        if "quantization" in d:
            kw["draft_quantization"] = d["quantization"]
        if d.get("tree") is not None:
            tree = d["tree"]
            if not isinstance(tree, dict) or sorted(set(tree) - {"max_nodes", "max_width"}) or "max_nodes" not in tree:
                raise ConfigError(f"speculative_config: tree must be {{'max_nodes': N, 'max_width': W}}, got {tree!r}")
            kw["tree_nodes"] = tree["max_nodes"]
            kw["tree_width"] = tree.get("max_width", DEFAULT_TREE_WIDTH)
        for name in ("num_speculative_tokens", "ngram_max", "ngram_min", "ngram_history", "layerskip_layers",
                     "head_tokens", "tree_nodes", "tree_width"):
            if name in kw and not _is_int(kw[name]):
                raise ConfigError(f"speculative_config: {name} must be an integer, got {kw[name]!r}")
        return cls(**kw)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The serving engine's shape (vLLM's names where it has the concept).

    - ``max_num_seqs``: slots decoded together (the batch);
    - ``max_num_batched_tokens``: tokens one step may run: every slot's decode/verification
      rows plus one prefill chunk (the rest of the budget, rounded down to a power of two);
    - ``max_model_len``: prompt + output tokens per request (default: the model's context);
    - ``kv_cache_tokens``: size of the page pool in tokens (default: ``max_num_seqs`` x
      ``max_model_len`` plus the rows of one verification, every slot at full length, or, where
      that does not fit in ``memory_utilization`` of the free memory, as many pages as do: slots
      are then admitted as pages allow, and the newest request is preempted when they run out);
    - ``memory_utilization``: the fraction of the memory free when the engine is built (the
      device's, or the host's on the CPU) that its default page pool and token buffer may take
      (vLLM's ``gpu_memory_utilization``, of the free memory rather than the total);
    - ``enable_prefix_caching``: share full prompt pages between requests with the same prefix;
    - ``max_burst_steps``: steps per device call (the host sees new tokens and arrivals between);
    - ``seed``: seeds of requests that bring none are drawn from this;
    - ``tensor_parallel_size``: devices the target's heads, MLP and vocabulary (and the KV
      pages) are sharded over (:mod:`jspec.parallel`);
    - ``small_row_weights``: keep a packed copy of the target's layer projections for steps of
      1-16 rows, read by the CPU small-row kernel on the engine's CPU path
      (:func:`jspec.models.cpu_path.with_small_row_weights`, ``pallas_kernels.cpu.small_rows``).
      ``None`` (the default): on where it applies (the CPU backend, one device, a float32 target,
      the kernel built); ``False``: off; ``True``: on wherever it applies (a warning where it
      does not). It costs the projections' memory once more (425 MB for SmolLM2-135M);
    - ``quantized_weights``: where the small-row copy is kept and the checkpoint stores a projection
      (or the LM head) as Q4_1 or Q8_0 blocks (a GGUF file: ``LoadedModel.quantized``), the copy is
      those blocks as they are, not floats (66 + 30 MB instead of 425 + 113 for SmolLM2-135M's Q4_1
      layers and Q8_0 head); the same results bit for bit. ``False``: float32 copies (for
      comparisons);
    - ``quantized_activations``: with those blocks, multiply them as llama.cpp does: each row of
      activations rounded to int8 a block of 32 (a scale per block, Q8_1), integer dot products
      summed exactly (AVX512-VNNI where the CPU has it). Not the float32 weights' results (SmolLM2-135M's
      logits, spanning ~50, move by 1.0-1.4 against transformers', the argmax kept), but each
      further row of a step costs less (the LM head's read is shared, the products do a quarter
      of the float FMAs); speculative output stays token-identical to plain decoding with the
      same setting (a row's result never depends on the other rows of its step). Off by default;
    - ``kv_cache_dtype``: what the page pools hold (vLLM's name): ``"auto"`` the model's dtype,
      or ``"float32"``, ``"float16"``, ``"bfloat16"``. Pages of 16 bits take half the memory and
      half the bytes a step reads at long contexts; K and V are rounded to them as they are
      written and widened as they are read, so logits move by that rounding (llama.cpp's default
      cache is float16), while speculative output stays token-identical to plain decoding on the
      same cache (both read the same rounded pages). ``"fp8"`` / ``"fp8_e4m3"`` (OCP E4M3, 3
      mantissa bits) and ``"fp8_e5m2"`` (2) take a quarter of float32's memory: written rounded to
      nearest even after saturating to the format's largest value (+-448, +-57344), with no scale
      (vLLM's uncalibrated k_scale = v_scale = 1.0), read by the CPU kernels and the xla path (the
      Triton kernel refuses them: ``"auto"`` attention on a GPU runs xla for them); logits move
      more than with 16 bits. A drafter's own pages (draft model, EAGLE head) follow it.
    """

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None
    kv_cache_tokens: Optional[int] = None
    memory_utilization: float = 0.9
    page_size: int = 16
    enable_prefix_caching: bool = True
    max_burst_steps: int = 16
    attention: str = "auto"
    seed: int = 0
    shuffle_pages: bool = False  # hand out pages in a random order (tests that paging is real)
    tensor_parallel_size: int = 1  # devices the target is sharded over (jspec.parallel)
    small_row_weights: Optional[bool] = None
    quantized_weights: bool = True
    quantized_activations: bool = False
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "max_burst_steps",
                     "tensor_parallel_size"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.page_size & (self.page_size - 1) or self.page_size > 1024:
            raise ConfigError(f"page_size must be a power of two <= 1024, got {self.page_size}")
        if self.max_num_seqs > 4096:
            raise ConfigError(f"max_num_seqs must be <= 4096, got {self.max_num_seqs}")
        for name in ("max_model_len", "kv_cache_tokens"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 1 <= v <= 2**31 - 1):
                raise ConfigError(f"{name} must be an integer in [1, 2^31), got {v!r}")
        if not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        u = self.memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError(f"memory_utilization must be a fraction in (0, 1], got {u!r}")
        if self.small_row_weights is not None and not isinstance(self.small_row_weights, bool):
            raise ConfigError(f"small_row_weights must be None, True or False, got {self.small_row_weights!r}")
        for name in ("quantized_weights", "quantized_activations"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.quantized_activations and not self.quantized_weights:
            raise ConfigError("quantized_activations multiplies quantized weights: it needs quantized_weights=True")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")
        if self.small_row_weights and self.tensor_parallel_size > 1:
            raise ConfigError("small_row_weights needs one device (tensor_parallel_size 1)")
