"""Bytes each device holds under tensor parallelism (weights, KV cache), on virtual CPU devices.

    python benchmarks/tp_memory.py            # prints a markdown table

Speed on virtual devices means nothing (they share the host's cores); what sharding buys is
memory per device, which this measures from the placed arrays' own shards. Rows: SmolLM2-135M
(9 query / 3 KV heads: tp 1 and 3 fit the heads) and a random Llama-shaped model with 8 query /
2 KV heads (tp 1, 2, and 4, where the KV repeat rule doubles the KV heads).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from jspec.config import EngineConfig, ModelConfig  # noqa: E402
from jspec.engine.engine import LLMEngine  # noqa: E402
from jspec.loading import LoadedModel, load_model  # noqa: E402
from jspec.models.llama import init_params  # noqa: E402

SLOTS, MODEL_LEN = 4, 1024  # the engine's page pool: 4 slots x 1024 tokens


def per_device(tree) -> dict:
    out = {}
    for x in jax.tree_util.tree_leaves(tree):
        for s in x.addressable_shards:
            out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return out


def row(name: str, model: LoadedModel, tp: int) -> str:
    eng = LLMEngine(model, EngineConfig(max_num_seqs=SLOTS, max_model_len=MODEL_LEN, attention="reference",
                                        tensor_parallel_size=tp))
    w = per_device(eng.runner.params)
    c = per_device(eng.runner.state.cache.k_pages + eng.runner.state.cache.v_pages)
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    kvh = eng.model.config.num_kv_heads
    return (f"| {name} | {tp} | {kvh} | {mib(max(w.values()))} | {mib(sum(w.values()))} | "
            f"{mib(max(c.values()))} | {mib(sum(c.values()))} |")


def main() -> None:
    smol = load_model("smollm2-135m")
    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=8,
                      num_kv_heads=2, head_dim=128, max_position_embeddings=2048)
    llama = LoadedModel(cfg, init_params(cfg, jax.random.key(0)), None, Path("random-llama-8q2kv"), "test")
    print("| model | tp | KV heads (after repeat) | weights MiB / device | weights MiB, all devices | "
          "KV cache MiB / device | KV cache MiB, all devices |")
    print("|---|---|---|---|---|---|---|")
    for tp in (1, 3):
        print(row("SmolLM2-135M (9q/3kv, f32)", smol, tp), flush=True)
    for tp in (1, 2, 4):
        print(row("random Llama 8q/2kv, 8 layers, H 1024 (f32)", llama, tp), flush=True)


if __name__ == "__main__":
    main()
