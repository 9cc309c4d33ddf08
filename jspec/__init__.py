"""jspec: speculative decoding of Llama-family models in JAX on a paged KV cache.

Quick tour (vLLM's conventions)::

    from jspec import LLM, SamplingParams
    llm = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, max_num_seqs=8)
    outs = llm.generate(["def fib(n):", "The capital of France is"], SamplingParams(max_tokens=64))
    print(outs[0].outputs[0].text, outs[0].metrics.mean_acceptance_length)

or one static batch::

    model = jspec.load_model("smollm2-135m")
    out = jspec.generate(model, ["def fib(n):"], jspec.SamplingParams(max_tokens=64),
                         spec=jspec.SpecConfig("ngram", num_speculative_tokens=4))
"""

import importlib
import importlib.util

# Only the light modules load with the package; the engine and the loaders (and with them JAX)
# load on first use. The ``jspec`` command thus installs its Ctrl-C handler before JAX starts
# (see jspec.cli.guard) and refuses bad options without importing JAX.
from jspec.config import CacheConfig, EngineConfig, ModelConfig, RopeScaling, SamplingParams, SpecConfig
from jspec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DraftMismatchError,
    InsufficientMemoryError,
    JspecError,
    MissingDependencyError,
    PromptError,
    UnsupportedModelError,
)

_LAZY = {
    "GenerationResult": "jspec.engine.generate", "generate": "jspec.engine.generate",
    "LLM": "jspec.engine.llm", "LLMEngine": "jspec.engine.engine", "RequestOutput": "jspec.engine.request",
    "CompletionOutput": "jspec.engine.request", "RequestMetrics": "jspec.engine.request",
    "DEFAULT_MODEL": "jspec.loading", "LoadedModel": "jspec.loading", "load_config": "jspec.loading",
    "load_model": "jspec.loading",
}


def __getattr__(name: str):
    """The lazily loaded names of ``__all__``, and subpackages (``jspec.models``) on attribute access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"jspec.{name}") is not None:
        value = importlib.import_module(f"jspec.{name}")
    else:
        raise AttributeError(f"module 'jspec' has no attribute {name!r}")
    globals()[name] = value
    return value


__version__ = "0.2.0"

__all__ = [
    "CacheConfig", "EngineConfig", "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "DraftMismatchError", "InsufficientMemoryError",
    "JspecError", "MissingDependencyError", "PromptError", "UnsupportedModelError", "LLM", "LLMEngine",
    "RequestOutput", "CompletionOutput",
    "RequestMetrics", "GenerationResult", "generate", "DEFAULT_MODEL", "LoadedModel", "load_config", "load_model",
    "__version__",
]
