"""Hugging Face transformers as a peer of ``jspec bench``: the same weights in PyTorch on the CPU.

:func:`transformers_peers` returns :class:`~jspec.bench.run.Method` rows whose ``run``
calls ``model.generate`` greedily with EOS respected: plain greedy, prompt lookup
(``prompt_lookup_num_tokens``) and, given a draft checkpoint, assisted generation with that
draft exported to a Hugging Face directory. Their tokens are compared with jspec AR's but a
difference does not fail the run (``lossless=False``): the two float32 implementations round
differently and a near-tie can flip. Time to first token comes from a streamer.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Optional

from jspec.bench.run import GREEDY, PROMPT_LOOKUP, Method, Run
from jspec.errors import CheckpointError, optional_import

PROMPT_LOOKUP_TOKENS = 10


def load_hf_model(model):
    """transformers' own load of a jspec model's checkpoint (a GGUF file or a HF directory)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    optional_import("torch", "jspec bench --peers transformers")  # transformers' models are PyTorch's
    from transformers import AutoModelForCausalLM

    src = Path(model.source)
    try:  # a GGUF is dequantized to float32; a directory loads in its own dtype
        if src.is_file():
            return AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name).eval()
        return AutoModelForCausalLM.from_pretrained(str(src)).eval()
    except Exception as e:  # transformers raises many kinds; one line is enough here
        raise CheckpointError(f"{src}: transformers cannot load it as a peer ({type(e).__name__}: {e})") from None


class _FirstToken:
    """A transformers streamer that notes when the first new token arrives."""

    def __init__(self):
        self.calls, self.t = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t is None:  # the first call carries the prompt
            self.t = time.perf_counter()

    def end(self):
        pass


def hf_generate(hf, ids: list[int], max_tokens: int, **kw) -> Run:
    torch = optional_import("torch", "jspec bench --peers transformers")
    x = torch.tensor([ids])
    eos = hf.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    streamer = _FirstToken()
    t = time.perf_counter()
    with torch.no_grad():
        try:
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad, streamer=streamer, **kw)
        except ValueError:  # some generation modes take no streamer
            streamer = None
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad, **kw)
    dt = time.perf_counter() - t
    ttft = streamer.t - t if streamer is not None and streamer.t is not None else None
    return Run(out[0, len(ids):].tolist(), dt, ttft)


def transformers_peers(model, assisted_draft: Optional[str] = None, hf=None) -> list[Method]:
    """Greedy and prompt lookup rows (and assisted generation with ``assisted_draft``, a
    small-llama draft checkpoint name or path, when given)."""
    hf = hf if hf is not None else load_hf_model(model)
    lookup = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    peers = [Method(GREEDY, run=lambda x, n: hf_generate(hf, x, n), lossless=False),
             Method(PROMPT_LOOKUP, run=lambda x, n: hf_generate(hf, x, n, **lookup), lossless=False)]
    if assisted_draft:
        from transformers import AutoModelForCausalLM

        from jspec.loading.drafts import export_hf, resolve_draft_path

        path = resolve_draft_path(assisted_draft)
        if path is None:
            raise CheckpointError(f"{assisted_draft}: no such draft checkpoint")
        # the shipped draft leaves out the embedding it shares with the target; the export adds it
        exported = export_hf(path, model, Path(tempfile.mkdtemp(prefix="jspec-draft-hf-")))
        assistant = AutoModelForCausalLM.from_pretrained(str(exported)).eval()
        peers.append(Method(f"transformers assisted ({path.name})",
                            run=lambda x, n: hf_generate(hf, x, n, assistant_model=assistant), lossless=False))
    return peers
