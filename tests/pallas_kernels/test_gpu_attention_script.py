"""benchmarks/gpu_attention.py runs end to end, in its CPU smoke mode (Pallas interpret mode,
tiny shapes, every section in its own child process, output under $OUT), so the script that
will spend scarce GPU minutes is checked before it gets them."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_attention.py"


def test_gpu_benchmark_smoke_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "gpu_attention.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    kinds = collections.Counter(r["kind"] for r in records)
    assert not kinds["error"] and not kinds["section_failed"] and not kinds["skipped"], \
        [r for r in records if r["kind"] in ("error", "section_failed", "skipped")]
    assert kinds["parity"] == 4 and all(r["ok"] for r in records if r["kind"] == "parity")
    assert kinds["timing"] == 7 and kinds["t_ratio"] == 2 and kinds["sweep"] == 3
    assert kinds["tree_parity"] == 4 and all(r["ok"] for r in records if r["kind"] == "tree_parity")
    assert any(r.get("tree") for r in records if r["kind"] == "timing")
    assert kinds["window_parity"] == 2 and all(r["ok"] for r in records if r["kind"] == "window_parity")
    assert kinds["window_ratio"] == 1 and any(r["options"].get("sliding_window") for r in records
                                              if r["kind"] == "timing")
    assert kinds["trace_events"] >= 1  # the profiler path ran (no GPU events on the CPU)
    [versions] = [r for r in records if r["kind"] == "versions"]
    assert versions["jax"] and versions["jaxlib"] and versions["tuning entry"] == "default"
    timing = [r for r in records if r["kind"] == "timing"]
    assert all(r["plan"]["block_q"] >= 16 and r["e2e_us"] > 0 and r["reference_us"] > 0
               for r in timing)
    assert any(r["copies"] > 1 for r in timing)  # the L2-defeating rotation over cache copies
    md = (tmp_path / "gpu_attention.md").read_text()
    for heading in ("## Parity", "## Timing", "## Sweep", "## Token trees", "## Local layers", "Smoke run"):
        assert heading in md
