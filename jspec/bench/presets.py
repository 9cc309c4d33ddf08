"""Named ``jspec bench`` runs (``--preset NAME``): the method sweeps this project measures, each
defined once here. A preset supplies the options it names; any of them given on the command
line wins (``--methods``, ``--peers``, ``--profile`` / ``--no-profile``).

- ``spec``: jspec's autoregressive decode (the reference), n-gram lookup at k = 2, 4, 8, layer
  skip (15 layers, k = 2), and the shipped small-llama draft and EAGLE head at k = 2, 4, 6; with
  transformers' greedy, prompt-lookup and assisted generation (the shipped draft) beside them,
  and the draft / verify / plain step times. The numbers of BENCHMARKS.md's speculative table.
- ``spec-quick``: the same at k = 4 only, without layer skip.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

DRAFT, EAGLE = "smollm2-135m-draft", "smollm2-135m-eagle"  # drafts shipped in checkpoints/


@dataclasses.dataclass(frozen=True)
class Preset:
    """The options of one ``jspec bench`` run that a preset can set."""

    methods: str  # --methods: comma-separated, as jspec.bench.run.parse_methods reads them
    peers: str = ""  # --peers
    profile: bool = False  # --profile: time draft / verify / plain steps apart


def _sweep(ngram_ks, draft_ks, layerskip: bool) -> str:
    methods = ["ar"] + [f"ngram:{k}" for k in ngram_ks] + (["layerskip:15:2"] if layerskip else [])
    return ",".join(methods + [f"{kind}:{name}:{k}" for kind, name in (("draft", DRAFT), ("eagle", EAGLE))
                               for k in draft_ks])


DEFAULT = Preset(methods="ar,ngram:4")  # no --preset
PEERS = f"transformers,transformers-assisted:{DRAFT}"
PRESETS = {
    "spec": Preset(_sweep((2, 4, 8), (2, 4, 6), layerskip=True), PEERS, profile=True),
    "spec-quick": Preset(_sweep((4,), (4,), layerskip=False), PEERS, profile=True),
}


def expand(name: Optional[str] = None, *, methods: Optional[str] = None, peers: Optional[str] = None,
           profile: Optional[bool] = None) -> Preset:
    """The options a run uses: each one given (not None), else preset ``name``'s, else
    :data:`DEFAULT`'s."""
    given = {"methods": methods, "peers": peers, "profile": profile}
    return dataclasses.replace(PRESETS[name] if name else DEFAULT, **{k: v for k, v in given.items() if v is not None})
