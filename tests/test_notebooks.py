"""The research notebooks execute top to bottom and show what they claim to show.

Each notebook in ``notebooks/`` runs in a fresh ``python3`` Jupyter kernel (nbclient), on a tiny
random Hugging Face Llama checkpoint named through ``JSPEC_NOTEBOOK_MODEL``. A failing cell
(an exception or a failed ``assert`` inside the notebook) fails the test; the checks below then
look for the lines each notebook prints.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from helpers import tiny_subprocess_xla_flags  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from helpers import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("notebook-model"), "llama", num_hidden_layers=4)


@pytest.fixture
def run_notebook(tiny_model_dir, monkeypatch):
    """Execute ``notebooks/<name>`` on the tiny model; returns (notebook, its text output)."""
    monkeypatch.setenv("JSPEC_NOTEBOOK_MODEL", str(tiny_model_dir))  # the kernel inherits it
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("XLA_FLAGS", tiny_subprocess_xla_flags(os.environ.get("XLA_FLAGS", "")))

    def run(name: str):
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=600,
                                         resources={"metadata": {"path": str(NOTEBOOKS)}})
        client.execute()  # raises CellExecutionError on the first failing cell
        return nb, _text(nb)

    return run


def _text(nb) -> str:
    """Every stream and text/plain output of the executed notebook, in order."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif "text/plain" in out.get("data", {}):
                parts.append(out.data["text/plain"])
    return "\n".join(parts)


def test_notebooks_are_stored_without_outputs():
    names = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert names == ["01_quickstart.ipynb", "02_acceptance_vs_k.ipynb", "03_paged_attention_kernel.ipynb",
                     "04_engine.ipynb", "05_train_a_draft.ipynb", "06_token_trees.ipynb",
                     "07_bring_your_own_model.ipynb", "08_structured_output.ipynb"]
    for name in names:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{name} holds outputs"


def test_quickstart(run_notebook):
    _, text = run_notebook("01_quickstart.ipynb")
    assert "greedy outputs identical to plain decoding: ngram, layerskip L=2" in text
    assert re.search(r"^plain\s+\d+\.\d\s+-$", text, re.M), text
    for method in ("ngram", r"layerskip L=2"):
        row = re.search(rf"^{method}\s+(\d+\.\d)\s+(\d+\.\d\d)\s+\[([0-9. ]+)\]$", text, re.M)
        assert row, f"no metrics row for {method}:\n{text}"
        assert 1.0 <= float(row.group(2)) <= 5.0  # mean accepted length with k = 4
        assert len(row.group(3).split()) == 4  # acceptance of each of the k positions
    run1 = re.search(r"seed 1234, run 1: (.*)", text).group(1)
    assert re.search(r"seed 1234, run 2: (.*)", text).group(1) == run1


def test_acceptance_vs_k(run_notebook):
    nb, text = run_notebook("02_acceptance_vs_k.ipynb")
    assert "4 configurations" in text  # the tiny model's small settings: k in (1, 4)
    rows = re.findall(r"^(ngram|layerskip L=2)\s+(\d)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)", text, re.M)
    assert [(name, int(k)) for name, k, *_ in rows] == [
        (name, k) for name in ("ngram", "layerskip L=2") for k in (1, 4)]
    for _, k, a, measured, formula in rows:
        assert 0.0 <= float(a) <= 1.0
        assert 1.0 <= float(measured) <= int(k) + 1
        assert 1.0 <= float(formula) <= int(k) + 1
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 1


def test_paged_attention_kernel(run_notebook):
    _, text = run_notebook("03_paged_attention_kernel.ipynb")
    diff = re.search(r"max abs difference kernel vs reference: (\S+)", text)
    assert diff and float(diff.group(1)) < 1e-5
    assert "entry the interpret-mode run used: default" in text
    assert "NVIDIA H200 -> lookup('cuda', 'NVIDIA H200') = cuda-hopper" in text
    assert "AMD MI300X -> lookup('rocm', 'gfx942') = rocm-gfx942" in text
    assert len(re.findall(r"num_splits=\d+", text)) == 4


def test_engine(run_notebook):
    _, text = run_notebook("04_engine.ipynb")
    assert "greedy outputs identical in every run" in text
    assert "step ms by k" in text and "k=0:" in text


