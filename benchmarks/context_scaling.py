"""How a decode step and a k = 4 verification step grow with the context.

    python benchmarks/context_scaling.py [--contexts 100,250,500,1000] [--k 4] [--rounds 3]
                                         [--repeats 10] [--attention auto | xla,cpu]
                                         [--compare-small-row-weights]
                                         [--kv-cache-dtype float32,float16]
                                         [--compare-int8-activations]

For each context length an engine holds one request whose prompt is that many tokens of
HumanEval text (problems concatenated), prefilled and decoded a few steps
(``jspec.bench.profile.prepared_engine``); every engine has the same page pool (sized for the
longest context), so that only the context differs. On that state it times the jitted target
step as the engine runs it, the state donated (``jspec.bench.profile.StepLoop``): a one-token
decode forward (q_len 1) and the verification forward of k drafts plus greedy acceptance
(q_len k + 1). ``--no-donate`` times the same functions without the donation: XLA then copies
every layer's pages before writing into them, a cost of the pool's size that the engine's donated
steps never pay. The contexts are timed in interleaved rounds (every context
and q_len once per round, best of ``repeats`` calls each) and the best over rounds is kept, so
that the VM's drift falls on all of them alike. Printed: ms per step, each against the shortest
context's decode step of the same variant (attention, weights), and verify / decode at each
context. The steps run on the engine's parameters (on the CPU: with the packed weight copy the
small-row kernel reads); ``--compare-small-row-weights`` times them without the copy (" (no copy)") and with it
(" (copy)") in the same rounds; ``--attention xla,cpu`` (several, comma-separated) times each
attention implementation's steps in the same rounds, each on an engine of its own;
``--kv-cache-dtype float32,float16`` likewise each page dtype's (EngineConfig.kv_cache_dtype).
``--compare-int8-activations`` adds the steps on the GGUF blocks in the int8 dot layout
(" (int8)": EngineConfig.quantized_activations) in the same rounds.
"""

from __future__ import annotations

import argparse

import common
import jax

import jspec
from jspec.config import SpecConfig
from jspec.bench.profile import StepLoop, best_ms, prepared_engine
from jspec.models.cpu_path import with_small_row_weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="100,250,500,1000")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--attention", default="auto",
                    help="attention implementation; several, comma-separated (e.g. xla,cpu), are timed side by side")
    ap.add_argument("--no-donate", action="store_true", help="time without donating the state (copies the pool)")
    ap.add_argument("--compare-small-row-weights", action="store_true",
                    help="also time every step with the small-row weight copy")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="the pages' dtype; several, comma-separated (e.g. float32,float16), are timed side by side")
    ap.add_argument("--compare-int8-activations", action="store_true",
                    help="also time every step with int8 activations on the GGUF blocks")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    model = jspec.load_model()
    text = "\n".join(common.humaneval_prompts(0, 40))
    ids = model.tokenizer(text)["input_ids"]
    if len(ids) < max(contexts):
        raise SystemExit(f"only {len(ids)} tokens of prompt text; lower --contexts")
    print(f"machine: {common.machine()}, git {common.git_rev()}, attention {args.attention}, "
          f"{'not donated' if args.no_donate else 'donated'}")
    print(f"SmolLM2-135M-Instruct (float32), batch 1, k = {args.k}; best over {args.rounds} interleaved rounds "
          f"of best-of-{args.repeats} calls, ms")
    weights = {"": None}  # the engine's own parameters
    if args.compare_small_row_weights:
        weights = {" (no copy)": model.params, " (copy)": with_small_row_weights(model.params)}
    if args.compare_int8_activations:
        weights[" (int8)"] = with_small_row_weights(model.params, quantized=model.quantized, int8_dot=True)
    attentions = [(a, kv) for a in args.attention.split(",") for kv in args.kv_cache_dtype.split(",")]
    variants = [(a, w) for a in attentions for w in weights]
    label = {(a, w): "".join(f" ({x})" for x, n in zip(a, (len(set(b[0] for b in attentions)),
                                                          len(set(b[1] for b in attentions)))) if n > 1) + w
             for a, w in variants}
    cases = {}  # (context, q_len, variant) -> a zero-argument step
    for c in contexts:
        for a in attentions:
            engine = prepared_engine(model, ids[:c], SpecConfig("ngram", args.k), attention=a[0],
                                     extra_tokens=max(contexts) - c, kv_cache_dtype=a[1])
            for q in (1, args.k + 1):
                for w, params in weights.items():
                    loop = StepLoop(engine, q, params=params)
                    cases[(c, q, (a, w))] = _undonated(loop) if args.no_donate else loop
                    jax.block_until_ready(cases[(c, q, (a, w))]())  # compile
        cache = engine.runner.state.cache
        print(f"  context {c}: prepared (kv length {int(cache.lengths[0])}, {cache.num_pages} pages of "
              f"{cache.page_size})", flush=True)
    best = {key: float("inf") for key in cases}
    for _ in range(args.rounds):
        for key, fn in cases.items():
            best[key] = min(best[key], best_ms(fn, repeats=args.repeats, compile=False))
    rows = []
    for var in variants:  # each against its own decode step at the shortest context
        base = best[(contexts[0], 1, var)]
        for c in contexts:
            d, v = best[(c, 1, var)], best[(c, args.k + 1, var)]
            rows.append({"context": f"{c}{label[var]}", "decode ms": f"{d:.1f}", f"decode vs {contexts[0]}": f"{d / base:.2f}x",
                         f"verify k={args.k} ms": f"{v:.1f}", f"verify vs decode at {contexts[0]}": f"{v / base:.2f}x",
                         "verify / decode": f"{v / d:.2f}x"})
    print()
    print(common.table(rows, list(rows[0])))


def _undonated(loop: StepLoop):
    """The loop's step without the donation: every call starts from the same state."""
    fn = jax.jit(loop.fn.__wrapped__)
    return lambda: fn(loop.params, loop.state, *loop.extra)[0]


if __name__ == "__main__":
    main()
