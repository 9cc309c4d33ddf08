"""Training drafts: the loss goes down, checkpoints round-trip exactly, resume is exact, a card
naming another target is refused, and the small Llama exports to transformers."""

import dataclasses
import json
import shutil

import chex
import jax
import numpy as np
import pytest
import torch

import jspec
from helpers import write_hf_checkpoint
from jspec.loading import drafts as ckpt
from jspec.train.distill import DistillConfig, run
from jspec.train.trainer import TrainConfig


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = write_hf_checkpoint(tmp_path_factory.mktemp("target"), "llama", num_hidden_layers=2,
                            max_position_embeddings=1024)
    return jspec.load_model(str(d))


def _dc(arch, steps=24, **kw):
    return DistillConfig(arch=arch, prompts=6, max_prompt_tokens=300, max_new_tokens=12, draft_vocab=128,
                         draft_layers=1, train=TrainConfig(steps=steps, batch_size=4, learning_rate=3e-3,
                                                           checkpoint_every=8, warmup_steps=2), **kw)


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    out = {}
    for arch in ("eagle", "small-llama"):
        path = tmp_path_factory.mktemp(arch) / "draft"
        card = run(target, "tiny-target", path, _dc(arch), eval_prompts=0, say=lambda *a: None)
        out[arch] = (path, card)
    return out


@pytest.mark.parametrize("arch", ["eagle", "small-llama"])
def test_card_describes_the_draft(trained, target, arch):
    path, card = trained[arch]
    assert card["architecture"] == arch and card["format"] == "jspec-draft"
    assert card["target"]["weights_sha256"] == target.weights_hash()
    assert card["data"]["prompts"] == 6 and "standard library" in card["data"]["source"]
    assert card["data"]["mix"][0]["sequences"] == 6
    assert card["training"]["steps"] == 24 and 0 < card["draft_vocab"]["size"] <= 128
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    assert size < 30e6


@pytest.mark.parametrize("arch", ["eagle", "small-llama"])
def test_loss_decreases_over_training(target, tmp_path, arch):
    from jspec.train import distill as D

    losses = []
    orig = D.train

    def spy(*a, **k):
        params, hist = orig(*a, **k)
        losses.extend(h["loss"] for h in hist)
        return params, hist

    D.train = spy
    try:
        run(target, "tiny-target", tmp_path / "d", _dc(arch, steps=30), eval_prompts=0, say=lambda *a: None)
    finally:
        D.train = orig
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert last < 0.9 * first, (first, last)


def test_eagle_round_trip_is_exact(trained, target, tmp_path):
    path, _ = trained["eagle"]
    params = ckpt.load_eagle(str(path), target)
    ckpt.save_eagle(tmp_path / "copy", params["head"], params["vocab_ids"], ckpt.read_card(path))
    again = ckpt.load_eagle(str(tmp_path / "copy"), target)
    chex.assert_trees_all_equal(params, again)


def test_small_llama_round_trip_is_exact(trained, target, tmp_path):
    path, _ = trained["small-llama"]
    draft, vocab = ckpt.load_draft(str(path), target)
    ckpt.save_small_llama(tmp_path / "copy", draft.config, draft.params, vocab, ckpt.read_card(path))
    again, vocab2 = ckpt.load_draft(str(tmp_path / "copy"), target)
    np.testing.assert_array_equal(np.asarray(vocab), np.asarray(vocab2))
    chex.assert_trees_all_equal(draft.params, again.params)


@pytest.mark.parametrize("arch,method", [("eagle", "eagle"), ("small-llama", "draft")])
def test_trained_drafts_are_lossless(trained, target, arch, method):
    path, _ = trained[arch]
    sp = jspec.SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    base = jspec.generate(target, prompts, sp)
    for k in (1, 4):
        out = jspec.generate(target, prompts, sp, spec=jspec.SpecConfig(method, k, draft=str(path)))
        assert out.token_ids == base.token_ids


