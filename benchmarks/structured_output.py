"""Structured output on the real model: JSON-schema requests with and without speculation, and
what constrained requests cost the unconstrained ones beside them.

    python benchmarks/structured_output.py [--limit 20] [--max-tokens 200] [--methods ar,ngram:4,hybrid:4]
                                           [--passes 2] [--out benchmarks/results/structured-DATE.json]

1. **JSON schema** (``benchmarks/json_schema_prompts.jsonl``: 20 requests written for this
   benchmark, objects with nested fields, enums and arrays): every request alone (batch 1,
   greedy, chat template), under each method in turn, ``--passes`` times, after a warm-up pass
   of every method (the prefix cache emptied before each pass); reported: tokens/s over the
   timed passes (compilation excluded, prefill included), the ratio to constrained AR, mean tokens per target forward, how
   many outputs parse and validate against their schema (``jsonschema``), and whether the
   tokens equal constrained AR's.
2. **Beside constrained requests**: 8 requests at once (the code prompts, 64 greedy tokens each,
   EOS ignored so the batch keeps its size, no speculation): all unconstrained, then 6
   unconstrained beside 2 with a JSON schema, five times alternating; reported: the medians of
   the unconstrained requests' mean decode tokens/s in each, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import git_rev, machine

ROOT = Path(__file__).resolve().parent


def load_requests(limit: int) -> list[dict]:
    rows = [json.loads(line) for line in (ROOT / "json_schema_prompts.jsonl").read_text().splitlines() if line.strip()]
    return rows[:limit]


def spec_of(method: str) -> dict | None:
    name, _, k = method.partition(":")
    if name == "ar":
        return None
    spec = {"method": name, "num_speculative_tokens": int(k or 4)}
    if name in ("hybrid", "eagle"):
        spec["model"] = "smollm2-135m-eagle3"
    return spec


def run_alone(engine, rid: str, prompt: str, sp) -> tuple[list[int], str, object, float]:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, sp, chat=True)
    final = None
    for outs in engine.step_until_done():
        for o in outs:
            if o.finished:
                final = o
    return final.outputs[0].token_ids, final.outputs[0].finish_reason, final.metrics, time.perf_counter() - t0


def json_schema_section(model, methods: list[str], rows: list[dict], max_tokens: int, passes: int) -> list[dict]:
    """Every method's engine is built and warmed first; then each request runs under each method
    in turn (``passes`` times), so the machine's drift reaches every method alike."""
    import jsonschema

    from jspec import EngineConfig, LLMEngine, SamplingParams

    sps = [SamplingParams(max_tokens=max_tokens, structured_outputs={"json": r["schema"]}) for r in rows]
    engines = {}
    for method in methods:
        engines[method] = engine = LLMEngine(model, EngineConfig(max_num_seqs=1, max_model_len=512,
                                                                 max_burst_steps=16), spec_of(method))
        for i, (r, sp) in enumerate(zip(rows, sps)):  # warm-up: every prompt length's prefill compiled
            run_alone(engine, f"warm-up-{i}", r["prompt"], sp)
    stats = {m: {"tokens": 0, "forwards": 0, "seconds": 0.0, "valid": 0, "ids": []} for m in methods}
    for p in range(passes):
        for method in methods:
            engines[method].reset_prefix_cache()
        for i, (r, sp) in enumerate(zip(rows, sps)):
            for method in methods:
                toks, reason, m, dt = run_alone(engines[method], f"{p}-{i}", r["prompt"], sp)
                st = stats[method]
                st["tokens"] += len(toks)
                st["forwards"] += m.num_steps
                st["seconds"] += dt
                if p == 0:
                    st["ids"].append(toks)
                    try:
                        text = model.tokenizer.decode(toks, skip_special_tokens=True)
                        jsonschema.validate(json.loads(text), r["schema"])
                        st["valid"] += reason == "stop"
                    except (ValueError, jsonschema.ValidationError):
                        pass
    out, reference = [], stats[methods[0]]["ids"]
    for method in methods:
        st = stats[method]
        row = {"method": method, "tokens": st["tokens"], "seconds": round(st["seconds"], 2),
               "tok_s": round(st["tokens"] / st["seconds"], 1),
               "tokens_per_forward": round(st["tokens"] / max(st["forwards"], 1), 2),
               "valid": f"{st['valid']}/{len(rows)}",
               "same_as_ar": f"{sum(a == b for a, b in zip(st['ids'], reference))}/{len(rows)}"}
        print(row, flush=True)
        out.append(row)
    base = out[0]["tok_s"]
    for row in out:
        row["vs_ar"] = round(row["tok_s"] / base, 2)
    return out


def beside_section(model, rows: list[dict]) -> dict:
    from jspec import EngineConfig, LLMEngine, SamplingParams

    prompts = [json.loads(line)["prompt"] for line in (ROOT / "code_prompts.jsonl").read_text().splitlines()][:8]
    engine = LLMEngine(model, EngineConfig(max_num_seqs=8, max_model_len=512, max_burst_steps=16))
    free = SamplingParams(max_tokens=64, ignore_eos=True)

    runs = iter(range(100))

    def run(constrained: int) -> float:
        tag = next(runs)
        for i, p in enumerate(prompts):
            sp = free if i >= constrained else SamplingParams(max_tokens=64, ignore_eos=True,
                                                              structured_outputs={"json": rows[i]["schema"]})
            engine.add_request(f"{tag}-{i}", p, sp, chat=True)
        rates = []
        for outs in engine.step_until_done():
            for o in outs:
                if o.finished and int(o.request_id.split("-")[1]) >= constrained:
                    m = o.metrics
                    rates.append((m.num_output_tokens - 1) / (m.last_token_time - m.first_token_time))
        return sum(rates) / len(rates)

    run(0), run(2)  # warm-up: both step variants compiled
    pairs = [(run(0), run(2)) for _ in range(5)]  # alternating: the machine's drift hits both
    alone, beside = (statistics.median(x) for x in zip(*pairs))
    return {"unconstrained_tok_s_alone": round(alone, 1), "unconstrained_tok_s_beside_25pct_constrained":
            round(beside, 1), "ratio": round(beside / alone, 3),
            "ratios_per_pair": [round(b / a, 3) for a, b in pairs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--methods", default="ar,ngram:4,hybrid:4")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jspec

    model = jspec.load_model("smollm2-135m")
    rows = load_requests(args.limit)
    result = {"machine": machine(), "commit": git_rev(),
              "command": "python benchmarks/structured_output.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
              "json_schema": json_schema_section(model, args.methods.split(","), rows, args.max_tokens, args.passes),
              "beside": beside_section(model, rows)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
