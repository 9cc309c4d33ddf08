"""The CPU attention kernel alone over pages of each dtype (measured 2026-12-05).

    python benchmarks/attention_pages.py [--contexts 100,1000] [--q-lens 1,5]
                                         [--dtypes float32,float16,bfloat16] [--repeats 30]

``pallas_kernels.cpu.paged_attention`` called for 30 layers in one jitted function, on
SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, pages of 16, 70 pages in a
shuffled table), each layer's K and V pages arrays of their own (30 x 2 x 860 KB: read from
beyond L2 every call, as in the model) and each output the next layer's query. Best of
``repeats`` calls, ms per call of 30 layers, every dtype in the same process. Float32 queries; the
pages float32, float16 or bfloat16 (``EngineConfig.kv_cache_dtype``), widened as they are read.
"""

from __future__ import annotations

import argparse
import time

import common
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu.paged_attention import paged_attention_cpu

LAYERS, KV_HEADS, HEADS, PAGES, PAGE, HEAD_DIM = 30, 3, 9, 70, 16, 64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="100,1000")
    ap.add_argument("--q-lens", default="1,5")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(PAGES)[None, :PAGES - 6].astype(np.int32))
    shape = (KV_HEADS, PAGES, PAGE, HEAD_DIM)
    pages = {dt: [[jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dt) for _ in range(LAYERS)]
                  for _ in range(2)] for dt in args.dtypes.split(",")}
    print(f"machine: {common.machine()}, git {common.git_rev()}; 30 layers of paged_attention_cpu, "
          f"best of {args.repeats}, ms")
    rows = []
    for t in (int(x) for x in args.q_lens.split(",")):
        for kv in (int(x) for x in args.contexts.split(",")):
            q = jnp.asarray(rng.standard_normal((1, t, HEADS, HEAD_DIM)).astype(np.float32))
            kv_lens, q_lens = jnp.array([kv], jnp.int32), jnp.array([t], jnp.int32)

            @jax.jit
            def layers(q, ks, vs):
                for k, v in zip(ks, vs):
                    q = paged_attention_cpu(q, k, v, table, kv_lens, q_lens)
                return q

            row = {"q_len": t, "keys": kv}
            for dt, (ks, vs) in pages.items():
                layers(q, ks, vs).block_until_ready()
                best = float("inf")
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    layers(q, ks, vs).block_until_ready()
                    best = min(best, time.perf_counter() - t0)
                row[f"{dt} ms"] = f"{best * 1e3:.2f}"
            rows.append(row)
    print(common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