@pytest.mark.parametrize("arch,method", [("eagle", "eagle"), ("small-llama", "draft")])
def test_card_for_another_target_is_refused(trained, target, tmp_path, arch, method):
    path, _ = trained[arch]
    other = tmp_path / "other"
    shutil.copytree(path, other, ignore=shutil.ignore_patterns(".train"))
    card = json.loads((other / "card.json").read_text())
    card["target"]["weights_sha256"] = "0" * 64
    card["target"]["name"] = "some-other-model"
    (other / "card.json").write_text(json.dumps(card))
    with pytest.raises(jspec.DraftMismatchError, match="some-other-model"):
        jspec.generate(target, [[5, 6]], jspec.SamplingParams(max_tokens=2),
                       spec=jspec.SpecConfig(method, 2, draft=str(other)))
    from jspec.cli import main

    assert main(["generate", "hello", "--model", str(target.source), "--spec", f"{method}:{other}"]) == 2


def test_resume_continues_exactly(target, tmp_path, monkeypatch):
    """12 steps in one go == 8 steps, a crash, and a resumed run to 12 (same batches, same
    optimizer state, bit for bit)."""
    from jspec.train import distill as D

    quiet = dict(eval_prompts=0, say=lambda *a: None)
    run(target, "t", tmp_path / "full", _dc("eagle", steps=12), **quiet)

    real = D.make_batches

    def crashing(*a, **k):
        fn = real(*a, **k)

        def batch_fn(step):
            if step == 8:
                raise KeyboardInterrupt  # the machine goes away after the step-8 checkpoint
            return fn(step)

        return batch_fn

    monkeypatch.setattr(D, "make_batches", crashing)
    with pytest.raises(KeyboardInterrupt):
        run(target, "t", tmp_path / "resumed", _dc("eagle", steps=12), **quiet)
    assert json.loads((tmp_path / "resumed" / ".train" / "state.json").read_text())["step"] == 8
    assert not (tmp_path / "resumed" / "eagle.safetensors").exists()  # nothing half-written
    monkeypatch.setattr(D, "make_batches", real)
    run(target, "t", tmp_path / "resumed", _dc("eagle", steps=12), resume=True, **quiet)
    a = ckpt.load_eagle(str(tmp_path / "full"), target)["head"]
    b = ckpt.load_eagle(str(tmp_path / "resumed"), target)["head"]
    chex.assert_trees_all_equal(a, b)
    with pytest.raises(jspec.CheckpointError, match="cannot resume"):
        run(target, "t", tmp_path / "resumed", _dc("eagle", steps=20), resume=True, **quiet)


def test_small_llama_exports_to_transformers(trained, target, tmp_path):
    from transformers import AutoModelForCausalLM

    from jspec.cache import init_cache
    from jspec.models.llama import forward

    path, _ = trained["small-llama"]
    out = ckpt.export_hf(path, target, tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    draft, _ = ckpt.load_draft(str(path), target)
    ids = [5, 9, 23, 40, 7]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    cfg = draft.config
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, jax.numpy.zeros((1, 1), jax.numpy.int32), 1, 16)
    got = forward(draft.params, cfg, jax.numpy.asarray([ids]), cache, jax.numpy.asarray([5], jax.numpy.int32),
                  attention="reference").logits[0]
    assert np.abs(np.asarray(got) - want).max() < 1e-4
    assert (out / "tokenizer.json").exists()


def test_validation_keeps_the_best_parameters(target, tmp_path):
    """With >= 20 sequences, 5% are held out; every checkpoint is scored on them and the card
    records the scores; the saved draft is the best-scoring one."""
    dc = DistillConfig(arch="eagle", prompts=24, max_prompt_tokens=300, max_new_tokens=8, draft_vocab=128,
                       train=TrainConfig(steps=16, batch_size=4, learning_rate=3e-3, checkpoint_every=4,
                                         warmup_steps=2))
    card = run(target, "t", tmp_path / "v", dc, eval_prompts=0, say=lambda *a: None)
    val = card["training"]["validation"]
    assert val["sequences"] == 1 and sorted(val["top1_agreement_by_step"], key=int) == ["4", "8", "12", "16"]
    assert (tmp_path / "v" / ".train" / "best.safetensors").exists()


