"""Builders for the hostile-input tests: GGUF files with chosen metadata, draft checkpoints
made without training, and the CLI run in-process or in a subprocess (optionally under a
memory limit)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- GGUF

def gguf_metadata(cfg, arch: str = "llama") -> dict:
    """{key: (value, GGUFValueType)} as llama.cpp writes them for ``cfg``."""
    import gguf

    T = gguf.GGUFValueType
    a = f"{arch}."
    return {
        a + "block_count": (cfg.num_layers, T.UINT32),
        a + "embedding_length": (cfg.hidden_size, T.UINT32),
        a + "feed_forward_length": (cfg.intermediate_size, T.UINT32),
        a + "attention.head_count": (cfg.num_heads, T.UINT32),
        a + "attention.head_count_kv": (cfg.num_kv_heads, T.UINT32),
        a + "rope.freq_base": (cfg.rope_theta, T.FLOAT32),
        a + "attention.layer_norm_rms_epsilon": (cfg.rms_norm_eps, T.FLOAT32),
        a + "context_length": (cfg.max_position_embeddings, T.UINT32),
        a + "vocab_size": (cfg.vocab_size, T.UINT32),
        "tokenizer.ggml.eos_token_id": (1, T.UINT32),
    }


def write_gguf_with(path: Path, hf_dir: Path, set_fields: dict | None = None, drop: tuple = (),
                    arch: str = "llama", tensors: dict | None = None) -> Path:
    """An F32 GGUF of the tiny HF checkpoint ``hf_dir`` with metadata fields replaced
    (``set_fields``: {key: (value, GGUFValueType)}) or removed (``drop``); ``tensors`` replaces
    tensors by Hugging Face name (before llama.cpp's Q/K permutation)."""
    import gguf

    from jspec.loading.hf import SafetensorsDir, load_hf_config
    from test_gguf import _gguf_name, _permute

    cfg = load_hf_config(hf_dir)
    src = SafetensorsDir(hf_dir)
    meta = gguf_metadata(cfg, arch)
    meta.update(set_fields or {})
    for key in drop:
        meta.pop(key, None)
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for name in sorted(src.keys()):
        x = np.asarray((tensors or {}).get(name, src.get(name)), np.float32)
        if name.endswith("q_proj.weight"):
            x = _permute(x, cfg.num_heads)
        elif name.endswith("k_proj.weight"):
            x = _permute(x, cfg.num_kv_heads)
        w.add_tensor(_gguf_name(name), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------- files

def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".train"))
    return dst


def edit_json(path: Path, fn) -> None:
    """Rewrite a JSON file with ``fn(obj)`` (which may mutate and return None, or return a new value)."""
    obj = json.loads(path.read_text())
    new = fn(obj)
    path.write_text(json.dumps(obj if new is None else new))


def edit_tensors(path: Path, fn) -> None:
    """Rewrite a safetensors file with ``fn(dict of arrays)`` mutating the dict."""
    from safetensors.numpy import load_file, save_file

    t = load_file(str(path))
    fn(t)
    save_file(t, str(path))


# ----------------------------------------------------------------------------- the CLI

def cli(*args) -> tuple[int, str, str]:
    """The CLI in-process: (exit code, stdout, stderr)."""
    from jspec.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def assert_one_line(code: int, out: str, err: str, fragment: str = "", exit_code: int = 2) -> str:
    """Exit ``exit_code``, nothing on stdout, exactly one ``jspec: error:`` line naming ``fragment``."""
    lines = err.strip().splitlines()
    assert code == exit_code, (code, err)
    assert out == "", out
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    if exit_code == 2:
        assert lines[0].startswith("jspec: error: "), err
    assert fragment in lines[0], (fragment, err)
    return lines[0]


_RUNNER = r"""
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
args, headroom, report = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
import jax, jax.numpy as jnp
from jspec.cli import main
import jspec.loading.hf, jspec.loading.gguf_loader, jspec.loading.convert, jspec.loading.drafts  # imports done before the limit
jnp.zeros(8).block_until_ready()  # the backend is up before the limit
if headroom:
    vm = [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:")][0]
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, vm + headroom))
t = time.time()
code = main(args)
json.dump({{"code": code, "seconds": time.time() - t}}, open(report, "w"))
sys.stderr.flush()
os._exit(code)
"""


def cli_subprocess(args, headroom: int = 0, timeout: float = 180, env: dict | None = None):
    """The CLI in a fresh Python, optionally under ``RLIMIT_AS`` = current size + ``headroom``
    bytes (set after JAX starts). Returns (exit code, stdout, stderr, seconds spent in main())."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        p = subprocess.run([sys.executable, "-c", _RUNNER.format(root=str(ROOT)), json.dumps([str(a) for a in args]),
                            str(headroom), str(report)], capture_output=True, text=True, timeout=timeout,
                           cwd=str(ROOT), env=dict(os.environ, **(env or {})))
        seconds = json.loads(report.read_text())["seconds"] if report.exists() else float("nan")
    return p.returncode, p.stdout, p.stderr, seconds
