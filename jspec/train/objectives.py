"""Losses of the two draft kinds, on a batch of target sequences (see :mod:`jspec.train.data`).

A batch: ``tokens`` int32 [B, L], ``lengths`` int32 [B], ``features`` [B, L, H] (the target's
final hidden states), ``labels`` int32 [B, L] (the target's greedy next token after position t,
as an index into the draft vocabulary, -1 when outside it).

- EAGLE head (arXiv:2401.15077): entry t sees (token_t, f_{t-1}) and regresses f_t (smooth L1)
  plus cross-entropy of its draft-vocabulary logits against the target's choice, weighted
  1.0 / 0.1 as in the paper; input features get uniform noise (the paper's remedy for the
  feature drift of chained drafting), and ``unroll`` > 1 also trains on the head's own
  predicted features (entry t fed f^_{t-1}), as drafting does from the second token on.
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
from jspec.models.eagle import eagle_forward
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


def eagle_loss(config: ModelConfig, noise: float = 0.2, unroll: int = 2, feature_weight: float = 1.0,
               token_weight: float = 0.1):
    def loss_fn(head, frozen, batch, key):
        tokens, feats, labels = batch["tokens"], batch["features"], batch["labels"]
        b, length = tokens.shape
        emb = jnp.take(frozen["embedding"], tokens, axis=0)
        mask = _position_mask(batch)
        prev = jnp.concatenate([jnp.zeros_like(feats[:, :1]), feats[:, :-1]], axis=1)
        prev = prev + jax.random.uniform(key, prev.shape, prev.dtype, -noise, noise)
        total, metrics = 0.0, {}
        for depth in range(unroll):
            f_hat, _ = eagle_forward(head, config, emb, prev, fresh_cache(config, 1, b, length), batch["lengths"])
            vloss = jnp.mean(optax.huber_loss(f_hat, feats, delta=1.0), axis=-1)  # smooth L1
            logits = jnp.einsum("bth,vh->btv", f_hat, frozen["lm_head"])
            ok = mask & (labels >= 0)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
            n_ok = jnp.maximum(jnp.sum(ok), 1)
            v = jnp.sum(jnp.where(mask, vloss, 0)) / jnp.maximum(jnp.sum(mask), 1)
            p = jnp.sum(jnp.where(ok, ce, 0)) / n_ok
            acc = jnp.sum(ok & (jnp.argmax(logits, -1) == labels)) / n_ok
            total = total + feature_weight * v + token_weight * p
            metrics[f"acc{depth + 1}"] = acc
            # next depth: entry t is fed the head's own prediction of f_{t-1}
            prev = jnp.concatenate([jnp.zeros_like(f_hat[:, :1]), f_hat[:, :-1]], axis=1)
        return total / unroll, metrics

    return loss_fn


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
