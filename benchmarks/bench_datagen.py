"""Draft training data at engine speed: the target's greedy continuations of standard-library
prompts, static batches (the old way) against the serving engine's continuous batching.

    python benchmarks/bench_datagen.py [--prompts 48] [--max-new-tokens 128] [--batch-sizes 16,32]

One run, side by side: for each batch size, ``generate_sequences(..., static=True)`` (static
batches of similar-length prompts through ``generate``) and ``generate_sequences`` (the engine,
continuous batching), each after a warm-up on 8 prompts of its own (both still compile the
shapes their timed run needs, as a distillation run does); prompts/s, generated tokens/s, and
whether both wrote the same tokens. The prompts are the distillation's own
(``stdlib_prompts``), never a benchmark's.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import common

import jspec
from jspec.train.data import generate_sequences, stdlib_prompts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="16,32")
    args = ap.parse_args()

    model = jspec.load_model()
    prompts = stdlib_prompts(args.prompts + 8, seed=1)
    warm, prompts = prompts[:8], prompts[8:]
    print(f"machine: {common.machine()}, git {common.git_rev()}", flush=True)
    rows = []
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        got = {}
        for static in (True, False):
            generate_sequences(model, warm, args.max_new_tokens, b, static=static)
            t = time.perf_counter()
            data = generate_sequences(model, prompts, args.max_new_tokens, b, static=static)
            seconds = time.perf_counter() - t
            new = int((data.lengths - data.prompt_lengths).sum())
            got[static] = data
            row = {"batch": b, "how": "static batches" if static else "engine", "prompts": len(prompts),
                   "new tokens": new, "seconds": round(seconds, 1), "prompts/s": round(len(prompts) / seconds, 2),
                   "tok/s": round(new / seconds, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        same = bool(np.array_equal(got[True].lengths, got[False].lengths)
                    and all(np.array_equal(got[True].tokens[i, :n], got[False].tokens[i, :n])
                            for i, n in enumerate(got[True].lengths)))
        print(json.dumps({"batch": b, "same tokens": same}), flush=True)
    print("\n| batch | how | prompts/s | new tok/s | seconds |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['how']} | {r['prompts/s']} | {r['tok/s']} | {r['seconds']} |")


if __name__ == "__main__":
    main()
