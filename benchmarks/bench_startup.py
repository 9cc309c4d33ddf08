"""Start-up on the default model: from the command to the first answer, with an empty compile
cache (cold) and with the persistent cache a previous run filled (warm).

    python benchmarks/bench_startup.py [--json FILE]

For each case a fresh ``JSPEC_CACHE_DIR`` (a temporary directory) is made; the command runs
twice in it, cold then warm, each in a new process:

- ``jspec generate "def fibonacci(n):" --max-tokens 16`` (plain, and ``--spec ngram -k 4``):
  seconds from the process's start to its exit;
- ``jspec serve`` (8 slots, max_model_len 2048; plain, and n-gram with dynamic k): seconds
  from the process's start to the first ``/health`` answering 200 (every step variant compiled
  or read from the cache, dynamic k's calibration included), then SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import common
from bench_server import start_server, stop_server

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"


def run_generate(extra: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jspec", "generate", PROMPT, "--max-tokens", "16", *extra], cwd=ROOT,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def run_serve(method: str, env: dict, log: Path) -> float:
    old = dict(os.environ)
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        proc, _ = start_server(method, SimpleNamespace(max_num_seqs=8, max_model_len=2048, start_timeout=900), log)
        ready = time.perf_counter() - t0
        stop_server(proc)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return ready


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cases = [("generate", "plain", []), ("generate", "ngram k=4", ["--spec", "ngram", "-k", "4"]),
             ("serve", "plain", "off"), ("serve", "ngram dynamic k", "dynamic:4")]
    rows = []
    for kind, name, extra in cases:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, JSPEC_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
            times = []
            for _ in ("cold", "warm"):
                if kind == "generate":
                    times.append(run_generate(extra, env))
                else:
                    times.append(run_serve(extra, env, Path(cache) / "serve.log"))
            rec = {"command": kind, "case": name, "cold_s": round(times[0], 1), "warm_s": round(times[1], 1)}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": common.machine(), "commit": common.git_rev(),
                                               "command": "python benchmarks/bench_startup.py", "rows": rows},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
