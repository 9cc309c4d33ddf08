"""Losses of the two draft kinds, on a batch of target sequences (see :mod:`jspec.train.data`).

A batch: ``tokens`` int32 [B, L], ``lengths`` int32 [B], ``prompt_lengths`` int32 [B],
``features`` [B, L, H] (the target's final hidden states), ``layer_features`` [B, L, n * H]
(the residual stream after an EAGLE-3 head's layers), ``labels`` int32 [B, L] (the target's
greedy next token after position t, as an index into the draft vocabulary, -1 when outside it).

- EAGLE heads (arXiv:2401.15077, arXiv:2503.01840): trained through the training-time test,
  ``depth`` passes in which pass j predicts the target's choice at t from the chain drafting
  would have started at the true entry t - j (:func:`~jspec.models.eagle.eagle_ttt_forward`).
  EAGLE-1 also regresses the target's final hidden state and sees noisy input features; EAGLE-3
  trains on tokens only. :func:`chain_acceptance` scores a head the same way on held-out data.
- small Llama: KL(p_target || q_draft) per position, both over the draft vocabulary (the
  target's distribution there renormalized), i.e. knowledge distillation on the tokens the
  draft can propose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jspec.cache.paged import init_cache
from jspec.config import ModelConfig
from jspec.models.eagle import eagle_ttt_forward, num_features_of
from jspec.models.llama import forward


def fresh_cache(config: ModelConfig, num_layers: int, batch: int, length: int, page_size: int = 16):
    pages = -(-length // page_size)
    tables = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    return init_cache(num_layers, config.num_kv_heads, config.head_dim, tables, batch * pages, page_size,
                      jnp.dtype(config.dtype))


def _position_mask(batch):
    b, length = batch["tokens"].shape
    t = jnp.arange(length)[None, :]
    return (t < batch["lengths"][:, None]) & (t >= 1)  # entry 0 has no previous feature


def head_inputs(head, frozen, batch):
    """(token embeddings [B, L, H], the target's feature F_{t-1} at each position t [B, L, F]):
    the final hidden state for an EAGLE-1 head, the fused layers' residual for an EAGLE-3 one."""
    feats = batch["layer_features"] if num_features_of(head) else batch["features"]
    prev = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1).astype(frozen["embedding"].dtype)
    return jnp.take(frozen["embedding"], batch["tokens"], axis=0), prev


def eagle_loss(config: ModelConfig, depth: int = 1, noise: float = 0.2, feature_weight: float = 1.0,
               token_weight: float = 0.1, decay: float = 1.0):
    """The head's loss over ``depth`` passes of the training-time test
    (:func:`~jspec.models.eagle.eagle_ttt_forward`): pass j predicts the target's choice at
    position t from the chain started at the true entry t - j, as drafting runs it.

    Per pass: cross-entropy of the draft-vocabulary logits against the target's choice (weight
    ``token_weight``); an EAGLE-1 head also regresses the target's final hidden state (smooth L1,
    ``feature_weight``; EAGLE-1's 1.0 / 0.1) and gets uniform noise of +-``noise`` on its input
    features (EAGLE-1's remedy for chained drafting's drift). An EAGLE-3 head trains on tokens
    only (its chained output is no feature of the target's): loss = cross-entropy, no noise.
    Pass j weighs ``decay ** j`` (normalized). Metrics ``acc{j+1}``: top-1 agreement with the
    target at pass j (given the earlier tokens, as when the earlier drafts were accepted).
    """

    def loss_fn(head, frozen, batch, key):
        labels = batch["labels"]
        emb, prev = head_inputs(head, frozen, batch)
        eagle3 = num_features_of(head) > 0
        if noise and not eagle3:
            prev = prev + jax.random.uniform(key, prev.shape, prev.dtype, -noise, noise)
        passes = eagle_ttt_forward(head, config, emb, prev, depth)
        mask = _position_mask(batch)
        t = jnp.arange(labels.shape[1])[None, :]
        total, weights, metrics = 0.0, 0.0, {}
        for j, f_hat in enumerate(passes):
            valid = mask & (t - j >= 1)
            ok = valid & (labels >= 0)
            n_ok = jnp.maximum(jnp.sum(ok), 1)
            logits = jnp.einsum("bth,vh->btv", f_hat, frozen["lm_head"])
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
            loss = jnp.sum(jnp.where(ok, ce, 0)) / n_ok
            if not eagle3:
                vloss = jnp.mean(optax.huber_loss(f_hat, batch["features"].astype(f_hat.dtype), delta=1.0), axis=-1)
                v = jnp.sum(jnp.where(valid, vloss, 0)) / jnp.maximum(jnp.sum(valid), 1)
                loss = feature_weight * v + token_weight * loss
            total, weights = total + decay ** j * loss, weights + decay ** j
            metrics[f"acc{j + 1}"] = jnp.sum(ok & (jnp.argmax(logits, -1) == labels)) / n_ok
        return total / weights, metrics

    return loss_fn


