"""Tensor-parallel runs for tests/test_parallel.py, in their own processes (the virtual CPU
devices of ``--xla_force_host_platform_device_count`` must be set before jax starts, and the
rest of the suite keeps one device).

    python tests/parallel_helpers.py engines            tp 2 and 4, every drafter -> JSON on stdout
    python tests/parallel_helpers.py distributed ADDR I  one of two jax.distributed processes, tp 2
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

# 8 query / 2 KV heads: tp 2 shards the KV heads, tp 4 repeats each twice (the KV repeat rule)
CONFIG = dict(num_heads=8, num_kv_heads=2, vocab_size=128, num_layers=1)
DRAFT = dict(num_heads=3, num_kv_heads=1, hidden_size=48, num_layers=1, vocab_size=128)  # tp 2/4: replicated
PROMPTS = [[5, 9, 13, 5, 9, 13, 5, 9, 13, 5], [40, 41, 42, 43, 7, 40, 41, 42, 43, 7, 40, 41]]
MAX_TOKENS = 14
RUNS = {2: ("none", "ngram", "draft", "eagle"), 4: ("none", "self-draft", "eagle")}


def target():
    from helpers import tiny_config, tiny_model

    return tiny_model(tiny_config(**CONFIG), seed=1, scale=4.0)


def qwen3_target():
    """The same heads as :func:`target`, with Qwen3's per-head q/k norms."""
    from helpers import tiny_qwen3

    return tiny_qwen3(seed=1, scale=4.0, **CONFIG)


def published_eagle3_engine(tp: int, speculate: bool = True, eagle1: bool = False):
    """A three-layer target with a published-layout EAGLE-3 head reading all three layers (or
    with ``eagle1`` a published EAGLE-1 head reading the final hidden state)."""
    from helpers import published_eagle3_params, tiny_config, tiny_model
    from jspec.speculative.drafters.eagle import EagleDrafter

    model = tiny_model(tiny_config(**dict(CONFIG, num_layers=3)), seed=2, scale=4.0)
    pair = (EagleDrafter(3, model.config, feature_layers=() if eagle1 else (0, 1, 2)),
            published_eagle3_params(model, eagle1=eagle1))
    return engine(tp, "none", model, pair if speculate else None)


def drafter(method: str, model):
    import jax
    import jax.numpy as jnp

    from helpers import tiny_config, tiny_model
    from jspec.models.eagle import init_eagle_params
    from jspec.models.llama import output_embedding
    from jspec.speculative.drafters import DraftModelDrafter, NgramDrafter
    from jspec.speculative.drafters.eagle import EagleDrafter

    cfg = model.config
    if method == "none":
        return None, None
    if method == "ngram":
        return NgramDrafter(3, 3, 1), None
    if method == "draft":
        d = tiny_model(tiny_config(**DRAFT), seed=5, scale=4.0)
        return DraftModelDrafter(3, d.config), d.params
    if method == "self-draft":  # the target as its own draft: sharded like it, every draft accepted
        return DraftModelDrafter(3, cfg), model.params
    head = init_eagle_params(cfg, jax.random.key(3), model.params)
    return EagleDrafter(3, cfg), {"head": head, "lm_head": output_embedding(model.params, cfg),
                                  "vocab_ids": jnp.arange(cfg.vocab_size, dtype=jnp.int32)}


def engine(tp: int, method: str, model=None, pair=None):
    """An engine with both prompts queued (greedy, reference attention); ``pair``: a (drafter,
    drafter params) to use instead of ``method``'s."""
    from jspec.config import EngineConfig, SamplingParams
    from jspec.engine.engine import LLMEngine

    model = model or target()
    d, dp = pair or drafter(method, model)
    eng = LLMEngine(model, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                                        kv_cache_tokens=192, attention="reference", tensor_parallel_size=tp),
                    drafter=d, drafter_params=dp)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return eng


def finish(eng) -> list[list[int]]:
    while eng.has_unfinished_requests():
        eng.step()
    return [list(eng.requests[str(i)].output_ids) for i in range(len(PROMPTS))]


def _spec_str(s) -> list:
    return [str(a) if a is not None else None for a in s]


def shardings_report(eng) -> dict:
    """Each weight's and page array's sharding next to what the rules say (as strings)."""
    import jax

    from jspec import parallel
    from jspec.cache.paged import PAGE_AXES
    from jspec.models.tensor_parallel import param_axes

    bad = []

    def check(name, x, axes):
        want = parallel.sharding(eng.mesh, axes, x.shape)
        if not x.sharding.is_equivalent_to(want, x.ndim):
            bad.append(f"{name}: {x.sharding.spec} != {want.spec}")

    params = eng.runner.params
    flat_axes = dict((jax.tree_util.keystr(p), a) for p, a in jax.tree_util.tree_flatten_with_path(
        param_axes(params), is_leaf=lambda a: isinstance(a, tuple))[0])
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        check(jax.tree_util.keystr(path), x, flat_axes[jax.tree_util.keystr(path)])
    cache = eng.runner.state.cache
    for i, x in enumerate(cache.k_pages + cache.v_pages):
        check(f"cache page array {i}", x, PAGE_AXES)
    dstate = eng.runner.state.drafter
    draft_pages = [str(x.sharding.spec) for x in getattr(dstate, "k_pages", ())]
    return {"bad": bad, "page_spec": str(cache.k_pages[0].sharding.spec), "draft_page_specs": draft_pages,
            "qkv_spec": str(params["layers_0"]["self_attn"]["qkv_proj"]["kernel"].sharding.spec),
            "num_kv_heads": eng.model.config.num_kv_heads, "page_shape": list(cache.k_pages[0].shape),
            "local_page_shape": list(cache.k_pages[0].addressable_shards[0].data.shape)}


