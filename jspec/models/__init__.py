"""Llama-family models as pure functions over parameter pytrees."""

from jspec.models.llama import LlamaForCausalLM, forward, init_params, rope_inv_freq

__all__ = ["LlamaForCausalLM", "forward", "init_params", "rope_inv_freq"]