def chain_acceptance(config: ModelConfig, k: int, temperature: float = 0.0):
    """``fn(head, frozen, batch) -> (accepted [k], starts)``: held-out acceptance per position of
    a k-token chain, from the training-time test, at every start t of the target's own
    continuation (``batch["prompt_lengths"] - 1 <= t``, ``t + k <= length``).

    Greedy (``temperature`` 0): ``accepted[j]`` counts starts whose drafts 1..j+1 all equal the
    target's choices, exactly what greedy verification accepts on that continuation (the chain's
    inputs are then the sequence's own tokens). Sampled: the expected count, the product over the
    chain of ``sum_x min(p(x), q(x))`` (Leviathan et al.'s per-token acceptance) with p the
    target's and q the head's distribution at ``temperature`` along the target's greedy
    continuation, an estimate (sampled drafts leave that path). ``frozen`` needs ``lm_full``:
    the target's whole output embedding [V, H], and ``vocab_ids`` [V']."""

    def fn(head, frozen, batch):
        labels = batch["labels"]
        emb, prev = head_inputs(head, frozen, batch)
        passes = eagle_ttt_forward(head, config, emb, prev, k)
        b, length = labels.shape
        t = jnp.arange(length)[None, :]
        starts = ((t >= jnp.maximum(batch["prompt_lengths"] - 1, 1)[:, None])
                  & (t + k <= batch["lengths"][:, None]))  # [B, L]
        shift = lambda x, j: jnp.pad(x, ((0, 0), (0, j)))[:, j:]  # noqa: E731  x[t + j]
        if temperature == 0.0:
            hits = [(jnp.argmax(jnp.einsum("bth,vh->btv", f, frozen["lm_head"]), -1) == labels) & (labels >= 0)
                    for f in passes]
            run = jnp.ones((b, length), bool)
            acc = []
            for j, hit in enumerate(hits):
                run = run & shift(hit, j)
                acc.append(jnp.sum(run & starts))
            return jnp.stack(acc).astype(jnp.float32), jnp.sum(starts)
        p = jax.nn.softmax(jnp.einsum("bth,vh->btv", batch["features"].astype(jnp.float32), frozen["lm_full"])
                           / temperature, axis=-1)
        p_draft = jnp.take(p, frozen["vocab_ids"], axis=-1)  # q is 0 outside the draft vocabulary
        run = jnp.ones((b, length), jnp.float32)
        acc = []
        for j, f in enumerate(passes):
            q = jax.nn.softmax(jnp.einsum("bth,vh->btv", f, frozen["lm_head"]) / temperature, axis=-1)
            alpha = jnp.sum(jnp.minimum(p_draft, q), axis=-1)
            run = run * shift(alpha, j)
            acc.append(jnp.sum(jnp.where(starts, run, 0.0)))
        return jnp.stack(acc), jnp.sum(starts)

    return fn


def distill_loss(config: ModelConfig):
    def loss_fn(trainable, frozen, batch, key):
        del key
        tokens = batch["tokens"]
        b, length = tokens.shape
        params = dict(trainable, embed_tokens={"embedding": frozen["embedding"]})
        h = forward(params, config, tokens, fresh_cache(config, config.num_layers, b, length), batch["lengths"],
                    attention="reference", compute_logits=False).hidden
        logits = jnp.einsum("bth,vh->btv", h, frozen["lm_head"])
        target = jax.nn.softmax(jnp.einsum("bth,vh->btv", batch["features"], frozen["lm_head"]), axis=-1)
        mask = _position_mask(batch) | (jnp.arange(length)[None, :] == 0)
        kl = jnp.sum(target * (jnp.log(jnp.maximum(target, 1e-30)) - jax.nn.log_softmax(logits)), axis=-1)
        n = jnp.maximum(jnp.sum(mask), 1)
        agree = jnp.sum(mask & (jnp.argmax(logits, -1) == jnp.argmax(target, -1))) / n
        return jnp.sum(jnp.where(mask, kl, 0)) / n, {"acc1": agree}

    return loss_fn
