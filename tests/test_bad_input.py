"""Bad input: the library raises a typed exception; the CLI prints one line and exits 2."""

import json
import subprocess
import sys

import numpy as np
import pytest

import jspec
from helpers import write_hf_checkpoint
from jspec.cli import main


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("good"), "llama")


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, good_dir):
    from test_gguf import write_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path, good_dir, "F32")
    return path


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def bad_checkpoints(tmp_path, good_dir, good_gguf):
    """(label, path, exception type, message fragment) for each broken checkpoint."""
    from safetensors.numpy import load_file, save_file

    out = [("missing", tmp_path / "does-not-exist", jspec.CheckpointNotFoundError, "no such model")]

    trunc = tmp_path / "truncated.gguf"
    data = good_gguf.read_bytes()
    trunc.write_bytes(data[: len(data) // 2])
    out.append(("truncated gguf", trunc, jspec.CheckpointError, "truncated.gguf"))

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    out.append(("corrupt gguf", corrupt, jspec.CheckpointError, "corrupt.gguf"))

    missing = _copy(good_dir, tmp_path / "missing-tensor")
    t = load_file(str(missing / "model.safetensors"))
    del t["model.layers.1.mlp.up_proj.weight"]
    save_file(t, str(missing / "model.safetensors"))
    out.append(("missing tensor", missing, jspec.CheckpointError, "model.layers.1.mlp.up_proj.weight"))

    shape = _copy(good_dir, tmp_path / "wrong-shape")
    cfg = json.loads((shape / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (shape / "config.json").write_text(json.dumps(cfg))
    out.append(("wrong shape", shape, jspec.CheckpointError, "has shape"))

    arch = _copy(good_dir, tmp_path / "gpt2")
    cfg = json.loads((arch / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (arch / "config.json").write_text(json.dumps(cfg))
    out.append(("unsupported arch", arch, jspec.UnsupportedModelError, "gpt2"))

    pickle_dir = tmp_path / "pickle"
    pickle_dir.mkdir()
    (pickle_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    out.append(("pickle dir", pickle_dir, jspec.UnsupportedModelError, "pickle"))
    pt = tmp_path / "model.pt"
    pt.write_bytes(b"\x80\x04")
    out.append(("pickle file", pt, jspec.UnsupportedModelError, "pickle"))
    return out


def test_library_raises_typed_errors(tmp_path, good_dir, good_gguf):
    for label, path, exc, fragment in bad_checkpoints(tmp_path, good_dir, good_gguf):
        with pytest.raises(exc, match=fragment.replace(".", r"\.")):
            jspec.load_model(str(path))
        assert issubclass(exc, jspec.JspecError), label


@pytest.mark.parametrize("kw,fragment", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(seed=2**64), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(num_speculative_tokens=99), "num_speculative_tokens"),
])
def test_sampling_params_validate(kw, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment):
        jspec.SamplingParams(**kw)


def test_prompt_errors(good_dir):
    model = jspec.load_model(str(good_dir))
    with pytest.raises(jspec.PromptError, match="empty"):
        jspec.generate(model, [""])
    with pytest.raises(jspec.PromptError, match="context"):
        jspec.generate(model, [[5] * 500], jspec.SamplingParams(max_tokens=20))
    with pytest.raises(jspec.PromptError, match="outside"):
        jspec.generate(model, [[5, 100000]])


def _cli(*args):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_cli_bad_checkpoints_exit_2_with_one_line(tmp_path, good_dir, good_gguf):
    for label, path, _, fragment in bad_checkpoints(tmp_path, good_dir, good_gguf):
        code, out, err = _cli("generate", "hello", "--model", str(path))
        assert code == 2, label
        assert out == "", label
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("jspec: error:") and fragment in lines[0], (label, err)


@pytest.mark.parametrize("args,fragment", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.1"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--max-new-tokens", "0"], "max_tokens"),
    (["--max-new-tokens", "600"], "context"),
    (["--spec", "bogus"], "--spec"),
    (["--num-speculative-tokens", "0", "--spec", "ngram"], "num_speculative_tokens"),
    (["--temperature", "abc"], "invalid float"),
])
def test_cli_bad_options_exit_2(good_dir, args, fragment):
    code, out, err = _cli("generate", "hello world", "--model", str(good_dir), *args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], err


def test_cli_empty_prompt_exit_2(good_dir):
    code, out, err = _cli("generate", "", "--model", str(good_dir))
    assert code == 2 and out == "" and "empty" in err and len(err.strip().splitlines()) == 1


def test_cli_subprocess_has_no_traceback(tmp_path):
    """The installed entry point: a missing model is one line on stderr and exit code 2."""
    p = subprocess.run([sys.executable, "-m", "jspec", "generate", "hi", "--model", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
