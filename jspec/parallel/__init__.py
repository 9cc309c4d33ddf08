"""Tensor parallelism on JAX's own SPMD machinery: one mesh axis, logical axes, one rules table.

Model code names *logical* axes (``"heads"``, ``"mlp"``, ``"vocab"``, ...) for every weight and
cache dimension; :data:`RULES` maps each to a mesh axis or to nothing (replicated). The mesh has
one axis, :data:`TP`. Target weights shard over heads, the MLP hidden dimension and the
vocabulary; KV pages over KV heads. GSPMD partitions the matmuls; attention runs per device
inside ``shard_map`` (heads are independent), so the cache is never gathered.

The KV repeat rule (:func:`kv_heads_for`): with fewer KV heads than devices, each KV head is
repeated ``tp / num_kv_heads`` times (in the K/V projections and in the pages) so every device
holds one; the query heads must divide by tp.

Multi-host: :func:`initialize_distributed` calls ``jax.distributed.initialize`` from arguments
or from ``JSPEC_COORDINATOR_ADDRESS`` / ``JSPEC_NUM_PROCESSES`` / ``JSPEC_PROCESS_ID`` (the
``JAX_*`` spellings are read too); afterwards ``jax.devices()`` lists every host's devices and
:func:`make_mesh` spans them. Every process runs the same program (multi-controller SPMD).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jspec.errors import ConfigError

TP = "tp"  # the mesh axis

# logical axis -> mesh axis (None: replicated). One table for every model and cache.
RULES: dict[str, Optional[str]] = {
    "vocab": TP,  # embedding rows, LM head columns
    "embed": None,  # the residual stream (hidden size)
    "heads": TP,  # query heads (and the fused QKV columns, grouped per device)
    "kv_heads": TP,  # KV heads of the pages
    "mlp": TP,  # the MLP hidden dimension (fused gate/up columns, grouped per device)
    "head_dim": None,
    "pages": None,
    "page_slots": None,
    "batch": None,
    "length": None,
}

Axes = tuple[Optional[str], ...]  # one logical name (or None) per array dimension


def kv_heads_for(num_heads: int, num_kv_heads: int, tp: int) -> int:
    """KV heads after the repeat rule for ``tp`` devices; ConfigError when tp does not fit."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if num_heads % tp:
        raise ConfigError(f"tensor_parallel_size {tp} does not divide the {num_heads} query heads")
    if num_kv_heads % tp == 0:
        return num_kv_heads
    if tp % num_kv_heads == 0:  # repeat each KV head tp / num_kv_heads times
        return tp
    raise ConfigError(f"tensor_parallel_size {tp} does not divide the {num_kv_heads} KV heads, nor do the KV "
                      f"heads divide it (to repeat them); choose a tp that divides both {num_heads} and "
                      f"{num_kv_heads}, or a multiple of {num_kv_heads} dividing {num_heads}")


def make_mesh(tp: int, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A one-axis mesh over the first ``tp`` devices (every process's, after
    :func:`initialize_distributed`)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise ConfigError(f"tensor_parallel_size {tp} needs {tp} devices; jax sees {len(devices)} "
                          f"({devices[0].platform}); on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tp} "
                          f"makes virtual ones")
    return Mesh(np.asarray(devices[:tp]), (TP,))


def abstract_mesh(tp: int) -> AbstractMesh:
    """The mesh's shape alone (what ``shard_map`` inside a jitted model needs)."""
    return AbstractMesh((tp,), (TP,))


def spec(axes: Axes, shape: Optional[tuple[int, ...]] = None, tp: Optional[int] = None) -> PartitionSpec:
    """PartitionSpec of logical ``axes`` under :data:`RULES`. With ``shape`` and ``tp``, a
    dimension that ``tp`` does not divide stays replicated."""
    out = []
    for i, a in enumerate(axes):
        m = RULES[a] if a is not None else None
        if m is not None and shape is not None and tp is not None and shape[i] % tp:
            m = None
        out.append(m)
    return PartitionSpec(*out)


def sharding(mesh: Mesh, axes: Axes, shape: Optional[tuple[int, ...]] = None) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, shape, mesh.shape[TP]))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def put(x, mesh: Mesh, axes: Optional[Axes] = None) -> jax.Array:
    """Place one array (numpy or jax) on ``mesh`` by logical ``axes`` (None: replicated). Works
    across processes: each builds only its own devices' shards, from identical host values."""
    x = np.asarray(x)
    s = sharding(mesh, axes, x.shape) if axes is not None else replicated(mesh)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])


def put_tree(tree, mesh: Mesh, axes_tree=None):
    """:func:`put` over a pytree; ``axes_tree`` mirrors it with an Axes tuple (or None) per leaf
    (None for the whole tree: everything replicated)."""
    if axes_tree is None:
        return jax.tree_util.tree_map(lambda x: put(x, mesh), tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    axes = treedef.flatten_up_to(axes_tree)
    return treedef.unflatten([put(x, mesh, a) for x, a in zip(leaves, axes)])


def to_host(x) -> np.ndarray:
    """A replicated array's value on this host (also when other processes hold devices of it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    return np.asarray(x.addressable_shards[0].data)


def _env(name: str) -> Optional[str]:
    return os.environ.get(f"JSPEC_{name}") or os.environ.get(f"JAX_{name}")


def initialize_distributed(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
    """``jax.distributed.initialize`` from the arguments or the environment (see the module
    docstring). Returns False (and does nothing) when neither names a coordinator. On CPUs the
    cross-process collectives go through gloo."""
    addr = coordinator_address or _env("COORDINATOR_ADDRESS")
    if not addr:
        return False
    n = num_processes if num_processes is not None else _env("NUM_PROCESSES")
    pid = process_id if process_id is not None else _env("PROCESS_ID")
    if n is None or pid is None:
        raise ConfigError("a coordinator address needs the number of processes and this process's id "
                          "(JSPEC_NUM_PROCESSES, JSPEC_PROCESS_ID)")
    try:
        n, pid = int(n), int(pid)
    except ValueError:
        raise ConfigError(f"num_processes and process_id must be integers, got {n!r}, {pid!r}") from None
    if not 0 <= pid < n:
        raise ConfigError(f"process_id must be in [0, {n}), got {pid}")
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # a jax without the option: its default applies
        pass
    jax.distributed.initialize(coordinator_address=addr, num_processes=n, process_id=pid)
    return True
