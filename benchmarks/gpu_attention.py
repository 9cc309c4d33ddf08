"""Paged verification attention on a GPU: parity, then kernel vs XLA reference vs HBM floor.

Run on the GPU machine (one NVIDIA H200, jax 0.11.2, no network), from the repository root:

    python benchmarks/gpu_attention.py                      # ~3-4 minutes, bf16
    python benchmarks/gpu_attention.py --out benchmarks/gpu_attention_h200.md

CPU smoke test of the script itself (Pallas interpret mode, tiny shapes, timings meaningless):

    python benchmarks/gpu_attention.py --interpret --quick

What is measured, per shape (B sequences of `ctx` keys, T query rows each, bf16):
    kernel us     the Pallas Triton kernel (pallas_kernels.paged_verify_attention), default tiles
                  from the tuning table entry of this device
    reference us  paged_verify_attention_reference under jit (XLA: gather the pages, einsum,
                  masked softmax, einsum)
    floor us      bytes that must move (K and V of the pages in use, q, the output) divided by
                  the copy bandwidth measured here with a large jnp array negation
    % of bw       floor / kernel
    speedup       reference / kernel
Each time is the per-iteration time of `iters` calls chained inside one jitted fori_loop (a
data dependency through the block table and kv_lens stops XLA from hoisting any of the work),
best of 3 runs, so host dispatch is not counted; the loop's own per-iteration cost is printed
separately.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels import tuning  # noqa: E402
from pallas_kernels.paged_verify_attention import (  # noqa: E402
    paged_verify_attention,
    paged_verify_attention_reference,
)


@dataclasses.dataclass(frozen=True)
class Heads:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


SMOLLM2 = Heads("smollm2", 9, 3, 64)  # SmolLM2-135M: 9 query / 3 KV heads, head_dim 64
LLAMA8B = Heads("llama8b", 32, 8, 128)  # Llama-3-8B: 32 query / 8 KV heads, head_dim 128
PAGE_SIZE = 16


def make_cache(key, heads: Heads, batch: int, t: int, ctx: int, dtype, poison: bool = False):
    """Random q and pages; each sequence owns ceil(ctx / PAGE_SIZE) pages scattered in the pool."""
    pages_per_seq = -(-ctx // PAGE_SIZE)
    num_pages = batch * pages_per_seq + 1  # + one page nobody owns
    kq, kk, kv, kp = jax.random.split(key, 4)
    shape = (heads.kv_heads, num_pages, PAGE_SIZE, heads.head_dim)
    q = jax.random.normal(kq, (batch, t, heads.q_heads, heads.head_dim), dtype)
    k = jax.random.normal(kk, shape, dtype)
    v = jax.random.normal(kv, shape, dtype)
    table = jax.random.permutation(kp, num_pages - 1)[: batch * pages_per_seq]
    table = table.reshape(batch, pages_per_seq).astype(jnp.int32)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    q_lens = jnp.full((batch,), t, jnp.int32)
    return q, k, v, table, kv_lens, q_lens


def poison(k, v, table, kv_lens):
    """NaN in every cache slot past kv_len and in unowned pages (what the kernel must not read)."""
    page_size = k.shape[2]
    owned = np.zeros(k.shape[1:3], bool)
    for row, n in zip(np.asarray(table), np.asarray(kv_lens)):
        for j, page in enumerate(row[: -(-n // page_size)]):
            owned[page, : min(page_size, n - j * page_size)] = True
    mask = jnp.asarray(owned)[None, :, :, None]
    return jnp.where(mask, k, jnp.nan), jnp.where(mask, v, jnp.nan)


def parity(interpret: bool, quick: bool) -> bool:
    """Kernel against the reference on a few ragged, poisoned shapes; True if all agree."""
    print("## Parity with the reference\n")
    print("| shape | dtype | max abs err | tolerance | ok |")
    print("|---|---|---|---|---|")
    key = jax.random.PRNGKey(0)
    shapes = [(SMOLLM2, 3, 5, 77), (LLAMA8B, 2, 9, 300)] if quick else [
        (SMOLLM2, 4, 1, 1000), (SMOLLM2, 3, 5, 2049), (LLAMA8B, 2, 9, 4100), (LLAMA8B, 8, 16, 515)]
    ok_all = True
    for heads, batch, t, ctx in shapes:
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
            q, k, v, table, _, _ = make_cache(key, heads, batch, t, ctx, dtype)
            kv_lens = jnp.asarray(np.linspace(t, ctx, batch).astype(np.int32))  # ragged
            q_lens = jnp.asarray(np.arange(batch) % (t + 1), jnp.int32)  # ragged, includes 0
            bad_k, bad_v = poison(k, v, table, kv_lens)
            clean_k, clean_v = jnp.nan_to_num(bad_k, nan=0.0), jnp.nan_to_num(bad_v, nan=0.0)
            out = paged_verify_attention(q, bad_k, bad_v, table, kv_lens, q_lens, interpret=interpret)
            ref = jax.jit(paged_verify_attention_reference)(q, clean_k, clean_v, table, kv_lens, q_lens)
            out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
            err = float(np.max(np.abs(out - ref))) if np.isfinite(out).all() else float("nan")
            ok = bool(np.isfinite(out).all() and np.allclose(out, ref, atol=tol, rtol=tol))
            ok_all &= ok
            print(f"| {heads.name} B={batch} T={t} ctx<={ctx} | {jnp.dtype(dtype).name} | "
                  f"{err:.2e} | {tol:g} | {'yes' if ok else '**NO**'} |")
    print()
    return ok_all


def measure_bandwidth(quick: bool) -> float:
    """Device copy bandwidth in bytes/s: a large array negation reads and writes every byte."""
    n = (1 << 22) if quick else (1 << 31)  # 4 GiB of bf16 on the GPU
    x = jnp.ones((n,), jnp.bfloat16)
    neg = jax.jit(lambda a: -a)
    neg(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        neg(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    del x
    return 2 * n * 2 / best


def chained(fn, iters: int):
    """jit(loop of `iters` calls of fn), each call depending on the previous one's output."""

    def loop(q, k, v, table, kv_lens, q_lens):
        def body(_, carry):
            table, lens = carry
            out = fn(q, k, v, table, lens, q_lens)
            x = out[0, 0, 0, 0].astype(jnp.float32)
            bump = (x != x).astype(jnp.int32)  # 0 unless NaN: a dependency XLA cannot drop
            # Both the table and the lengths change (by 0) every step, so neither the kernel
            # nor the reference's page gather can be hoisted out of the loop.
            return table + bump, lens + bump

        return lax.fori_loop(0, iters, body, (table, kv_lens))[1]

    return jax.jit(loop)


