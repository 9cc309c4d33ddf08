"""Session fixtures. Tests marked ``slow`` share one load of the real SmolLM2-135M model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("JSPEC_COMPILE_CACHE", "0")  # the CLI runs in-process here; its cache is process-wide


@pytest.fixture(autouse=True, scope="session")
def _jspec_cache_dir(tmp_path_factory):
    """Tokenizer/XLA caches go to a per-session temporary directory."""
    if "JSPEC_CACHE_DIR" not in os.environ:
        os.environ["JSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("jspec-cache"))
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, loaded once (float32)."""
    import jspec

    return jspec.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF (PyTorch, float32, CPU)."""
    from transformers import AutoModelForCausalLM

    from jspec.loading import smollm2_path

    p = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory):
    from helpers import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
