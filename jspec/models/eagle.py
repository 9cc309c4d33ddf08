"""EAGLE-style draft heads: EAGLE-1 (Li et al., "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty", ICML 2024, arXiv:2401.15077) and the EAGLE-3 variant that
fuses several target layers (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", arXiv:2503.01840).

The head drafts at the *feature* level. F_t is what the target hands the head for position t:

- EAGLE-1 (``num_features`` = 0): the target's final hidden state after its final norm (the
  vector its LM head turns into the distribution of token t + 1);
- EAGLE-3 (``num_features`` = n): the residual stream after n chosen target layers (low, middle,
  high), concatenated [n * H]. Each layer's part is RMS-normalised without parameters first
  (SmolLM2's residual stream reaches 1e3 RMS at its attention-sink position and 1e4 in single
  dimensions, against ~3-30 elsewhere), then ``fuse`` [n * H] -> [H] mixes them.

Head entry t takes the current token and the previous position's feature,

    g_{t-1} = fuse(F_{t-1})  (EAGLE-3)   or   F_{t-1}  (EAGLE-1)
    x_t = fc([embed(token_t), g_{t-1}])            fc: [2H] -> [H]
    h_t = DecoderLayer(x_t; attention over entries <= t, its own one-layer paged cache)
    logits_t = RMSNorm(h_t) @ E_draft^T            E_draft: target embedding rows of the draft vocabulary

reusing the target's (frozen) embedding for both the token input and the LM head. Drafting
chains the head on its own output in place of g: RMSNorm(h_t) for EAGLE-1 (trained to regress
F_t), h_t itself for EAGLE-3 (trained only through the tokens it leads to). Verification then
hands back the target's true features, which replace the predicted ones in the head's cache.
Unlike the published EAGLE-3 layer (whose attention reads [embed; hidden] of width 2H), the
head keeps EAGLE-1's ``fc`` in front of a standard decoder layer, so the target's last layer
can warm-start it.

:func:`eagle_ttt_forward` is the *training-time test*: the head run ``depth`` times over whole
sequences, pass j continuing, at every position t, the chain that drafting would have started
from the true entry t - j, with the attention each chained entry has when drafting (true
entries <= t - j, then the chain's own entries). Positions 2..k are trained as they are used.

Parameters: ``fuse/kernel`` (EAGLE-3 only), ``fc/{kernel,bias}``, ``layer/...`` (a Llama decoder
layer with the target's dimensions), ``norm/scale``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jspec import attention as attention_lib
from jspec.cache.paged import PagedKVCache, init_cache
from jspec.config import ModelConfig
from jspec.models.llama import MLP, Attention, DecoderLayer, DenseContext, Linear, RMSNorm, Segment, segment_meta


class HeadOutput(NamedTuple):
    normed: jax.Array  # [B, T, H]: RMSNorm(h), what the draft-vocabulary LM head reads
    chained: jax.Array  # [B, T, H]: what the next chained entry takes in place of g
    context: object  # the new one-layer cache, or (k, v) [B, T, KVH, D] of a dense pass


def rms_parts(features: jax.Array, parts: int, eps: float = 1e-6) -> jax.Array:
    """Each of the ``parts`` equal pieces of the last axis scaled to unit RMS (float32 inside)."""
    x = features.astype(jnp.float32).reshape(*features.shape[:-1], parts, -1)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x.reshape(features.shape).astype(features.dtype)


def _run_on_context(module, x, shape: tuple[int, int], context, q_lens, rows, tree=None):
    """A head's layer (or attention) ``module`` on rows x [B * T, ...] of shape ``shape`` (B, T):
    over a :class:`~jspec.models.llama.DenseContext` (returns (out, (k, v))) or over the head's
    one-layer paged cache, ``q_lens`` rows each in cache rows ``rows`` (returns (out, the cache
    with the new K/V and lengths)); ``tree``: the rows of a token tree (TreeRows), as in a
    target's tree verification."""
    if isinstance(context, DenseContext):
        out, k, v = module(x, context, None, None)
        return out, (k, v)
    meta = segment_meta(Segment(jnp.zeros(shape, jnp.int32), q_lens, rows, tree=tree), context)
    out, k, v = module(x, (meta,), context.k_pages[0], context.v_pages[0])
    lengths = context.lengths + q_lens if rows is None else context.lengths.at[rows].add(q_lens, mode="drop")
    return out, context.replace(k_pages=(k,), v_pages=(v,), lengths=lengths)


