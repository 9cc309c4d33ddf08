"""Why a lone n-gram request is slow over HTTP: off vs n-gram k = 4 for one request, in process,
at several ``max_model_len`` and slot counts (BENCHMARKS.md, server section).

    python benchmarks/diag_ngram_len.py [--lens 320,1024] [--max-num-seqs 1]

One engine per row, warmed up; HumanEval problem 0, 64 new tokens with EOS ignored, best of two
runs; prints time per output token, steps and time per step.
"""

from __future__ import annotations

import argparse

import common

import jspec
from bench_engine import release
from jspec.config import EngineConfig, SamplingParams, SpecConfig
from jspec.engine.engine import LLMEngine

METHODS = (("off", SpecConfig()), ("ngram:4", SpecConfig("ngram", num_speculative_tokens=4)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="320,1024")
    ap.add_argument("--max-num-seqs", type=int, default=1)
    args = ap.parse_args()
    seqs = args.max_num_seqs
    prompt = common.humaneval_prompts(0, 1)[0]
    model = jspec.load_model()
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    for length in [int(x) for x in args.lens.split(",")]:
        for name, spec in METHODS:
            config = EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * 5 + 256, max_model_len=length,
                                  max_burst_steps=8)
            engine = LLMEngine(model, config, spec)
            engine.warmup()
            best, steps = None, 0
            for rep in range(2):
                r = engine.add_request(str(rep), prompt, sp)
                while engine.has_unfinished_requests():
                    engine.step()
                tpot, steps = r.metrics.time_per_output_token, r.metrics.num_steps
                best = tpot if best is None else min(best, tpot)
                engine.pop_finished()
            print(f"max_num_seqs {seqs} max_model_len {length} {name}: TPOT {1e3 * best:.1f} ms, steps {steps}, "
                  f"ms/step {1e3 * best * sp.max_tokens / steps:.1f}", flush=True)
            release(engine)


if __name__ == "__main__":
    main()
