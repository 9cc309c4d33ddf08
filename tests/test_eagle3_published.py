"""EAGLE-3 heads as others publish them (the EAGLE authors, SpecForge, vLLM's ``speculators``):
the head against a PyTorch implementation written here from the published architecture, the
target features the head reads against transformers' hidden states, both layouts loading to the
same parameters, lossless speculation with such a head, and bad layouts refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from eagle_reference import attention, mlp
from eagle_reference import variant as layout_variant
from eagle_reference import causal as _causal
from eagle_reference import rms as _rms
from helpers import write_hf_checkpoint
from jspec.config import SamplingParams, SpecConfig
from jspec.errors import CheckpointError, DraftMismatchError, UnsupportedModelError
from jspec.loading.drafts import read_eagle, save_tensors
from jspec.loading.eagle_formats import read_published_eagle3, write_published_eagle3
from jspec.models.eagle import eagle_forward
from jspec.models.llama import DenseContext, forward

LAYERS = 8  # the head reads the stream entering layers 2, 4 and 5
DRAFT_VOCAB = 200


class TorchEagle3(torch.nn.Module):
    """The published EAGLE-3 head (one sequence, causal attention), named as its checkpoints are."""

    def __init__(self, h, heads, kv_heads, head_dim, inter, vocab, eps, theta):
        super().__init__()
        L = torch.nn.Linear  # noqa: N806
        self.h, self.heads, self.kv_heads, self.d, self.eps, self.theta = h, heads, kv_heads, head_dim, eps, theta
        self.fc = L(3 * h, h, bias=False)
        m = torch.nn.Module()
        m.self_attn = torch.nn.Module()
        m.self_attn.q_proj, m.self_attn.k_proj = L(2 * h, heads * head_dim, bias=False), L(2 * h, kv_heads * head_dim, bias=False)
        m.self_attn.v_proj, m.self_attn.o_proj = L(2 * h, kv_heads * head_dim, bias=False), L(heads * head_dim, h, bias=False)
        m.mlp = torch.nn.Module()
        m.mlp.gate_proj, m.mlp.up_proj, m.mlp.down_proj = L(h, inter, bias=False), L(h, inter, bias=False), L(inter, h, bias=False)
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            setattr(m, name, torch.nn.Module())
            getattr(m, name).weight = torch.nn.Parameter(torch.empty(h).uniform_(0.5, 1.5))
        self.midlayer = m
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.empty(h).uniform_(0.5, 1.5))
        self.lm_head = L(h, vocab, bias=False)

    def forward(self, embeds, prev, chained=False):  # [T, H], [T, 3H] (or [T, H] chained)
        m = self.midlayer
        g = prev if chained else self.fc(prev)
        x = torch.cat([_rms(embeds, m.input_layernorm.weight, self.eps), _rms(g, m.hidden_norm.weight, self.eps)], -1)
        hidden = g + attention(m.self_attn, x, self.heads, self.kv_heads, self.d, self.theta)
        hidden = hidden + mlp(m.mlp, _rms(hidden, m.post_attention_layernorm.weight, self.eps))
        return self.lm_head(_rms(hidden, self.norm.weight, self.eps)), hidden


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_hf_checkpoint(tmp_path_factory.mktemp("t") / "target", "llama", seed=2, num_hidden_layers=LAYERS)
    return d, jspec.load_model(str(d))


def _torch_head(cfg, seed=0):
    torch.manual_seed(seed)
    return TorchEagle3(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 96, DRAFT_VOCAB,
                       cfg.rms_norm_eps, cfg.rope_theta).eval()


def _save_eagle_layout(directory, head, cfg, vocab_ids):
    """As the EAGLE authors' and SpecForge's checkpoints: state-dict names, d2t and t2d, config."""
    tensors = {k: v.detach().numpy() for k, v in head.state_dict().items()}
    tensors["d2t"] = np.asarray(vocab_ids, np.int64) - np.arange(len(vocab_ids))
    tensors["t2d"] = np.isin(np.arange(cfg.vocab_size), vocab_ids)
    directory.mkdir(parents=True)
    save_tensors(directory / "model.safetensors", tensors, {"format": "pt"})
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": 96,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "vocab_size": cfg.vocab_size,
        "draft_vocab_size": len(vocab_ids)}))
    return directory


def test_the_head_matches_the_published_architecture(target, tmp_path):
    """Logits and chained outputs of the loaded head equal the PyTorch head's, from target
    features and chained on its own output."""
    _, model = target
    cfg = model.config
    head = _torch_head(cfg)
    vocab_ids = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, DRAFT_VOCAB, replace=False))
    params, layers = read_eagle(str(_save_eagle_layout(tmp_path / "h", head, cfg, vocab_ids)), model)
    assert layers == (1, 3, 4)
    np.testing.assert_array_equal(np.asarray(params["vocab_ids"]), vocab_ids)
    rng = np.random.default_rng(1)
    t = 9
    embeds, feats = rng.normal(size=(t, cfg.hidden_size)), rng.normal(size=(t, 3 * cfg.hidden_size)) * 3
    ctx = DenseContext(jnp.arange(t)[None], _causal)
    with torch.no_grad():
        want_logits, want_h = head(torch.tensor(embeds, dtype=torch.float32), torch.tensor(feats, dtype=torch.float32))
        chain_logits, _ = head(torch.tensor(embeds, dtype=torch.float32), want_h, chained=True)
    out = eagle_forward(params["head"], cfg, jnp.asarray(embeds, jnp.float32)[None], jnp.asarray(feats, jnp.float32)[None],
                        ctx, None)
    np.testing.assert_allclose(np.asarray(out.normed[0] @ params["lm_head"].T), want_logits.numpy(), atol=2e-4)
    np.testing.assert_allclose(np.asarray(out.chained[0]), want_h.numpy(), atol=2e-4)
    again = eagle_forward(params["head"], cfg, jnp.asarray(embeds, jnp.float32)[None], out.chained, ctx, None,
                          fused=True)
    np.testing.assert_allclose(np.asarray(again.normed[0] @ params["lm_head"].T), chain_logits.numpy(), atol=2e-4)


def test_the_features_are_the_stream_entering_layers_2_l2_and_l3(target):
    """What jspec hands the head (the stream leaving feature layers 1, 3, 4) is what
    transformers' hidden_states[2], [4], [5] hold: the input of those layers."""
    from jspec.cache import init_cache
    from transformers import AutoModelForCausalLM

    directory, model = target
    ids = [int(x) for x in np.random.default_rng(3).integers(2, 300, 11)]
    with torch.no_grad():
        hs = AutoModelForCausalLM.from_pretrained(str(directory)).eval()(torch.tensor([ids]),
                                                                         output_hidden_states=True).hidden_states
    want = torch.cat([hs[2], hs[4], hs[5]], -1)[0].numpy()
    cfg = model.config
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jnp.arange(1)[None], 1, 16)
    out = forward(model.params, cfg, jnp.asarray([ids], jnp.int32), cache, jnp.asarray([len(ids)], jnp.int32),
                  attention="reference", feature_layers=(1, 3, 4))
    np.testing.assert_allclose(np.asarray(out.hidden[0]), want, atol=1e-4)


