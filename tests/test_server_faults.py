"""``jspec serve`` against what clients send: one request's failure stays that request's, big
prompts are refused before they cost anything, every way a client can hold the server has a
timeout, SIGTERM always ends the process with exit 0, and a long mixed soak returns the server
to idle.

The servers are real subprocesses on 127.0.0.1 serving a tiny random Llama (with a real BPE
tokenizer and chat template), talked to with the ``openai`` client, ``httpx`` and raw sockets;
the engine-failure tests run the app in-process (uvicorn in a thread) so that a fault can be
injected into the engine. Figures (latencies, exit times, RSS, page counts) are printed with
``pytest -s`` and, with ``JSPEC_FAULT_FIGURES=FILE``, written there as JSON; the assertions are
about behaviour, with bounds wide enough for a busy two-core machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

import server_helpers
from helpers import write_hf_checkpoint
from server_helpers import launch, stalled_body

openai = pytest.importorskip("openai")

NAME = "tiny"
KEY = "fault-key"
MAX_MODEL_LEN = 128
START_TIMEOUT = 240.0
FIGURES: dict = {}


def _figure(name: str, value) -> None:
    FIGURES[name] = value
    print(f"[figure] {name}: {value}")
    path = os.environ.get("JSPEC_FAULT_FIGURES")
    if path:
        Path(path).write_text(json.dumps(FIGURES, indent=1))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=512)


class Proc:
    def __init__(self, proc: subprocess.Popen, log: Path):
        self.proc, self.log, self.url = proc, log, ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60.0, **kw)

    def post(self, path: str, body, timeout: float = 60.0, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                          **kw)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")] = float(value)
        return out

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").split(":")
        return host, int(port)

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"still running {timeout:g} s after SIGTERM:\n{self.log.read_text()}")
        return rc, time.monotonic() - t0


def start(model: Path, tmp: Path, *extra: str) -> Proc:
    log = tmp / f"server-{time.monotonic_ns()}.log"
    args = ["--model", str(model), "--served-model-name", NAME, "--host", "127.0.0.1", "--port", "0",
            "--api-key", KEY, "--max-num-seqs", "4", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens",
            "1024", "--max-burst-steps", "4", "--log-level", "warning", *extra]
    return Proc(launch(args, log), log)


def wait_ready(p: Proc) -> None:
    p.url = server_helpers.wait_ready(p.proc, p.log, START_TIMEOUT)


def stop(p: Proc) -> None:
    server_helpers.stop(p.proc)


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    p = start(tiny_dir, tmp_path_factory.mktemp("serve"), "--max-waiting-requests", "12", "--body-timeout", "3",
              "--header-timeout", "2")
    try:
        wait_ready(p)
        yield p
    finally:
        stop(p)


def complete(p: Proc, prompt="def add(a, b):", **kw) -> httpx.Response:
    body = {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    body.update(kw)
    return p.post("/v1/completions", body)


def assert_idle(p: Proc) -> dict:
    """No request in the engine and every KV page free (prefix-cached pages count as free)."""
    deadline = time.monotonic() + 30
    while True:
        m = p.metrics()
        idle = (m["jspec:num_requests_running"] == 0 and m["jspec:num_requests_waiting"] == 0
                and m["jspec:kv_cache_free_pages"] == m["jspec:kv_cache_total_pages"])
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, m
    return m


# ----------------------------------------------------------------------------- one request's fault

DEGENERATE = [
    ("temperature", 1e-46), ("temperature", 1e-39), ("temperature", 5e-324), ("temperature", 1e-30),
    ("temperature", 3.4e38), ("temperature", 0.0),
    ("top_p", 1e-46), ("top_p", 5e-324), ("top_p", 1e-39), ("top_p", 1.0), ("top_p", 0.999999999999),
    ("top_k", 2**31 - 1), ("top_k", 2**63 - 1), ("top_k", 1), ("top_k", -1),
    ("seed", 2**63 - 1), ("seed", -(2**63)), ("seed", 2**64 + 5), ("seed", 0),
    ("max_tokens", 2**31), ("max_tokens", 10**30), ("max_tokens", 1),
    ("num_speculative_tokens", 0), ("num_speculative_tokens", 2**40), ("num_speculative_tokens", -1),
    ("stop", ["\ufffd"]), ("stop", [""]), ("stop", ["x" * 10_000]), ("stop", ["a", "b", "c", "d"]),
    ("temperature", 1e308), ("top_p", -0.0), ("temperature", -0.0),
]


@pytest.mark.parametrize("field,value", DEGENERATE, ids=[f"{f}={v!r:.20}" for f, v in DEGENERATE])
def test_degenerate_sampling_values_never_hurt_a_later_request(server, field, value):
    """Each value is answered (200, or 400 with an OpenAI error naming a field), and the next
    normal request still gets the greedy answer it gets alone; /health stays 200."""
    baseline = complete(server).json()["choices"][0]["text"]
    r = complete(server, **{field: value})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["text"], str)
    else:
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"] and "\n" not in err["message"]
    after = complete(server)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == baseline
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_degenerate_values_in_chat_and_streams(server):
    client = server.client()
    for kw in ({"top_p": 1e-46}, {"temperature": 1e-46}, {"extra_body": {"top_k": 2**31 - 1}}):
        reply = client.chat.completions.create(model=NAME, max_tokens=6,
                                               messages=[{"role": "user", "content": "hello"}], **kw)
        assert reply.choices[0].finish_reason in ("stop", "length")
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=NAME, prompt="for i in", max_tokens=6, stream=True, **kw) if c.choices)
        assert isinstance(text, str)
    assert_idle(server)


# ----------------------------------------------------------------------------- bounded work

def _latency(p: Proc, n: int = 5) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        assert complete(p).status_code == 200
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2]


def test_a_huge_prompt_is_refused_unread_and_stalls_no_one(server):
    """A 15 MB prompt (and a 15 MB chat message) is refused with 400 before it is tokenized;
    normal requests sent while it is sent and refused are served about as fast as alone
    (figures printed). The big bodies are encoded before the clock starts, so that the test's
    own JSON encoding does not count."""
    idle = _latency(server)
    big = "word " * (3 * 2**20)  # 15 MiB of text
    bodies = {"completion": ("/v1/completions", {"model": NAME, "prompt": big, "max_tokens": 4}),
              "chat": ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": big}]})}
    encoded = {k: (path, json.dumps(b).encode()) for k, (path, b) in bodies.items()}
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    results, beside = {}, []

    def send_big(kind):
        path, body = encoded[kind]
        t0 = time.perf_counter()
        r = httpx.post(server.url + path, content=body, headers=headers, timeout=60)
        results[kind] = (r, time.perf_counter() - t0)

    for kind in encoded:
        t = threading.Thread(target=send_big, args=(kind,))
        t.start()
        while t.is_alive():
            t0 = time.perf_counter()
            assert complete(server).status_code == 200
            beside.append(time.perf_counter() - t0)
        t.join()
        r, seconds = results[kind]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and err["code"] == "context_length_exceeded" and "characters" in err["message"]
    beside.sort()
    _figure("normal_request_idle_median_s", round(idle, 4))
    _figure("normal_request_beside_15MB_prompts_s", {"n": len(beside), "median": round(beside[len(beside) // 2], 4),
                                                     "max": round(beside[-1], 4)})
    _figure("15MB_prompt_refused_in_s", {k: round(v[1], 3) for k, v in results.items()})
    assert beside[-1] < max(10 * idle, 2.0), (idle, beside)
    assert server.metrics()['jspec:request_rejected_total{reason="prompt_too_long"}'] >= 2


def test_over_long_token_prompts_never_reach_the_engine(server):
    before = server.metrics()
    r = complete(server, prompt=[5] * 200)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = complete(server, prompt="def add " * 30, max_tokens=120)  # fits in characters, not in tokens
    assert r.status_code == 400 and "max_tokens=120" in r.json()["error"]["message"]
    after = server.metrics()
    assert after['jspec:request_rejected_total{reason="prompt_too_long"}'] == \
        before['jspec:request_rejected_total{reason="prompt_too_long"}'] + 2
    # the engine saw neither: its finished-request counters did not move
    assert sum(v for k, v in after.items() if k.startswith("jspec:request_success_total")) == \
        sum(v for k, v in before.items() if k.startswith("jspec:request_success_total"))


def test_rss_returns_after_refused_5MB_prompts(server):
    """50 refused 5 MB prompts leave the server's RSS where it was (figures printed)."""
    body = json.dumps({"model": NAME, "prompt": "x" * (5 * 2**20), "max_tokens": 4}).encode()
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with httpx.Client(timeout=60) as c:
        for _ in range(3):  # warm the path
            assert c.post(server.url + "/v1/completions", content=body, headers=headers).status_code == 400
        before = server.rss_mb()
        for _ in range(50):
            assert c.post(server.url + "/v1/completions", content=body, headers=headers).status_code == 400
    time.sleep(0.5)
    after = server.rss_mb()
    _figure("rss_before_50_refused_5MB_prompts_mb", round(before, 1))
    _figure("rss_after_50_refused_5MB_prompts_mb", round(after, 1))
    assert after < before * 1.10 + 20, (before, after)


