"""Which implementation of the model families a jitted step runs: one value the engine picks.

A :class:`ModelPath` is what steps and drafters call a model through (``forward``,
``forward_segments``, ``eagle_forward``, and ``times_rows``, a product by a table of rows such
as a draft vocabulary's LM head). :data:`PLAIN` runs the plain Flax modules of
:mod:`jspec.models.llama` and :mod:`jspec.models.eagle`, the same on every backend;
``jspec.models.cpu_path.CPU`` runs their subclasses, which put steps of a few rows on the C++
CPU kernels. Both read the same parameter trees (the CPU path also reads the packed copies that
``jspec.models.cpu_path.with_small_row_weights`` adds; the plain one ignores them). The engine
chooses the path once, for the backend it runs on, and hands it to its steps and drafters as a
static field: no layer of the plain model looks for kernels or packed weights.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from jspec.config import ModelConfig
from jspec.models import eagle, llama


@dataclasses.dataclass(frozen=True)
class ModelPath:
    """The plain path (hashable, no fields: a static argument of jitted steps). Subclasses swap
    the top modules and :meth:`times_rows`."""

    causal_lm: ClassVar[type] = llama.LlamaForCausalLM
    eagle_head: ClassVar[type] = eagle.EagleHead

    def forward(self, params, config: ModelConfig, tokens, cache, q_lens, **options) -> llama.ForwardOutput:
        """:func:`jspec.models.llama.forward` (same options) on this path's modules."""
        return llama.forward(params, config, tokens, cache, q_lens, module_cls=self.causal_lm, **options)

    def forward_segments(self, params, config: ModelConfig, segments, cache, **options):
        """:func:`jspec.models.llama.forward_segments` (same options) on this path's modules."""
        return llama.forward_segments(params, config, segments, cache, module_cls=self.causal_lm, **options)

    def eagle_forward(self, head_params, config: ModelConfig, embeds, prev, cache, q_lens, *args,
                      **options) -> eagle.HeadOutput:
        """:func:`jspec.models.eagle.eagle_forward` (same arguments) on this path's head."""
        return eagle.eagle_forward(head_params, config, embeds, prev, cache, q_lens, *args, head_cls=self.eagle_head,
                                   **options)

    def times_rows(self, x: jax.Array, rows: jax.Array, quantized: Optional[jax.Array] = None) -> jax.Array:
        """``x`` [..., K] times ``rows`` [N, K] transposed -> float32 [..., N] (a draft vocabulary's
        LM head). ``quantized``: the same rows in the CPU kernel's quantized layout, which a path
        may read instead (this one does not)."""
        return jnp.einsum("...k,nk->...n", x, rows, preferred_element_type=jnp.float32)


PLAIN = ModelPath()
