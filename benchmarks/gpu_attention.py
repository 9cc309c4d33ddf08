"""Paged verification attention on a GPU: parity, then kernel vs XLA reference vs HBM roofline.

Made for ONE unattended run of <= 10 minutes on the GPU machine (one NVIDIA H200, jax 0.11.2,
Python 3.12, no network), from the repository root:

    python benchmarks/gpu_attention.py                  # results under $OUT (else ./out)
    python benchmarks/gpu_attention.py --out DIR --budget-s 500

CPU smoke test of the script itself (Pallas interpret mode, tiny shapes, times meaningless;
tests/pallas_kernels runs it):

    python benchmarks/gpu_attention.py --smoke --out /tmp/smoke

The run is split into sections, each in its own child process (a CUDA fault or a hang in one
section cannot take the others down; the parent notes how it ended and goes on), and every case
inside a section is isolated too (an exception is recorded and the next case runs). Each result
is appended and flushed as it comes to DIR/gpu_attention.md (tables) and DIR/gpu_attention.jsonl
(one JSON record a line), so a run cut short keeps everything measured so far. Sections, in
order, each starting only while the time budget lasts:

    parity   kernel vs reference on NaN-poisoned caches: block tables 2x wider than the context
             with garbage ids (-1, 2^30, other sequences' and unowned pages) past the live
             pages, q_len = 0 rows, T = 17 at G = 8, one split and many, f32 and bf16
    llama    Llama-8B heads (Hq 32, KVH 8, D 128, page 16, bf16): B x context x T in {1, 5}
    sweep    num_splits / block_k / num_stages / num_warps around the tuned plan, two shapes
    extra    T = 17 at G = 8 (Hq 64, KVH 8), then SmolLM2-135M heads (9 / 3, D 64)
    trees    token-tree verification (a random tree's ancestor mask): parity at T = 17 and 32,
             then Llama-8B heads at T = 1 (a decode step), 17 and 32 (16- and 31-node trees)
    local    Gemma's local layers (Gemma-3-27B heads: Hq 32, KVH 16, D 128, window 1,024, score
             scale 168^-0.5): parity with the reference, then T = 1 and 5 at 32k context, a local
             layer against a global one (the ratio: what the window saves)

Per timed shape: the plan (block_q, block_k, splits, live programs per SM, warps, stages);
kernel us (the Pallas kernel alone, from the profiler's device trace); device us (every device
op of one call: kernel + split merge); e2e us (host wall time per call of the jitted function,
calls queued back to back); % of HBM read bandwidth (bytes that must be read -- live K/V, q --
plus the output written, over kernel us, against the H200's 4.8 TB/s); the XLA reference's e2e
us and the speedup; and, after each T = 5 row, the T = 5 / T = 1 ratio. L2 is defeated by
rotating each call through enough copies of the KV cache to exceed 2x the 50 MB L2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import json
import math
import os
import pathlib
import platform
import subprocess
from typing import Optional
import sys
import tempfile
import time
import traceback
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import tuning  # noqa: E402
from pallas_kernels.paged_verify_attention import (  # noqa: E402
    paged_verify_attention,
    paged_verify_attention_reference,
    plan_for,
)

HBM_READ_BPS = 4.8e12  # H200 HBM3e
L2_BYTES = 50 * 2**20  # H200 L2
PAGE_SIZE = 16
SECTIONS = ("parity", "llama", "sweep", "extra", "trees", "local")


@dataclasses.dataclass(frozen=True)
class Heads:
    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


LLAMA8B = Heads("llama8b", 32, 8, 128)  # Llama-3-8B
LLAMA70B = Heads("llama70b", 64, 8, 128)  # Llama-3-70B: G = 8
SMOLLM2 = Heads("smollm2", 9, 3, 64)  # SmolLM2-135M
TINY = Heads("tiny", 4, 2, 32)  # smoke mode
GEMMA27B = Heads("gemma3-27b", 32, 16, 128)  # Gemma-3-27B (query_pre_attn_scalar 168)


# ------------------------------------------------------------------------------ output


class Report:
    """Appends markdown lines and JSON records to DIR, flushed as they come."""

    def __init__(self, out_dir: pathlib.Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.md_path = out_dir / "gpu_attention.md"
        self.jsonl_path = out_dir / "gpu_attention.jsonl"

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        with open(self.md_path, "a") as f:
            f.write(text + "\n")
            f.flush()

    def record(self, kind: str, **fields) -> None:
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps({"kind": kind, "time": time.time(), **fields}, default=str) + "\n")
            f.flush()

    def error(self, what: str, exc: BaseException) -> None:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        msg = f"{type(exc).__name__}: {first}"
        self.line(f"| {what} | **error** {msg} |")
        self.record("error", case=what, error=msg, traceback=traceback.format_exc()[-4000:])


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version(), "jax": jax.__version__}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith(("jax", "triton", "nvidia-cuda", "pytorch-triton")) and name != "jax":
            out[name] = dist.version
    try:
        import triton  # a standalone Triton, if any; jaxlib bundles its own

        out["triton (python package)"] = triton.__version__
    except ImportError:
        pass
    dev = jax.devices()[0]
    out["device"] = f"{dev.platform} {dev.device_kind}"
    out["tuning entry"] = tuning.current().name
    return out


# ------------------------------------------------------------------------------ inputs


def make_cache(key, heads: Heads, batch: int, t: int, ctx: int, dtype, copies: int = 1,
               width: float = 1.25):
    """Random q and `copies` copies of the K/V pages; each sequence owns ceil(ctx / 16) pages
    scattered over the pool; the block table is `width` x wider than that (spare slots: 0)."""
    pages = -(-ctx // PAGE_SIZE)
    num_pages = batch * pages + 1
    kq, kk, kv, kp = jax.random.split(key, 4)
    shape = (heads.kv_heads, num_pages, PAGE_SIZE, heads.head_dim)
    q = jax.random.normal(kq, (batch, t, heads.q_heads, heads.head_dim), dtype)
    ks = [jax.random.normal(jax.random.fold_in(kk, i), shape, dtype) for i in range(copies)]
    vs = [jax.random.normal(jax.random.fold_in(kv, i), shape, dtype) for i in range(copies)]
    perm = jax.random.permutation(kp, num_pages - 1)[: batch * pages].astype(jnp.int32)
    table = jnp.zeros((batch, math.ceil(pages * width)), jnp.int32)
    table = table.at[:, :pages].set(perm.reshape(batch, pages))
    lens = (jnp.full((batch,), ctx, jnp.int32), jnp.full((batch,), t, jnp.int32))
    return [(q, k, v, table, *lens) for k, v in zip(ks, vs)]


def report_parity(rep, section: str, what: str, out: np.ndarray, ref: np.ndarray, tol: float) -> None:
    """One parity row: the kernel's output against the reference's, within ``tol``."""
    finite = bool(np.isfinite(out).all())
    err = float(np.max(np.abs(out - ref))) if finite else float("nan")
    ok = finite and bool(np.allclose(out, ref, atol=tol, rtol=tol))
    rep.line(f"| {what} | {err:.2e} | {tol:g} | {'yes' if ok else '**NO**'} |")
    rep.record(section, case=what, max_abs_err=err, ok=ok)


def poisoned_case(rng, heads: Heads, kv_lens, q_lens, t: int, dtype, width: float = 2.0):
    """(kernel args, reference args): NaN in unowned pages and past kv_len; garbage table ids
    (-1, 2^30, unowned and other sequences' pages) past the live pages; clean copies for the
    reference."""
    kv_lens = np.asarray(kv_lens, np.int32)
    need = -(-kv_lens // PAGE_SIZE)
    num_pages = int(need.sum()) + 3
    max_pages = max(1, math.ceil(int(need.max()) * width))
    shape = (heads.kv_heads, num_pages, PAGE_SIZE, heads.head_dim)
    q = rng.standard_normal((len(kv_lens), t, heads.q_heads, heads.head_dim)).astype(np.float32)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    perm = rng.permutation(num_pages)
    garbage = np.select([rng.random((len(kv_lens), max_pages)) < p for p in (0.25, 0.5)],
                        [-1, 1 << 30], rng.integers(0, num_pages, (len(kv_lens), max_pages)))
    table = garbage.astype(np.int32)
    clean_table = np.zeros_like(table)
    owned = np.zeros((num_pages, PAGE_SIZE), bool)
    start = 0
    for i, n in enumerate(need):
        ids = perm[start:start + n]
        start += n
        table[i, :n] = clean_table[i, :n] = ids
        for j, page in enumerate(ids):
            owned[page, : min(PAGE_SIZE, kv_lens[i] - j * PAGE_SIZE)] = True
    mask = owned[None, :, :, None]
    as_dt = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    common = (jnp.asarray(kv_lens), jnp.asarray(q_lens, jnp.int32))
    kernel_args = (as_dt(q), as_dt(np.where(mask, k, np.nan)), as_dt(np.where(mask, v, np.nan)),
                   jnp.asarray(table), *common)
    ref_args = (as_dt(q), as_dt(np.where(mask, k, 0)), as_dt(np.where(mask, v, 0)),
                jnp.asarray(clean_table), *common)
    return kernel_args, ref_args


# ------------------------------------------------------------------------------ timing


def wall_us(fn, arg_sets, iters: int, repeats: int = 3) -> float:
    """Host wall time per call, calls queued back to back, rotating through arg_sets."""
    jax.block_until_ready(fn(*arg_sets[0]))  # compile, warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        best = min(best, time.perf_counter() - t0)
    return best / iters * 1e6


def device_events(trace_dir: str) -> dict[str, list[float]]:
    """{event name: [durations in us]} of the kernels on the GPU stream lines of a trace."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return {}
    events, fallback = defaultdict(list), defaultdict(list)
    for plane in ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            name = line.name.lower()
            if name.startswith("xla"):  # per-module / per-op summaries: would double count
                continue
            target = events if "stream" in name else fallback
            for ev in line.events:
                target[ev.name].append(ev.duration_ns / 1e3)
    return dict(events or fallback)


def profile(runs) -> dict[str, list[float]]:
    """Run each (fn, arg_sets, iters) of `runs` (already compiled) inside one profiler trace."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        try:
            for fn, arg_sets, iters in runs:
                for i in range(iters):
                    out = fn(*arg_sets[i % len(arg_sets)])
                jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        return device_events(d)


def kernel_fn(interpret: bool, **tiles):
    return jax.jit(functools.partial(paged_verify_attention, interpret=interpret, **tiles))


def random_tree_mask(batch: int, t: int, seed: int) -> jax.Array:
    """int32 [batch, t]: the attention contract's tree_mask of a random tree of t - 1 nodes per
    sequence (row 0 the root; bit j of row r: r sees row j, its ancestors and itself)."""
    rng = np.random.default_rng(seed)
    bits = np.ones((batch, t), np.int64)
    for i in range(1, t):  # row i's parent: the root or an earlier row
        parent = rng.integers(0, i, batch)
        bits[:, i] = bits[np.arange(batch), parent] | (1 << i)
    return jnp.asarray(bits.astype(np.uint32).view(np.int32))


def kernel_name(plan: tuning.TilePlan) -> str:
    return (f"_bq{plan.block_q}_bk{plan.block_k}_s{plan.num_splits}_w{plan.num_warps}"
            f"_st{plan.num_stages}")


class Ctx:
    """What a section needs: options, report, deadline."""

    def __init__(self, args):
        self.args = args
        self.smoke = args.smoke
        self.interpret = args.smoke
        self.report = Report(args.out)
        self.deadline = args.deadline
        self.l2 = 64 * 1024 if args.smoke else L2_BYTES
        self.num_cores = tuning.current().num_cores
        self.events_noted = False

    def time_left(self) -> bool:
        return time.time() < self.deadline

    def skip(self, what: str) -> bool:
        if self.time_left():
            return False
        self.report.line(f"| {what} | skipped: time budget |")
        self.report.record("skipped", case=what)
        return True


# ------------------------------------------------------------------------------ sections


def section_parity(cx: Ctx) -> None:
    rep = cx.report
    rep.line("\n## Parity with the reference (NaN-poisoned caches, garbage table slots)\n")
    rep.line("| case | dtype | splits | max abs err | tolerance | ok |")
    rep.line("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    if cx.smoke:
        cases = [(TINY, (5, 40, 0), (5, 2, 0), 5, None), (TINY, (17, 33), (17, 9), 17, 1)]
    else:
        cases = [
            (LLAMA8B, (5, 700, 4100), (5, 0, 3), 5, None),  # ragged, q_len 0, split-k
            (LLAMA8B, (5, 700, 4100), (5, 0, 3), 5, 1),  # same, one split
            (LLAMA8B, (1, 33, 2049, 0), (1, 1, 1, 0), 1, 7),  # decode, kv_len 0, many splits
            (LLAMA70B, (17, 300), (17, 9), 17, None),  # T = 17 at G = 8: one 256-row block
            (SMOLLM2, (9, 515, 64), (9, 4, 9), 9, None),
        ]
    for heads, kv_lens, q_lens, t, splits in cases:
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
            what = (f"{heads.name} kv={kv_lens} q={q_lens} | {jnp.dtype(dtype).name} | "
                    f"{splits or 'auto'}")
            if cx.skip(what):
                continue
            try:
                kargs, rargs = poisoned_case(rng, heads, kv_lens, q_lens, t, dtype)
                tiles = {} if splits is None else dict(num_splits=splits)
                out = np.asarray(kernel_fn(cx.interpret, **tiles)(*kargs), np.float32)
                ref = np.asarray(jax.jit(paged_verify_attention_reference)(*rargs), np.float32)
                report_parity(rep, "parity", what, out, ref, tol)
            except Exception as e:  # noqa: BLE001 -- report, keep going
                rep.error(what, e)


TIMING_HEADER = ("| heads | B | T | ctx | block_q | block_k | splits | prog/SM | warps | stages | "
                 "kernel us | device us | e2e us | % HBM | reference us | speedup |")
TIMING_RULE = "|" + "---|" * (TIMING_HEADER.count("|") - 1)


def time_shape(cx: Ctx, heads: Heads, batch: int, t: int, ctx: int, t1_kernel: dict, tree: bool = False,
               options: Optional[dict] = None) -> None:
    """One timed shape (``options``: the kernel's layer options, such as a local layer's window;
    its T = 1 row, ``t1_kernel``, is the same layer's)."""
    rep = cx.report
    layer = f" window {options['sliding_window']}" if options and options.get("sliding_window") else ""
    label = f"{' tree' if tree else ''}{layer}"
    what = f"{heads.name} | {batch} | {t}{label} | {ctx}"
    if cx.skip(what):
        return
    try:
        dtype = jnp.bfloat16
        itemsize = 2
        kv_bytes = 2 * heads.kv_heads * batch * ctx * heads.head_dim * itemsize
        pool_bytes = 2 * heads.kv_heads * (batch * -(-ctx // PAGE_SIZE) + 1) * PAGE_SIZE \
            * heads.head_dim * itemsize
        copies = max(1, math.ceil(2.2 * cx.l2 / pool_bytes))  # > 2x L2 in flight
        sets = make_cache(jax.random.PRNGKey(batch * 131 + t * 7 + ctx), heads, batch, t, ctx,
                          dtype, copies)
        q, k, _, table, kv_lens, q_lens = sets[0]
        plan = plan_for(q, k, table)
        per_sm = plan.live_programs(kv_lens, q_lens) / cx.num_cores
        io_bytes = kv_bytes + 2 * q.size * itemsize
        iters = 2 if cx.smoke else int(np.clip(0.1 / (io_bytes / 3e12 + 5e-6), 5, 200))

        kern = kernel_fn(cx.interpret, **(options or {}))
        if tree:  # the same call with a random tree's mask
            mask = random_tree_mask(batch, t, batch * 31 + t)
            kern = jax.jit(functools.partial(paged_verify_attention, interpret=cx.interpret, tree_mask=mask))
        e2e = wall_us(kern, sets, iters)
        kernel_us = device_us = float("nan")
        events = {}
        if not cx.smoke or not cx.events_noted:  # smoke: once, to exercise the profiler path
            try:  # no profiler (CUPTI) must not cost the other columns
                events = profile([(kern, sets, iters)])
            except Exception as e:  # noqa: BLE001
                rep.error(f"{what} profile", e)
            mine = [d for n, ds in events.items() if "paged_verify_attention" in n for d in ds]
            if mine:
                kernel_us = float(np.median(mine))
            if events:
                device_us = sum(sum(ds) for ds in events.values()) / iters
            if not cx.events_noted:  # once: what the trace held, to check what was timed
                cx.events_noted = True
                top = sorted(events.items(), key=lambda kv: -sum(kv[1]))[:6]
                rep.record("trace_events", case=what,
                           events={n: (len(d), float(np.median(d))) for n, d in top})
        try:  # the reference materialises the gathered pages and scores: it may not fit
            ref = wall_us(jax.jit(functools.partial(paged_verify_attention_reference, **(options or {}))), sets,
                          iters)
        except Exception as e:  # noqa: BLE001
            ref = float("nan")
            rep.error(f"{what} reference", e)
        pct = 100 * io_bytes / (kernel_us * 1e-6) / HBM_READ_BPS  # nan without a trace
        row = (f"| {heads.name} | {batch} | {t}{label} | {ctx} | {plan.block_q} | {plan.block_k} | "
               f"{plan.num_splits} | {per_sm:.2f} | {plan.num_warps} | {plan.num_stages} | "
               f"{kernel_us:.1f} | {device_us:.1f} | {e2e:.1f} | {pct:.0f}% | {ref:.1f} | "
               f"{ref / e2e:.2f}x |")
        rep.line(row)
        rep.record("timing", heads=heads.name, batch=batch, t=t, tree=tree, options=options or {}, ctx=ctx,
                   copies=copies,
                   plan=dataclasses.asdict(plan), programs_per_sm=per_sm, kernel_us=kernel_us,
                   device_us=device_us, e2e_us=e2e, hbm_pct=pct, reference_us=ref,
                   bytes=io_bytes, iters=iters, interpret=cx.interpret)
        key = (heads.name, batch, ctx, layer)  # a tree's T = 1 row is the same layer's decode step
        if t == 1:
            t1_kernel[key] = (kernel_us, e2e)
        elif key in t1_kernel:
            k1, e1 = t1_kernel[key]
            rep.line(f"| {heads.name} | {batch} | T={t}{label} / T=1 | {ctx} | "
                     f"kernel {kernel_us / k1:.2f}x, e2e {e2e / e1:.2f}x |")
            rep.record("t_ratio", heads=heads.name, batch=batch, t=t, tree=tree, ctx=ctx,
                       kernel_ratio=kernel_us / k1, e2e_ratio=e2e / e1)
        del sets
    except Exception as e:  # noqa: BLE001 -- report, keep going
        rep.error(what, e)


def section_llama(cx: Ctx) -> None:
    rep = cx.report
    rep.line(f"\n## Timing, {'tiny' if cx.smoke else 'Llama-8B'} heads, bf16, page 16\n")
    rep.line(TIMING_HEADER)
    rep.line(TIMING_RULE)
    heads = TINY if cx.smoke else LLAMA8B
    shapes = [(2, 70)] if cx.smoke else [
        (1, 4096), (64, 4096), (1, 32768), (64, 32768), (16, 8192)]
    t1: dict = {}
    for batch, ctx in shapes:
        for t in (1, 5):
            time_shape(cx, heads, batch, t, ctx, t1)


def section_sweep(cx: Ctx) -> None:
    rep = cx.report
    heads = TINY if cx.smoke else LLAMA8B
    shapes = [(1, 70, 5)] if cx.smoke else [(1, 4096, 5), (64, 4096, 5)]
    for batch, ctx, t in shapes:
        rep.line(f"\n## Sweep, {heads.name} B={batch} T={t} ctx={ctx} (one knob at a time)\n")
        rep.line("| tiles | plan | kernel us | e2e us | % HBM |")
        rep.line("|---|---|---|---|---|")
        if cx.skip(f"sweep {heads.name} B={batch}"):
            continue
        try:
            pool_bytes = 2 * heads.kv_heads * (batch * -(-ctx // PAGE_SIZE) + 1) * PAGE_SIZE \
                * heads.head_dim * 2
            sets = make_cache(jax.random.PRNGKey(7), heads, batch, t, ctx, jnp.bfloat16,
                              max(1, math.ceil(2.2 * cx.l2 / pool_bytes)))
            q, k, _, table, kv_lens, q_lens = sets[0]
            io_bytes = 2 * heads.kv_heads * batch * ctx * heads.head_dim * 2 + 2 * q.size * 2
        except Exception as e:  # noqa: BLE001
            rep.error(f"sweep {heads.name} B={batch}", e)
            continue
        variants = [{}]
        knobs = ({"num_splits": [1, 4]} if cx.smoke else {
            "num_splits": [1, 8, 16, 32, 64] if batch == 1 else [2, 4],
            "block_k": [16, 32, 128], "num_stages": [1, 2, 4], "num_warps": [2, 8]})
        variants += [{name: v} for name, values in knobs.items() for v in values]
        iters = 2 if cx.smoke else int(np.clip(0.05 / (io_bytes / 3e12 + 5e-6), 5, 100))
        compiled, seen = [], set()
        for tiles in variants:
            what = ", ".join(f"{n}={v}" for n, v in tiles.items()) or "tuned plan"
            if cx.skip(what):
                break
            try:
                plan = plan_for(q, k, table, **tiles)
                if plan in seen:
                    continue
                seen.add(plan)
                fn = kernel_fn(cx.interpret, **tiles)
                e2e = wall_us(fn, sets, iters)
                compiled.append((what, plan, fn, e2e))
            except Exception as e:  # noqa: BLE001 -- a config that does not compile: next
                rep.error(what, e)
        events = {}
        if compiled:
            try:  # one trace for all variants: kernel names carry the tiles
                events = profile([(fn, sets, iters) for _, _, fn, _ in compiled])
            except Exception as e:  # noqa: BLE001
                rep.error("sweep profile", e)
        for what, plan, _, e2e in compiled:
            mine = [d for n, ds in events.items() if n.endswith(kernel_name(plan)) for d in ds]
            kus = float(np.median(mine)) if mine else float("nan")
            pct = 100 * io_bytes / (kus * 1e-6) / HBM_READ_BPS if mine else float("nan")
            desc = (f"bq{plan.block_q} bk{plan.block_k} s{plan.num_splits} w{plan.num_warps} "
                    f"st{plan.num_stages}")
            rep.line(f"| {what} | {desc} | {kus:.1f} | {e2e:.1f} | {pct:.0f}% |")
            rep.record("sweep", heads=heads.name, batch=batch, t=t, ctx=ctx, tiles=what,
                       plan=dataclasses.asdict(plan), kernel_us=kus, e2e_us=e2e, hbm_pct=pct)
        del sets


def section_extra(cx: Ctx) -> None:
    rep = cx.report
    rep.line("\n## Timing, T = 17 at G = 8, then SmolLM2-135M heads\n")
    rep.line(TIMING_HEADER)
    rep.line(TIMING_RULE)
    t1: dict = {}
    if cx.smoke:
        time_shape(cx, TINY, 1, 17, 40, t1)
        return
    for batch, ctx in ((1, 4096), (16, 4096)):
        time_shape(cx, LLAMA70B, batch, 17, ctx, t1)
    for batch, ctx in ((1, 4096), (64, 4096)):
        for t in (1, 5):
            time_shape(cx, SMOLLM2, batch, t, ctx, t1)


def option_parity(cx: Ctx, section: str, label: str, heads: Heads, rng, cases, options_of) -> None:
    """Parity rows of the kernel with the contract's options (``options_of(kv_lens, t)``: a tree
    mask, a window) against the reference with the same options, on poisoned caches, for each
    (kv_lens, q_lens, T) of ``cases`` in float32 and bfloat16."""
    for kv_lens, q_lens, t in cases:
        for dtype, tol in ((jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)):
            what = f"{label} kv={kv_lens} q={q_lens} | {jnp.dtype(dtype).name}"
            if cx.skip(what):
                continue
            try:
                kargs, rargs = poisoned_case(rng, heads, kv_lens, q_lens, t, dtype)
                options = options_of(kv_lens, t)
                out = np.asarray(kernel_fn(cx.interpret, **options)(*kargs), np.float32)
                ref = np.asarray(jax.jit(functools.partial(paged_verify_attention_reference, **options))(*rargs),
                                 np.float32)
                report_parity(cx.report, section, what, out, ref, tol)
            except Exception as e:  # noqa: BLE001 -- report, keep going
                cx.report.error(what, e)


def section_trees(cx: Ctx) -> None:
    """Token-tree verification: the kernel with a tree mask against the reference with it
    (poisoned caches), then its time beside a decode step's (T = 1) at 16 and 31 nodes."""
    rep = cx.report
    rep.line("\n## Token trees: parity with the reference, then T = 17 and 32 tree rows against T = 1\n")
    rep.line("| case | dtype | max abs err | tolerance | ok |")
    rep.line("|---|---|---|---|---|")
    rng = np.random.default_rng(1)
    heads = TINY if cx.smoke else LLAMA8B
    option_parity(cx, "tree_parity", f"{heads.name} tree", heads, rng,
                  (((40, 90), (17, 9), 17), ((700, 33), (32, 20), 32)),
                  lambda kv_lens, t: dict(tree_mask=random_tree_mask(len(kv_lens), t, t)))
    rep.line("")
    rep.line(TIMING_HEADER)
    rep.line(TIMING_RULE)
    t1: dict = {}
    shapes = [(1, 40)] if cx.smoke else [(1, 4096), (16, 4096)]
    for batch, ctx in shapes:
        time_shape(cx, heads, batch, 1, ctx, t1)
        for t in ((17,) if cx.smoke else (17, 32)):
            time_shape(cx, heads, batch, t, ctx, t1, tree=True)


def section_local(cx: Ctx) -> None:
    """Gemma's local layers: the kernel with a sliding window, cap-free, at Gemma-3-27B's score
    scale, against the reference (poisoned caches), then a local layer's time beside a global
    one's at 32k context."""
    rep = cx.report
    heads = TINY if cx.smoke else GEMMA27B
    window = 8 if cx.smoke else 1024
    rep.line(f"\n## Local layers (Gemma): parity with the reference, then a {window}-key window against none\n")
    rep.line("| case | dtype | max abs err | tolerance | ok |")
    rep.line("|---|---|---|---|---|")
    rng = np.random.default_rng(2)
    local = dict(sliding_window=window, sm_scale=168 ** -0.5)
    cases = (((40, 9, 70), (5, 2, 1), 5),) if cx.smoke else (((3000, 900, 1030), (5, 1, 5), 5),)
    option_parity(cx, "window_parity", f"{heads.name} window {window}", heads, rng, cases, lambda kv_lens, t: local)
    rep.line("")
    rep.line(TIMING_HEADER)
    rep.line(TIMING_RULE)
    t1: dict = {}
    shapes = [(1, 64)] if cx.smoke else [(1, 32768), (16, 32768)]
    for batch, ctx in shapes:
        for options in (None, local):  # a global layer, then a local one
            for t in ((1,) if cx.smoke else (1, 5)):
                time_shape(cx, heads, batch, t, ctx, t1, options=options)
        glob_, loc = t1.get((heads.name, batch, ctx, "")), t1.get((heads.name, batch, ctx, f" window {window}"))
        if glob_ and loc:
            rep.line(f"| {heads.name} | {batch} | T=1 window {window} / global | {ctx} | "
                     f"kernel {loc[0] / glob_[0]:.2f}x, e2e {loc[1] / glob_[1]:.2f}x |")
            rep.record("window_ratio", heads=heads.name, batch=batch, ctx=ctx, window=window,
                       kernel_ratio=loc[0] / glob_[0], e2e_ratio=loc[1] / glob_[1])


def run_section(name: str, args) -> None:
    cx = Ctx(args)
    {"parity": section_parity, "llama": section_llama, "sweep": section_sweep,
     "extra": section_extra, "trees": section_trees, "local": section_local}[name](cx)


# ------------------------------------------------------------------------------ driver


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("OUT") or "out"),
                    help="output folder (default: $OUT if set, else ./out)")
    ap.add_argument("--budget-s", type=float, default=500.0,
                    help="start no new case after this many seconds (whole run)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU smoke test: Pallas interpret mode, tiny shapes, times meaningless")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    ap.add_argument("--inline", action="store_true", help="run sections in this process")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:  # one section, in a child process
        run_section(args.child, args)
        return 0

    start = time.time()
    args.deadline = start + args.budget_s
    rep = Report(args.out)
    rep.line(f"\n# Paged verification attention, run of {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    info = versions()
    rep.line(", ".join(f"{k} {v}" for k, v in info.items())
             + (". **Smoke run: interpret mode on the CPU, times are meaningless.**"
                if args.smoke else ""))
    rep.record("versions", **info, entry=dataclasses.asdict(tuning.current()))
    for name in args.sections.split(","):
        if time.time() > args.deadline:
            rep.line(f"\nsection {name}: skipped, time budget spent")
            rep.record("skipped", case=f"section {name}")
            continue
        if args.inline:
            try:
                run_section(name, args)
            except Exception as e:  # noqa: BLE001
                rep.error(f"section {name}", e)
            continue
        cmd = [sys.executable, __file__, "--child", name, "--out", str(args.out),
               "--deadline", str(args.deadline)] + (["--smoke"] if args.smoke else [])
        try:  # a section may overrun its deadline by one case; past that it is killed
            proc = subprocess.run(cmd, timeout=max(30.0, args.deadline - time.time() + 45),
                                  stdout=sys.stdout, stderr=subprocess.PIPE, text=True)
            if proc.returncode:
                tail = proc.stderr.strip().splitlines()[-3:]
                rep.line(f"\nsection {name} exited with {proc.returncode}: {' / '.join(tail)}")
                rep.record("section_failed", section=name, rc=proc.returncode,
                           stderr=proc.stderr[-4000:])
        except subprocess.TimeoutExpired:
            rep.line(f"\nsection {name}: killed after its time budget")
            rep.record("section_failed", section=name, rc="timeout")
    rep.line(f"\nwall time {time.time() - start:.0f} s; results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
