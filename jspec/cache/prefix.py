"""Keys of full pages for the prefix cache.

Page i of a sequence is identified by all the tokens up to its end: its key is
``sha256(key of page i - 1 || tokens of page i)``, starting from a salt that names everything
else the cached K/V depend on (the engine's model and drafter). Two sequences share page i only
if their first ``(i + 1) * page_size`` tokens are equal, so a shared page holds exactly the
K/V the other sequence would have computed.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def page_keys(tokens: Sequence[int], page_size: int, salt: bytes = b"", num_tokens: int | None = None) -> list[bytes]:
    """Keys of the full pages among the first ``num_tokens`` tokens (default: all)."""
    n = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
    arr = np.asarray(tokens[:n], np.int64)
    keys, parent = [], hashlib.sha256(salt).digest()
    for i in range(n // page_size):
        parent = hashlib.sha256(parent + arr[i * page_size:(i + 1) * page_size].tobytes()).digest()
        keys.append(parent)
    return keys