class EagleHead(nn.Module):
    config: ModelConfig  # the target's
    attention: str = "reference"
    num_features: int = 0  # 0: EAGLE-1; n: EAGLE-3 fusion of n target layers
    linear_cls = Linear  # fuse and fc (jspec.models.cpu_path swaps in its own, as for the layer)
    layer_cls = DecoderLayer

    @nn.compact
    def __call__(self, embeds, prev, context, q_lens=None, rows=None, fused: bool = False, tree=None) -> HeadOutput:
        """embeds [B, T, H]; ``prev`` [B, T, n * H] the target's features F_{t-1} (``fused`` False)
        or [B, T, H] the head's own chained outputs (``fused`` True; EAGLE-1 takes [B, T, H] either
        way). ``context``: the head's paged cache (``q_lens`` rows each, ``rows`` picks the cache
        rows, None: all) or a :class:`~jspec.models.llama.DenseContext`."""
        cfg = self.config
        dtype = jnp.dtype(cfg.dtype)
        b, t = embeds.shape[:2]
        if self.num_features and not fused:
            prev = self.linear_cls(cfg.hidden_size, dtype=dtype, name="fuse")(rms_parts(prev.astype(embeds.dtype),
                                                                              self.num_features))
        x = self.linear_cls(cfg.hidden_size, use_bias=True, dtype=dtype, name="fc")(
            jnp.concatenate([embeds, prev.astype(embeds.dtype)], axis=-1))
        layer = self.layer_cls(cfg, self.attention, name="layer")
        x, new_context = _run_on_context(layer, x.reshape(b * t, -1), (b, t), context, q_lens, rows, tree)
        h = x.reshape(b, t, -1)
        normed = RMSNorm(cfg.rms_norm_eps, dtype, name="norm")(h)
        return HeadOutput(normed, h if self.num_features else normed, new_context)


class PublishedEagle3Head(nn.Module):
    """The EAGLE-3 head as its authors, SpecForge and vLLM publish it (``LlamaForCausalLMEagle3``),
    for heads trained elsewhere. Entry t takes token t's embedding and g_{t-1}: ``fc`` [3H] -> [H]
    of the target's three features (no bias, no normalisation first) or, when chaining, the
    head's own previous output h_{t-1}; its attention reads both, normalised apart, side by side:

        x_t = [input_layernorm(embed(token_t)); hidden_norm(g_{t-1})]        [2H]
        a_t = g_{t-1} + o_proj(attention(qkv_proj(x_t)))                      q/k/v read 2H
        h_t = a_t + mlp(post_attention_layernorm(a_t))
        logits_t = norm(h_t) @ lm_head^T                                       its own draft-vocabulary head

    The three features are the residual stream entering the target's layers (2, L/2, L - 3) by
    default, i.e. leaving layers (1, L/2 - 1, L - 4): jspec's ``feature_layers`` count the latter
    (:func:`jspec.loading.eagle_formats.read_published_eagle3`). ``config``: the target's, with
    the head's MLP width and, whatever the target's family, a Llama layer's attention (no QKV
    bias, no q/k norms). Parameters: ``fc``, ``input_layernorm``, ``hidden_norm``,
    ``self_attn`` (fused ``qkv_proj`` [2H, (Hq + 2 KVH) D], ``o_proj``),
    ``post_attention_layernorm``, ``mlp`` (fused ``gate_up_proj``, ``down_proj``), ``norm``."""

    config: ModelConfig
    attention: str = "reference"

    @nn.compact
    def __call__(self, embeds, prev, context, q_lens=None, rows=None, fused: bool = False, tree=None) -> HeadOutput:
        cfg = self.config
        dtype, eps = jnp.dtype(cfg.dtype), cfg.rms_norm_eps
        b, t = embeds.shape[:2]
        g = prev.astype(embeds.dtype)
        if not fused:
            g = Linear(cfg.hidden_size, dtype=dtype, name="fc")(g)
        g = g.reshape(b * t, -1)
        x = jnp.concatenate([RMSNorm(eps, dtype, name="input_layernorm")(embeds.reshape(b * t, -1)),
                             RMSNorm(eps, dtype, name="hidden_norm")(g)], axis=-1)
        a, new_context = _run_on_context(Attention(cfg, self.attention, name="self_attn"), x, (b, t), context,
                                         q_lens, rows, tree)
        h = g + a
        h = h + MLP(cfg, name="mlp")(RMSNorm(eps, dtype, name="post_attention_layernorm")(h))
        h = h.reshape(b, t, -1)
        return HeadOutput(RMSNorm(eps, dtype, name="norm")(h), h, new_context)


