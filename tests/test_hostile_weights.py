"""Weights and draft files that are wrong in content: non-finite target weights (which used to
generate token 0 forever), and draft checkpoints whose card is not an object, names another
vocabulary, or whose tensors are missing, misshapen, non-finite or point outside the target's
vocabulary. Each case: a typed error naming the file and the tensor or field, and through the
CLI, exit 2 with one line.

Mutations seen to fail these tests: ``check_finite`` made a no-op (jspec/loading/convert.py; the
fuzz tests fail too); the range check in ``check_vocab_ids`` removed (jspec/loading/drafts.py).
"""

import dataclasses

import jax
import numpy as np
import pytest

import jspec
from helpers import write_hf_checkpoint
from hostile_helpers import assert_one_line, cli, copy_dir, edit_json, edit_tensors, write_gguf_with
from jspec.loading import drafts as ckpt

CE, DE, NF = jspec.CheckpointError, jspec.DraftMismatchError, jspec.CheckpointNotFoundError


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("w-target"), "llama")


@pytest.fixture(scope="module")
def target(target_dir):
    return jspec.load_model(str(target_dir))


# ----------------------------------------------------------------------------- target weights

@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, target_dir, value):
    d = copy_dir(target_dir, tmp_path / "d")
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name][3, 5] = value

    edit_tensors(d / "model.safetensors", poison)
    with pytest.raises(CE, match=rf"tensor {name} holds 1 non-finite values"):
        jspec.load_model(str(d), tokenizer=False)
    assert_one_line(*cli("generate", "hello", "--model", d), name)


def test_non_finite_gguf_weights_are_refused(tmp_path, target_dir):
    from jspec.loading.hf import SafetensorsDir

    emb = np.array(SafetensorsDir(target_dir).get("model.embed_tokens.weight"))
    emb[7] = np.nan
    path = write_gguf_with(tmp_path / "nan.gguf", target_dir, tensors={"model.embed_tokens.weight": emb})
    with pytest.raises(CE, match=r"nan\.gguf: tensor model\.embed_tokens\.weight holds 64 non-finite"):
        jspec.load_model(str(path), tokenizer=False)


def test_float16_overflow_is_refused_in_float16_only(tmp_path, target_dir):
    d = copy_dir(target_dir, tmp_path / "d")
    edit_tensors(d / "model.safetensors", lambda t: t.update({"model.norm.weight": np.full(64, 1e5, np.float32)}))
    assert jspec.load_model(str(d), tokenizer=False).config.dtype == "float32"
    with pytest.raises(CE, match="model.norm.weight holds values beyond float16's range"):
        jspec.load_model(str(d), dtype="float16", tokenizer=False)


def test_integer_weights_are_refused(tmp_path, target_dir):
    d = copy_dir(target_dir, tmp_path / "d")
    edit_tensors(d / "model.safetensors", lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(CE, match="model.norm.weight has dtype int32"):
        jspec.load_model(str(d), tokenizer=False)


# ----------------------------------------------------------------------------- drafts

@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory, target):
    from jspec.models.eagle import init_eagle_params

    out = tmp_path_factory.mktemp("w-eagle") / "eagle"
    head = init_eagle_params(target.config, jax.random.key(0), target.params)
    card = {"target": ckpt.target_identity(target), "draft_vocab": {"size": 64}}
    ckpt.save_eagle(out, head, np.arange(64), card)
    return out


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("w-small") / "small"
    cfg = dataclasses.replace(target.config, num_layers=1, tie_word_embeddings=True)
    params = {"layers_0": target.params["layers_0"], "norm": target.params["norm"],
              "embed_tokens": target.params["embed_tokens"]}
    card = {"target": ckpt.target_identity(target), "draft_vocab": {"size": 64}}
    ckpt.save_small_llama(out, cfg, params, np.arange(64), card)
    return out


def _card(fn):
    return lambda d: edit_json(d / "card.json", fn)


def _tensors(file, fn):
    return lambda d: edit_tensors(d / file, fn)


def _set_vocab(file, ids):
    return _tensors(file, lambda t: t.update(draft_vocab_ids=np.asarray(ids)))


def _delete(file, key_fn):
    def edit(d):
        def drop(t):
            del t[next(k for k in sorted(t) if key_fn(k))]
        edit_tensors(d / file, drop)
    return edit


def _poison(file, key_fn):
    def poison(t):
        k = next(k for k in sorted(t) if key_fn(k))
        t[k] = t[k].copy()
        t[k].flat[0] = np.nan
    return _tensors(file, poison)