# ----------------------------------------------------------------------------- clients that hold on

def test_a_stalled_body_gets_408_and_a_silent_connection_is_closed(server):
    host, port = server.address()
    stalled = stalled_body(host, port, KEY, 500, b'{"model": ', timeout=30)
    slow_headers = socket.create_connection((host, port), timeout=30)
    slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    silent = socket.create_connection((host, port), timeout=30)
    t0 = time.monotonic()
    reply = stalled.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert slow_headers.recv(4096) == b""  # closed without a response: the headers never ended
    assert silent.recv(4096) == b""
    _figure("stalled_body_and_headers_closed_after_s", round(time.monotonic() - t0, 2))
    for s in (stalled, slow_headers, silent):
        s.close()
    assert complete(server).status_code == 200


def test_a_burst_past_the_queue_bound_gets_429_with_retry_after(server):
    """40 requests at once at a bound of 12 waiting: the ones past it get 429 with Retry-After
    at once, every other one completes; then the server is idle. Each client connects first and
    all send together, and each asks for 96 tokens: the 40 arrive within milliseconds, while the
    4 slots need seconds to drain the queue, however loaded the machine is."""
    gate = threading.Barrier(40)
    headers = {"Authorization": f"Bearer {KEY}"}

    def one(i):
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as c:
            assert c.get("/health").status_code == 200  # the connection is open before the burst
            gate.wait(timeout=60)
            return c.post("/v1/completions", json={"model": NAME, "prompt": f"def f{i}(x):", "max_tokens": 96,
                                                   "temperature": 0.0, "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        replies = list(pool.map(one, range(40)))
    codes = [r.status_code for r in replies]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 16, codes
    for r in replies:
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
        else:
            assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    _figure("burst_40_at_bound_12", {"ok": codes.count(200), "429": codes.count(429)})
    assert_idle(server)


def test_metrics_and_openapi_need_the_key(server):
    for path in ("/metrics", "/openapi.json"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
        assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 200
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------------- the soak

def test_soak_1000_mixed_requests_with_disconnects_returns_to_idle(server):
    """1,000 requests from 12 clients: completions and chat, streamed or not, a few invalid, 10%
    cut off by their client mid-way. Every request not cut off gets its full answer (or its
    400); afterwards the engine is idle, every page free, and RSS near its post-warm-up value."""
    rng = random.Random(0)
    plan = []
    for i in range(1000):
        kind = rng.choice(["completion", "completion-stream", "chat", "chat-stream"])
        cut = i % 10 == 3
        bad = not cut and i % 25 == 7
        plan.append((i, kind, cut, bad))
    for i in range(20):  # warm-up: every kind once
        complete(server, prompt=f"warm {i}", max_tokens=rng.randint(1, 12))
    rss_warm = server.rss_mb()
    lost, counts = [], {"ok": 0, "bad": 0, "cut": 0, "429": 0}
    lock = threading.Lock()

    def run(item):
        i, kind, cut, bad = item
        chat = kind.startswith("chat")
        body = {"model": NAME, "max_tokens": 40 if cut else 1 + i % 12, "temperature": (i % 3) * 0.5,
                "seed": i, "stream": kind.endswith("stream")}
        if chat:
            body["messages"] = [{"role": "user", "content": f"request {i}: say something"}]
        else:
            body["prompt"] = f"def request_{i}(x):"
        if bad:
            body["temperature"] = "hot"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        headers = {"Authorization": f"Bearer {KEY}"}
        try:
            if cut:
                with httpx.stream("POST", server.url + path, json=dict(body, stream=True), headers=headers,
                                  timeout=60) as r:
                    for _ in r.iter_lines():
                        break  # the client leaves after the first line
                with lock:
                    counts["cut"] += 1
                return
            r = httpx.post(server.url + path, json=body, headers=headers, timeout=120)
            if bad:
                ok = r.status_code == 400
                key = "bad"
            elif r.status_code == 429:
                ok, key = True, "429"
            elif body["stream"]:
                lines = [x for x in r.text.splitlines() if x.startswith("data: ")]
                finishes = [json.loads(x[6:])["choices"][0].get("finish_reason") for x in lines[:-1]
                            if json.loads(x[6:])["choices"]]
                ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and finishes[-1] in ("stop", "length")
                key = "ok"
            else:
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                key = "ok"
        except httpx.HTTPError as e:
            ok, key = False, f"{type(e).__name__}"
        with lock:
            if ok:
                counts[key] += 1
            else:
                lost.append((i, kind, key))

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        list(pool.map(run, plan))
    seconds = time.monotonic() - t0
    m = assert_idle(server)
    rss_after = server.rss_mb()
    _figure("soak", {"requests": len(plan), "seconds": round(seconds, 1), **counts, "lost": len(lost),
                     "free_pages": m["jspec:kv_cache_free_pages"], "total_pages": m["jspec:kv_cache_total_pages"],
                     "rss_after_warmup_mb": round(rss_warm, 1), "rss_after_soak_mb": round(rss_after, 1)})
    assert not lost, lost[:10]
    assert counts["cut"] == 100 and counts["bad"] == sum(1 for _, _, c, b in plan if b)
    assert rss_after < rss_warm * 1.25, (rss_warm, rss_after)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ----------------------------------------------------------------------------- SIGTERM, start-up

def test_sigterm_with_stalled_bodies_and_streams_exits_0_within_the_drain_timeout(tiny_dir, tmp_path):
    """A body that never completes (the body timeout is longer than the drain), a slow-header
    connection and a long stream in flight: SIGTERM ends the process with exit 0 within
    drain-timeout + 5 s, the stream ends with finish reason "abort"."""
    p = start(tiny_dir, tmp_path, "--drain-timeout", "3", "--body-timeout", "120", "--header-timeout", "120")
    try:
        wait_ready(p)
        host, port = p.address()
        stalled = stalled_body(host, port, KEY, 900, b"{")
        slow = socket.create_connection((host, port), timeout=60)
        slow.sendall(b"POST /v1/comp")
        stream_lines: list[str] = []

        def long_stream():
            body = {"model": NAME, "prompt": "a", "max_tokens": 120, "ignore_eos": True, "stream": True,
                    "temperature": 0.0}
            try:
                with httpx.stream("POST", p.url + "/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
                    for line in r.iter_lines():
                        stream_lines.append(line)
                        time.sleep(0.2)  # a slow reader keeps the request in flight
            except httpx.HTTPError:
                pass

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(1.0)
        p.proc.send_signal(signal.SIGTERM)
        rc, seconds = p.wait_exit(3 + 30)
        t.join(30)
        _figure("sigterm_with_stalled_body_exit_s", round(seconds, 2))
        assert rc == 0, p.log.read_text()
        assert seconds < 3 + 5 + 10, seconds  # the goal is drain + 5 s; slack for a busy machine
        data = [json.loads(x[6:]) for x in stream_lines if x.startswith("data: {")]
        assert data and data[-1]["choices"][0]["finish_reason"] in ("abort", "length")
    finally:
        stop(p)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("delay", [0.2, 1.5, 4.0])
def test_sigterm_at_any_moment_of_start_up_exits_0(tiny_dir, tmp_path, delay):
    """While importing, loading or compiling: exit 0 within a few seconds."""
    p = start(tiny_dir, tmp_path)
    time.sleep(delay)
    assert p.proc.poll() is None, p.log.read_text()
    p.proc.send_signal(signal.SIGTERM)
    rc, seconds = p.wait_exit(30)
    _figure(f"sigterm_during_start_up_{delay}s_exit_s", round(seconds, 2))
    assert rc == 0, p.log.read_text()
    assert seconds < 15, seconds


def test_the_port_refuses_until_ready_then_answers(tiny_dir, tmp_path):
    """From start to ready a connection is refused at once (never accepted and left
    unanswered); the first one accepted is answered, with 200."""
    port = _free_port()
    p = start(tiny_dir, tmp_path, "--port", str(port))
    try:
        outcomes = []
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and p.proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                outcomes.append(r.status_code)
                break
            except httpx.ConnectError:
                outcomes.append("refused")
            time.sleep(0.05)
        assert outcomes and outcomes[-1] == 200, (outcomes[-5:], p.log.read_text())
        assert set(outcomes) <= {"refused", 200}, outcomes
        _figure("connections_refused_while_starting", outcomes.count("refused"))
    finally:
        stop(p)


# ----------------------------------------------------------------------------- engine faults, in-process

@pytest.fixture(scope="module")
def live_app(tiny_dir):
    """The app on a real engine, served by uvicorn in a thread of this process (so that faults can
    be injected into the engine); yields (url, engine, worker)."""
    import uvicorn

    from jspec.config import EngineConfig
    from jspec.engine.engine import LLMEngine
    from jspec.loading import open_checkpoint
    from jspec.server.app import create_app
    from jspec.server.worker import EngineWorker

    model = open_checkpoint(str(tiny_dir)).load()
    engine = LLMEngine(model, EngineConfig(max_num_seqs=4, max_model_len=MAX_MODEL_LEN, kv_cache_tokens=1024,
                                           max_burst_steps=4))
    worker = EngineWorker(engine)
    app = create_app(worker, NAME)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield url, engine, worker
    server.should_exit = True
    thread.join(30)
    sock.close()


def _post(url, body, timeout=60.0):
    return httpx.post(url + "/v1/completions", json=dict({"model": NAME, "max_tokens": 8, "temperature": 0.0}, **body),
                      timeout=timeout)


def test_a_request_the_engine_fails_gets_500_and_the_rest_go_on(live_app, monkeypatch):
    """The detokenizer raises for prompts containing "BOOM": that request gets a 500 (or an error
    event on its stream); requests beside it and after it are answered as before, /health stays
    200 and no page is left held."""
    url, engine, worker = live_app
    baseline = _post(url, {"prompt": "def add(a, b):"}).json()["choices"][0]["text"]
    real = engine._detokenize

    def detokenize(r, new_from):
        if "BOOM" in engine.tokenizer.decode(r.prompt_ids):
            raise IndexError("piece id is out of range")
        return real(r, new_from)

    monkeypatch.setattr(engine, "_detokenize", detokenize)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bad = pool.submit(_post, url, {"prompt": "BOOM goes"})
        good = [pool.submit(_post, url, {"prompt": "def add(a, b):"}) for _ in range(2)]
        r = bad.result()
        assert r.status_code == 500 and "IndexError" in r.json()["error"]["message"]
        assert all(g.result().json()["choices"][0]["text"] == baseline for g in good)
    with httpx.stream("POST", url + "/v1/completions", json={"model": NAME, "prompt": "BOOM", "max_tokens": 8,
                                                             "stream": True}, timeout=60) as s:
        lines = [x for x in s.iter_lines() if x.startswith("data: ")]
    assert "internal_server_error" in lines[-2] and lines[-1] == "data: [DONE]"
    assert _post(url, {"prompt": "def add(a, b):"}).json()["choices"][0]["text"] == baseline
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert worker.snapshot["free_pages"] == worker.snapshot["usable_pages"]
    assert worker.finished_by_reason["error"] >= 2


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_server_serves_on(live_app, monkeypatch):
    url, engine, worker = live_app
    baseline = _post(url, {"prompt": "def add(a, b):"}).json()["choices"][0]["text"]
    real, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("an engine bug")
        return real()

    monkeypatch.setattr(engine, "step", step)
    r = _post(url, {"prompt": "def add(a, b):"})
    assert r.status_code == 500 and "an engine bug" in r.json()["error"]["message"]
    assert worker.failed_bursts >= 1
    assert _post(url, {"prompt": "def add(a, b):"}).json()["choices"][0]["text"] == baseline
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    m = httpx.get(url + "/metrics", timeout=10).text
    assert re.search(r'jspec:engine_failures_total\{model_name="tiny"\} [1-9]', m)