def test_both_layouts_load_the_same_and_speculation_stays_lossless(target, tmp_path):
    _, model = target
    cfg = model.config
    vocab_ids = np.sort(np.random.default_rng(5).choice(cfg.vocab_size, DRAFT_VOCAB, replace=False))
    params, layers = read_eagle(str(_save_eagle_layout(tmp_path / "src", _torch_head(cfg, 4), cfg, vocab_ids)), model)
    loaded = {}
    for layout in ("eagle", "speculators"):
        d = write_published_eagle3(tmp_path / layout, params["head"], params["lm_head"], params["vocab_ids"], cfg,
                                   layers, layout)
        loaded[layout] = read_published_eagle3(d, model)
        assert loaded[layout][1] == layers
        for a, b in zip(jax.tree_util.tree_leaves(loaded[layout][0]), jax.tree_util.tree_leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    names = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert names["speculators_model_type"] == "eagle3"
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 7, 40, 41]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = jspec.generate(model, prompts, sp, attention="reference").token_ids
    for spec in (SpecConfig("eagle", num_speculative_tokens=3, draft=str(tmp_path / "speculators")),
                 SpecConfig("hybrid", num_speculative_tokens=3, draft=str(tmp_path / "eagle"))):
        out = jspec.generate(model, prompts, sp, spec=spec, attention="reference")
        assert out.token_ids == plain and out.proposed_counts[0] > 0  # the head drafted, and was verified


