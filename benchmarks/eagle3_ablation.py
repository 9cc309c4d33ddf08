"""EAGLE-3's ideas one at a time: fused target layers, the training-time
test, the draft vocabulary's size, and the data mix, each trained the same number of steps on
the same data from the same warm start, scored on the same held-out continuations.

    python benchmarks/eagle3_ablation.py --data checkpoints/smollm2-135m-eagle3/.train/data.safetensors \
        [--steps 150] [--only A,B] [--json OUT]

Rows (every one: batch 8, learning rate 1e-3 warm-up-cosine, seed 0, the target's last layer as
the warm start):

    A  EAGLE-1: the final hidden state, one pass (teacher forcing; noise, feature regression)
    B  EAGLE-1 + training-time test (4 passes: every position of a k = 4 chain)
    C  EAGLE-3 fusion (low/middle/high layers), one pass (tokens only)
    D  EAGLE-3 fusion + training-time test (4 passes)
    E  D with a 2,048-token draft vocabulary (instead of the 8,192 most frequent target choices)
    G  D on the generated sequences only (no read windows)

Scores: greedy acceptance per position of a 4-token chain on the held-out target continuations
(exact for greedy verification on those continuations), its mean accepted length, and the T = 0.7
estimate (``jspec.train.objectives.chain_acceptance``); training seconds; and for the vocabulary
rows the time of one head step at batch 1 (what drafting pays per token, the LM head included).
The data file is the one ``jspec distill`` leaves in ``OUT/.train/`` (needs the EAGLE-3 layers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import common

import jspec
from jspec.cache.paged import init_cache
from jspec.models.eagle import eagle_forward, init_eagle_params
from jspec.models.llama import output_embedding
from jspec.speculative.drafters.base import draft_vocab_logits
from jspec.train.data import DraftData, draft_vocabulary
from jspec.train.distill import draft_labels, held_out_acceptance, make_batches, split_validation
from jspec.train.objectives import eagle_loss
from jspec.train.trainer import TrainConfig, train

ROWS = {  # name: (what, fused layers?, passes, draft vocabulary, generated sequences only)
    "A": ("EAGLE-1, 1 pass", False, 1, 8192, False),
    "B": ("EAGLE-1 + training-time test (4 passes)", False, 4, 8192, False),
    "C": ("EAGLE-3 fusion, 1 pass", True, 1, 8192, False),
    "D": ("EAGLE-3 fusion + training-time test (4 passes)", True, 4, 8192, False),
    "E": ("D, draft vocabulary 2,048", True, 4, 2048, False),
    "G": ("D, generated sequences only", True, 4, 8192, True),
}


def head_step_ms(target, head, vocab_ids, repeats: int = 20) -> float:
    """One drafting step of the head at batch 1 (head forward + draft-vocabulary LM head)."""
    cfg = target.config
    lm = jnp.take(output_embedding(target.params, cfg), vocab_ids, axis=0)
    cache = init_cache(1, cfg.num_kv_heads, cfg.head_dim, jnp.arange(64, dtype=jnp.int32)[None], 64, 16)
    cache = cache.replace(lengths=jnp.asarray([300], jnp.int32))

    @jax.jit
    def step(head, emb, feat, cache):
        out = eagle_forward(head, cfg, emb, feat, cache, jnp.ones((1,), jnp.int32), fused=True)
        return draft_vocab_logits(out.normed[:, 0], lm, vocab_ids, cfg.vocab_size)

    emb = jnp.ones((1, 1, cfg.hidden_size), jnp.float32)
    jax.block_until_ready(step(head, emb, emb, cache))
    t = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(step(head, emb, emb, cache))
    return (time.perf_counter() - t) / repeats * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--only", default=",".join(ROWS))
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    target = jspec.load_model()
    cfg = target.config
    data = DraftData.load(Path(args.data))
    print(f"machine: {common.machine()}, git {common.git_rev()}; data {len(data.lengths)} sequences, "
          f"{int(data.lengths.sum())} tokens, layers {list(data.feature_layers)}", flush=True)
    train_idx, val_idx = split_validation(len(data.lengths), 0.05, 0)
    rows = output_embedding(target.params, cfg)
    results = []
    for name in args.only.split(","):
        what, fused, passes, vocab, generated_only = ROWS[name]
        vocab_ids = draft_vocabulary(data, vocab, always=tuple(cfg.eos_token_ids))
        labels = draft_labels(data, vocab_ids, cfg.vocab_size)
        pool = train_idx[data.generated[train_idx]] if generated_only else train_idx
        tc = TrainConfig(steps=args.steps, batch_size=8, learning_rate=1e-3, warmup_steps=20, weight_decay=0.01,
                         checkpoint_every=args.steps, seed=0)
        batch_fn = make_batches(data, labels, tc.batch_size, tc.seed, pool=pool)
        frozen = {"embedding": target.params["embed_tokens"]["embedding"], "lm_head": jnp.take(rows, vocab_ids, 0)}
        head = init_eagle_params(cfg, jax.random.key(0), target.params, num_features=3 if fused else 0)
        t = time.perf_counter()
        head, history = train(eagle_loss(cfg, depth=passes), head, frozen, batch_fn, tc, progress=False)
        seconds = time.perf_counter() - t
        scores = held_out_acceptance(target, head, frozen, vocab_ids, data, labels, val_idx, 4)
        row = {"row": name, "what": what, "steps": args.steps, "train_seconds": round(seconds, 1),
               "training_tokens": history[-1]["tokens"], "final_loss": round(history[-1]["loss"], 4),
               "greedy": scores["T=0"]["all"], "T=0.7": scores["T=0.7"]["all"],
               "coverage": round(float(np.isin(data.argmax[np.arange(data.tokens.shape[1])[None] <
                                                           data.lengths[:, None]], vocab_ids).mean()), 4),
               "head_step_ms": round(head_step_ms(target, head, jnp.asarray(vocab_ids)), 2)}
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | what | greedy acceptance per position (k = 4) | mean accepted (k = 4) | T = 0.7 mean accepted "
          "| coverage | head step ms | train s |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        g, s = r["greedy"], r["T=0.7"]
        print(f"| {r['row']} | {r['what']} | {', '.join(f'{a:.3f}' for a in g['acceptance_per_position'])} | "
              f"{g['mean_accepted_length_by_k']['4']:.3f} | {s['mean_accepted_length_by_k']['4']:.3f} | "
              f"{r['coverage']:.3f} | {r['head_step_ms']} | {r['train_seconds']:.0f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"machine": common.machine(), "git": common.git_rev(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
