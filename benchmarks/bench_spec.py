"""Speculative decoding on HumanEval prompts: jspec autoregressive vs each drafter (k sweep), and
transformers' greedy, prompt-lookup and (when a draft is shipped) assisted generation, one run.

    python benchmarks/bench_spec.py [--prompts 10] [--max-new-tokens 128] [--quick]

Greedy, batch 1, EOS respected (all greedy methods are lossless, so each emits the same tokens
up to float ties). Each prompt runs every method back to back, so machine noise spreads over all
of them; speedups are ratios of summed tokens over summed seconds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import common

import jspec

ROOT = Path(__file__).resolve().parents[1]


def jspec_methods(quick: bool):
    m = [("jspec autoregressive", jspec.SpecConfig())]
    for k in ([4] if quick else [2, 4, 8]):
        m.append((f"jspec ngram k={k}", jspec.SpecConfig("ngram", k)))
    if not quick:
        m.append(("jspec layerskip L=15 k=2", jspec.SpecConfig("layerskip", 2, layerskip_layers=15)))
    for name in ("smollm2-135m-draft", "smollm2-135m-eagle"):
        path = ROOT / "checkpoints" / name
        if path.exists():
            kind = "eagle" if "eagle" in name else "draft"
            for k in ([4] if quick else [2, 4, 6]):
                m.append((f"jspec {kind} k={k}", jspec.SpecConfig(kind, k, draft=str(path))))
    return m


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--start", type=int, default=0, help="first HumanEval problem")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()

    model = jspec.load_model()
    prompts = common.humaneval_prompts(args.start, args.prompts)
    ids = [model.tokenizer(p)["input_ids"] for p in prompts]
    sp = jspec.SamplingParams(max_tokens=args.max_new_tokens)
    methods = jspec_methods(args.quick)
    hf = None if args.no_hf else common.load_hf_peer()
    hf_methods = [] if hf is None else [("transformers greedy", {}),
                                         ("transformers prompt lookup (10)", {"prompt_lookup_num_tokens": 10})]
    draft_hf = ROOT / "checkpoints" / "smollm2-135m-draft"
    if hf is not None and (draft_hf / "config.json").exists():
        import tempfile

        from transformers import AutoModelForCausalLM

        from jspec.loading.drafts import export_hf

        # The shipped draft leaves out the embedding it shares with the target; the export adds it.
        exported = export_hf(draft_hf, model, Path(tempfile.mkdtemp(prefix="jspec-draft-hf-")))
        assistant = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
        hf_methods.append(("transformers assisted (shipped draft)", {"assistant_model": assistant}))

    # Warm-up: compile every jspec configuration once, run each transformers method once.
    for _, spec in methods:
        jspec.generate(model, [ids[0]], jspec.SamplingParams(max_tokens=8), spec=spec)
    for _, kw in hf_methods:
        common.hf_generate(hf, ids[0], 8, **kw)

    totals = {name: {"tokens": 0, "seconds": 0.0, "forwards": 0, "acc": []} for name, _ in methods + hf_methods}
    reference = {}
    mismatches = {name: 0 for name, _ in methods}
    for i, x in enumerate(ids):
        for name, spec in methods:
            r = jspec.generate(model, [x], sp, spec=spec)
            t = totals[name]
            t["tokens"] += r.num_tokens
            t["seconds"] += r.total_s
            t["forwards"] += r.num_target_forwards
            if r.acceptance_per_position:
                t["acc"].append(r.acceptance_per_position)
            if name == "jspec autoregressive":
                reference[i] = r.token_ids[0]
            elif r.token_ids[0] != reference[i]:
                mismatches[name] += 1
        for name, kw in hf_methods:
            toks, sec = common.hf_generate(hf, x, args.max_new_tokens, **kw)
            totals[name]["tokens"] += len(toks)
            totals[name]["seconds"] += sec
        print(f"prompt {i}: done", flush=True)

    # Draft vs verify time per step, each part timed apart on the first prompt's state.
    from jspec.engine.profile import profile_step

    parts = {name: profile_step(model, ids[0], spec) for name, spec in methods if spec.enabled}

    base = totals["jspec autoregressive"]["tokens"] / totals["jspec autoregressive"]["seconds"]
    hf_rates = {n: totals[n]["tokens"] / totals[n]["seconds"] for n, _ in hf_methods}
    rows = []
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        row = {"method": name, "tok/s": f"{rate:.1f}", "speedup vs jspec AR": f"{rate / base:.2f}x"}
        if name.startswith("jspec") and name != "jspec autoregressive":
            row["mean accepted length"] = f"{t['tokens'] / max(t['forwards'], 1):.2f}"
            if t["acc"]:
                k = len(t["acc"][0])
                row["acceptance per position"] = "[" + ", ".join(
                    f"{sum(a[j] for a in t['acc']) / len(t['acc']):.2f}" for j in range(k)) + "]"
            row["greedy = AR"] = f"{len(ids) - mismatches[name]}/{len(ids)}"
            p = parts[name]
            row["draft / verify / plain step ms"] = f"{p.draft_ms:.1f} / {p.verify_ms:.1f} / {p.plain_step_ms:.1f}"
        if "transformers prompt lookup (10)" in hf_rates:
            row["vs transformers PLD"] = f"{rate / hf_rates['transformers prompt lookup (10)']:.2f}x"
        rows.append(row)
    cols = ["method", "tok/s", "speedup vs jspec AR", "vs transformers PLD", "mean accepted length",
            "acceptance per position", "draft / verify / plain step ms", "greedy = AR"]
    print(f"\nmachine: {common.machine()}, git {common.git_rev()}")
    print(f"SmolLM2-135M-Instruct (float32), greedy, batch 1, up to {args.max_new_tokens} new tokens, "
          f"HumanEval problems {args.start}..{args.start + len(ids) - 1}\n")
    print(common.table(rows, cols))


if __name__ == "__main__":
    main()
