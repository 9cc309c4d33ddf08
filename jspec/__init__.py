"""jspec: speculative decoding of Llama-family models in JAX on a paged KV cache.

Quick tour::

    import jspec
    model = jspec.load_model("smollm2-135m")
    out = jspec.generate(model, ["def fib(n):"], jspec.SamplingParams(max_tokens=64),
                         spec=jspec.SpecConfig("ngram", num_speculative_tokens=4))
    print(out.texts[0], out.mean_accepted_length)
"""

import importlib
import importlib.util

# Only the light modules load with the package; the engine and the loaders (and with them JAX)
# load on first use. The ``jspec`` command thus installs its Ctrl-C handler before JAX starts
# (see jspec.cli.guard) and refuses bad options without importing JAX.
from jspec.config import CacheConfig, ModelConfig, RopeScaling, SamplingParams, SpecConfig
from jspec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DraftMismatchError,
    InsufficientMemoryError,
    JspecError,
    PromptError,
    UnsupportedModelError,
)

_LAZY = {
    "GenerationResult": "jspec.engine.generate", "generate": "jspec.engine.generate",
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


__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "DraftMismatchError", "InsufficientMemoryError",
    "JspecError", "PromptError", "UnsupportedModelError", "GenerationResult", "generate", "DEFAULT_MODEL",
    "LoadedModel", "load_config", "load_model", "__version__",
]
