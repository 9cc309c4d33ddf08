"""The serving engine: offline throughput against batch size, and online latency under Poisson
arrivals, with speculation off, fixed k and dynamic k, beside transformers' static batching.

    python benchmarks/bench_engine.py [--prompts 16] [--max-tokens 128] [--batch-sizes 1,4,16,32]
                                      [--methods ar,ngram:4,eagle:3,hybrid:3,dynamic:4] [--no-hf]
                                      [--online-rates 0.5,1,2] [--online-requests 24] [--plot PNG]

Offline: the first ``--prompts`` HumanEval problems (a documented subset: 164 x 256 tokens per
configuration does not fit the CPU budget), natural EOS, up to ``--max-tokens`` new tokens; the
engine at each ``max_num_seqs`` with each method, and transformers' batched ``generate`` (static
batches of the same size, left padding, greedy). Every method is greedy, so each engine run must
produce the same tokens as jspec AR at batch 1 (a mismatch is reported per method). Throughput is
generated tokens over wall time (compilation excluded: each configuration is warmed up first).
With ``--rounds R`` (default 1) the prompts run R times with each method, the methods
interleaved (round r starts at the r-th method, so drift on a shared machine falls on all of
them; transformers takes its turn among them); a method's throughput is the median over its
rounds. Every run gets a fresh engine (built, warmed up and calibrated, then released): one engine
alive at a time, because five engines of 16 slots held past Linux's vm.max_map_count and LLVM
died. XLA's persistent compilation cache makes the rebuilds cheaper (an AR engine at batch 1:
33 s, then 16.5 s), but warm-ups still take most of a long run's time; every run starts with an
empty prefix cache and lookup history, and a dynamic-k row's cost-model columns are its last
round's.
A method written ``METHOD@rows`` (``ar@rows``, ``ngram:4@rows``) runs with the engine's small-row
weight copy (``EngineConfig(small_row_weights=True)``), ``METHOD@norows`` without it (``False``),
for a side-by-side comparison; a method without a suffix runs on the engine's default (the copy
where the CPU small-row kernel applies).

Online: requests from the same prompts arrive as a Poisson process at each rate (requests/s);
the engine serves them as they come (added between bursts when their arrival time has passed);
p50/p99 time to first token and time per output token, per method, at ``max_num_seqs`` 8.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import jax
import numpy as np

import common

import jspec
from jspec.cli import enable_compile_cache
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.bench.run import HISTORY_TOKENS  # ``+history``: the lookup history's size
from jspec.engine.engine import LLMEngine
from jspec.timing import Stopwatch

ROOT = Path(__file__).resolve().parents[1]
HF = "transformers static batch"


def spec_of(method: str) -> SpecConfig:
    """``ar``, ``ngram:K``, ``eagle:K``, ``hybrid:K``, ``draft:K``, ``dynamic:K`` (n-gram, k chosen
    per burst up to K); the n-gram ones take the shortest match as a third part
    (``ngram:4:2`` = ``prompt_lookup_min`` 2; without it SpecConfig's default) and, with the
    hybrid, ``+history`` (``ngram:4+history``: ``ngram_history`` of HISTORY_TOKENS; emptied
    before every run)."""
    base, plus, extra = method.split("@")[0].partition("+")
    if plus and extra != "history":
        raise SystemExit(f"unknown part +{extra} in method {method!r} (only +history)")
    name, *rest = base.split(":")
    k = int(rest[0]) if rest and rest[0] else 4
    if len(rest) > (2 if name in ("ngram", "dynamic") else 1):
        raise SystemExit(f"too many parts in method {method!r}")
    if plus and name not in ("ngram", "dynamic", "hybrid"):
        raise SystemExit(f"+history applies to ngram, dynamic and hybrid, not {method!r}")
    lookup = {"ngram_min": int(rest[1])} if len(rest) > 1 else {}
    if plus:
        lookup["ngram_history"] = HISTORY_TOKENS
    if name == "ar":
        return SpecConfig()
    if name == "ngram":
        return SpecConfig("ngram", k, **lookup)
    if name in ("eagle", "hybrid"):  # the shipped EAGLE-3 head; hybrid: n-gram lookup, else that head
        history = {"ngram_history": lookup["ngram_history"]} if name == "hybrid" and plus else {}
        return SpecConfig(name, k, draft=str(ROOT / "checkpoints" / "smollm2-135m-eagle3"), **history)
    if name == "draft":
        return SpecConfig("draft", k, draft=str(ROOT / "checkpoints" / "smollm2-135m-draft"))
    if name == "dynamic":
        return SpecConfig("ngram", k, dynamic_k=True, **lookup)
    raise SystemExit(f"unknown method {method!r}")


def small_rows_of(method: str):
    """``METHOD@rows`` / ``METHOD@norows``: the engine with / without its small-row weight copy
    (EngineConfig.small_row_weights); no suffix: the engine's default (on where it applies)."""
    _, _, how = method.partition("@")
    if how not in ("", "rows", "norows"):
        raise SystemExit(f"unknown method suffix {how!r} in {method!r} (only @rows, @norows)")
    return {"": None, "rows": True, "norows": False}[how]


def engine_for(model, spec: SpecConfig, seqs: int, max_model_len: int, small_rows=None) -> LLMEngine:
    k = spec.num_speculative_tokens if spec.enabled else 0
    config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * (k + 1) + 256, max_model_len=max_model_len,
                          kv_cache_tokens=seqs * (max_model_len + k + 1), max_burst_steps=16,
                          small_row_weights=small_rows)
    engine = LLMEngine(model, config, spec)
    engine.warmup()
    return engine


