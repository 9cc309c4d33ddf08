"""Which drafter a hybrid step should use: a replay of drafting policies on the target's own text.

    python benchmarks/hybrid_policy.py [--start 64] [--count 100] [--max-tokens 128] [--k 4]
                                       [--head smollm2-135m-eagle3] [--json OUT]

Greedy verification accepts the longest prefix of a proposal that equals the target's greedy
continuation, and the committed text is that continuation whatever was drafted. So once the
target's continuation of each prompt is known (generated here through the engine) and the
head's chain is known at every position (the training-time test over the whole sequence,
:func:`jspec.models.eagle.eagle_ttt_forward`: exact for every draft up to the first miss, which
is all acceptance reads), every drafting policy can be replayed step by step without running
the engine: at committed length L the policy picks n-gram lookup or the head's chain, the step
accepts a drafts, L grows by a + 1. The replay prints each policy's mean accepted length (new
tokens / steps) and how often it used each drafter; the oracle row (the better of the two at
every step) bounds what any choice between them can reach.

The default prompts are HumanEval problems 64..163, apart from the 0..31 that ``jspec bench``
and BENCHMARKS.md report on, so a policy chosen here is then measured on prompts it was not
chosen on.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import common

import jspec
from jspec.loading.drafts import read_eagle
from jspec.models.eagle import eagle_ttt_forward
from jspec.train.data import DraftData, add_target_features, generate_sequences
from jspec.train.objectives import head_inputs


def head_chains(target, params, data, k: int, batch_size: int = 4):
    """(drafts int32 [N, L, k], first-draft probability float32 [N, L]): the head's chain of k
    drafts from every entry t (its pending token at t), as drafting builds it from true features."""
    head, rows, vocab_ids = params["head"], params["lm_head"], params["vocab_ids"]
    frozen = {"embedding": target.params["embed_tokens"]["embedding"]}

    @jax.jit
    def run(batch):
        emb, prev = head_inputs(head, frozen, batch)
        passes = eagle_ttt_forward(head, target.config, emb, prev, k)
        logits = [jnp.einsum("bth,vh->btv", f.astype(jnp.float32), rows.astype(jnp.float32)) for f in passes]
        best = jnp.stack([vocab_ids[jnp.argmax(x, -1)] for x in logits], -1)  # [B, T, k]: pass j at t
        p1 = jnp.max(jax.nn.softmax(logits[0], -1), -1)
        return best, p1

    n, width = data.tokens.shape
    passes = np.zeros((n, width, k), np.int32)
    p1 = np.zeros((n, width), np.float32)
    for s in range(0, n, batch_size):
        idx = np.arange(s, min(n, s + batch_size))
        b = {"tokens": jnp.asarray(data.tokens[idx]), "layer_features": jnp.asarray(data.layer_features[idx]),
             "features": jnp.asarray(data.features[idx])}
        best, p = run(b)
        passes[idx], p1[idx] = np.asarray(best), np.asarray(p)
    # the chain from entry t: draft j is pass j's prediction at position t + j
    chains = np.zeros_like(passes)
    for j in range(k):
        chains[:, :width - j, j] = passes[:, j:, j]
    return chains, p1


def ngram_lookup(tokens: np.ndarray, length: int, k: int, n_max: int, n_min: int,
                 pick: str = "latest") -> tuple[list[int], int]:
    """(drafts, matched n) of n-gram lookup at committed length ``length``; ([], 0) without a
    match. ``pick="latest"`` is jspec's (:func:`~jspec.speculative.drafters.ngram.ngram_propose`,
    no history): the latest earlier occurrence of the longest suffix that has one;
    ``"frequent"``: of that suffix's occurrences, the latest of those whose next token is the
    most frequent next token among them."""
    for n in range(n_max, n_min - 1, -1):
        if length < n + 1:
            continue
        suffix = tokens[length - n:length]
        starts = [i for i in range(length - n - 1, -1, -1) if np.array_equal(tokens[i:i + n], suffix)]
        if not starts:
            continue
        i = starts[0]  # the latest
        if pick == "frequent":
            nxt = [int(tokens[j + n]) for j in starts]
            best = max(set(nxt), key=lambda t: (nxt.count(t), -nxt.index(t)))
            i = starts[nxt.index(best)]
        return list(tokens[i + n:min(i + n + k, length)]), n
    return [], 0


def accepted(drafts, truth) -> int:
    a = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        a += 1
    return a


def replay(data, chains, p1, k: int, policies: dict) -> dict:
    """Each policy ``(lookup, choose)``: ``lookup`` = (n_max, pick) of its n-gram half, ``choose``
    picks "ngram", "head" or "extend" (the n-gram's drafts, then the head's chain after them)."""
    out = {}
    for name, ((n_max, pick), choose) in policies.items():
        steps = new = used_head = 0
        for i in range(len(data.lengths)):
            tokens, end, start = data.tokens[i], int(data.lengths[i]), int(data.prompt_lengths[i])
            length = start + 1  # the prefill's token is committed before the first step
            while length < end:
                truth = list(tokens[length:min(end, length + k)])
                ng, n = ngram_lookup(tokens, length, k, n_max, 1, pick)
                head = list(chains[i, length - 1])
                a_ng, a_head = accepted(ng, truth), accepted(head, truth)
                # n-gram drafts, the head's chain after them (inputs the true tokens while they are accepted)
                a_ext = a_ng if a_ng < len(ng) else len(ng) + accepted(head[len(ng):], truth[len(ng):])
                pick_ = choose(ng=ng, n=n, head=head, p1=float(p1[i, length - 1]), a_ng=a_ng, a_head=a_head,
                               a_ext=a_ext)
                used_head += pick_ != "ngram"
                a = {"head": a_head, "ngram": a_ng, "extend": a_ext}[pick_]
                length += a + 1
                steps += 1
            new += end - start - 1
        out[name] = {"mean accepted length": round(new / steps, 3), "steps": steps, "steps running the head": used_head}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=64)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--head", default="smollm2-135m-eagle3")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cache", default=None, help="an .npz of the sequences and chains: written, or read if it exists")
    args = ap.parse_args()
    k = args.k

    print(f"machine: {common.machine()}, git {common.git_rev()}", flush=True)
    cache = Path(args.cache) if args.cache else None
    if cache and cache.exists():  # the sequences and chains of an earlier run with the same arguments
        z = np.load(cache)
        data = DraftData(z["tokens"], z["lengths"], z["prompt_lengths"])
        chains, p1 = z["chains"], z["p1"]
    else:
        target = jspec.load_model()
        params, layers = read_eagle(args.head, target)
        prompts = common.humaneval_prompts(args.start, args.count)
        data = generate_sequences(target, prompts, args.max_tokens, batch_size=16)
        data = add_target_features(target, data, batch_size=8, feature_layers=layers)
        chains, p1 = head_chains(target, params, data, k)
        if cache:
            np.savez(cache, tokens=data.tokens, lengths=data.lengths, prompt_lengths=data.prompt_lengths,
                     chains=chains, p1=p1)

    def lookup(n_min):
        return lambda ng, n, **_: "ngram" if ng and n >= n_min else "head"

    jspecs = (3, "latest")  # the ngram_max of SpecConfig before 2026-12-03 (now 8), the latest occurrence
    policies = {
        "head only": (jspecs, lambda **_: "head"),
        **{f"n-gram only, n <= {n_max}, {pick} occurrence": ((n_max, pick), lambda **_: "ngram")
           for n_max in (3, 5, 8) for pick in ("latest", "frequent")},
        "hybrid, shortest match 1": (jspecs, lookup(1)),
        "hybrid, shortest match 2 (jspec's)": (jspecs, lookup(2)),
        "hybrid, shortest match 3": (jspecs, lookup(3)),
        **{f"hybrid, shortest match 2, n <= {n_max}, {pick} occurrence": ((n_max, pick), lookup(2))
           for n_max in (3, 5, 8) for pick in ("latest", "frequent") if (n_max, pick) != jspecs},
        "hybrid, match >= 2 and the head agrees on draft 1": (
            jspecs, lambda ng, n, head, **_: "ngram" if ng and n >= 2 and ng[0] == head[0] else "head"),
        "hybrid, match >= 3, or >= 1 and the head agrees": (
            jspecs, lambda ng, n, head, **_: "ngram" if ng and (n >= 3 or ng[0] == head[0]) else "head"),
        **{f"hybrid, match >= 2 unless the head is sure (p1 > {t})": (
            jspecs, lambda ng, n, head, p1, t=t, **_: "ngram" if ng and n >= 2 and (p1 <= t or ng[0] == head[0])
            else "head") for t in (0.5, 0.7, 0.9)},
        "hybrid, shortest match 2, the head's chain after a short match": (
            jspecs, lambda ng, n, **_: "extend" if ng and n >= 2 else "head"),
        "oracle: the better of the two every step": (
            jspecs, lambda a_ng, a_head, **_: "head" if a_head > a_ng else "ngram"),
        "oracle of the three (n-gram, head, n-gram then head)": (
            jspecs, lambda a_ng, a_head, a_ext, **_: max((a_ng, "ngram"), (a_ext, "extend"), (a_head, "head"))[1]),
    }
    results = replay(data, chains, p1, k, policies)
    rows = [{"policy": name, **r} for name, r in results.items()]
    print(f"\nHumanEval {args.start}..{args.start + args.count - 1}, {args.max_tokens} new tokens at most, k = {k}\n")
    print(common.table(rows, list(rows[0])))
    if args.json:
        Path(args.json).write_text(json.dumps({"k": k, "start": args.start, "count": args.count, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