def time_us(fn, args, iters: int) -> float:
    f = chained(fn, iters)
    f(*args).block_until_ready()  # compile + warm up
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def loop_overhead_us(iters: int = 200) -> float:
    """Per-iteration cost of the chained loop around a trivial body (one tiny fusion)."""
    q = jnp.zeros((1, 1, 1, 8), jnp.float32)
    lens = jnp.zeros((8,), jnp.int32)
    return time_us(lambda q, k, v, t, lens, ql: q + lens[0], (q, q, q, q, lens, lens), iters)


def floor_bytes(heads: Heads, batch: int, t: int, ctx: int, itemsize: int) -> int:
    pages = -(-ctx // PAGE_SIZE)
    kv = 2 * batch * heads.kv_heads * pages * PAGE_SIZE * heads.head_dim * itemsize
    q_and_out = 2 * batch * t * heads.q_heads * heads.head_dim * itemsize
    return kv + q_and_out


def grid(quick: bool):
    if quick:
        return [(SMOLLM2, 2, 1, 64), (LLAMA8B, 1, 5, 96)]
    shapes = []
    for heads in (SMOLLM2, LLAMA8B):
        for batch, ctx in ((1, 1024), (1, 32768), (16, 4096), (64, 8192)):
            for t in (1, 5, 9):
                shapes.append((heads, batch, t, ctx))
    return shapes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="stop starting new timing shapes after this many seconds")
    ap.add_argument("--out", type=pathlib.Path, help="also write the timing table here")
    args = ap.parse_args()
    start = time.perf_counter()

    dev = jax.devices()[0]
    entry = tuning.current()
    print(f"# Paged verification attention, {dev.device_kind} ({dev.platform})\n")
    print(f"jax {jax.__version__}, python {sys.version.split()[0]}, tuning entry `{entry.name}`"
          f" (num_warps={entry.num_warps}, num_stages={entry.num_stages}, "
          f"block_k={entry.block_k}), page_size={PAGE_SIZE}"
          + (", **interpret mode: times are meaningless**" if args.interpret else "") + "\n")

    ok = parity(args.interpret, args.quick)

    bw = measure_bandwidth(args.quick)
    overhead = loop_overhead_us()
    print(f"Measured copy bandwidth: {bw / 1e9:.0f} GB/s. Loop overhead per iteration "
          f"(included in every time below): {overhead:.1f} us.\n")

    kernel = lambda *a: paged_verify_attention(*a, interpret=args.interpret)  # noqa: E731
    reference = paged_verify_attention_reference
    lines = ["| heads | B | T | ctx | kernel us | reference us | floor us | % of bw | speedup |",
             "|---|---|---|---|---|---|---|---|---|"]
    print("## Timing (bf16)\n")
    print("\n".join(lines))
    key = jax.random.PRNGKey(1)
    for heads, batch, t, ctx in grid(args.quick):
        if time.perf_counter() - start > args.budget_s:
            lines.append(f"| {heads.name} | {batch} | {t} | {ctx} | skipped: time budget | | | | |")
            print(lines[-1])
            continue
        inputs = make_cache(key, heads, batch, t, ctx, jnp.bfloat16)
        floor = floor_bytes(heads, batch, t, ctx, 2) / bw * 1e6
        iters = 3 if args.interpret else int(np.clip(20_000 / max(floor, 10.0), 10, 200))
        try:
            k_us = time_us(kernel, inputs, iters)
            k_txt = f"{k_us:.1f}"
        except Exception as e:  # report, keep going: one bad shape should not lose the run
            k_us, k_txt = float("nan"), f"error: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
        try:
            r_us = time_us(reference, inputs, iters)
            r_txt = f"{r_us:.1f}"
        except Exception as e:
            r_us, r_txt = float("nan"), f"error: {type(e).__name__}"
        del inputs
        lines.append(f"| {heads.name} | {batch} | {t} | {ctx} | {k_txt} | {r_txt} | {floor:.1f} | "
                     f"{100 * floor / k_us:.0f}% | {r_us / k_us:.2f}x |")
        print(lines[-1], flush=True)

    print(f"\nparity: {'ok' if ok else 'FAILED'}; wall time {time.perf_counter() - start:.0f} s")
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
