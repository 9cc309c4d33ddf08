"""The installed package, not only the checkout: a wheel built from this tree holds every module,
the CPU kernels' C++ sources and the shipped drafts, and an install of it finds the drafts as
package data (``importlib.resources``), with no checkout beside it. The wheel is built offline
(``--no-deps --no-build-isolation``) from a copy of the tree: an in-tree build leaves build/,
whose stale files later wheels would carry."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".train")  # a draft's training scratch stays out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("jspec", "pallas_kernels", "checkpoints"):
        shutil.copytree(ROOT / name, src / name, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("jspec-*.whl")
    return whl


def tree_files(top: str, *patterns: str) -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pattern in patterns for p in (ROOT / top).rglob(pattern)
            if "__pycache__" not in p.parts and ".train" not in p.parts}


def test_the_wheel_holds_the_modules_the_kernel_sources_and_the_drafts(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = tree_files("jspec", "*.py") | tree_files("pallas_kernels", "*.py")
    assert modules - names == set()  # a subpackage missing from pyproject.toml's list shows here
    kernels = tree_files("pallas_kernels", "cpu/*.cc", "cpu/*.h")
    assert {"pallas_kernels/cpu/small_rows.cc", "pallas_kernels/cpu/cpu_common.h"} <= kernels
    assert kernels - names == set()
    drafts = {"jspec/" + f for f in tree_files("checkpoints", "*") if not (ROOT / f).is_dir()}
    for name in ("smollm2-135m-draft", "smollm2-135m-eagle", "smollm2-135m-eagle3"):
        assert f"jspec/checkpoints/{name}/card.json" in drafts
    assert "jspec/checkpoints/smollm2-135m-eagle3/eagle.safetensors" in drafts
    assert drafts - names == set()
    assert not {n for n in names if n.startswith(("checkpoints/", "tests/", "benchmarks/")) or "/.train/" in n}


def test_an_install_of_the_wheel_finds_the_drafts_through_importlib_resources(wheel, tmp_path):
    """The wheel unpacked is an install of it (pure Python); run from elsewhere, with only that
    install on the path, the loader's lookup resolves the shipped drafts inside it."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = """
import importlib.resources, pathlib, sys
import jspec
from jspec.loading import drafts
site = pathlib.Path(sys.argv[1])
assert pathlib.Path(jspec.__file__).is_relative_to(site), jspec.__file__
assert drafts.shipped_dir() == importlib.resources.files("jspec.checkpoints") == site / "jspec" / "checkpoints"
for name in ("smollm2-135m-draft", "smollm2-135m-eagle", "smollm2-135m-eagle3"):
    path = drafts.resolve_draft_path(name)
    assert path == site / "jspec" / "checkpoints" / name, path
    assert drafts.read_card(path)["format"] == "jspec-draft"
print("ok")
"""
    env = dict(os.environ, PYTHONPATH=str(site))
    out = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_checkout_finds_its_own_checkpoints_folder():
    """In the tree (where ``jspec distill --out checkpoints/NAME`` writes) the drafts are the
    checkout's own checkpoints/."""
    from jspec.loading import drafts

    assert drafts.shipped_dir() == ROOT / "checkpoints"
    assert drafts.resolve_draft_path("smollm2-135m-eagle3") == ROOT / "checkpoints" / "smollm2-135m-eagle3"
