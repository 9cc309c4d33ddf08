"""Sampled vs greedy decoding speed, side by side in one run: what temperature, top-k and top-p
cost per token, plain and speculative.

    python benchmarks/bench_sampling.py [--max-new-tokens 96] [--repeats 3] [--spec ngram:4]

Batch 1, EOS ignored (every setting emits the same number of tokens), the same story prompt;
each repeat runs every setting back to back so machine noise spreads over all of them. The
result is each setting's tokens/s as a ratio of greedy's.
"""

from __future__ import annotations

import argparse

import common

import jspec

PROMPT = ("Once upon a time, in a small village at the edge of a great forest, there lived a young girl named "
          "Mira who loved to explore. Every morning she walked past the old mill, greeted the baker and the "
          "blacksmith, and wandered into the woods to look for birds, strange stones and the tracks of animals. "
          "One day, while following a narrow path she had never seen before, she found")

SETTINGS = [
    ("greedy", dict(temperature=0.0)),
    ("temperature 0.8", dict(temperature=0.8)),
    ("temperature 0.8, top-k 50", dict(temperature=0.8, top_k=50)),
    ("temperature 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95)),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spec", default="none,ngram:4", help="comma-separated: none, ngram:K")
    args = ap.parse_args()
    model = jspec.load_model()
    ids = model.tokenizer(PROMPT)["input_ids"]
    specs = []
    for s in args.spec.split(","):
        kind, _, k = s.partition(":")
        specs.append((s, jspec.SpecConfig() if kind == "none" else jspec.SpecConfig(kind, int(k or 4))))
    runs = [(sname, spec, name, jspec.SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True, seed=0, **kw))
            for sname, spec in specs for name, kw in SETTINGS]
    for _, spec, _, sp in runs:  # compile
        jspec.generate(model, [ids], sp, spec=spec)
    tot = {(s, n): [0, 0.0, []] for s, _, n, _ in runs}
    for _ in range(args.repeats):
        for sname, spec, name, sp in runs:
            r = jspec.generate(model, [ids], sp, spec=spec)
            t = tot[(sname, name)]
            t[0] += r.num_tokens
            t[1] += r.total_s
            if r.mean_accepted_length:
                t[2].append(r.mean_accepted_length)
    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"SmolLM2-135M-Instruct (float32), batch 1, {len(ids)}-token story prompt, {args.max_new_tokens} new "
          f"tokens (EOS ignored), {args.repeats} repeats\n")
    rows = []
    for sname, _ in specs:
        base = tot[(sname, "greedy")][0] / tot[(sname, "greedy")][1]
        for name, _ in SETTINGS:
            n, s, acc = tot[(sname, name)]
            rows.append({"decoding": "plain" if sname == "none" else sname, "sampling": name,
                         "tok/s": f"{n / s:.1f}", "vs greedy": f"{n / s / base:.2f}x",
                         "mean accepted length": f"{sum(acc) / len(acc):.2f}" if acc else ""})
    print(common.table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