def test_train_a_draft(run_notebook):
    nb, text = run_notebook("05_train_a_draft.ipynb")
    points = int(re.search(r"tiny run: (\d+) validation points", text).group(1))
    assert points == 3  # 24 steps, a checkpoint (and a held-out score) every 8
    scores = [float(a) for a in re.findall(r"held-out top-1 agreement (\d\.\d+)", text)]
    assert len(scores) == points and all(0.0 <= a <= 1.0 for a in scores)
    assert "greedy identical to plain decoding: yes" in text
    assert 1.0 <= float(re.search(r"mean accepted length at k = 4: (\d+\.\d+)", text).group(1)) <= 5.0
    shipped = re.findall(r"shipped (smollm2-135m-\w+): top-1 agreement (\S+) at step \d+ -> (\S+) at step (\d+)", text)
    assert [name for name, *_ in shipped] == ["smollm2-135m-eagle3", "smollm2-135m-eagle", "smollm2-135m-draft"]
    for name, first, last, steps in shipped:  # read from the cards: the curves rose
        assert float(last) > float(first) and int(steps) >= 400
    assert "held-out mean accepted length at k = 4" in text  # the EAGLE-3 card's chain score
    assert re.search(r"continued from smollm2-135m-eagle3 \(\d+ steps, \d+k tokens before", text)  # its lineage
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 1


def test_token_trees(run_notebook):
    nb, text = run_notebook("06_token_trees.ipynb")
    tree = re.search(r"tree: (\d+) nodes, depth (\d+); accepted (\d+) node\(s\) and one more token: (\d+) tokens", text)
    assert tree, text
    nodes, depth, accepted, emitted = map(int, tree.groups())
    assert 1 <= nodes <= 12 and 1 <= depth <= 4 and accepted <= depth and emitted == accepted + 1
    assert "greedy identical to plain decoding for every chain and tree: yes" in text
    rows = re.findall(r"^(chain k=\d|tree \d+x\d)\s+(\d+\.\d)\s+(\d+\.\d\d)$", text, re.M)
    assert [name for name, *_ in rows] == ["chain k=1", "chain k=2", "chain k=4", "tree 4x2", "tree 8x3"]
    for name, drafted, tokens in rows:
        assert 1.0 <= float(tokens) <= float(drafted) + 1  # no more than the drafts plus the extra token
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 2


def test_bring_your_own_model(run_notebook):
    _, text = run_notebook("07_bring_your_own_model.ipynb")
    assert re.search(r"^gemma-3-27b\s+gemma3_text\s+27\.01B parameters, 62 layers, 52 of them local", text, re.M), text
    assert re.search(r"^llama-3\.1-405b\s+MI300X\s+1\s+refused: the weights \(756\.0 GiB", text, re.M), text
    assert re.search(r"^llama-3\.1-405b\s+MI300X\s+8\s+94\.5 GiB\s+[\d,]+$", text, re.M), text
    for family in ("qwen3: qwen3", "gemma3: gemma3_text"):
        assert re.search(rf"^{family}, max \|logits - transformers\| = \d\.\de-0[5-9]; n-gram speculation "
                         r"identical to plain greedy: yes$", text, re.M), text
    for layout in ("eagle", "speculators"):
        assert re.search(rf"^{layout}\s+layout: detected as eagle3, .* identical to plain decoding: yes$", text, re.M)


def test_structured_output(run_notebook):
    nb, text = run_notebook("08_structured_output.ipynb")
    assert "valid JSON under the schema: yes" in text
    assert "speculative output identical to constrained decoding: yes" in text
    forced, total = map(int, re.search(r"forced positions: (\d+) of (\d+)", text).groups())
    assert 0 < forced < total
    assert re.search(r"^regex  -> '\d{3}-\d{4}' \(eos\)$", text, re.M), text
    assert re.search(r"^choice -> '(yes|no|maybe)' \(eos\)$", text, re.M), text
    assert "refused: structured output regex is invalid" in text
    images = [out for cell in nb.cells for out in cell.get("outputs", []) if "image/png" in out.get("data", {})]
    assert len(images) == 1