class PublishedEagle1Head(nn.Module):
    """The EAGLE-1 head as its authors publish it (``fc`` and ``layers.0.``) and as vLLM's
    ``speculators`` format does (``fusion_fc`` and ``transformer.``), for heads trained elsewhere.
    Entry t takes token t's embedding and g_{t-1}, the target's final hidden state (after its
    final norm) or, when chaining, the head's own previous output h_{t-1}:

        x_t = fc([embed(token_t); g_{t-1}])                  fc: [2H] -> [H], a bias where it has one
        a_t = x_t + o_proj(attention(x_t))                   no input norm: the layer's is removed
        h_t = a_t + mlp(post_attention_layernorm(a_t))
        logits_t = h_t @ E^T                                 the target's LM head, no norm

    h_t predicts the target's next hidden state, and chaining feeds it back as it is. With
    ``layernorms`` (``speculators``' variant) the embedding, the layer's input and h_t before the
    LM head are RMS-normalised (``embedding_layernorm``, ``input_layernorm``,
    ``pre_lm_head_layernorm``). ``config``: the target's, with the head's MLP width and QKV bias.
    Parameters: ``fc``, ``self_attn`` (fused ``qkv_proj``, ``o_proj``),
    ``post_attention_layernorm``, ``mlp`` (fused ``gate_up_proj``, ``down_proj``), and the three
    norms with ``layernorms``."""

    config: ModelConfig
    attention: str = "reference"
    fc_bias: bool = False
    layernorms: bool = False

    @nn.compact
    def __call__(self, embeds, prev, context, q_lens=None, rows=None, fused: bool = False, tree=None) -> HeadOutput:
        cfg = self.config
        dtype, eps = jnp.dtype(cfg.dtype), cfg.rms_norm_eps
        b, t = embeds.shape[:2]
        if self.layernorms:
            embeds = RMSNorm(eps, dtype, name="embedding_layernorm")(embeds)
        x = Linear(cfg.hidden_size, use_bias=self.fc_bias, dtype=dtype, name="fc")(
            jnp.concatenate([embeds, prev.astype(embeds.dtype)], axis=-1)).reshape(b * t, -1)
        inp = RMSNorm(eps, dtype, name="input_layernorm")(x) if self.layernorms else x
        a, new_context = _run_on_context(Attention(cfg, self.attention, name="self_attn"), inp, (b, t), context,
                                         q_lens, rows, tree)
        h = x + a
        h = (h + MLP(cfg, name="mlp")(RMSNorm(eps, dtype, name="post_attention_layernorm")(h))).reshape(b, t, -1)
        out = RMSNorm(eps, dtype, name="pre_lm_head_layernorm")(h) if self.layernorms else h
        return HeadOutput(out, h, new_context)


def is_published_eagle3(head_params) -> bool:
    """Whether head parameters are a :class:`PublishedEagle3Head`'s."""
    return "hidden_norm" in head_params


def is_published(head_params) -> bool:
    """Whether head parameters are a published head's (:class:`PublishedEagle3Head` or
    :class:`PublishedEagle1Head`: attention and MLP at the top), else an :class:`EagleHead`'s."""
    return "self_attn" in head_params


@functools.lru_cache(maxsize=None)
def _module(config: ModelConfig, attention: str, num_features: int = 0, head_cls: type = EagleHead) -> EagleHead:
    return head_cls(config, attention_lib.resolve(attention), num_features)


@functools.lru_cache(maxsize=None)
def _published_module(config: ModelConfig, attention: str, eagle1: tuple[bool, bool] | None = None) -> nn.Module:
    """A :class:`PublishedEagle3Head`, or with ``eagle1`` = (fc bias, layernorms) a
    :class:`PublishedEagle1Head`."""
    if eagle1 is None:
        return PublishedEagle3Head(config, attention_lib.resolve(attention))
    return PublishedEagle1Head(config, attention_lib.resolve(attention), *eagle1)


