"""jspec end to end on a GPU: speculative vs plain greedy decoding through the Pallas kernel.

Made to run right after ``gpu_attention.py`` in the same device call (the real model's GGUF is
~98 MB and cannot travel to the device machine, so the model here is a randomly initialised
Llama of a chosen shape; tokens are ids, no tokenizer):

    python benchmarks/gpu_e2e.py [--out DIR] [--budget-s 120] [--shape smollm2|1b]

For each (attention, batch) it runs greedy autoregressive decoding and n-gram speculative
decoding (k = 4) with ``jspec.generate`` and reports: whether the speculative tokens equal the
autoregressive tokens (the losslessness check, on the GPU), tokens/s of each, the speculative
speedup, the mean accepted length, and the time of a speculative step over a plain step
(mean accepted length x AR tok/s / n-gram tok/s: with random weights the drafts are rarely
accepted, but the prompts' repeats make n-gram propose on every step, so this is what a k = 4
verification costs against a decode step at that batch size). Then it compares the two attention implementations'
greedy tokens (pallas vs xla: equal up to float rounding near ties). Results are appended and
flushed to DIR/gpu_e2e.md as they come; each case is isolated (an error is printed, the next
case runs). ``--smoke`` runs a tiny shape on the CPU with the kernel in interpret mode.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.config import ModelConfig, SamplingParams, SpecConfig  # noqa: E402
from jspec.loading import LoadedModel  # noqa: E402
from jspec.models.llama import init_params  # noqa: E402

SHAPES = {
    # SmolLM2-135M's shape (30 layers, 9 / 3 heads of 64), random weights.
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3, head_dim=64),
    # Llama-3.2-1B's shape with a 32k vocabulary.
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, head_dim=64),
    "tiny": dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16),
}


def random_model(shape: str, dtype: str, seed: int = 0) -> LoadedModel:
    config = ModelConfig(**SHAPES[shape], max_position_embeddings=4096, dtype=dtype,
                         eos_token_ids=())
    params = init_params(config, jax.random.key(seed))
    # Scaled so greedy choices are far from ties (as the tests' tiny models).
    params = jax.tree_util.tree_map(lambda p: p * 2.0 if p.ndim > 1 else p, params)
    return LoadedModel(config, params, None, pathlib.Path(shape), "random")


def prompts(batch: int, vocab: int, length: int = 48) -> list[list[int]]:
    """Prompts with repeated phrases, so the n-gram drafter has something to match."""
    rng = np.random.default_rng(batch)
    out = []
    for _ in range(batch):
        phrase = rng.integers(2, vocab, 12).tolist()
        out.append((phrase * (length // 12 + 1))[:length])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("OUT") or "out"))
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--impls", default="pallas,xla", help="attention implementations")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, CPU, interpret mode")
    args = ap.parse_args()
    if args.smoke:
        args.shape, args.max_tokens, args.batches, args.dtype = "tiny", 12, "2", "float32"
    deadline = time.time() + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / "gpu_e2e.md"

    def line(text: str = "") -> None:
        print(text, flush=True)
        with open(md, "a") as f:
            f.write(text + "\n")

    impls = ("interpret", "xla") if args.smoke else tuple(args.impls.split(","))
    dev = jax.devices()[0]
    line(f"\n# jspec end to end, {time.strftime('%Y-%m-%d %H:%M:%S')}: {dev.platform} "
         f"{dev.device_kind}, jax {jax.__version__}, random {args.shape} model, {args.dtype}, "
         f"greedy, {args.max_tokens} new tokens, prompts of 48 tokens\n")
    line("| attention | batch | AR tok/s | ngram:4 tok/s | speedup | mean accepted | step / AR step | "
         "spec == AR | compile s (AR, spec) |")
    line("|---|---|---|---|---|---|---|---|---|")
    model = random_model(args.shape, args.dtype)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    ar_tokens = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        ps = prompts(batch, model.config.vocab_size)
        for impl in impls:
            if time.time() > deadline:
                line(f"| {impl} | {batch} | skipped: time budget |")
                continue
            try:
                runs, compile_s = {}, {}
                for name, spec in (("ar", SpecConfig()),
                                   ("ngram", SpecConfig("ngram", num_speculative_tokens=4))):
                    warm = jspec.generate(model, ps, sp, spec=spec, attention=impl)
                    compile_s[name] = warm.compile_s
                    runs[name] = jspec.generate(model, ps, sp, spec=spec, attention=impl)
                ar, ng = runs["ar"], runs["ngram"]
                ar_tokens[(impl, batch)] = ar.token_ids
                same = sum(a == b for a, b in zip(ar.token_ids, ng.token_ids))
                first = min(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                            for a, b in zip(ar.token_ids, ng.token_ids))
                line(f"| {impl} | {batch} | {ar.tokens_per_second:.1f} | "
                     f"{ng.tokens_per_second:.1f} | "
                     f"{ng.tokens_per_second / ar.tokens_per_second:.2f}x | "
                     f"{ng.mean_accepted_length:.2f} | "
                     f"{ng.mean_accepted_length * ar.tokens_per_second / ng.tokens_per_second:.2f}x | "
                     f"{same}/{batch} (first difference at {first}) | "
                     f"{compile_s['ar']:.0f}, {compile_s['ngram']:.0f} |")
            except Exception as e:  # noqa: BLE001 -- report, keep going
                first = (str(e).strip().splitlines() or [""])[0][:200]
                line(f"| {impl} | {batch} | **error** {type(e).__name__}: {first} |")
                traceback.print_exc()
        a, b = (ar_tokens.get((impl, batch)) for impl in (impls + impls)[:2])
        if len(impls) > 1 and a is not None and b is not None:
            agree = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), len(s))
                     for s, t in zip(a, b)]
            line(f"| {impls[0]} vs xla AR | {batch} | identical prompts "
                 f"{sum(x == len(s) for x, s in zip(agree, a))}/{batch}; first difference at "
                 f"token {min(agree)} (min over prompts) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
