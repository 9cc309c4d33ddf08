"""EAGLE-1 heads as others publish them (the EAGLE authors' ``fc`` + ``layers.0.``, vLLM's
``speculators`` ``fusion_fc`` + ``transformer.``, with and without its layernorms): the head
against a PyTorch implementation written here from the published architecture, both layouts
loading to the same parameters, lossless speculation with such a head, and bad layouts refused
by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from eagle_reference import attention, causal, mlp, rms
from eagle_reference import variant as layout_variant
from helpers import write_hf_checkpoint
from jspec.config import SamplingParams, SpecConfig
from jspec.errors import CheckpointError, DraftMismatchError, UnsupportedModelError
from jspec.loading.drafts import read_eagle, save_tensors
from jspec.loading.eagle_formats import published_kind, read_published_eagle1, write_published_eagle1
from jspec.models.eagle import eagle_forward
from jspec.models.llama import DenseContext, output_embedding

INTER = 80


class TorchEagle1(torch.nn.Module):
    """The published EAGLE-1 head (one sequence, causal attention), named as the EAGLE authors'
    checkpoints are; ``layernorms``: speculators' variant with three more RMSNorms."""

    def __init__(self, cfg, fc_bias=True, qkv_bias=False, layernorms=False):
        super().__init__()
        L = torch.nn.Linear  # noqa: N806
        h, self.cfg, self.layernorms = cfg.hidden_size, cfg, layernorms
        self.fc = L(2 * h, h, bias=fc_bias)
        m = torch.nn.Module()
        m.self_attn = torch.nn.Module()
        m.self_attn.q_proj = L(h, cfg.q_size, bias=qkv_bias)
        m.self_attn.k_proj, m.self_attn.v_proj = L(h, cfg.kv_size, bias=qkv_bias), L(h, cfg.kv_size, bias=qkv_bias)
        m.self_attn.o_proj = L(cfg.q_size, h, bias=False)
        m.mlp = torch.nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = L(h, INTER, bias=False), L(h, INTER, bias=False), L(INTER, h, bias=False)
        norms = ["post_attention_layernorm"] + (["input_layernorm"] if layernorms else [])
        for name in norms:
            setattr(m, name, torch.nn.Module())
            getattr(m, name).weight = torch.nn.Parameter(torch.empty(h).uniform_(0.5, 1.5))
        self.layers = torch.nn.ModuleList([m])
        if layernorms:
            for name in ("embedding_layernorm", "pre_lm_head_layernorm"):
                setattr(self, name, torch.nn.Module())
                getattr(self, name).weight = torch.nn.Parameter(torch.empty(h).uniform_(0.5, 1.5))

    def forward(self, embeds, prev):  # [T, H], [T, H] -> (what the LM head reads, the chained output)
        c, m, eps = self.cfg, self.layers[0], self.cfg.rms_norm_eps
        if self.layernorms:
            embeds = rms(embeds, self.embedding_layernorm.weight, eps)
        x = self.fc(torch.cat([embeds, prev], -1))
        inp = rms(x, m.input_layernorm.weight, eps) if self.layernorms else x
        hidden = x + attention(m.self_attn, inp, c.num_heads, c.num_kv_heads, c.head_dim, c.rope_theta)
        hidden = hidden + mlp(m.mlp, rms(hidden, m.post_attention_layernorm.weight, eps))
        out = rms(hidden, self.pre_lm_head_layernorm.weight, eps) if self.layernorms else hidden
        return out, hidden


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_hf_checkpoint(tmp_path_factory.mktemp("t") / "target", "llama", seed=2, num_hidden_layers=4)
    return jspec.load_model(str(d))


def _torch_head(cfg, seed=0, **kw):
    torch.manual_seed(seed)
    return TorchEagle1(cfg, **kw).eval()


