"""N-gram lookup's longest suffix (``SpecConfig.ngram_max``, vLLM's ``prompt_lookup_max``), end to end.

    python benchmarks/bench_lookup_length.py [--limit 16] [--max-tokens 128] [--lengths 3,8]
                                             [--ngram-ks 4] [--profile] [--json OUT]

``jspec bench``'s runner (:func:`jspec.bench.run.run_bench`: batch 1, greedy, every method's
tokens checked against jspec AR's, side by side in one run) over HumanEval problems 0..limit-1,
with n-gram at each k of ``--ngram-ks`` and the hybrid (n-gram, else the shipped EAGLE-3 head)
at k = 4, each at every ``ngram_max`` in ``--lengths`` (the shortest match left at its default: 1
for n-gram, 2 for the hybrid). ``benchmarks/hybrid_policy.py`` replays the same choice without
the engine. The run of 7 methods x 32 prompts with ``--profile`` used to pass Linux's
vm.max_map_count (``jspec bench`` built an engine per prompt and kept every one's programs);
with one engine per method it completes (measured 2026-12-03).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common

import jspec
from jspec.cli import enable_compile_cache
from jspec.config import SpecConfig
from jspec.bench.run import Method, humaneval_prompts, run_bench

ROOT = Path(__file__).resolve().parents[1]
HEAD = str(ROOT / "checkpoints" / "smollm2-135m-eagle3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lengths", default="3,8")
    ap.add_argument("--ngram-ks", default="4", help="k of the n-gram rows (the hybrid's is 4)")
    ap.add_argument("--profile", action="store_true", help="draft / verify / plain step ms (compiles more)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    enable_compile_cache()
    model = jspec.load_model()
    print(f"machine: {common.machine()}, git {common.git_rev()}", flush=True)
    methods = [Method("jspec ar", SpecConfig())]
    for n in [int(x) for x in args.lengths.split(",")]:
        methods += [Method(f"ngram k={k}, n<={n}", SpecConfig("ngram", int(k), ngram_max=n))
                    for k in args.ngram_ks.split(",")]
        methods.append(Method(f"hybrid k=4, n<={n}", SpecConfig("hybrid", 4, draft=HEAD, ngram_max=n)))
    report = run_bench(model, humaneval_prompts(0, args.limit), methods, max_tokens=args.max_tokens,
                       profile=args.profile)
    print(report.markdown())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    if report.mismatches:
        raise SystemExit(f"greedy mismatches: {report.mismatches}")


if __name__ == "__main__":
    main()