def release(engine: LLMEngine) -> None:
    """Drop an engine's compiled programs before the next configuration compiles its own: each
    XLA CPU executable holds hundreds of memory maps, and a sweep that keeps them all passes
    Linux's vm.max_map_count (65,530) and dies in LLVM with "Cannot allocate memory"."""
    engine.__dict__.clear()
    jax.clear_caches()
    gc.collect()


def offline(engine: LLMEngine, ids, sp) -> tuple[list[list[int]], float, dict]:
    watch = Stopwatch()
    reqs = [engine.add_request(f"r{i}-{time.monotonic_ns()}", x, sp) for i, x in enumerate(ids)]
    while engine.has_unfinished_requests():
        engine.step()
    seconds = watch.elapsed()
    out = [list(r.output_ids) for r in reqs]
    steps = sum(r.metrics.num_steps for r in reqs)
    acc = sum(r.metrics.num_accepted_tokens for r in reqs)
    prop = sum(r.metrics.num_draft_tokens for r in reqs)
    engine.pop_finished()
    return out, seconds, {"mean_accepted_length": sum(map(len, out)) / max(steps, 1),
                          "acceptance": acc / prop if prop else None}


def online(engine: LLMEngine, ids, sp, rate: float, count: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    t0 = time.perf_counter()
    reqs, i = [], 0
    while i < count or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while i < count and arrivals[i] <= now:
            reqs.append(engine.add_request(f"o{i}-{time.monotonic_ns()}", ids[i % len(ids)], sp,
                                           arrival_time=t0 + arrivals[i]))
            i += 1
        if engine.has_unfinished_requests():
            engine.step()
        elif i < count:
            time.sleep(max(0.0, min(0.05, arrivals[i] - (time.perf_counter() - t0))))
    wall = time.perf_counter() - t0
    ttft = np.asarray([r.metrics.ttft for r in reqs])
    tpot = np.asarray([r.metrics.time_per_output_token for r in reqs if r.metrics.time_per_output_token])
    tokens = sum(len(r.output_ids) for r in reqs)
    engine.pop_finished()
    return {"rate": rate, "throughput": tokens / wall, "ttft_p50": float(np.percentile(ttft, 50)),
            "ttft_p99": float(np.percentile(ttft, 99)), "tpot_p50": float(np.percentile(tpot, 50)),
            "tpot_p99": float(np.percentile(tpot, 99))}


def hf_static(hf, tok, ids, batch: int, max_tokens: int) -> tuple[int, float]:
    """transformers' batched greedy generate over static batches (left padding)."""
    import torch

    tokens, seconds = 0, 0.0
    pad = hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else hf.config.eos_token_id[0]
    for s in range(0, len(ids), batch):
        group = ids[s:s + batch]
        width = max(map(len, group))
        x = torch.tensor([[pad] * (width - len(g)) + g for g in group])
        mask = torch.tensor([[0] * (width - len(g)) + [1] * len(g) for g in group])
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(x, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        seconds += time.perf_counter() - t
        for row in out[:, width:].tolist():
            n = len(row)
            for j, t_ in enumerate(row):  # count up to and including the first EOS
                if t_ == pad:
                    n = j + 1
                    break
            tokens += n
    return tokens, seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,4,16,32")
    ap.add_argument("--methods", default="ar,ngram:4,eagle:3,dynamic:4")
    ap.add_argument("--rounds", type=int, default=1, help="runs per method, interleaved; the median counts")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--online-rates", default="0.5,1,2")
    ap.add_argument("--online-requests", type=int, default=24)
    ap.add_argument("--online-methods", default="ar,ngram:4,dynamic:4")
    ap.add_argument("--plot", default="", help="write tokens/s against max_num_seqs to this PNG")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    enable_compile_cache()  # every run builds its engine afresh: compile once, load after
    model = jspec.load_model()
    prompts = common.humaneval_prompts(0, args.prompts)
    ids = [model.tokenizer(p)["input_ids"] for p in prompts]
    sp = SamplingParams(max_tokens=args.max_tokens)
    max_model_len = -(-(max(map(len, ids)) + args.max_tokens) // 64) * 64
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    print(f"machine: {common.machine()}, git {common.git_rev()}", flush=True)

    results = {"offline": [], "online": []}
    reference = None
    hf = None if args.no_hf else common.load_hf_peer()
    if hf is not None:
        common.hf_generate(hf, ids[0], 4)  # warm-up
    rotation = methods + ([HF] if hf is not None else [])  # transformers takes its turn in the rounds
    for b in sizes:
        runs = {m: [] for m in rotation}
        info = {}
        for r in range(args.rounds):
            for m in rotation[r % len(rotation):] + rotation[:r % len(rotation)]:
                if m == HF:
                    tokens, seconds = hf_static(hf, model.tokenizer, ids, b, args.max_tokens)
                    runs[m].append((tokens, seconds))
                    print(f"  batch {b}, {m}, round {r + 1}: {tokens / seconds:.1f} tok/s", flush=True)
                    continue
                engine = engine_for(model, spec_of(m), b, max_model_len, small_rows_of(m))
                runs[m].append(offline(engine, ids, sp))
                out, sec, _ = runs[m][-1]
                print(f"  batch {b}, {m}, round {r + 1}: {sum(map(len, out)) / sec:.1f} tok/s", flush=True)
                if m.startswith("dynamic"):  # the cost model of the slot bucket that ran the most bursts
                    most = max(engine.costs, key=lambda n: engine.stats.bursts_by_slots[n])
                    info[m] = {"k chosen": engine.costs[most].chosen,
                               "step ms by k": {k: round(1e3 * v, 1) for k, v in engine.costs[most].step_seconds.items() if v},
                               "bursts by slot bucket": engine.stats.bursts_by_slots}
                release(engine)
        for m, done in runs.items():
            if m == HF:
                tokens = done[0][0]
                seconds = float(np.median([sec for _, sec in done]))
                row = {"batch": b, "method": m, "tokens": tokens, "seconds": round(seconds, 2),
                       "tok/s": round(tokens / seconds, 1)}
                if len(done) > 1:
                    row["tok/s by round"] = [round(t / sec, 1) for t, sec in done]
                results["offline"].append(row)
                print(json.dumps(row), flush=True)
                continue
            if reference is None:
                reference = done[0][0]
            same = min(sum(a == r for a, r in zip(out, reference)) for out, _, _ in done)
            tokens = sum(map(len, done[0][0]))
            seconds = float(np.median([sec for _, sec, _ in done]))
            row = {"batch": b, "method": m, "tokens": tokens, "seconds": round(seconds, 2),
                   "tok/s": round(tokens / seconds, 1), "same as AR": f"{same}/{len(ids)}", **done[-1][2]}
            if len(done) > 1:
                row["tok/s by round"] = [round(sum(map(len, out)) / sec, 1) for out, sec, _ in done]
            row.update(info.get(m, {}))
            results["offline"].append(row)
            print(json.dumps(row), flush=True)
    del hf

    for m in filter(None, args.online_methods.split(",")):  # --online-methods "": offline only
        engine = engine_for(model, spec_of(m), 8, max_model_len, small_rows_of(m))
        for rate in [float(r) for r in args.online_rates.split(",") if r]:
            row = {"method": m, **online(engine, ids, sp, rate, args.online_requests)}
            results["online"].append(row)
            print(json.dumps(row), flush=True)
        release(engine)

    # tables
    print(f"\nSmolLM2-135M-Instruct (float32), greedy, HumanEval problems 0..{len(ids) - 1}, natural EOS, "
          f"up to {args.max_tokens} new tokens\n")
    rows = []
    for b in sizes:
        base = next(r for r in results["offline"] if r["batch"] == b and r["method"] == methods[0])
        hf_row = next((r for r in results["offline"] if r["batch"] == b and r["method"] == HF), None)
        for r in results["offline"]:
            if r["batch"] != b:
                continue
            rows.append({"max_num_seqs": b, "method": r["method"], "tok/s": r["tok/s"],
                         "vs AR": f"{r['tok/s'] / base['tok/s']:.2f}x",
                         "vs transformers": f"{r['tok/s'] / hf_row['tok/s']:.2f}x" if hf_row else "",
                         "mean accepted length": (f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") else ""),
                         "same as AR": r.get("same as AR", "")})
    print(common.table(rows, list(rows[0])))
    print()
    orows = [{"method": r["method"], "rate (req/s)": r["rate"], "tok/s": f"{r['throughput']:.1f}",
              "TTFT p50 / p99 (s)": f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f}",
              "TPOT p50 / p99 (ms)": f"{1e3 * r['tpot_p50']:.0f} / {1e3 * r['tpot_p99']:.0f}"} for r in results["online"]]
    if orows:
        print(common.table(orows, list(orows[0])))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, sizes, methods, args.plot)


def plot(results, sizes, methods, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    names = methods + [HF]
    for m in names:
        ys = [next((r["tok/s"] for r in results["offline"] if r["batch"] == b and r["method"] == m), None) for b in sizes]
        if any(y is not None for y in ys):
            ax.plot(sizes, ys, marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("jspec engine, SmolLM2-135M, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
