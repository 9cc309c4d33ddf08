"""Replay n-gram prompt lookup over the target's own greedy continuations: how many steps each
request would take at each (k, longest match, shortest match), and what that is worth under a
verification cost, without running speculative decoding once per setting.

    python benchmarks/ngram_replay.py [--start 16] [--count 148] [--max-tokens 128]
                                      [--ks 2,3,4,6,8] [--lookups 3:1,3:2,4:1,4:2,4:3]
                                      [--verify-slopes 0.025,0.05] [--cache FILE]
                                      [--history-tokens 0,8192]

Greedy speculative decoding commits exactly the plain greedy tokens, so a lookup setting's
steps follow from those tokens alone: at each step the lookup proposes from the committed
tokens (the rule of ``jspec.speculative.drafters.ngram``: for n from the longest match down to
the shortest, the latest earlier occurrence of the last n tokens; its continuation, cut at the
committed text, up to k tokens), the leading drafts equal to the next greedy tokens are
accepted, and one more token comes from the target. A step that proposes nothing is a plain
decode step (cost 1); a step that verifies costs ``1 + slope * k`` decode steps (the engine's
verify / decode ratio at batch 1 on this CPU was 1.1-1.3x at k = 4). Reported per setting: the
median over requests of each request's decode-time speedup (what a server's p50 time per
output token sees) and the aggregate over all tokens (what offline throughput sees). With
``--history-tokens``, the requests run one after another and each also looks up in the last
TOKENS tokens of the ones before it (the engine's ``ngram_history`` rule).

The continuations come from the engine (plain greedy, 16 slots) and are cached in ``--cache``.
The default prompts, HumanEval 16..163, leave out the 0..15 and 0..31 that the engine and
server benchmarks run, so a setting chosen here is not fitted to them. Checked against the
engine's own counters on four requests (64 new tokens, k = 4, matches of 3 down to 2): the same
drafting steps and proposed tokens; steps and accepted tokens differ only by the last step
(the engine counts drafts accepted past ``max_tokens`` and one step more).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

import common


HISTORY_MIN_MATCH = 2  # jspec.speculative.drafters.ngram's rule for matches in the history


def lookup(seq: np.ndarray, t: int, k: int, n_max: int, n_min: int, history: np.ndarray | None = None) -> np.ndarray:
    """The drafts proposed after the first ``t`` tokens of ``seq`` (possibly none); ``history``:
    earlier requests' text, -1 between requests (the engine's ``ngram_history``)."""
    for n in range(n_max, n_min - 1, -1):
        if t >= n + 1:
            windows = sliding_window_view(seq[:t - 1], n)  # starts i with i + n < t: an earlier occurrence
            hits = np.nonzero((windows == seq[t - n:t]).all(axis=1))[0]
            if len(hits):
                start = hits[-1] + n
                return seq[start:min(start + k, t)]
        if history is not None and n >= HISTORY_MIN_MATCH and t >= n and len(history) > n:
            windows = sliding_window_view(history[:-1], n)  # a continuation token follows ...
            hits = np.nonzero((windows == seq[t - n:t]).all(axis=1) & (history[n:] != -1))[0]  # ... of that request
            if len(hits):
                cont = history[hits[-1] + n:hits[-1] + n + k]
                ends = np.nonzero(cont == -1)[0]
                return cont[:ends[0]] if len(ends) else cont
    return seq[:0]


def replay(seq: np.ndarray, prompt_len: int, k: int, n_max: int, n_min: int,
           history: np.ndarray | None = None) -> list[tuple[int, int]]:
    """(drafts proposed, drafts accepted) per decode step after the prefill's first token."""
    t, steps = prompt_len + 1, []
    while t < len(seq):
        drafts = lookup(seq, t, k, n_max, n_min, history)
        accepted = 0
        while accepted < len(drafts) and t + accepted < len(seq) and drafts[accepted] == seq[t + accepted]:
            accepted += 1
        steps.append((len(drafts), accepted))
        t += accepted + 1
    return steps


