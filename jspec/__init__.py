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

from jspec.config import CacheConfig, EngineConfig, ModelConfig, RopeScaling, SamplingParams, SpecConfig
from jspec.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    DraftMismatchError,
    JspecError,
    PromptError,
    UnsupportedModelError,
)
from jspec.engine import LLMEngine, RequestOutput, CompletionOutput, RequestMetrics
from jspec.engine.generate import GenerationResult, generate
from jspec.engine.llm import LLM
from jspec.loading import DEFAULT_MODEL, LoadedModel, load_config, load_model

__version__ = "0.2.0"

__all__ = [
    "CacheConfig", "EngineConfig", "ModelConfig", "RopeScaling", "SamplingParams", "SpecConfig",
    "CheckpointError", "CheckpointNotFoundError", "ConfigError", "DraftMismatchError", "JspecError",
    "PromptError", "UnsupportedModelError", "LLM", "LLMEngine", "RequestOutput", "CompletionOutput",
    "RequestMetrics", "GenerationResult", "generate", "DEFAULT_MODEL", "LoadedModel", "load_config",
    "load_model", "__version__",
]
