"""``--kv-cache-dtype`` and ``--quantized-activations`` (``jspec generate``, ``serve`` and ``bench``):
what the KV pages hold and how the GGUF blocks are multiplied (EngineConfig.kv_cache_dtype,
EngineConfig.quantized_activations). ``bench`` applies them to its jspec methods."""

from __future__ import annotations

from jspec.config import KV_CACHE_DTYPES


def add_numerics_arguments(p) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pages' dtype (vLLM's --kv-cache-dtype): auto = the model's; float16 / bfloat16 "
                        "halve the cache and round K/V, fp8 (= fp8_e4m3) / fp8_e5m2 quarter it (default auto)")
    p.add_argument("--quantized-activations", action="store_true",
                   help="multiply the GGUF blocks as llama.cpp does: activations rounded to int8 a block of 32, "
                        "integer dot products (faster verification; logits move slightly; speculative output "
                        "still equals plain decoding with the same flag)")