def test_engine_data_equals_static_batches(target):
    """Draft data through the engine (continuous batching, 3 slots for 7 prompts of different
    lengths) holds exactly the tokens of the old static batches, and counts every prompt done."""
    from jspec.train.data import generate_sequences, stdlib_prompts

    prompts = [p[:200] for p in stdlib_prompts(7, seed=5)]
    done = []
    engine = generate_sequences(target, prompts, 10, batch_size=3, progress=done.append)
    static = generate_sequences(target, prompts, 10, batch_size=3, static=True)
    assert sum(done) == 7
    np.testing.assert_array_equal(engine.prompt_lengths, static.prompt_lengths)
    np.testing.assert_array_equal(engine.lengths, static.lengths)
    np.testing.assert_array_equal(engine.tokens, static.tokens)
    assert (engine.lengths > engine.prompt_lengths).all()


@pytest.mark.parametrize("arch,other", [("eagle", "small-llama"), ("small-llama", "eagle")])
def test_init_continues_from_a_draft(trained, target, tmp_path, arch, other):
    """``init`` starts from a trained draft's parameters: with a learning rate too small to move
    them, the result is that draft (not a fresh one), on new data and a new draft vocabulary;
    the card names where it started and its held-out score before training. A checkpoint of the
    other architecture is refused."""
    path, _ = trained[arch]
    dc = dataclasses.replace(_dc(arch, steps=2), prompts=5, draft_vocab=100, draft_layers=3,
                             train=TrainConfig(steps=2, batch_size=4, learning_rate=1e-12, warmup_steps=0))
    said = []
    card = run(target, "t", tmp_path / "cont", dc, eval_prompts=0, init=str(path), say=said.append)
    assert card["training"]["init"]["checkpoint"] == str(path)
    prior = ckpt.read_card(path)["training"]  # the lineage: tokens seen before, counted on
    assert card["training"]["init"]["tokens_total"] == prior["tokens_total"] > 0
    assert card["training"]["tokens_total"] > prior["tokens_total"]
    assert card["draft_vocab"]["size"] <= 100
    def params_of(p):
        return ckpt.load_eagle(str(p), target)["head"] if arch == "eagle" else ckpt.load_draft(str(p), target)[0].params

    before, after = params_of(path), params_of(tmp_path / "cont")
    if arch == "small-llama":
        assert card["config"]["draft_layers"] == 1  # the checkpoint's, not dc's 3
    chex.assert_trees_all_close(before, after, atol=1e-6, rtol=1e-7)
    fresh = run(target, "t", tmp_path / "fresh", dataclasses.replace(dc, draft_layers=1), eval_prompts=0,
                say=lambda *a: None)
    assert "init" not in fresh["training"]
    assert any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(params_of(tmp_path / "fresh"))))
    with pytest.raises(jspec.DraftMismatchError, match="architecture"):
        run(target, "t", tmp_path / "wrong", dataclasses.replace(dc, arch=other), eval_prompts=0,
            init=str(path), say=lambda *a: None)


