"""The serving engine: requests, the host-side scheduler, bursts of jitted steps, the LLM front door."""

from jspec.engine.engine import LLMEngine
from jspec.engine.generate import GenerationResult, generate
from jspec.engine.request import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["LLMEngine", "GenerationResult", "generate", "CompletionOutput", "RequestMetrics", "RequestOutput"]
