"""Option checks of ``jspec generate``, in two stages so that nothing slow runs on bad input.

1. :func:`generate_options` needs no model: prompts (valid UTF-8, not empty), sampling numbers
   (:class:`SamplingParams`), ``--spec`` and ``-k`` (``-k`` without ``--spec`` is refused),
   ``--page-size``, ``--attention`` against the backend, and that a draft path exists.
2. :func:`generate_fits` needs only the model's config (``jspec.load_config`` reads headers,
   not weights): the token budget against the context, ``layerskip:L`` against the layer
   count, and the bytes of weights + KV cache against the memory available.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional, Sequence

from jspec.config import (CHECKPOINT_METHODS, DEFAULT_TREE_WIDTH, HEAD_METHODS, CacheConfig, ModelConfig,
                          SamplingParams, SpecConfig, kv_cache_array_dtype)
from jspec.errors import ConfigError, PromptError

DEFAULT_K = 4
CHAT_TEMPLATE_TOKENS = 256  # upper bound of what a chat template adds around a prompt


def text_argument(value: str, what: str) -> str:
    """A command-line string that must be text: Python maps bytes that are not UTF-8 to lone
    surrogates (``surrogateescape``); refuse them with the offending byte."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(value[e.start]) - 0xDC00 if 0xDC80 <= ord(value[e.start]) <= 0xDCFF else None
        at = f"byte 0x{byte:02x}" if byte is not None else f"character U+{ord(value[e.start]):04X}"
        raise PromptError(f"{what} is not valid UTF-8 ({at} at position {e.start})") from None
    return value


def parse_spec(value: str, k: int) -> SpecConfig:
    """``none``, ``ngram``, ``layerskip:L``, ``draft:PATH_OR_NAME``, ``eagle:PATH``, ``hybrid:PATH``
    -> SpecConfig."""
    method, _, arg = value.partition(":")
    if method in ("none", "ngram"):
        if arg:
            raise ConfigError(f"--spec {method} takes no argument, got {value!r}")
        return SpecConfig(method, num_speculative_tokens=k)
    if method == "layerskip":
        try:
            layers = int(arg)
        except ValueError:
            raise ConfigError(f"--spec layerskip:L needs an integer L, got {value!r}") from None
        return SpecConfig(method, num_speculative_tokens=k, layerskip_layers=layers)
    if method in CHECKPOINT_METHODS:
        if not arg:
            raise ConfigError(f"--spec {method}:PATH needs a checkpoint path")
        return SpecConfig(method, num_speculative_tokens=k, draft=arg)
    raise ConfigError(f"--spec must be none, ngram, layerskip:L, draft:PATH, eagle:PATH or hybrid:PATH, got {value!r}")


def with_tree(spec: SpecConfig, nodes: int, width) -> SpecConfig:
    """``spec`` with the token-tree budget of --tree-nodes / --tree-width (checked by SpecConfig)."""
    if width is not None and not nodes:
        raise ConfigError("--tree-width needs --tree-nodes")
    if not nodes:
        return spec
    return dataclasses.replace(spec, tree_nodes=nodes, tree_width=DEFAULT_TREE_WIDTH if width is None else width)


def _check_attention(impl: str) -> None:
    from jspec.attention import resolve

    try:
        resolve(impl)
    except ConfigError:
        import jax

        raise ConfigError(f"--attention {impl} compiles for a GPU and the backend is {jax.default_backend()!r}; "
                          "use --attention auto or reference") from None


def _check_draft_exists(spec: SpecConfig) -> None:
    from jspec.errors import CheckpointNotFoundError
    from jspec.loading import resolve
    from jspec.loading.drafts import resolve_draft_path

    path = resolve_draft_path(spec.draft)
    if spec.method in HEAD_METHODS and (path is None or not path.is_dir()):
        raise CheckpointNotFoundError(f"--spec {spec.method}:{spec.draft}: no such EAGLE checkpoint directory")
    if spec.method == "draft" and path is None:
        resolve(spec.draft)  # a model name (smollm2-135m) or nothing: raises


