"""Compile time of the engine's step programs against the model's depth and width, from abstract
shapes: no weights are allocated, so an 80-layer 70B-wide target compiles on a laptop.

    python benchmarks/bench_compile.py [--configs llama-3.1-8b,llama-3.1-70b] [--layers 30,40,80]
                                       [--slots 8] [--k 4] [--json FILE]

For each public config (docs/configs) cut to each layer count, in bfloat16 on one device: the
burst program the engine runs for a decode step (the plain step at ``--slots`` slots) and for a
verification step (n-gram drafts, k = ``--k``), each lowered from ``jax.ShapeDtypeStruct``
parameters and state (``jax.jit(...).lower(...)``) and compiled for this machine's backend, with
the seconds of lowering and of compiling apart. XLA's compilation cache is off for the run, so
every number is a cold compile. ``--lower-only``: trace and lower only. ``--modes once,inline``
times each program twice, side by side: with each kind of decoder layer traced once
(``jspec.models.llama.call_layer``, the default) and with every layer traced inline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import common  # noqa: F401  (environment for the benchmarks)

ROOT = Path(__file__).resolve().parents[1]


def abstract_inputs(cfg, slots: int, max_len: int, k: int, drafter=None):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec.engine.layout import slot_tokens
    from jspec.engine.runner import init_decode_state
    from jspec.models.llama import init_params

    page = 16
    buffer_len = slot_tokens(max_len, k, page)
    pages = slots * buffer_len // page + 1
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    state = jax.eval_shape(lambda: init_decode_state(cfg, slots, buffer_len, buffer_len // page, pages, page, k,
                                                     drafter=drafter))
    tables = jax.ShapeDtypeStruct((slots, buffer_len // page), jnp.int32)
    spec_k = jax.ShapeDtypeStruct((slots,), jnp.int32)
    return params, state, tables, spec_k, np.int32(1), np.bool_(False)


def time_step(step, cfg, slots: int, max_len: int, k: int, drafter=None, compile_too: bool = True) -> dict:
    from jspec.engine.runner import run_burst

    params, state, tables, spec_k, limit, stop = abstract_inputs(cfg, slots, max_len, k, drafter)
    t0 = time.perf_counter()
    lowered = run_burst.lower(step, params, None, state, tables, spec_k, None, limit, stop)
    t1 = time.perf_counter()
    if compile_too:
        lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2), "total_s": round(t2 - t0, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="llama-3.1-8b,llama-3.1-70b")
    ap.add_argument("--layers", default="30,40,80")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--lower-only", action="store_true", help="trace and lower, do not compile")
    ap.add_argument("--modes", default="once", help="once, inline or both: how decoder layers are traced")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from jspec.loading import read_config
    from jspec.models import llama
    from jspec.speculative.drafters import NgramDrafter
    from jspec.speculative.steps import PlainStep, SpecStep

    rows = []
    for name in args.configs.split(","):
        base = read_config(str(ROOT / "docs" / "configs" / f"{name}.json"), "bfloat16")
        for n in (int(x) for x in args.layers.split(",")):
            cfg = dataclasses.replace(base, num_layers=n)
            eos = tuple(cfg.eos_token_ids)
            drafter = NgramDrafter(args.k, 3, 1)
            for kind, step, k, d in (("decode", PlainStep(cfg, eos, "reference"), 0, None),
                                     ("verify", SpecStep(cfg, eos, "reference", drafter), args.k, drafter)):
                for mode in args.modes.split(","):
                    llama.TRACE_LAYERS_ONCE = mode == "once"
                    jax.clear_caches()
                    rec = {"config": name, "layers": n, "hidden": cfg.hidden_size, "step": kind,
                           "slots": args.slots, "k": k, "layers_traced": mode,
                           **time_step(step, cfg, args.slots, args.max_model_len, k, d, not args.lower_only)}
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
    result = {"machine": common.machine(), "commit": common.git_rev(), "backend": jax.default_backend(),
              "command": "python benchmarks/bench_compile.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                  if v not in (None, False) and k != "json").replace(" True", ""),
              "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