def test_eagle3_mix_budget_and_held_out_card(target, tmp_path):
    """An EAGLE-3 head on a mix of generated, chat and read sequences within a time budget: the
    steps come from the budget, the card records the mix, the fused layers, the training curve
    (tokens seen) and held-out acceptance per position at T = 0 and 0.7; the head loads and
    drafts losslessly."""
    dc = DistillConfig(arch="eagle3", prompts=12, chat_prompts=0, read_code_tokens=600, read_prose_tokens=400,
                       window=64, max_prompt_tokens=300, max_new_tokens=10, draft_vocab=128, ttt_depth=2, eval_k=3,
                       validation_fraction=0.2, budget_minutes=4.0,
                       train=TrainConfig(steps=1, batch_size=4, learning_rate=3e-3, checkpoint_every=4, warmup_steps=2))
    card = run(target, "t", tmp_path / "e3", dc, eval_prompts=0, say=lambda *a: None)
    assert card["config"]["head"] == "eagle3" and card["config"]["feature_layers"] == [0, 1]  # 2 layers: clipped
    assert card["training"]["budget_minutes"] == 4.0 and card["training"]["steps"] > 1
    names = [s["name"] for s in card["data"]["mix"]]
    assert len(names) == 3 and "read" in names[1] and "prose" in names[2]
    assert card["data"]["target_pass_tokens_per_second"] > 0
    val = card["training"]["validation"]
    assert "mean accepted length" in val["score"] and val["score_by_step"]
    tokens = list(val["training_tokens_by_step"].values())
    assert tokens == sorted(tokens) and tokens[0] > 0
    for temp in ("T=0", "T=0.7"):
        per = card["held_out"][temp]["all"]["acceptance_per_position"]
        assert len(per) == 3 and all(0 <= a <= 1 for a in per) and per == sorted(per, reverse=True)
    sp = jspec.SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    spec = jspec.SpecConfig("eagle", 3, draft=str(tmp_path / "e3"))
    assert jspec.generate(target, prompts, sp, spec=spec).token_ids == jspec.generate(target, prompts, sp).token_ids


def test_general_requests_are_everyday_and_never_a_benchmark_prompt():
    """The everyday chat requests (prose data for ``--chat`` users): distinct, the same for a
    seed, all five kinds in any 100 of them, none of them a benchmark prompt, and counted in the
    data mix."""
    from pathlib import Path

    from jspec.train.data import general_requests

    many = general_requests(1000, seed=0)
    assert len(many) == len(set(many)) == 1000
    assert general_requests(50, seed=1) == general_requests(50, seed=1) != general_requests(50, seed=2)
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "prose_prompts.jsonl"
    held_out = {json.loads(line)["prompt"] for line in bench.read_text().splitlines() if line.strip()}
    assert held_out and not held_out & set(many)
    first = general_requests(100, seed=0)
    kinds = {"story": ("story", "poem", "novel", "fable"), "letter": ("email", "letter", "message"),
             "pair": (" over ", "difference between", "Compare"), "work": ("Hamlet", "Summarize", "characters",
                                                                              "theme", "still read")}
    for kind, words in kinds.items():
        assert sum(any(w in r for w in words) for r in first) >= 10, kind
    assert DistillConfig(arch="eagle3", prompts=0, general_prompts=4).mix.general_prompts == 4
    with pytest.raises(jspec.ConfigError):
        DistillConfig(arch="eagle3", prompts=0, general_prompts=-1)


def test_a_published_eagle3_head_reads_three_layers_below_the_last(target):
    """The published architecture fuses exactly three layers whose output enters another layer
    (its config names the layers they enter); the default is vLLM's (entering 2, L / 2, L - 3)."""
    from jspec.train.distill import published_feature_layers

    assert published_feature_layers(32) == (1, 15, 28)
    eight = dataclasses.replace(target.config, num_layers=8)
    assert _dc("eagle3-published").layers_for(eight) == (1, 3, 4)
    assert _dc("eagle3-published", feature_layers=(0, 5, 6)).layers_for(eight) == (0, 5, 6)
    for layers in ((0, 5, 7), (0, 5), (2, 2, 3)):
        with pytest.raises(jspec.ConfigError, match="three distinct layers"):
            _dc("eagle3-published", feature_layers=layers).layers_for(eight)
    with pytest.raises(jspec.ConfigError, match="three distinct layers"):
        _dc("eagle3-published").layers_for(target.config)  # two layers: too shallow for the default
