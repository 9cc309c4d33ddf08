"""Pallas kernels of jspec.

Each kernel file has the same shape: the kernel body, a jitted wrapper with static tile
arguments and explicit ``ValueError`` shape checks, and a ``*_reference`` in plain ``jnp``
with the same signature. Tile tables live in :mod:`pallas_kernels.tuning`.
"""

from pallas_kernels.paged_verify_attention import (
    check_paged_verify_args,
    paged_verify_attention,
    paged_verify_attention_reference,
)

__all__ = ["check_paged_verify_args", "paged_verify_attention", "paged_verify_attention_reference"]
