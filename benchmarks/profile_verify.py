"""Where a verification step's time goes: a per-op profile of the jitted target step (forward +
greedy acceptance) at several q_lens on the real model (``jspec.bench.profile.profile_ops``).

    python benchmarks/profile_verify.py [--q-lens 1,2,5,9] [--repeats 10] [--prompt-index 0]
                                        [--compare-small-row-weights] [--compare-float-weights]
                                        [--compare-int8-activations]

q_len 1 is a plain decoding step, q_len k + 1 the verification of k drafts. Each category is
the median over calls of the summed durations of its XLA CPU thunks (their named-scope path in
the compiled HLO), so the categories need not add up to the wall time (thunks may overlap,
and dispatch between them is not counted); "wall" is the best call timed without the profiler.
The engine's parameters are what it runs: on the CPU kernel, the small-row copy of the
projections, as the GGUF file's own Q4_1 / Q8_0 blocks where it has them.
``--compare-small-row-weights`` adds the same profile without the copy (the model's float32
parameters through XLA), ``--compare-float-weights`` with a float32 copy in place of the blocks
(``jspec.models.cpu_path.with_small_row_weights`` without ``quantized``), ``--compare-int8-activations``
with the blocks in the int8 dot-product layout (``EngineConfig.quantized_activations``: activations
rounded to int8, integer products), in the same run.
"""

from __future__ import annotations

import argparse

import common

import jspec
from jspec.config import SpecConfig
from jspec.bench.profile import prepared_engine, profile_ops
from jspec.models.cpu_path import with_small_row_weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--q-lens", default="1,2,5,9")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--prompt-index", type=int, default=0, help="HumanEval problem")
    ap.add_argument("--compare-small-row-weights", action="store_true")
    ap.add_argument("--compare-float-weights", action="store_true")
    ap.add_argument("--compare-int8-activations", action="store_true")
    args = ap.parse_args()
    model = jspec.load_model()
    prompt = common.humaneval_prompts(args.prompt_index, 1)[0]
    ids = model.tokenizer(prompt)["input_ids"]
    qs = [int(q) for q in args.q_lens.split(",")]
    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"SmolLM2-135M-Instruct (float32), HumanEval problem {args.prompt_index} ({len(ids)} prompt tokens), "
          f"median of {args.repeats} calls per q_len, ms")
    engine = prepared_engine(model, ids, SpecConfig("ngram", max(max(qs) - 1, 1)))
    runs = [("the engine's parameters", profile_ops(model, ids, qs, repeats=args.repeats, engine=engine))]
    if args.compare_small_row_weights:
        runs.append(("the model's float32 parameters, no small-row copy",
                     profile_ops(model, ids, qs, repeats=args.repeats, engine=engine, params=model.params)))
    if args.compare_float_weights:
        runs.append(("a float32 small-row copy in place of the GGUF's blocks",
                     profile_ops(model, ids, qs, repeats=args.repeats, engine=engine,
                                 params=with_small_row_weights(model.params))))
    if args.compare_int8_activations:
        runs.append(("the GGUF's blocks with int8 activations (quantized_activations)",
                     profile_ops(model, ids, qs, repeats=args.repeats, engine=engine,
                                 params=with_small_row_weights(model.params, quantized=model.quantized, int8_dot=True))))
    for title, profs in runs:
        print(f"\n### {title}\n")
        _table(profs)


def _table(profs):
    cats = sorted({c for p in profs for c in p.by_category}, key=lambda c: -max(p.by_category.get(c, 0) for p in profs))
    rows = []
    base = {c: profs[0].by_category.get(c, 0.0) for c in cats}
    for p in profs:
        row = {"q_len": p.q_len, "wall (best)": f"{p.best_ms:.1f}", "sum of ops": f"{sum(p.by_category.values()):.1f}"}
        for c in cats:
            v = p.by_category.get(c, 0.0)
            row[c] = f"{v:.1f}" if p.q_len == profs[0].q_len or not base[c] else f"{v:.1f} ({v / base[c]:.1f}x)"
        rows.append(row)
    print(common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
