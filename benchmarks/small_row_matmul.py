"""Can XLA's CPU backend do a few-row product for what its bytes cost?

    python benchmarks/small_row_matmul.py [--q-lens 1,2,5,9] [--repeats 20]

The product under test is SmolLM2-135M's 30 layers of projections without attention (QKV, O,
gate/up, down: 425 MB of float32 weights) on q rows, q = 1 being a decode step and q = k + 1 a
verification. Memory-bound, every q should cost about what q = 1 costs. Each row of the table
is one way of writing the product or one per-function XLA CPU compiler option (passed through
``jax.jit(compiler_options=...)``, never process-wide); the cells are the best of ``repeats``
calls, in ms, and the step's cost relative to q = 1 of the default.
"""

from __future__ import annotations

import argparse
import time

import common
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.small_rows import pack_rows, small_rows_matmul

D, FF, LAYERS = 576, 1536, 30
SHAPES = {"qkv": (D, 960), "o": (D, D), "gate_up": (D, 2 * FF), "down": (FF, D)}  # (in, out)


def _dot(x, w, how: str):
    if how == "transposed":  # w stored [out, in], contracted on its minor dimension
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))
    if how == "row by row":
        return jnp.concatenate([x[i:i + 1] @ w for i in range(x.shape[0])], 0)
    if how == "kernel, plain":  # w [out, in]: pallas_kernels.cpu.small_rows, one weight row at a time
        return small_rows_matmul(x, w)
    if how == "kernel, packed":  # w packed by pack_rows (what the engine keeps)
        return small_rows_matmul(x, w, w.shape[0] * w.shape[2])
    if how == "multiply-reduce":  # w stored [out, in]: a loop fusion instead of a dot
        return jnp.sum(x[:, None, :] * w[None], axis=-1)
    return x @ w


def _layers(x, weights, how: str):
    for w in weights:
        h = _dot(x, w["qkv"], how)[:, :D]
        x = x + _dot(h, w["o"], how)
        a, b = jnp.split(_dot(x, w["gate_up"], how), 2, axis=-1)
        x = x + _dot(jax.nn.silu(a) * b, w["down"], how)
    return x


VARIANTS = (
    ("jnp.dot, weights [in, out] (jspec today)", "default", {}),
    ("dot_general, weights [out, in]", "transposed", {}),
    ("CPU small-row kernel, weights [out, in]", "kernel, plain", {}),
    ("CPU small-row kernel, weights packed (the engine's copy)", "kernel, packed", {}),
    ("one matrix-vector product per row", "row by row", {}),
    ("multiply + reduce, weights [out, in]", "multiply-reduce", {}),
    ("XNNPACK dot fusion", "default", {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}),
    ("YNNPACK dot fusion", "default", {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}),
    ("oneDNN dot fusion", "default", {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}),
    ("oneDNN custom call", "default", {"xla_cpu_experimental_onednn_custom_call": True}),
    ("Eigen single-threaded", "default", {"xla_cpu_multi_thread_eigen": False}),
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-lens", default="1,2,5,9")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-torch", action="store_true", help="leave out the PyTorch reference row")
    ap.add_argument("--only", default="", help="run only the variants whose name contains one of "
                    "these comma-separated words (the first variant, XLA's default, always runs: it is the base)")
    args = ap.parse_args()
    qs = [int(q) for q in args.q_lens.split(",")]
    rng = np.random.default_rng(0)
    base = [{k: rng.standard_normal(s, dtype=np.float32) * 0.02 for k, s in SHAPES.items()} for _ in range(LAYERS)]
    layouts = {"kernel": [{k: jnp.asarray(v) for k, v in w.items()} for w in base],
               "rows": [{k: jnp.asarray(v.T.copy()) for k, v in w.items()} for w in base]}
    layouts["packed"] = [{k: pack_rows(v) for k, v in w.items()} for w in layouts["rows"]]
    xs = {q: jnp.asarray(rng.standard_normal((q, D), dtype=np.float32)) for q in qs}
    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"30 layers of SmolLM2-135M projections, float32, best of {args.repeats} calls, ms "
          "(in brackets: / the default's q = 1)\n")
    print("| variant | " + " | ".join(f"q = {q}" for q in qs) + " |")
    print("|---|" + "---|" * len(qs))
    ref = None
    words = [w for w in args.only.split(",") if w]
    for i, (name, how, opts) in enumerate(VARIANTS):
        if i and words and not any(w in name for w in words):
            continue
        weights = layouts["packed" if how == "kernel, packed" else
                          "rows" if how in ("transposed", "multiply-reduce", "kernel, plain") else "kernel"]
        fn = jax.jit(lambda x, w, how=how: _layers(x, w, how), compiler_options=opts or None)
        cells = []
        for q in qs:
            for _ in range(3):  # compile, then warm up
                fn(xs[q], weights).block_until_ready()
            best = float("inf")
            for _ in range(args.repeats):
                t = time.perf_counter()
                fn(xs[q], weights).block_until_ready()
                best = min(best, time.perf_counter() - t)
            ms = 1000 * best
            ref = ms if ref is None else ref
            cells.append(f"{ms:.1f} ({ms / ref:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if not args.no_torch:
        print(f"| PyTorch {_torch_row(base, qs, args.repeats, ref)} |")


def _torch_row(base, qs, repeats: int, ref: float) -> str:
    """The same product in PyTorch (oneDNN / MKL sgemm): what this CPU can do, for reference."""
    import torch

    ws = [{k: torch.from_numpy(v) for k, v in w.items()} for w in base]

    def layers(x):
        for w in ws:
            h = (x @ w["qkv"])[:, :D]
            x = x + h @ w["o"]
            a, b = (x @ w["gate_up"]).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(a) * b) @ w["down"]
        return x

    cells = []
    with torch.inference_mode():
        for q in qs:
            x = torch.randn(q, D)
            layers(x)
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                layers(x)
                best = min(best, time.perf_counter() - t)
            cells.append(f"{1000 * best:.1f} ({1000 * best / ref:.2f}x)")
    return f"{torch.__version__} (reference, not jspec) | " + " | ".join(cells)


if __name__ == "__main__":
    main()
