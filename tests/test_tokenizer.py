"""The default model's tokenizer built without PyTorch (jspec's GGUF reader feeding transformers'
converter) equals transformers' own GGUF route: the same tokenizer.json, chat template, special
tokens and ids."""

import filecmp
import importlib.util

import pytest

from jspec.errors import CheckpointNotFoundError
from jspec.loading import smollm2_path, tokenizer

TEXTS = ["def f(x):\n    return x ** 2  # héllo \t wörld 你好 🙂", " a leading space",
         "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def gguf():
    try:
        return smollm2_path()
    except CheckpointNotFoundError as e:
        pytest.skip(str(e))


def test_the_torch_free_tokenizer_is_transformers_own(gguf, tmp_path):
    pytest.importorskip("torch")  # transformers' route, the reference, needs it
    ref = tokenizer._quiet_auto_tokenizer().from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    mine = tokenizer.gguf_tokenizer_without_torch(gguf)
    ref.save_pretrained(str(tmp_path / "ref"))
    mine.save_pretrained(str(tmp_path / "mine"))
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert filecmp.cmp(tmp_path / "ref" / name, tmp_path / "mine" / name, shallow=False), name
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id"):
        assert getattr(mine, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        assert mine(text)["input_ids"] == ref(text)["input_ids"], text
    chat = [{"role": "user", "content": "hi"}]
    assert (mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_without_torch_the_loader_takes_the_torch_free_route(gguf, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path))  # no cached tokenizer: build one
    called = []
    build = tokenizer.gguf_tokenizer_without_torch
    monkeypatch.setattr(tokenizer, "gguf_tokenizer_without_torch", lambda p: called.append(p) or build(p))
    tok = tokenizer.load_tokenizer("gguf", gguf)
    assert called == [gguf] and tok("def f(x):")["input_ids"]