def num_features_of(head_params) -> int:
    """How many target layers a head's parameters fuse (0: an EAGLE-1 head)."""
    if is_published(head_params):
        kernel = head_params["fc"]["kernel"]  # [3H, H] of an EAGLE-3 head, [2H, H] of an EAGLE-1 one
        return kernel.shape[0] // kernel.shape[1] if is_published_eagle3(head_params) else 0
    fuse = head_params.get("fuse")
    if fuse is None:
        return 0
    kernel = fuse["kernel"]
    return kernel.shape[0] // kernel.shape[1]


def head_module(head_params, config: ModelConfig, attention: str = "reference", head_cls: type = EagleHead
                ) -> nn.Module:
    """The module that runs ``head_params``: ``head_cls`` (:class:`EagleHead` or a subclass with
    its parameters) for jspec's heads; :class:`PublishedEagle3Head` or
    :class:`PublishedEagle1Head` (the plain modules, on every path) for a published
    architecture's, at the MLP width and QKV bias its parameters have."""
    if not is_published(head_params):
        return _module(config, attention, num_features_of(head_params), head_cls)
    width = head_params["mlp"]["down_proj"]["kernel"].shape[0]
    bias = "bias" in head_params["self_attn"]["qkv_proj"]
    # a Llama layer whatever the target's family: no q/k norms, a QKV bias where it has one
    head = dataclasses.replace(config, intermediate_size=width, qkv_bias=bias, qk_norm=False)
    eagle1 = None if is_published_eagle3(head_params) else ("bias" in head_params["fc"],
                                                            "embedding_layernorm" in head_params)
    return _published_module(head, attention, eagle1)


def eagle_forward(head_params, config: ModelConfig, embeds, prev, cache: PagedKVCache, q_lens,
                  attention: str = "reference", rows=None, fused: bool = False, *,
                  head_cls: type = EagleHead, tree=None) -> HeadOutput:
    """Pure head forward over its paged cache (see :meth:`EagleHead.__call__`), with the module
    :func:`head_module` picks for the parameters."""
    with jax.named_scope("eagle_head"):
        return head_module(head_params, config, attention, head_cls).apply(
            {"params": head_params}, embeds, prev, cache, q_lens, rows, fused, tree)


def _ttt_attend(config: ModelConfig, earlier, depth: int):
    """The attention of pass ``depth`` of the training-time test: the query at position t sees
    the true entries (pass 0) at positions <= t - depth and the entry of pass i at position
    t - depth + i for i = 1..depth (the chain so far; pass ``depth``'s own key is itself).
    ``earlier``: the (k, v) [B, T, KVH, D] of passes 0..depth - 1. Padding past a sequence's
    length needs no mask: causality keeps it from every real query."""
    g = config.num_heads // config.num_kv_heads
    scale = config.head_dim ** -0.5

    def attend(q, k, v):
        b, t, hq, d = q.shape
        qg = q.reshape(b, t, config.num_kv_heads, g, d).astype(jnp.float32) * scale
        k0, v0 = earlier[0] if depth else (k, v)
        pos = jnp.arange(t)
        see = pos[None, :] <= pos[:, None] - depth  # [T, S]
        s0 = jnp.einsum("btkgd,bskd->bkgts", qg, k0.astype(jnp.float32))
        s0 = jnp.where(see, s0, -jnp.inf)
        chain_k = [kv[0] for kv in earlier[1:]] + ([k] if depth else [])
        chain_v = [kv[1] for kv in earlier[1:]] + ([v] if depth else [])
        # pass i's entry at t - (depth - i): its keys shifted right by depth - i positions
        shift = lambda x, n: jnp.pad(x, ((0, 0), (n, 0), (0, 0), (0, 0)))[:, :t]  # noqa: E731
        ck = [shift(x, depth - 1 - j) for j, x in enumerate(chain_k)]
        cv = [shift(x, depth - 1 - j) for j, x in enumerate(chain_v)]
        sc = [jnp.einsum("btkgd,btkd->bkgt", qg, x.astype(jnp.float32))[..., None] for x in ck]
        p = jax.nn.softmax(jnp.concatenate([s0] + sc, axis=-1), axis=-1)  # [B, KVH, G, T, T + depth]
        out = jnp.einsum("bkgts,bskd->btkgd", p[..., :t], v0.astype(jnp.float32))
        for j, x in enumerate(cv):
            out = out + jnp.einsum("bkgt,btkd->btkgd", p[..., t + j], x.astype(jnp.float32))
        return out.reshape(b, t, hq, d).astype(q.dtype)

    return attend


