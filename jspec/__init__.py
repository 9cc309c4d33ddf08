"""jspec: speculative decoding of Llama-family models in JAX on a paged KV cache.

Quick tour::

    import jspec
    model = jspec.load_model("smollm2-135m")
    out = jspec.generate(model, ["def fib(n):"], jspec.SamplingParams(max_tokens=64),
                         spec=jspec.SpecConfig("ngram", num_speculative_tokens=4))
    print(out.texts[0], out.mean_accepted_length)
"""

from jspec.config import CacheConfig, ModelConfig, RopeScaling, SamplingParams, SpecConfig
from jspec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DraftMismatchError,
    JspecError,
    PromptError,
    UnsupportedModelError,
)
from jspec.engine.generate import GenerationResult, generate
from jspec.loading import DEFAULT_MODEL, LoadedModel, load_config, load_model

__version__ = "0.1.0"

__all__ = [
    "CacheConfig", "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "DraftMismatchError", "JspecError",
    "PromptError", "UnsupportedModelError", "GenerationResult", "generate", "DEFAULT_MODEL",
    "LoadedModel", "load_config", "load_model", "__version__",
]