def _save(directory, head, cfg, layout="eagle"):
    """As the EAGLE authors' checkpoints (a one-layer Llama config) or speculators' (renamed)."""
    tensors = {k: v.detach().numpy() for k, v in head.state_dict().items()}
    geometry = {"hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": INTER, "num_hidden_layers": 1,
                "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size}
    if layout == "eagle":
        config = dict(geometry, architectures=["LlamaForCausalLM"], bias=head.fc.bias is not None)
    else:
        tensors = {k.replace("fc.", "fusion_fc.", 1).replace("layers.0.", "transformer.", 1): v
                   for k, v in tensors.items()}
        config = {"speculators_model_type": "eagle", "architectures": ["EagleSpeculator", "LlamaDecoderLayer"],
                  "transformer_layer_config": geometry, "layernorms": head.layernorms,
                  "fusion_bias": head.fc.bias is not None}
    directory.mkdir(parents=True)
    save_tensors(directory / "model.safetensors", tensors, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("layout, kw", [
    ("eagle", {"fc_bias": True}),
    ("speculators", {"fc_bias": False}),
    ("speculators", {"fc_bias": True, "qkv_bias": True, "layernorms": True}),
], ids=["eagle", "speculators", "speculators-layernorms-biases"])
def test_the_head_matches_the_published_architecture(target, tmp_path, layout, kw):
    """What the target's LM head reads and the chained output of the loaded head equal the
    PyTorch head's, from the target's final hidden states and chained on its own output."""
    cfg = target.config
    head = _torch_head(cfg, **kw)
    directory = _save(tmp_path / "h", head, cfg, layout)
    assert published_kind(directory) == "eagle"
    params, layers = read_eagle(str(directory), target)
    assert layers == ()
    np.testing.assert_array_equal(np.asarray(params["vocab_ids"]), np.arange(cfg.vocab_size))
    rng = np.random.default_rng(1)
    t = 9
    embeds, feats = rng.normal(size=(t, cfg.hidden_size)), rng.normal(size=(t, cfg.hidden_size)) * 3
    ctx = DenseContext(jnp.arange(t)[None], causal)
    lm = np.asarray(output_embedding(target.params, cfg))
    with torch.no_grad():
        want_out, want_h = head(torch.tensor(embeds, dtype=torch.float32), torch.tensor(feats, dtype=torch.float32))
        chain_out, _ = head(torch.tensor(embeds, dtype=torch.float32), want_h)
    out = eagle_forward(params["head"], cfg, jnp.asarray(embeds, jnp.float32)[None], jnp.asarray(feats, jnp.float32)[None],
                        ctx, None)
    np.testing.assert_allclose(np.asarray(out.normed[0]) @ lm.T, want_out.numpy() @ lm.T, atol=2e-4)
    np.testing.assert_allclose(np.asarray(out.chained[0]), want_h.numpy(), atol=2e-4)
    again = eagle_forward(params["head"], cfg, jnp.asarray(embeds, jnp.float32)[None], out.chained, ctx, None,
                          fused=True)
    np.testing.assert_allclose(np.asarray(again.normed[0]), chain_out.numpy(), atol=2e-4)


def test_both_layouts_load_the_same_and_speculation_stays_lossless(target, tmp_path):
    cfg = target.config
    params, _ = read_eagle(str(_save(tmp_path / "src", _torch_head(cfg, 4), cfg)), target)
    for layout in ("eagle", "speculators"):
        d = write_published_eagle1(tmp_path / layout, params["head"], cfg, layout)
        back, layers = read_published_eagle1(d, target)
        assert layers == ()
        for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((tmp_path / "speculators" / "config.json").read_text())["speculators_model_type"] == "eagle"
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 7, 40, 41]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = jspec.generate(target, prompts, sp, attention="reference").token_ids
    for spec in (SpecConfig("eagle", num_speculative_tokens=3, draft=str(tmp_path / "speculators")),
                 SpecConfig("hybrid", num_speculative_tokens=3, draft=str(tmp_path / "eagle"))):
        out = jspec.generate(target, prompts, sp, spec=spec, attention="reference")
        assert out.token_ids == plain and out.proposed_counts[0] > 0  # the head drafted, and was verified


def test_bad_layouts_are_refused_by_name(target, tmp_path):
    cfg = target.config
    good = _save(tmp_path / "good", _torch_head(cfg), cfg)

    def variant(name, change):
        return layout_variant(good, tmp_path / name, change)

    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) layers.0.post_attention_layernorm.weight"):
        read_eagle(variant("missing", lambda t: t.pop("layers.0.post_attention_layernorm.weight")), target)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) layers.0.extra.weight"):
        read_eagle(variant("extra", lambda t: t.update({"layers.0.extra.weight": np.zeros(3, np.float32)})), target)
    with pytest.raises(DraftMismatchError, match="fc.weight has shape"):
        read_eagle(variant("shape", lambda t: t.update({"fc.weight": np.zeros((cfg.hidden_size, 3), np.float32)})),
                   target)
    with pytest.raises(CheckpointError, match="not an EAGLE-1 head's layout"):
        read_eagle(variant("renamed", lambda t: t.update({f"model.{k}": t.pop(k) for k in list(t)})), target)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((good / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="convert it in that directory first: python -c"):
        read_eagle(str(pickled), target)
