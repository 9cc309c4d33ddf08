"""Speculative decoding on HumanEval prompts: jspec autoregressive vs each drafter (k sweep), and
transformers' greedy, prompt-lookup and (when a draft is shipped) assisted generation, one run.

    python benchmarks/bench_spec.py [--prompts 10] [--max-new-tokens 128] [--quick] [--no-hf]

A thin call of ``jspec bench`` (:mod:`jspec.bench.run`, where the logic lives) with this
project's method sweep and the draft / verify / plain step times (``--profile``). Greedy, batch
1, EOS respected; every jspec method must emit jspec AR's tokens (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common  # noqa: F401  (environment)

from jspec.cli import main as jspec_main

ROOT = Path(__file__).resolve().parents[1]


def methods(quick: bool) -> str:
    m = ["ar"] + [f"ngram:{k}" for k in ([4] if quick else [2, 4, 8])]
    if not quick:
        m.append("layerskip:15:2")
    for kind, name in (("draft", "smollm2-135m-draft"), ("eagle", "smollm2-135m-eagle")):
        if (ROOT / "checkpoints" / name).exists():
            m += [f"{kind}:{name}:{k}" for k in ([4] if quick else [2, 4, 6])]
    return ",".join(m)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--start", type=int, default=0, help="first HumanEval problem")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", help="also write every number here")
    ap.add_argument("--plot", help="also draw tokens/s and acceptance here (PNG)")
    args = ap.parse_args()
    argv = ["bench", "--suite", "humaneval", "--start", str(args.start), "--limit", str(args.prompts),
            "--max-tokens", str(args.max_new_tokens), "--methods", methods(args.quick), "--profile"]
    if not args.no_hf:
        draft = ROOT / "checkpoints" / "smollm2-135m-draft"
        argv += ["--peers", "transformers" + (",transformers-assisted:smollm2-135m-draft" if draft.exists() else "")]
    if args.json:
        argv += ["--json", args.json]
    if args.plot:
        argv += ["--plot", args.plot]
    print(f"git {common.git_rev()}")
    return jspec_main(argv)


if __name__ == "__main__":
    sys.exit(main())