def cache_collectives(eng) -> list[str]:
    """Collectives in the compiled bursts (decode/verification, and with a prefill chunk) whose
    result has a page array's shape (global or per device): a gathered or moved KV cache."""
    import numpy as np

    from jspec.engine.runner import run_burst
    from jspec.models.llama import Segment

    r, s = eng.runner, eng.scheduler
    step = eng._steps[eng.k_max]
    rows, width, _ = eng.prefill_shapes[0]
    prefill = Segment(np.zeros((rows, width), np.int32), np.zeros((rows,), np.int32),
                      np.full((rows,), len(s.slots), np.int32))
    found = []
    for seg in (None, prefill):
        text = run_burst.lower(step, r.params, r.drafter_params, r.state, s.tables(),
                               np.zeros((len(s.slots),), np.int32), seg, np.int32(1), np.bool_(False)).compile().as_text()
        found += collectives_of_shapes(text, page_shapes(eng))
    return found


def page_shapes(eng) -> set[str]:
    x = eng.runner.state.cache.k_pages[0]
    return {",".join(map(str, x.shape)), ",".join(map(str, x.addressable_shards[0].data.shape))}


def collectives_of_shapes(hlo: str, shapes: set[str]) -> list[str]:
    import re

    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*\(?[a-z0-9]+\[([0-9,]*)\][^ ]*\s+(all-gather|all-reduce|all-to-all|collective-permute)", line)
        if m and m.group(1) in shapes:
            out.append(line.strip()[:200])
    return out


def gathered_cache_collectives(eng) -> list[str]:
    """The detector's control: a jitted function that returns a page array replicated."""
    import jax

    from jspec import parallel

    x = eng.runner.state.cache.k_pages[0]
    f = jax.jit(lambda p: p * 2, out_shardings=parallel.replicated(eng.mesh))
    return collectives_of_shapes(f.lower(x).compile().as_text(), page_shapes(eng))


def pallas_in_shard_map(model, tp: int = 2) -> float:
    """Max |logits difference| of one forward with the Pallas kernel (interpret mode) inside
    shard_map at ``tp`` against the reference attention on one device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec import parallel
    from jspec.cache.paged import PAGE_AXES, init_cache
    from jspec.models.llama import forward
    from jspec.models.tensor_parallel import param_axes, tp_config, tp_params

    tables = np.arange(1, 9, dtype=np.int32).reshape(2, 4)
    tokens = np.asarray([p[:8] for p in PROMPTS], np.int32)
    q_lens = np.asarray([8, 6], np.int32)

    def run(cfg, params, attention, mesh=None):
        c = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, 9, 4)
        if mesh is not None:
            c = c.replace(k_pages=tuple(parallel.put(x, mesh, PAGE_AXES) for x in c.k_pages),
                          v_pages=tuple(parallel.put(x, mesh, PAGE_AXES) for x in c.v_pages))
        return jax.jit(lambda p, c: forward(p, cfg, tokens, c, q_lens, attention=attention).logits)(params, c)

    ref = run(model.config, model.params, "reference")
    mesh = parallel.make_mesh(tp)
    cfg = tp_config(model.config, tp)
    params = tp_params(model.params, model.config, cfg)
    out = run(cfg, parallel.put_tree(params, mesh, param_axes(params)), "interpret", mesh)
    live = np.arange(tokens.shape[1])[None, :, None] < q_lens[:, None, None]
    return float(jnp.max(jnp.where(live, jnp.abs(out - ref), 0.0)))


def gemma_target(arch: str = "gemma2"):
    """The same heads as :func:`target` in a Gemma 2 / Gemma 3 decoder: a local layer (the
    window shorter than the prompts) and a global one, caps and (Gemma 3) q/k norms."""
    from helpers import tiny_gemma

    return tiny_gemma(arch, seed=1, scale=4.0, **dict(CONFIG, num_layers=2))


def run_engines() -> dict:
    model = target()
    out = {"pallas_max_diff": pallas_in_shard_map(model)}
    for tp, methods in RUNS.items():
        for method in methods:
            t = time.perf_counter()
            eng = engine(tp, method, model)
            tokens = finish(eng)
            rec = {"tokens": tokens, "accepted": eng.stats.num_accepted_tokens}
            if method != "ngram":
                rec["shardings"] = shardings_report(eng)
            if method == "eagle":
                rec["cache_collectives"] = cache_collectives(eng)
                rec["control_collectives"] = gathered_cache_collectives(eng)
            out[f"{tp}/{method}"] = rec
            print(f"tp {tp} {method}: {time.perf_counter() - t:.1f}s", file=sys.stderr, flush=True)
    out["2/qwen3"] = {"tokens": finish(engine(2, "ngram", qwen3_target()))}
    for arch in ("gemma2", "gemma3_text"):
        out[f"2/{arch}"] = {"tokens": finish(engine(2, "ngram", gemma_target(arch)))}
    out["2/published-eagle3"] = {"tokens": finish(published_eagle3_engine(2))}
    eng = published_eagle3_engine(2, eagle1=True)
    out["2/published-eagle1"] = {"tokens": finish(eng), "accepted": eng.stats.num_accepted_tokens}
    return out


def run_distributed(address: str, process_id: int) -> dict:
    from jspec import parallel

    parallel.initialize_distributed(address, 2, process_id)
    import jax

    eng = engine(2, "none")
    devices = [d.id for d in eng.mesh.devices.flat]
    return {"process": jax.process_index(), "processes": jax.process_count(), "mesh_devices": devices,
            "tokens": finish(eng)}


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "engines":
        result = run_engines()
    else:
        result = run_distributed(sys.argv[2], int(sys.argv[3]))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # jax.distributed's shutdown barrier would wait on the other process