def generate_options(args, prompts: Sequence[str]) -> tuple[SamplingParams, SpecConfig, CacheConfig]:
    """Every check that needs no model (stage 1 of the module docstring)."""
    if not prompts:
        raise PromptError("no prompt given")
    for i, p in enumerate(prompts):
        text_argument(p, "the prompt" if len(prompts) == 1 else f"prompt {i}")
        if not p:
            raise PromptError("prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                              ignore_eos=args.ignore_eos, structured_outputs=structured_option(args))
    k = args.num_speculative_tokens
    if k is not None and args.spec.partition(":")[0] == "none":
        raise ConfigError("-k/--num-speculative-tokens needs --spec (speculation is off without it)")
    spec = parse_spec(args.spec, DEFAULT_K if k is None else k)
    cache_config = CacheConfig(page_size=args.page_size)
    _check_attention(args.attention)
    if spec.method in CHECKPOINT_METHODS:
        _check_draft_exists(spec)
    return sampling, spec, cache_config


def structured_option(args) -> Optional[dict]:
    """The structured-output constraint of --json-schema / --json-object / --regex / --choice /
    --grammar (argparse lets one of them through), its files read; None without one."""
    schema, grammar = getattr(args, "json_schema", None), getattr(args, "grammar", None)
    if schema is not None:
        text = schema if schema.lstrip().startswith("{") else _read_text(schema, "--json-schema")
        try:
            return {"json": json.loads(text)}
        except ValueError as e:
            raise ConfigError(f"--json-schema: not valid JSON ({e})") from None
    if grammar is not None:
        return {"grammar": _read_text(grammar, "--grammar")}
    if getattr(args, "json_object", False):
        return {"json_object": True}
    if getattr(args, "regex", None) is not None:
        return {"regex": args.regex}
    if getattr(args, "choice", None):
        return {"choice": list(args.choice)}
    return None


def _read_text(path: str, option: str) -> str:
    try:
        return Path(text_argument(path, option)).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{option}: cannot read {path} ({e.__class__.__name__})") from None


def run_tokens(prompt_bytes: int, max_tokens: int, k: int, page_size: int, context: int, chat: bool) -> int:
    """Token slots one sequence can occupy: prompt (at most one token per byte, plus BOS and a
    chat template) + budget + verification slack, within the context, rounded up to the shape
    quantum of :mod:`jspec.engine.layout` (or a page, when pages are larger)."""
    from jspec.engine.layout import SHAPE_QUANTUM, round_up

    tokens = min(context, prompt_bytes + 2 + (CHAT_TEMPLATE_TOKENS if chat else 0) + max_tokens) + k + 1
    return round_up(tokens, max(SHAPE_QUANTUM, page_size))


def generate_fits(config: ModelConfig, prompts: Sequence[str], sampling: SamplingParams, spec: SpecConfig,
                  cache_config: CacheConfig, chat: bool = False, kv_cache_dtype: str = "auto") -> None:
    """Checks that need the model's config but not its weights (stage 2 of the module docstring)."""
    import jax

    from jspec.loading import memory
    from jspec.loading.convert import load_bytes

    context = config.max_position_embeddings
    if sampling.max_tokens >= context:
        raise PromptError(f"--max-tokens {sampling.max_tokens} does not fit the model's context of "
                          f"{context} tokens (the prompt needs at least one)")
    if spec.method == "layerskip" and not 1 <= spec.layerskip_layers < config.num_layers:
        raise ConfigError(f"layerskip:L needs 1 <= L < {config.num_layers} (the target's layers), "
                          f"got {spec.layerskip_layers}")
    k = spec.drafts_per_step
    slots = sum(run_tokens(len(p.encode("utf-8")), sampling.max_tokens, k, cache_config.page_size, context, chat)
                for p in prompts)
    weights, staging = load_bytes(config)
    kv = memory.kv_cache_bytes(config, slots, kv_cache_array_dtype(kv_cache_dtype, config.dtype))
    what = f"{config.num_params():,} parameters ({config.dtype}) and a KV cache of {slots:,} tokens"
    device = jax.local_devices()[0]
    if device.platform == "cpu":
        memory.check_fits(weights + staging + kv, what)
    else:
        memory.check_fits(weights + kv, what, device=device)


__all__ = ["generate_options", "generate_fits", "parse_spec", "text_argument", "run_tokens", "with_tree"]
