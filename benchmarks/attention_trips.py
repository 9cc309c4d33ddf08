"""What one trip of the xla attention loop costs on the CPU, apart from the model.

    python benchmarks/attention_trips.py [--contexts 100,250,500,1000] [--block-keys 256,512,cpu]
                                         [--profile-context 1000] [--batch 1] [--q-len 1]

Two measurements on SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64,
pages of 16), with random K/V and a random block table:

1. ``jspec.attention.paged_attention_xla`` called for 30 layers in one jitted function (each
   layer's pages its own arrays, each output feeding the next layer's query, as in the model),
   best of 5 x 30 calls, ms per call, for each context and each ``block_keys`` (the same pool
   and table width for every context); ``cpu`` in ``--block-keys`` adds the same call on the C++
   kernel that reads the pages in place (``pallas_kernels.cpu.paged_attention``);
2. the XLA CPU ops of one layer's call at ``--profile-context`` under ``jax.profiler``:
   microseconds per call and per loop trip of each op (the loop's own ``while`` event spans its
   body's ops).

The loop's trip count is ceil(context / block_keys); a trip costs a fixed part and a part in
proportion to its keys (masked or not), which is what the block size trades.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import tempfile
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData

from jspec.attention import BLOCK_KEYS, paged_attention_xla
from pallas_kernels.cpu.paged_attention import paged_attention_cpu

LAYERS, KV_HEADS, HEADS, HEAD_DIM, PAGE = 30, 3, 9, 64, 16


def _inputs(ctx: int, batch: int, q_len: int, pages: int, layers: int, seed: int = 0):
    """Every context gets the same pool and table width (the longest context's), as in an engine."""
    rng = np.random.default_rng(seed)
    shape = (KV_HEADS, pages, PAGE, HEAD_DIM)
    k = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(layers)]
    v = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(layers)]
    q = jnp.asarray(rng.standard_normal((batch, q_len, HEADS, HEAD_DIM)), jnp.float32)
    width = pages - 8
    tables = jnp.asarray(np.stack([rng.permutation(pages)[:width] for _ in range(batch)]), jnp.int32)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    q_lens = jnp.full((batch,), q_len, jnp.int32)
    return q, k, v, tables, kv_lens, q_lens


def time_layers(block_keys, ctx: int, batch: int, q_len: int, pages: int, rounds: int = 5, calls: int = 30) -> float:
    q, k, v, tables, kv_lens, q_lens = _inputs(ctx, batch, q_len, pages, LAYERS)
    attend = (paged_attention_cpu if block_keys == "cpu" else
              functools.partial(paged_attention_xla, block_keys=block_keys))

    @jax.jit
    def layers(q, k, v, tables, kv_lens, q_lens):
        for kl, vl in zip(k, v):
            q = q + attend(q, kl, vl, tables, kv_lens, q_lens)
        return q

    jax.block_until_ready(layers(q, k, v, tables, kv_lens, q_lens))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            out = layers(q, k, v, tables, kv_lens, q_lens)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def profile_layer(block_keys: int, ctx: int, batch: int, q_len: int, pages: int, calls: int = 200):
    q, k, v, tables, kv_lens, q_lens = _inputs(ctx, batch, q_len, pages, 1)
    fn = jax.jit(functools.partial(paged_attention_xla, block_keys=block_keys))
    compiled = fn.lower(q, k[0], v[0], tables, kv_lens, q_lens).compile()
    ops = set(compiled.as_text().replace("%", " ").split())  # HLO instruction names
    jax.block_until_ready(compiled(q, k[0], v[0], tables, kv_lens, q_lens))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(compiled(q, k[0], v[0], tables, kv_lens, q_lens))
        data = ProfileData.from_file(glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0])
    total, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            for e in line.events:
                if e.name in ops:
                    total[e.name] += e.duration_ns
                    count[e.name] += 1
    return [(name, ns / calls / 1e3, count[name] / calls) for name, ns in total.most_common(12)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="100,250,500,1000")
    ap.add_argument("--block-keys", default=f"{BLOCK_KEYS},{2 * BLOCK_KEYS},cpu")
    ap.add_argument("--profile-context", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--q-len", type=int, default=1)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [b if b == "cpu" else int(b) for b in args.block_keys.split(",")]
    pages = -(-max(contexts) // PAGE) + 8  # table width -(-max // PAGE), 8 pages to spare
    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"attention of {LAYERS} layers, batch {args.batch}, q_len {args.q_len}, "
          f"{HEADS} heads / {KV_HEADS} KV heads, head_dim {HEAD_DIM}, pages of {PAGE}; ms per call (best of 5 x 30)\n")
    rows = []
    for bk in sizes:
        row = {"block_keys": str(bk)}
        for c in contexts:
            row[f"{c} tokens"] = f"{time_layers(bk, c, args.batch, args.q_len, pages):.2f}"
        rows.append(row)
    print(common.table(rows, ["block_keys"] + [f"{c} tokens" for c in contexts]))
    for bk in [b for b in sizes if b != "cpu"]:
        trips = -(-args.profile_context // bk)
        print(f"\none layer at {args.profile_context} tokens, block_keys {bk} ({trips} trips): us per call, us per execution, executions per call")
        for name, us, n in profile_layer(bk, args.profile_context, args.batch, args.q_len, pages):
            print(f"  {us:8.1f} {us / n if n else 0:8.1f}  x{n:4.1f}  {name}")


if __name__ == "__main__":
    main()
