"""``jspec serve`` on the real model beside hostile clients: how long a normal request takes
while 15 MB prompts are sent and refused, RSS across 50 refused 5 MB prompts, and how long a
SIGTERM takes to end the process with a stalled request body open.

    python benchmarks/bench_server_faults.py [--max-num-seqs 4] [--max-model-len 2048]
                                             [--drain-timeout 5] [--json FILE]

One ``jspec serve`` (SmolLM2-135M, no speculation) on 127.0.0.1; nothing else is contacted. A
"normal request" is a greedy completion of a HumanEval-style prompt, 16 new tokens, not
streamed, timed by the client. Big bodies are JSON-encoded before any clock starts.

Goals: a normal request's latency beside a 15 MB prompt within 2x of its idle latency; RSS after
the 50 refusals within 10% of before; SIGTERM with a stalled body: exit 0 within
drain-timeout + 5 s.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

import bench_server

MODEL = bench_server.MODEL
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def normal(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                   "temperature": 0.0}, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0


def beside(url: str, path: str, body: bytes) -> tuple[list[float], float, int]:
    """Normal requests, one after another, while ``body`` is posted and answered."""
    out = {}

    def big():
        t0 = time.perf_counter()
        r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=300)
        out["status"], out["seconds"] = r.status_code, time.perf_counter() - t0

    t = threading.Thread(target=big)
    t.start()
    times = [normal(url)]
    while t.is_alive():
        times.append(normal(url))
    t.join()
    return times, out["seconds"], out["status"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--drain-timeout", type=float, default=5.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "server.log"
    proc, url = bench_server.start_server("off", args, log, ("--drain-timeout", str(args.drain_timeout)))
    res: dict = {}
    try:
        for _ in range(3):
            normal(url)
        idle = [normal(url) for _ in range(9)]
        res["idle_s"] = {"median": round(statistics.median(idle), 4), "max": round(max(idle), 4)}
        text = "word " * (3 * 2**20)
        bodies = {"completion_15MB": ("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 4}),
                  "chat_15MB": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": text}]})}
        for name, (path, body) in bodies.items():
            times, seconds, status = beside(url, path, json.dumps(body).encode())
            res[name] = {"status": status, "refused_in_s": round(seconds, 3), "normal_requests": len(times),
                         "normal_median_s": round(statistics.median(times), 4), "normal_max_s": round(max(times), 4)}
        five = json.dumps({"model": MODEL, "prompt": "x" * (5 * 2**20), "max_tokens": 4}).encode()
        with httpx.Client(timeout=120) as c:
            before = rss_mb(proc.pid)
            codes = [c.post(url + "/v1/completions", content=five, headers={"Content-Type": "application/json"})
                     .status_code for _ in range(50)]
        time.sleep(0.5)
        res["rss_50_refused_5MB"] = {"before_mb": round(before, 1), "after_mb": round(rss_mb(proc.pid), 1),
                                     "statuses": sorted(set(codes))}
        host, port = url.removeprefix("http://").split(":")
        stalled = socket.create_connection((host, int(port)))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(15)
        rc = proc.wait(args.drain_timeout + 60)
        res["sigterm_with_stalled_body"] = {"exit_code": rc, "seconds": round(time.monotonic() - t0, 2),
                                            "drain_timeout_s": args.drain_timeout}
        stalled.close()
    finally:
        bench_server.stop_server(proc)
    idle_median = res["idle_s"]["median"]
    res["goals"] = {
        "beside_15MB_within_2x_idle": all(res[n]["normal_median_s"] <= 2 * idle_median for n in bodies),
        "rss_within_10pct": res["rss_50_refused_5MB"]["after_mb"] <= 1.1 * res["rss_50_refused_5MB"]["before_mb"],
        "sigterm_exit_0_within_drain_plus_5s": rc == 0 and res["sigterm_with_stalled_body"]["seconds"]
        <= args.drain_timeout + 5,
    }
    print(json.dumps(res, indent=1))
    print(f"git {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
