"""Loop the jitted target step at one q_len for a while, for an outside profiler (``perf``):

    python benchmarks/step_loop.py --q-len 5 --seconds 25 [--int8-activations] &
    # once it prints "ready": perf record -F 2000 -p <pid> -o q5.data -- sleep 15
    # perf report -i q5.data --sort symbol --stdio

The step is the one ``profile_verify.py`` profiles (``jspec.bench.profile.StepLoop``: q_len 1 a
plain decoding step, k + 1 a verification of k drafts), on HumanEval problem 0 after its prefill;
prints the mean wall time of a step at the end.
"""

from __future__ import annotations

import argparse
import time

import common
import jax

import jspec
from jspec.config import SpecConfig
from jspec.bench.profile import StepLoop, prepared_engine
from jspec.models.cpu_path import with_small_row_weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--int8-activations", action="store_true", help="the GGUF blocks in the int8 dot layout")
    args = ap.parse_args()
    model = jspec.load_model()
    ids = model.tokenizer(common.humaneval_prompts(0, 1)[0])["input_ids"]
    engine = prepared_engine(model, ids, SpecConfig("ngram", max(args.q_len - 1, 1)))
    params = (with_small_row_weights(model.params, quantized=model.quantized, int8_dot=True)
              if args.int8_activations else None)
    loop = StepLoop(engine, args.q_len, params)
    for _ in range(20):
        jax.block_until_ready(loop())
    print("ready", flush=True)
    t, n = time.perf_counter(), 0
    while time.perf_counter() - t < args.seconds:
        jax.block_until_ready(loop())
        n += 1
    print(f"q_len {args.q_len}: {1e3 * (time.perf_counter() - t) / n:.2f} ms a step ({n} steps)")


if __name__ == "__main__":
    main()