def test_bad_layouts_are_refused_by_name(target, tmp_path):
    _, model = target
    cfg = model.config
    vocab_ids = np.arange(DRAFT_VOCAB)
    good = _save_eagle_layout(tmp_path / "good", _torch_head(cfg), cfg, vocab_ids)
    def variant(name, change):
        return layout_variant(good, tmp_path / name, change)

    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) midlayer.hidden_norm.weight"):
        read_eagle(variant("missing", lambda t: t.pop("midlayer.hidden_norm.weight")), model)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) midlayer.extra.weight"):
        read_eagle(variant("extra", lambda t: t.update({"midlayer.extra.weight": np.zeros(3, np.float32)})), model)
    with pytest.raises(DraftMismatchError, match="fc.weight has shape"):
        read_eagle(variant("shape", lambda t: t.update({"fc.weight": np.zeros((cfg.hidden_size, 2), np.float32)})),
                   model)
    with pytest.raises(DraftMismatchError, match="d2t maps"):
        read_eagle(variant("d2t", lambda t: t.update({"d2t": np.full(DRAFT_VOCAB, cfg.vocab_size, np.int64)})), model)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((good / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UnsupportedModelError, match="convert it in that directory first: python -c"):
        read_eagle(str(pickled), model)
    other = json.loads((good / "config.json").read_text())
    other["num_key_value_heads"] = cfg.num_kv_heads * 2
    (tmp_path / "geometry").mkdir()
    (tmp_path / "geometry" / "config.json").write_text(json.dumps(other))
    with pytest.raises(DraftMismatchError, match="num_key_value_heads"):
        read_eagle(str(tmp_path / "geometry"), model)
    with pytest.raises(CheckpointError, match="neither a jspec head"):
        read_eagle(str(tmp_path), model)


def test_a_head_jspec_trains_is_served_in_the_published_layouts(target, tmp_path):
    """``jspec distill --arch eagle3-published`` trains the published architecture;
    ``jspec export-draft`` writes it in both layouts, which read back bit for bit, load strictly
    into the PyTorch head named as the published checkpoints (with its logits), and draft the
    same tokens, accepted alike, as the jspec checkpoint. jspec's own EAGLE-3 head is refused."""
    import chex

    from hostile_helpers import assert_one_line, cli
    from jspec.loading.drafts import export_eagle, load_tensors
    from jspec.models.eagle import init_published_eagle3_params, is_published_eagle3
    from jspec.train.distill import DistillConfig, run
    from jspec.train.trainer import TrainConfig

    directory, model = target
    cfg = model.config
    dc = DistillConfig(arch="eagle3-published", prompts=6, max_prompt_tokens=300, max_new_tokens=12,
                       draft_vocab=DRAFT_VOCAB, train=TrainConfig(steps=6, batch_size=4, learning_rate=3e-3,
                                                                  checkpoint_every=6, warmup_steps=2))
    card = run(model, "tiny", tmp_path / "jspec", dc, eval_prompts=0, say=lambda *a: None)
    assert card["config"]["head"] == "eagle3-published" and card["config"]["feature_layers"] == [1, 3, 4]
    params, layers = read_eagle(str(tmp_path / "jspec"), model)
    assert is_published_eagle3(params["head"]) and layers == (1, 3, 4)
    start = init_published_eagle3_params(cfg, jax.random.key(0), model.params)
    assert not np.array_equal(np.asarray(params["head"]["fc"]["kernel"]), np.asarray(start["fc"]["kernel"]))

    export_eagle(tmp_path / "jspec", model, tmp_path / "eagle", "eagle")
    code, out, _ = cli("export-draft", tmp_path / "eagle", "--target", directory, "--out", tmp_path / "speculators",
                       "--layout", "speculators")
    assert code == 0 and "speculators layout" in out
    for layout in ("eagle", "speculators"):
        got, got_layers = read_eagle(str(tmp_path / layout), model)
        assert got_layers == layers
        chex.assert_trees_all_equal(got, params)
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]

    tensors = load_tensors(tmp_path / "eagle" / "model.safetensors")
    head = TorchEagle3(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                       DRAFT_VOCAB, cfg.rms_norm_eps, cfg.rope_theta).eval()
    head.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k not in ("d2t", "t2d")},
                         strict=True)
    rng = np.random.default_rng(4)
    embeds, feats = rng.normal(size=(7, cfg.hidden_size)), rng.normal(size=(7, 3 * cfg.hidden_size))
    with torch.no_grad():
        want, _ = head(torch.tensor(embeds, dtype=torch.float32), torch.tensor(feats, dtype=torch.float32))
    mine = eagle_forward(params["head"], cfg, jnp.asarray(embeds, jnp.float32)[None],
                         jnp.asarray(feats, jnp.float32)[None], DenseContext(jnp.arange(7)[None], _causal), None)
    np.testing.assert_allclose(np.asarray(mine.normed[0] @ params["lm_head"].T), want.numpy(), atol=2e-4)

    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43, 7, 40, 41]]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    plain = jspec.generate(model, prompts, sp, attention="reference").token_ids
    runs = [jspec.generate(model, prompts, sp, attention="reference",
                           spec=SpecConfig("eagle", num_speculative_tokens=3, draft=str(tmp_path / name)))
            for name in ("jspec", "eagle", "speculators")]
    for r in runs:
        assert r.token_ids == plain and r.proposed_counts == runs[0].proposed_counts
        assert r.accepted_counts == runs[0].accepted_counts

    own = DistillConfig(arch="eagle3", prompts=6, max_prompt_tokens=300, max_new_tokens=12, draft_vocab=DRAFT_VOCAB,
                        train=TrainConfig(steps=1, batch_size=4, checkpoint_every=1, warmup_steps=1))
    run(model, "tiny", tmp_path / "own", own, eval_prompts=0, say=lambda *a: None)
    assert_one_line(*cli("export-draft", tmp_path / "own", "--target", directory, "--out", tmp_path / "x"),
                    "--arch eagle3-published")
    assert not (tmp_path / "x").exists()
