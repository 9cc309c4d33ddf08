"""Control flow that keeps big buffers in place.

``lax.cond`` copies: an XLA conditional's result is a buffer of its own, so a branch that
updates the KV page pool (or a drafter's pages) writes a full copy of it, and the decode loop
around it copies it back into its carry. On the CPU that was two copies of the whole pool per
speculative step (at 8 slots x 1,024 tokens of SmolLM2-135M, 2 x 755 MB: a lone request's step
went from 53 to 119 ms). A while loop's carry is updated in place, so :func:`cond_in_place` runs
the chosen branch as a loop of zero or one trip instead: same result as ``lax.cond``, no copy.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def cond_in_place(pred, true_fn: Callable, false_fn: Callable, buffers: Any):
    """``true_fn(buffers)`` if ``pred`` else ``false_fn(buffers)``, updating ``buffers`` in place.

    Each branch takes ``buffers`` (a pytree, typically the page pools) and returns
    ``(new_buffers, out)`` with the same structure, shapes and dtypes as the other branch's. The
    branches must read the pools from their argument, not from an enclosing scope: a closed-over
    buffer stays live next to the carry and XLA copies it again. Returns ``(new_buffers, out)``.
    """
    _, out_shape = jax.eval_shape(true_fn, buffers)
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

    def once(fn):
        def body(carry):
            bufs, _, _ = carry
            new_bufs, res = fn(bufs)
            return new_bufs, res, jnp.bool_(True)
        return body

    pred = jnp.asarray(pred, bool)
    carry = (buffers, out, jnp.bool_(False))
    carry = jax.lax.while_loop(lambda c: pred & ~c[2], once(true_fn), carry)
    carry = jax.lax.while_loop(lambda c: ~pred & ~c[2], once(false_fn), (carry[0], carry[1], jnp.bool_(False)))
    return carry[0], carry[1]
