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


def test_a_cached_tokenizer_reads_back_the_same_without_importing_torch(gguf, tmp_path, monkeypatch):
    """The second load reads the saved tokenizer.json (a warm start's path): the same ids, chat
    template and special tokens as the tokenizer built from the metadata, and no PyTorch import
    (AutoTokenizer's config machinery pulls it in, seconds of every start)."""
    import json
    import subprocess
    import sys

    monkeypatch.setenv("JSPEC_CACHE_DIR", str(tmp_path))
    built = tokenizer.load_tokenizer("gguf", gguf)
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    chat = [{"role": "user", "content": "hi"}]
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from jspec.loading import tokenizer\n"
        f"tok = tokenizer.load_tokenizer('gguf', Path({str(gguf)!r}))\n"
        f"texts = {TEXTS!r}\n"
        "print(json.dumps({'ids': [tok(t)['input_ids'] for t in texts],\n"
        f"  'chat': tok.apply_chat_template({chat!r}, tokenize=False, add_generation_prompt=True),\n"
        "  'special': [tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token, tok.eos_token_id],\n"
        "  'torch': 'torch' in sys.modules}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    read = json.loads(out.stdout.strip().splitlines()[-1])
    assert read["ids"] == [built(t)["input_ids"] for t in TEXTS]
    assert read["chat"] == built.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert read["special"] == [built.bos_token, built.eos_token, built.unk_token, built.pad_token, built.eos_token_id]
    assert read["torch"] is False