def speedups(runs: list[tuple[int, list]], k: int, slope: float) -> tuple[float, float]:
    """(median per-request speedup, aggregate speedup) of decode time over plain decoding."""
    costs = [(tokens, sum(1.0 + slope * k if proposed else 1.0 for proposed, _ in steps))
             for tokens, steps in runs if tokens > 8]  # a request that stops at once has no decode time to speak of
    per_request = [tokens / cost for tokens, cost in costs]
    return float(np.median(per_request)), sum(t for t, _ in costs) / sum(c for _, c in costs)


def continuations(start: int, count: int, max_tokens: int, cache: Path) -> list[tuple[np.ndarray, int]]:
    if cache.exists():
        data = np.load(cache)
        if data["meta"].tolist() == [start, count, max_tokens]:
            return [(data[f"s{i}"], int(data["prompt_lens"][i])) for i in range(count)]
    import jspec
    from bench_engine import engine_for, offline, spec_of
    from jspec.config import SamplingParams

    model = jspec.load_model()
    ids = [model.tokenizer(p)["input_ids"] for p in common.humaneval_prompts(start, count)]
    max_model_len = -(-(max(map(len, ids)) + max_tokens) // 64) * 64
    engine = engine_for(model, spec_of("ar"), 16, max_model_len)
    out, _, _ = offline(engine, ids, SamplingParams(max_tokens=max_tokens))
    seqs = [np.asarray(p + o, np.int32) for p, o in zip(ids, out)]
    np.savez(cache, meta=np.asarray([start, count, max_tokens]), prompt_lens=np.asarray([len(p) for p in ids]),
             **{f"s{i}": s for i, s in enumerate(seqs)})
    return [(s, len(p)) for s, p in zip(seqs, ids)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--start", type=int, default=16)
    ap.add_argument("--count", type=int, default=148)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ks", default="2,3,4,6,8")
    ap.add_argument("--lookups", default="3:1,3:2,4:1,4:2,4:3", help="LONGEST:SHORTEST match lengths")
    ap.add_argument("--verify-slopes", default="0.025,0.05", help="a verifying step costs 1 + slope * k decode steps")
    ap.add_argument("--cache", default="/tmp/jspec-ngram-replay.npz")
    ap.add_argument("--history-tokens", default="0",
                    help="lookup history sizes to replay (the engine's ngram_history): the requests, in order, "
                         "each see the last TOKENS tokens of the ones before it")
    args = ap.parse_args()
    data = continuations(args.start, args.count, args.max_tokens, Path(args.cache))
    slopes = [float(s) for s in args.verify_slopes.split(",")]
    print(f"HumanEval {args.start}..{args.start + args.count - 1}, greedy, up to {args.max_tokens} new tokens; "
          "speedup of decode time over plain decoding, median request / aggregate\n")
    print("| history tokens | k | longest:shortest match | drafting steps | accepted per draft | "
          + " | ".join(f"slope {s}" for s in slopes) + " |")
    print("|---|---|---|---|---|" + "---|" * len(slopes))
    for size in [int(x) for x in args.history_tokens.split(",")]:
        histories = [None] * len(data)
        if size:
            flat = np.concatenate([np.r_[-1, seq] for seq, _ in data]).astype(np.int64)
            ends = np.cumsum([len(seq) + 1 for seq, _ in data])
            histories = [np.r_[np.full(size, -1), flat[:end - len(seq) - 1]][-size:] for (seq, _), end in zip(data, ends)]
        for k in [int(x) for x in args.ks.split(",")]:
            for pair in args.lookups.split(","):
                n_max, n_min = map(int, pair.split(":"))
                runs = [(len(seq) - plen - 1, replay(seq, plen, k, n_max, n_min, h)) for (seq, plen), h in zip(data, histories)]
                steps = [s for _, st in runs for s in st]
                drafting = sum(1 for p, _ in steps if p)
                accepted = sum(a for _, a in steps) / max(drafting, 1)
                cells = [f"{m:.2f} / {a:.2f}" for m, a in (speedups(runs, k, s) for s in slopes)]
                print(f"| {size} | {k} | {n_max}:{n_min} | {drafting / len(steps):.2f} | {accepted:.2f} | "
                      + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
