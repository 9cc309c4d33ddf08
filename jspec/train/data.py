"""Training data for drafts: prompts that are not the benchmark's, the target's own greedy
continuations of them, and the target's features and choices along each sequence.

Prompts come from the Python standard library on this machine: each is a function signature
plus its docstring, the shape of a HumanEval prompt, but none of HumanEval's 164 problems (the
benchmark's prompts stay held out). The target then writes the continuation, so the draft
learns what *this* target produces, which is what speculative decoding must predict.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import random
import sysconfig
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.cache.paged import init_cache
from jspec.models.llama import forward, output_embedding


def stdlib_prompts(count: int, seed: int = 0, min_doc_chars: int = 60, max_chars: int = 1500) -> list[str]:
    """``count`` prompts ``def name(args):\\n    \"\"\"docstring\"\"\"\\n`` from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in path.parts or path.name.startswith("test"):
            continue
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or len(doc) < min_doc_chars or not node.body:
                continue
            first = node.body[0]
            text = "\n".join(lines[node.lineno - 1:first.end_lineno])
            indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
            text = "\n".join(line[indent:] for line in text.splitlines()) + "\n"
            if len(text) <= max_chars:
                found.append(text)
    random.Random(seed).shuffle(found)
    return found[:count]


@dataclasses.dataclass
class DraftData:
    """Sequences (prompt + the target's continuation) and the target's view of them."""

    tokens: np.ndarray  # int32 [N, L]
    lengths: np.ndarray  # int32 [N]
    prompt_lengths: np.ndarray  # int32 [N]
    features: Optional[np.ndarray] = None  # float32 [N, L, H]: target final hidden states
    argmax: Optional[np.ndarray] = None  # int32 [N, L]: target's greedy next token after position t

    def fingerprint(self) -> str:
        return hashlib.sha256(self.tokens.tobytes() + self.lengths.tobytes()).hexdigest()[:16]

    def save(self, path: Path) -> None:
        from jspec.loading.drafts import save_tensors

        t = {"tokens": self.tokens, "lengths": self.lengths, "prompt_lengths": self.prompt_lengths}
        if self.features is not None:
            t.update(features=self.features, argmax=self.argmax)
        save_tensors(path, t)

    @classmethod
    def load(cls, path: Path) -> "DraftData":
        from jspec.loading.drafts import load_tensors

        t = load_tensors(path)
        return cls(t["tokens"], t["lengths"], t["prompt_lengths"], t.get("features"), t.get("argmax"))


def generate_sequences(target, prompts: list[str], max_new_tokens: int, batch_size: int = 16,
                       progress: Optional[Callable[[int], None]] = None, static: bool = False) -> DraftData:
    """Greedy continuations of ``prompts`` by the target (EOS respected).

    Through the serving engine: ``batch_size`` sequences decode together, and the moment one
    finishes its slot takes the next prompt (continuous batching: no sequence waits for the
    slowest of a batch, no padding to the longest). ``static=True`` runs the old way, static
    batches of ``batch_size`` prompts of similar length through ``generate`` (kept to measure the
    difference, ``benchmarks/bench_datagen.py``). Both give the same tokens: greedy decoding in
    the engine does not depend on what else runs beside a sequence."""
    from jspec.config import EngineConfig, SamplingParams
    from jspec.engine.engine import LLMEngine
    from jspec.engine.generate import generate

    ids = [target.tokenizer(p)["input_ids"] for p in prompts]
    sp = SamplingParams(max_tokens=max_new_tokens)
    seqs: dict[int, list[int]] = {}
    if static:
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            out = generate(target, [ids[i] for i in batch], sp)
            for i, new in zip(batch, out.token_ids):
                seqs[i] = ids[i] + new
            if progress:
                progress(len(batch))
    else:
        longest = max(map(len, ids)) + max_new_tokens
        max_len = min(-(-longest // 64) * 64, target.config.max_position_embeddings)
        engine = LLMEngine(target, EngineConfig(max_num_seqs=batch_size, max_num_batched_tokens=batch_size + 512,
                                                max_model_len=max_len, kv_cache_tokens=batch_size * max_len,
                                                max_burst_steps=16, enable_prefix_caching=False))
        reqs = [engine.add_request(str(i), x, sp) for i, x in enumerate(ids)]
        while engine.has_unfinished_requests():
            done = sum(out.finished for out in engine.step())
            if progress and done:
                progress(done)
        seqs = {i: ids[i] + list(r.output_ids) for i, r in enumerate(reqs)}
    width = max(len(s) for s in seqs.values())
    tokens = np.zeros((len(ids), width), np.int32)
    for i, s in seqs.items():
        tokens[i, :len(s)] = s
    return DraftData(tokens, np.asarray([len(seqs[i]) for i in range(len(ids))], np.int32),
                     np.asarray([len(x) for x in ids], np.int32))


def add_target_features(target, data: DraftData, batch_size: int = 8,
                        progress: Optional[Callable[[int], None]] = None) -> DraftData:
    """Run the target over every sequence once: its final hidden state and greedy choice at
    each position (exactly what a verification pass computes there)."""
    cfg = target.config
    n, width = data.tokens.shape
    page = 16
    pages = -(-width // page)

    @jax.jit
    def run(params, tokens, lengths):
        b = tokens.shape[0]
        tables = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, tables, b * pages, page,
                           jnp.dtype(cfg.dtype))
        h = forward(params, cfg, tokens, cache, lengths, attention="reference", compute_logits=False).hidden
        logits = jnp.einsum("bth,vh->btv", h, output_embedding(params, cfg))
        return h.astype(jnp.float32), jnp.argmax(logits, -1).astype(jnp.int32)

    feats = np.zeros((n, width, cfg.hidden_size), np.float32)
    best = np.zeros((n, width), np.int32)
    for s in range(0, n, batch_size):
        tok = np.zeros((batch_size, width), np.int32)
        lens = np.zeros((batch_size,), np.int32)
        m = min(batch_size, n - s)
        tok[:m], lens[:m] = data.tokens[s:s + m], data.lengths[s:s + m]
        h, a = run(target.params, jnp.asarray(tok), jnp.asarray(lens))
        feats[s:s + m], best[s:s + m] = np.asarray(h[:m]), np.asarray(a[:m])
        if progress:
            progress(m)
    return dataclasses.replace(data, features=feats, argmax=best)


def draft_vocabulary(data: DraftData, size: int, always: tuple[int, ...] = ()) -> np.ndarray:
    """The ``size`` tokens the target chooses most often in ``data`` (plus ``always``), sorted."""
    mask = np.arange(data.tokens.shape[1])[None, :] < data.lengths[:, None]
    counts = np.bincount(data.argmax[mask].ravel(), minlength=1)
    top = list(np.argsort(-counts, kind="stable")[:size])
    ids = sorted(set(int(t) for t in top if counts[t] > 0) | set(always))
    return np.asarray(ids[:max(size, len(always))], np.int32)
