"""A small optax training loop with periodic checkpoints and exact resume.

The loop owns nothing model-specific: it takes a loss ``loss_fn(trainable, frozen, batch, key)
-> (loss, metrics)``, the trainable and frozen parameter pytrees, and a ``batch_fn(step)`` that
returns the batch of a given step deterministically, so a resumed run sees the same batches as
an uninterrupted one. Training state (parameters, optimizer state, step) is saved as
safetensors under ``state_dir`` every ``checkpoint_every`` steps, atomically (no pickle).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jspec.errors import CheckpointError, ConfigError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    checkpoint_every: int = 100
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError("steps and batch_size must be >= 1")
        if not self.learning_rate > 0:
            raise ConfigError(f"learning_rate must be > 0, got {self.learning_rate}")

    def optimizer(self) -> optax.GradientTransformation:
        warmup = min(self.warmup_steps, max(self.steps - 1, 0))
        schedule = optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, warmup, self.steps,
                                                      self.learning_rate * 0.05)
        return optax.chain(optax.clip_by_global_norm(self.grad_clip),
                           optax.adamw(schedule, weight_decay=self.weight_decay))


def _flat_with_paths(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def _restore(template, flat: dict[str, np.ndarray], what: str):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    out = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        if key not in flat:
            raise CheckpointError(f"training state has no {what} entry {key}")
        out.append(jnp.asarray(flat[key], dtype=jnp.asarray(leaf).dtype).reshape(jnp.shape(leaf)))
    return jax.tree_util.tree_unflatten(treedef, out)


def save_state(state_dir: Path, step: int, params, opt_state, meta: dict) -> None:
    from jspec.loading.drafts import save_tensors, write_json

    save_tensors(state_dir / "params.safetensors", _flat_with_paths(params))
    save_tensors(state_dir / "opt_state.safetensors", _flat_with_paths(opt_state))
    write_json(state_dir / "state.json", dict(meta, step=step))  # written last: marks completeness


def load_state(state_dir: Path, params, opt_state, meta: dict):
    """(step, params, opt_state) from ``state_dir``; refuses a state of another run."""
    from jspec.loading.drafts import load_tensors

    info = json.loads((state_dir / "state.json").read_text())
    for key, value in meta.items():
        if info.get(key) != value:
            raise CheckpointError(f"{state_dir}: cannot resume, {key} was {info.get(key)!r}, now {value!r}")
    params = _restore(params, load_tensors(state_dir / "params.safetensors"), "parameter")
    opt_state = _restore(opt_state, load_tensors(state_dir / "opt_state.safetensors"), "optimizer")
    return int(info["step"]), params, opt_state


def train(loss_fn: Callable, trainable, frozen, batch_fn: Callable[[int], Any], tc: TrainConfig, *,
          state_dir: Optional[Path] = None, resume: bool = False, meta: Optional[dict] = None,
          progress: bool = True, log: Optional[Callable[[int, dict], None]] = None,
          validate: Optional[Callable[[Any], float]] = None):
    """Optimize ``trainable``; returns (trainable, history of per-step metric dicts).

    With ``validate(params) -> score`` (higher is better; or a dict of metrics with the score
    under ``"score"``), the parameters are scored at every checkpoint and the best-scoring ones
    are returned (early stopping on held-out data); the scores are in the history as
    ``validation`` (the metrics as ``validation_metrics``). When batches are dicts with
    ``lengths``, the history counts the training tokens seen so far (``tokens``).
    """
    opt = tc.optimizer()
    opt_state = opt.init(trainable)
    meta = dict(meta or {}, steps=tc.steps, batch_size=tc.batch_size, seed=tc.seed)
    start = 0
    best, best_score = trainable, float("-inf")
    if resume and state_dir is not None and (state_dir / "state.json").exists():
        start, trainable, opt_state = load_state(state_dir, trainable, opt_state, meta)
        best = trainable
        if validate is not None and (state_dir / "best.safetensors").exists():
            from jspec.loading.drafts import load_tensors

            best = _restore(trainable, load_tensors(state_dir / "best.safetensors"), "best parameter")
            best_score = float(json.loads((state_dir / "state.json").read_text()).get("best_score", "-inf"))

    @jax.jit
    def step_fn(params, opt_state, batch, key):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, batch, key)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, dict(metrics, loss=loss)

    history = []
    tokens = 0
    if start:
        tokens = int(json.loads((state_dir / "state.json").read_text()).get("tokens", 0))
    bar = None
    if progress:
        from tqdm import tqdm  # text bar everywhere: no ipywidgets needed in notebooks

        bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    for step in range(start, tc.steps):
        key = jax.random.fold_in(jax.random.key(tc.seed), step)
        batch = batch_fn(step)
        trainable, opt_state, metrics = step_fn(trainable, opt_state, batch, key)
        metrics = {k: float(v) for k, v in metrics.items()}
        if isinstance(batch, dict) and "lengths" in batch:
            tokens += int(np.asarray(batch["lengths"]).sum())
        history.append(dict(metrics, step=step + 1, tokens=tokens))
        if bar is not None:
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items()})
        if log is not None:
            log(step + 1, metrics)
        done = step + 1
        if done % tc.checkpoint_every == 0 or done == tc.steps:
            if validate is not None:
                scored = validate(trainable)
                score = float(scored["score"] if isinstance(scored, dict) else scored)
                history[-1]["validation"] = score
                if isinstance(scored, dict):
                    history[-1]["validation_metrics"] = {k: float(v) for k, v in scored.items() if k != "score"}
                if bar is not None:
                    shown = history[-1].get("validation_metrics") or {"score": score}
                    bar.write(f"step {done}: held-out " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
                if score > best_score:
                    best, best_score = trainable, score
                    if state_dir is not None:
                        from jspec.loading.drafts import save_tensors

                        save_tensors(state_dir / "best.safetensors", _flat_with_paths(best))
            if state_dir is not None:
                save_state(state_dir, done, trainable, opt_state, dict(meta, best_score=best_score, tokens=tokens)
                           if validate is not None else dict(meta, tokens=tokens))
    if bar is not None:
        bar.close()
    return (best if validate is not None else trainable), history
