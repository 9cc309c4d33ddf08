"""Llama weights laid out for tensor parallelism, and the logical axes of every weight.

:func:`tp_config` applies the KV repeat rule (:func:`jspec.parallel.kv_heads_for`) and sets
``tensor_parallel``; :func:`tp_params` rewrites a one-device parameter tree into that layout:

    qkv_proj  [H, (Hq + 2 KVH) D]  ->  [H, tp x (Hq/tp + 2 KVH'/tp) D]   (KV heads repeated to KVH')
    gate_up   [H, 2 I]             ->  [H, tp x 2 x I/tp]

so that the device owning column block i holds the Q, K and V heads (and the gate and up
slices) it computes with: the fused matmuls shard evenly and need no collective. With tp = 1
both layouts are the same. :func:`param_axes` names each weight's logical axes; the rules in
:mod:`jspec.parallel` map them to the mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jspec import parallel
from jspec.config import ModelConfig

# (parent module, leaf) -> logical axes; any other weight (norms, EAGLE's fc) is replicated
_AXES = {
    ("embed_tokens", "embedding"): ("vocab", "embed"),  # [V, H]
    ("lm_head", "kernel"): ("embed", "vocab"),  # [H, V]
    ("qkv_proj", "kernel"): ("embed", "heads"),  # [H, (Hq + 2 KVH) D], grouped per device
    ("qkv_proj", "bias"): ("heads",),
    ("o_proj", "kernel"): ("heads", "embed"),  # [Hq D, H]
    ("gate_up_proj", "kernel"): ("embed", "mlp"),  # [H, 2 I], grouped per device
    ("down_proj", "kernel"): ("mlp", "embed"),  # [I, H]
}


def tp_config(config: ModelConfig, tp: int) -> ModelConfig:
    """``config`` for ``tp`` devices (ConfigError, naming the heads, when tp does not fit)."""
    kv = parallel.kv_heads_for(config.num_heads, config.num_kv_heads, tp)
    return dataclasses.replace(config, num_kv_heads=kv, tensor_parallel=tp)


def _qkv(cols: np.ndarray, old: ModelConfig, new: ModelConfig) -> np.ndarray:
    """[..., (Hq + 2 KVH) D] in the one-device layout -> the layout of ``new``."""
    d, tp = old.head_dim, new.tensor_parallel
    lead = cols.shape[:-1]
    q, k, v = np.split(cols, [old.q_size, old.q_size + old.kv_size], axis=-1)
    rep = new.num_kv_heads // old.num_kv_heads
    k, v = (np.repeat(x.reshape(*lead, old.num_kv_heads, d), rep, axis=-2) for x in (k, v))  # [..., KVH', D]
    parts = [x.reshape(*lead, tp, -1) for x in (q, k, v)]  # [..., tp, heads/tp * D]
    return np.concatenate(parts, axis=-1).reshape(*lead, -1)


def _gate_up(cols: np.ndarray, tp: int) -> np.ndarray:
    """[..., 2 I] as [gate | up] -> [..., tp x 2 x I/tp]."""
    gate, up = np.split(cols, 2, axis=-1)
    lead = cols.shape[:-1]
    return np.stack([gate.reshape(*lead, tp, -1), up.reshape(*lead, tp, -1)], axis=-2).reshape(*lead, -1)


def tp_layer(layer: dict, old: ModelConfig, new: ModelConfig) -> dict:
    """One decoder layer's parameters (``self_attn``, ``mlp``, norms) in ``new``'s layout."""
    if old.tensor_parallel != 1:
        raise ValueError("tp_layer expects one-device weights")
    attn = dict(layer["self_attn"])
    attn["qkv_proj"] = {name: _qkv(np.asarray(w), old, new) for name, w in attn["qkv_proj"].items()}
    mlp = dict(layer["mlp"])
    mlp["gate_up_proj"] = {"kernel": _gate_up(np.asarray(mlp["gate_up_proj"]["kernel"]), new.tensor_parallel)}
    return {**layer, "self_attn": attn, "mlp": mlp}


def tp_params(params: dict, old: ModelConfig, new: ModelConfig) -> dict:
    """A whole model's parameters in ``new``'s layout (host numpy arrays; place them with
    :func:`jspec.parallel.put_tree` and :func:`param_axes`)."""
    out = jax.tree_util.tree_map(np.asarray, dict(params))
    for i in range(old.num_layers):
        out[f"layers_{i}"] = tp_layer(out[f"layers_{i}"], old, new)
    return out


def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def param_axes(params):
    """A tree like ``params`` with each weight's logical axes (None per dimension: replicated)."""
    def axes(path, x):
        names = tuple(_key(p) for p in path[-2:])
        return _AXES.get(names, (None,) * np.ndim(x))

    return jax.tree_util.tree_map_with_path(axes, params)