def eagle_ttt_forward(head_params, config: ModelConfig, embeds, prev_features, depth: int) -> list[jax.Array]:
    """The training-time test over whole sequences: ``embeds`` [B, T, H] of tokens 0..T-1,
    ``prev_features`` [B, T, F] the target's F_{t-1} for each position t (row 0: zeros).
    Returns ``depth`` arrays [B, T, H] (RMSNorm(h), the LM head's input): pass j
    at position t is the head's entry t in the chain started from the true entry t - j, i.e. its
    prediction of the target's token after t given tokens <= t and true features < t - j + 1.
    Valid where t - j >= 1 (and t below the sequence's length)."""
    module = head_module(head_params, config)
    b, t = embeds.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zeros = jnp.zeros((b, 1, config.hidden_size), embeds.dtype)
    out, kvs, prev, fused = [], [], prev_features, False
    for j in range(depth):
        ctx = DenseContext(positions, _ttt_attend(config, kvs, j))
        r = module.apply({"params": head_params}, embeds, prev, ctx, fused=fused)
        out.append(r.normed)
        kvs.append(r.context)
        # pass j + 1 at position t continues pass j's chain from position t - 1
        prev, fused = jnp.concatenate([zeros, r.chained[:, :-1].astype(embeds.dtype)], axis=1), True
    return out


def _init_inputs(config: ModelConfig, num_features: int) -> tuple:
    """Inputs of one entry to initialise a head with: embedding, feature, a one-layer cache, q_lens."""
    dtype = jnp.dtype(config.dtype)
    cache = init_cache(1, config.num_kv_heads, config.head_dim, jnp.zeros((1, 1), jnp.int32), 1, 16, dtype)
    feature = jnp.zeros((1, 1, config.hidden_size * max(num_features, 1)), dtype)
    return jnp.zeros((1, 1, config.hidden_size), dtype), feature, cache, jnp.ones((1,), jnp.int32)


def init_eagle_params(config: ModelConfig, key: jax.Array, target_params=None, num_features: int = 0):
    """Random head parameters (``num_features`` > 0: an EAGLE-3 head fusing that many target
    layers); with ``target_params`` the decoder layer starts as the target's last layer and the
    norm as its final norm (a warm start used by training)."""
    params = _module(config, "reference", num_features).init(key, *_init_inputs(config, num_features))["params"]
    if target_params is not None:
        params = dict(params)
        params["layer"] = jax.tree_util.tree_map(jnp.array, target_params[f"layers_{config.num_layers - 1}"])
        params["norm"] = {"scale": jnp.array(target_params["norm"]["scale"])}
    return params


def init_published_eagle3_params(config: ModelConfig, key: jax.Array, target_params=None, num_features: int = 3):
    """Random :class:`PublishedEagle3Head` parameters for ``config`` (the target's, at its MLP
    width), so that jspec can train heads that vLLM and SGLang serve. With ``target_params`` the
    head warm-starts where the target has a like part: the attention's half that reads the
    (normalised) feature, ``o_proj``, the MLP and their norms from the target's last layer, the
    final norm from the target's; the fused features' ``fc`` and the embedding half start random."""
    head = dataclasses.replace(config, qkv_bias=False, qk_norm=False)
    params = _published_module(head, "reference").init(key, *_init_inputs(config, num_features))["params"]
    if target_params is None:
        return params
    last = target_params[f"layers_{config.num_layers - 1}"]
    params = jax.tree_util.tree_map(jnp.array, params)
    h = config.hidden_size

    def take(node: dict, name: str, part) -> None:  # a family whose part differs keeps the random one
        if jax.tree_util.tree_map(jnp.shape, node[name]) == jax.tree_util.tree_map(jnp.shape, part):
            node[name] = jax.tree_util.tree_map(jnp.array, part)

    for name, part in (("mlp", last["mlp"]), ("post_attention_layernorm", last["post_attention_layernorm"]),
                       ("hidden_norm", last["input_layernorm"]), ("norm", target_params["norm"])):
        take(params, name, part)
    take(params["self_attn"], "o_proj", last["self_attn"]["o_proj"])
    qkv = last["self_attn"].get("qkv_proj", {})
    if set(qkv) == {"kernel"} and qkv["kernel"].shape == (h, params["self_attn"]["qkv_proj"]["kernel"].shape[1]):
        kernel = params["self_attn"]["qkv_proj"]["kernel"]
        params["self_attn"]["qkv_proj"]["kernel"] = kernel.at[h:].set(qkv["kernel"].astype(kernel.dtype))
    return params
