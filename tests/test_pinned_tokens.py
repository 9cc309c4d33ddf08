"""The real model's tokens, pinned: greedy and sampled output of every drafter on SmolLM2-135M
equals the sequences in ``data/pinned_tokens.json``, recorded with this suite's settings on the CPU
kernel path (an AVX-512 host, 2026-12-06, git 2a54b73).

A refactoring of the model, the kernels or the engine that changes one bit of a logit that
matters shows up here as a changed token, even where speculative output still equals plain
output (both would move together). Greedy sequences must also equal AR's for every drafter.

``JSPEC_PIN_RECORD=1`` writes the file anew instead of comparing (after a change that is meant to
move the numbers; say so in the commit).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from pallas_kernels.cpu import build as cpu_kernels

pytestmark = pytest.mark.slow

DATA = pathlib.Path(__file__).parent / "data" / "pinned_tokens.json"
PROMPTS = ["def fibonacci(n):", "The capital of France is"]
METHODS = {
    "ar": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "layerskip": {"method": "layerskip", "num_speculative_tokens": 2, "layers": 15},
    "draft": {"method": "draft_model", "model": "smollm2-135m-draft", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "model": "smollm2-135m-eagle", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3},
    "hybrid": {"method": "hybrid", "model": "smollm2-135m-eagle3", "num_speculative_tokens": 3},
}
RECORD = os.environ.get("JSPEC_PIN_RECORD") == "1"


@pytest.fixture(scope="module")
def sequences(smollm2):
    from jspec import LLM, SamplingParams

    out = {}
    for name, spec in METHODS.items():
        llm = LLM(smollm2, speculative_config=spec, max_num_seqs=2)
        for label, sp in (("greedy", SamplingParams(max_tokens=32)),
                          ("sampled", SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7))):
            out[f"{name}/{label}"] = [list(r.outputs[0].token_ids) for r in llm.generate(PROMPTS, sp)]
    if RECORD:
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(out, indent=1) + "\n")
    return out


@pytest.mark.skipif(not cpu_kernels.preferred("small_rows"), reason="pinned on the CPU kernel path "
                    "(AVX-512 or AVX2 + FMA); XLA's own products round differently")
@pytest.mark.parametrize("key", [f"{m}/{s}" for m in METHODS for s in ("greedy", "sampled")])
def test_tokens_are_the_pinned_ones(sequences, key):
    pinned = json.loads(DATA.read_text())
    assert sequences[key] == pinned[key], key


def test_greedy_speculation_is_plain_greedy(sequences):
    for name in METHODS:
        assert sequences[f"{name}/greedy"] == sequences["ar/greedy"], name
