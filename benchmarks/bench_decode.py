"""Autoregressive decode: jspec vs Hugging Face transformers, same model, prompts and tokens.

    python benchmarks/bench_decode.py [--prompts 6] [--max-new-tokens 64] [--compare-int8-activations]

Greedy, batch 1, every prompt generates exactly ``max_new_tokens`` (EOS ignored on both sides:
``ignore_eos`` / ``min_new_tokens``). jspec and transformers run interleaved prompt by prompt so
machine noise hits both; the ratio is the result. The floor is the weight bytes one token must
read over the measured memory read bandwidth: jspec's decode step reads the GGUF file's own Q4_1
/ Q8_0 blocks (``LoadedModel.quantized``, 112 MB for SmolLM2-135M), so its floor is those bytes'; the
float32 floor (538 MB, what transformers' dequantized model and jspec's float32 copy read) is
printed beside it. ``--compare-int8-activations`` also runs jspec with
``quantized_activations=True`` (int8 products on the same blocks, the same bytes) interleaved, and
prints its numbers against the same floor.
"""

from __future__ import annotations

import argparse

import numpy as np

import common  # noqa: F401  (environment)

import jspec
from jspec.models.cpu_path import small_rows_apply


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compare-int8-activations", action="store_true")
    args = ap.parse_args()
    n = args.max_new_tokens

    model = jspec.load_model()
    hf = common.load_hf_peer()
    prompts = common.humaneval_prompts(0, args.prompts)
    ids = [model.tokenizer(p)["input_ids"] for p in prompts]
    sp = jspec.SamplingParams(max_tokens=n, ignore_eos=True)

    jspec.generate(model, [ids[0]], sp)  # compile
    int8 = [0, 0.0, 0, 0.0]  # with quantized_activations: tokens, seconds, decode tokens, decode seconds
    if args.compare_int8_activations:
        jspec.generate(model, [ids[0]], sp, quantized_activations=True)
    common.hf_generate(hf, ids[0], 4, min_new_tokens=4)  # warm up
    rows, tot = [], {"jspec": [0, 0.0], "hf": [0, 0.0]}
    decode = [0, 0.0]  # jspec's tokens after the first, and the time after the first token (no prefill)
    same = 0
    for i, x in enumerate(ids):
        r = jspec.generate(model, [x], sp)
        if args.compare_int8_activations:
            q = jspec.generate(model, [x], sp, quantized_activations=True)
            int8[0] += q.num_tokens
            int8[1] += q.total_s
            int8[2] += q.num_tokens - 1
            int8[3] += q.total_s - q.ttft_s
        hf_toks, hf_s = common.hf_generate(hf, x, n, min_new_tokens=n)
        same += r.token_ids[0] == hf_toks
        tot["jspec"][0] += r.num_tokens
        tot["jspec"][1] += r.total_s
        decode[0] += r.num_tokens - 1
        decode[1] += r.total_s - r.ttft_s
        tot["hf"][0] += len(hf_toks)
        tot["hf"][1] += hf_s
        rows.append({"prompt": i, "prompt tokens": len(x), "jspec tok/s": f"{r.tokens_per_second:.1f}",
                     "transformers tok/s": f"{len(hf_toks) / hf_s:.1f}",
                     "ratio": f"{r.tokens_per_second / (len(hf_toks) / hf_s):.2f}",
                     "jspec TTFT ms": f"{r.ttft_s * 1e3:.0f}"})
    j = tot["jspec"][0] / tot["jspec"][1]
    h = tot["hf"][0] / tot["hf"][1]
    reads = common.read_bandwidths()
    bw = max(reads.values())
    f32_bytes = model.config.num_params() * 4  # float32; the tied LM head reads the embedding
    # what a decode step reads: the blocks of the quantized projections and LM head, the rest
    # (norm gains, the embedding row looked up) in float32
    weight_bytes = f32_bytes
    if model.quantized and small_rows_apply("float32"):  # the engine reads the blocks (the CPU kernels run)
        covered = sum(int(np.prod(w.shape)) for w in _covered(model))
        weight_bytes = (sum(q.nbytes for q in model.quantized.values())
                        + 4 * (model.config.num_params() - covered + model.config.hidden_size))
    floor = bw * 1e9 / weight_bytes
    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"model: SmolLM2-135M-Instruct (Q4_1 GGUF: jspec reads its blocks, transformers dequantizes it to "
          f"float32), greedy, batch 1, "
          f"{n} new tokens per prompt, {len(ids)} HumanEval prompts\n")
    print(common.table(rows, list(rows[0])))
    print(f"\njspec {j:.1f} tok/s, transformers {h:.1f} tok/s: **jspec / transformers = {j / h:.2f}x**; "
          f"identical greedy tokens on {same}/{len(ids)} prompts")
    print("reads of 512 MB: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in reads.items()))
    print(f"floor: {weight_bytes / 1e6:.0f} MB of weights per token at {bw:.1f} GB/s (the best read) "
          f"= {floor:.1f} tok/s upper bound; jspec reaches {j / floor:.0%} of it "
          f"(the float32 floor: {f32_bytes / 1e6:.0f} MB = {bw * 1e9 / f32_bytes:.1f} tok/s)")
    d = decode[0] / decode[1]
    print(f"jspec's decode steps alone (time after the first token, no prefill): {1e3 / d:.1f} ms per token, "
          f"{d:.1f} tok/s = {d / floor:.0%} of the floor")
    if args.compare_int8_activations:
        qj, qd = int8[0] / int8[1], int8[2] / int8[3]
        print(f"with int8 activations (quantized_activations): {qj:.1f} tok/s = {qj / j:.2f}x jspec's exact products, "
              f"{qj / h:.2f}x transformers; decode steps {1e3 / qd:.1f} ms per token = {qd / floor:.0%} of the floor")


def _covered(model):
    """The float32 parameters the quantized blocks stand in for (their float32 form, same shapes)."""
    from jspec.models.llama import output_embedding

    for where in model.quantized:
        if where == ("lm_head_rows",):
            yield output_embedding(model.params, model.config)
        else:
            node = model.params
            for key in where:
                node = node[key]
            yield node["kernel"]


if __name__ == "__main__":
    main()
