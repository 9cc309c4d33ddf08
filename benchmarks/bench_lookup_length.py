"""N-gram lookup's longest suffix (``SpecConfig.ngram_max``, vLLM's ``prompt_lookup_max``), end to end.

    python benchmarks/bench_lookup_length.py [--limit 32] [--max-tokens 128] [--lengths 3,8]
                                             [--json OUT]

``jspec bench``'s runner (:func:`jspec.engine.bench.run_bench`: batch 1, greedy, every method's
tokens checked against jspec AR's, side by side in one run) over HumanEval problems 0..limit-1,
with n-gram k = 4, n-gram k = 8 and the hybrid (n-gram, else the shipped EAGLE-3 head) k = 4, each
at every ``ngram_max`` in ``--lengths`` (the shortest match left at its default: 1 for n-gram, 2
for the hybrid). ``benchmarks/hybrid_policy.py`` replays the same choice without the engine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import common

import jspec
from jspec.cli import enable_compile_cache
from jspec.config import SpecConfig
from jspec.engine.bench import Method, humaneval_prompts, run_bench

ROOT = Path(__file__).resolve().parents[1]
HEAD = str(ROOT / "checkpoints" / "smollm2-135m-eagle3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--lengths", default="3,8")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    enable_compile_cache()
    model = jspec.load_model()
    print(f"machine: {common.machine()}, git {common.git_rev()}", flush=True)
    methods = [Method("jspec ar", SpecConfig())]
    for n in [int(x) for x in args.lengths.split(",")]:
        methods += [Method(f"ngram k=4, n<={n}", SpecConfig("ngram", 4, ngram_max=n)),
                    Method(f"ngram k=8, n<={n}", SpecConfig("ngram", 8, ngram_max=n)),
                    Method(f"hybrid k=4, n<={n}", SpecConfig("hybrid", 4, draft=HEAD, ngram_max=n))]
    report = run_bench(model, humaneval_prompts(0, args.limit), methods, max_tokens=args.max_tokens, profile=True)
    print(report.markdown())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
    if report.mismatches:
        raise SystemExit(f"greedy mismatches: {report.mismatches}")


if __name__ == "__main__":
    main()
