"""The engine's side of tensor parallelism: the target, its drafter and the decode state put
on a mesh by the rules of :mod:`jspec.parallel`.

- target: KV repeat rule and per-device column layout (:mod:`jspec.models.tensor_parallel`),
  weights sharded over heads / MLP / vocabulary;
- drafters on the target's weights (EAGLE's decoder layer, layer skip) follow the target's
  layout; a separate draft model is sharded by the same rule when its heads allow it and
  replicated otherwise; anything else a drafter holds is replicated;
- decode state: the target's pages (and a sharded drafter's) over KV heads, the rest replicated.

The state is built directly with its shardings (no full-size copy on one device), and the
jitted steps keep it so: GSPMD propagates the shardings and attention runs inside shard_map.
"""

from __future__ import annotations

import dataclasses

import jax

from jspec import parallel
from jspec.cache.paged import PAGE_AXES
from jspec.errors import ConfigError
from jspec.models.eagle import is_published
from jspec.models.tensor_parallel import param_axes, tp_config, tp_layer, tp_params
from jspec.speculative.drafters.draft_model import DraftModelDrafter
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.layerskip import LayerSkipDrafter


def shard_target(model, mesh):
    """A LoadedModel with the tp config and its weights on ``mesh``."""
    config = tp_config(model.config, mesh.shape[parallel.TP])
    params = tp_params(model.params, model.config, config)
    return dataclasses.replace(model, config=config, params=parallel.put_tree(params, mesh, param_axes(params)))


def shard_drafter(drafter, dparams, target_config, tp_target_config, mesh):
    """(drafter, drafter params) for ``mesh``; ``target_config`` is the one-device config."""
    tp = mesh.shape[parallel.TP]
    if drafter is None:
        return None, None
    if isinstance(drafter, EagleDrafter):
        head = dict(dparams["head"])
        if is_published(head):  # its attention and MLP sit at the top of the head
            head.update(tp_layer({"self_attn": head["self_attn"], "mlp": head["mlp"]}, target_config,
                                 tp_target_config))
        else:
            head["layer"] = tp_layer(head["layer"], target_config, tp_target_config)
        dparams = {**dparams, "head": head}
        return dataclasses.replace(drafter, config=tp_target_config), parallel.put_tree(dparams, mesh, param_axes(dparams))
    if isinstance(drafter, LayerSkipDrafter):
        return dataclasses.replace(drafter, config=tp_target_config), dparams
    if isinstance(drafter, DraftModelDrafter):
        try:
            config = tp_config(drafter.config, tp)
        except ConfigError:  # heads or MLP that tp does not divide: the draft is replicated
            return drafter, parallel.put_tree(dparams, mesh)
        if drafter.draft_vocab:
            dparams = {**dparams, "model": tp_params(dparams["model"], drafter.config, config)}
        else:
            dparams = tp_params(dparams, drafter.config, config)
        return dataclasses.replace(drafter, config=config), parallel.put_tree(dparams, mesh, param_axes(dparams))
    return drafter, (None if dparams is None else parallel.put_tree(dparams, mesh))


def state_axes(state, drafter):
    """Logical axes of every leaf of a DecodeState (shapes suffice: an eval_shape result)."""
    drafter_tp = getattr(getattr(drafter, "config", None), "tensor_parallel", 1) > 1

    def axes(path, x):
        names = [str(getattr(p, "name", getattr(p, "key", p))) for p in path]
        pages = len(names) >= 2 and names[1] in ("k_pages", "v_pages")
        if pages and (names[0] == "cache" or (names[0] == "drafter" and drafter_tp)):
            return PAGE_AXES
        return (None,) * len(x.shape)

    return jax.tree_util.tree_map_with_path(axes, state)


def build_state(make, mesh, drafter, *args):
    """``make(*args)`` (a DecodeState) computed straight into its shardings on ``mesh``."""
    shape = jax.eval_shape(make, *args)
    leaves, treedef = jax.tree_util.tree_flatten(shape)
    axes = treedef.flatten_up_to(state_axes(shape, drafter))
    out = treedef.unflatten([parallel.sharding(mesh, a, x.shape) for x, a in zip(leaves, axes)])
    return jax.jit(make, out_shardings=out)(*args)