E = "eagle.safetensors"
EAGLE_CASES = [
    ("card is a list", _card(lambda c: [c]), CE, "card.json: expected a JSON object, got ["),
    ("card is a number", _card(lambda c: 7), CE, "expected a JSON object"),
    ("card is not JSON", lambda d: (d / "card.json").write_text("{"), CE, "card.json: not valid"),
    ("card format", _card(lambda c: c.update(format="other")), CE, "format"),
    ("card version", _card(lambda c: c.update(version=2)), CE, "version"),
    ("card architecture", _card(lambda c: c.update(architecture="small-llama")), DE, "architecture"),
    ("card target not an object", _card(lambda c: c.update(target=["x"])), CE, "target"),
    ("card hash not hex", _card(lambda c: c["target"].update(weights_sha256="xyz")), CE, "target.weights_sha256"),
    ("card vocabulary of another target", _card(lambda c: c["target"].update(vocab_size=49152)), DE,
     "vocabulary of 49152 tokens"),
    ("card draft_vocab.size as a string", _card(lambda c: c["draft_vocab"].update(size="64")), CE,
     "draft_vocab.size"),
    ("card draft_vocab.size wrong", _card(lambda c: c["draft_vocab"].update(size=65)), CE, "draft_vocab.size = 65"),
    ("vocab ids outside the target's", _set_vocab(E, np.arange(250, 314)), DE,
     "outside the target's vocabulary [0, 300)"),
    ("vocab ids negative", _set_vocab(E, np.arange(-1, 63)), DE, "outside the target's vocabulary"),
    ("vocab ids as floats", _set_vocab(E, np.arange(64, dtype=np.float32)), CE, "integer"),
    ("vocab ids repeated", _set_vocab(E, np.zeros(64, np.int32)), CE, "repeat"),
    ("vocab ids 2-D", _set_vocab(E, np.arange(64).reshape(8, 8)), CE, "1-D"),
    ("no vocab ids", _delete(E, lambda k: k == "draft_vocab_ids"), CE, "missing tensor draft_vocab_ids"),
    ("feature layers not a list", _card(lambda c: c.setdefault("config", {}).update(feature_layers="0,1")), CE,
     "config.feature_layers must be a list"),
    ("feature layers outside the target", _card(lambda c: c.setdefault("config", {}).update(feature_layers=[0, 9])),
     DE, "outside the target's 2"),
    ("feature layers named but no fusion tensor (an EAGLE-1 file)",
     _card(lambda c: c.setdefault("config", {}).update(feature_layers=[0, 1])), CE, "missing tensor head/fuse"),
    ("a head tensor missing", _delete(E, lambda k: k.startswith("head/")), CE, "missing tensor head/"),
    ("a head tensor too many", _tensors(E, lambda t: t.update({"head/extra": np.ones(2, np.float32)})), CE,
     "unexpected tensor head/extra"),
    ("a head tensor misshapen", _tensors(E, lambda t: t.update({k: v[:1] for k, v in t.items() if k.startswith("head/fc")})),
     DE, "has shape"),
    ("a head tensor NaN", _poison(E, lambda k: k.startswith("head/")), CE, "non-finite"),
    ("no eagle.safetensors", lambda d: (d / E).unlink(), NF, "eagle.safetensors: missing"),
    ("eagle.safetensors corrupt", lambda d: (d / E).write_bytes(b"\x08" + b"\x00" * 7 + b"{garbage"), CE,
     "cannot read safetensors"),
]

M, V = "model.safetensors", "draft_vocab.safetensors"
SMALL_CASES = [
    ("card is a list", _card(lambda c: [c]), CE, "card.json: expected a JSON object"),
    ("card architecture", _card(lambda c: c.update(architecture="eagle")), DE, "architecture"),
    ("a layer tensor missing", _delete(M, lambda k: k.endswith("mlp.up_proj.weight")), CE,
     "missing tensor model.layers.0.mlp.up_proj.weight"),
    ("a layer tensor NaN", _poison(M, lambda k: k.endswith("o_proj.weight")), CE,
     "model.layers.0.self_attn.o_proj.weight holds 1 non-finite"),
    ("layer count 1e9 in config.json", lambda d: edit_json(d / "config.json", lambda c: c.update(num_hidden_layers=10**9)),
     CE, "num_hidden_layers is 1000000000"),
    ("vocab ids outside the target's", _set_vocab(V, [0, 1, 299, 300]), DE, "outside the target's vocabulary"),
    ("no draft_vocab.safetensors though the card declares one", lambda d: (d / V).unlink(), CE,
     "draft_vocab.safetensors: missing"),
    ("draft_vocab.safetensors without its tensor", _tensors(V, lambda t: t.update(other=t.pop("draft_vocab_ids"))),
     CE, "missing tensor draft_vocab_ids"),
]


def _load_eagle(d, target):
    return ckpt.load_eagle(str(d), target)


def _load_small(d, target):
    return ckpt.load_draft(str(d), target)


@pytest.mark.parametrize("arch,cases,load", [("eagle", EAGLE_CASES, _load_eagle), ("draft", SMALL_CASES, _load_small)])
def test_draft_files(tmp_path, target, target_dir, eagle_dir, small_dir, arch, cases, load):
    pristine = eagle_dir if arch == "eagle" else small_dir
    load(pristine, target)  # the unedited draft loads
    for i, (label, edit, exc, fragment) in enumerate(cases):
        d = copy_dir(pristine, tmp_path / f"{arch}{i}")
        edit(d)
        with pytest.raises(exc) as info:
            load(d, target)
        assert fragment in str(info.value) and str(d) in str(info.value), (label, str(info.value))
        if i % 3 == 0:  # a third of them through the CLI too (each loads the target)
            assert_one_line(*cli("generate", "hello", "--model", target_dir, "--spec", f"{arch}:{d}", "-k", "2"),
                            fragment)
