"""``jspec serve`` end to end: one real server (a subprocess on 127.0.0.1, the real SmolLM2-135M,
n-gram speculation, an API key), talked to with the real ``openai`` client and raw HTTP.

The module shares that one server; the last test sends it SIGTERM and checks that it drains and
exits 0 (tests run in file order). Everything is kept small (short prompts, max_tokens <= 24,
one prefill shape) so that the module runs in a few minutes on two CPU cores.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import launch, stop, wait_ready

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "test-key-123"
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
MAX_MODEL_LEN = 256
SLOTS = 8
# every slot's verification rows (8 x (4 + 1)) plus one 16-token prefill chunk: one prefill shape
BATCHED_TOKENS = SLOTS * (SPEC["num_speculative_tokens"] + 1) + 16
START_TIMEOUT = 400.0  # loading + compiling, on a busy 2-core machine
PROMPTS = ["def fib(n):", "The capital of France is", "Once upon a time, a small robot",
           "red green blue red green blue red green"]  # the last one gets n-gram drafts
CHAT = ["Say hello in one short sentence.", "What is 2 + 2?"]
MAX_TOKENS = 16
LONG = 240  # tokens of requests that are cut off (disconnect): nearly the whole context


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def client(self, key: str = KEY, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120.0, **kw)

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of every sample in ``/metrics`` (labels other than model_name kept)."""
        text = httpx.get(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "").replace(",}", "}")
            out[key] = float(value)
        return out


def _start(tmp: Path) -> Server:
    log = tmp / "server.log"
    args = ["--model", MODEL, "--host", "127.0.0.1", "--port", "0", "--api-key", KEY, "--speculative-config",
            json.dumps(SPEC), "--max-num-seqs", str(SLOTS), "--max-model-len", str(MAX_MODEL_LEN),
            "--kv-cache-tokens", "2048", "--max-num-batched-tokens", str(BATCHED_TOKENS), "--max-burst-steps", "4",
            "--log-level", "warning"]
    return Server(launch(args, log), "", log)


def _wait_ready(server: Server) -> None:
    server.url = wait_ready(server.proc, server.log, START_TIMEOUT)


def _stop(server: Server) -> None:
    stop(server.proc)


@pytest.fixture(scope="module")
def _process(tmp_path_factory):
    """The server process; it loads the model and compiles every step variant before /health answers."""
    server = _start(tmp_path_factory.mktemp("serve"))
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def offline(server, smollm2):
    """The engine's own greedy output for PROMPTS (plain) and CHAT (chat template), in-process,
    with the server's engine settings. It runs after the server's warm-up, so its programs (the
    same as the server's) come from the session's persistent compilation cache."""
    from jspec.config import EngineConfig, SamplingParams, SpecConfig
    from jspec.engine.engine import LLMEngine

    engine = LLMEngine(smollm2, EngineConfig(max_num_seqs=SLOTS, max_num_batched_tokens=BATCHED_TOKENS,
                                             max_model_len=MAX_MODEL_LEN, kv_cache_tokens=2048, max_burst_steps=4),
                       SpecConfig.from_dict(SPEC))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"p{i}", p, params)
    for i, p in enumerate(CHAT):
        engine.add_request(f"c{i}", p, params, chat=True)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (o.text, o.finish_reason, len(o.token_ids))
    return {"plain": [done[f"p{i}"] for i in range(len(PROMPTS))], "chat": [done[f"c{i}"] for i in range(len(CHAT))]}


@pytest.fixture(scope="module")
def server(_process):
    _wait_ready(_process)
    # warm up once (the first request through every layer)
    _process.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    return _process


# ---------------------------------------------------------------------- the command (no server)
@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", "{bad"], "--speculative-config is not valid JSON"),
    (["--speculative-config", '{"method": "nope"}'], "method"),
    (["--port", "99999"], "--port"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--api-key", ""], "--api-key"),
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
])
def test_bad_options_exit_2_before_loading(argv, message, capsys):
    from jspec.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_busy_port_exits_2(capsys):
    from jspec.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert main(["serve", "--port", str(s.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1" in capsys.readouterr().err


# ---------------------------------------------------------------------- the API
def test_models_health_and_metrics_names(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    m = server.metrics()
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"}',
                 "jspec:num_requests_running", "jspec:num_requests_waiting", "jspec:prompt_tokens_total",
                 "jspec:generation_tokens_total", "jspec:time_to_first_token_seconds_count",
                 "jspec:request_queue_time_seconds_count", "jspec:kv_cache_free_pages", "jspec:kv_cache_total_pages"):
        assert name in m, name
    # the warm-up request has finished: the ratios follow the counters
    drafts = m["vllm:spec_decode_num_drafts_total"]
    if drafts:
        assert m["jspec:spec_decode_accepted_per_verification"] == pytest.approx(
            1 + m["vllm:spec_decode_num_accepted_tokens_total"] / drafts)
        assert m["jspec:spec_decode_draft_tokens_per_verification"] == pytest.approx(
            m["vllm:spec_decode_num_draft_tokens_total"] / drafts)
    else:
        assert m["jspec:spec_decode_accepted_per_verification"] == 0.0


def test_completions_greedy_equal_offline(server, offline):
    """Every prompt in one request (a batch prompt: one choice per prompt, in order)."""
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [ch.index for ch in r.choices] == list(range(len(PROMPTS)))
    assert [(ch.text, ch.finish_reason) for ch in r.choices] == [(t, reason) for t, reason, _ in offline["plain"]]
    assert r.usage.completion_tokens == sum(n for _, _, n in offline["plain"]) and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert server.metrics()["vllm:spec_decode_num_draft_tokens_total"] > 0  # the last prompt is drafted from


def test_completions_stream_equal_offline(server, offline):
    prompt, (text, reason, n) = PROMPTS[0], offline["plain"][0]
    chunks = list(server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    usage = [ch.usage for ch in chunks if ch.usage is not None]
    assert usage and usage[-1].completion_tokens == n


def test_chat_greedy_equal_offline(server, offline):
    c = server.client()

    def one(msg):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}],
                                         max_tokens=MAX_TOKENS, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(CHAT)) as pool:
        replies = list(pool.map(one, CHAT))
    for r, (text, reason, n) in zip(replies, offline["chat"]):
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == text
        assert r.choices[0].finish_reason == reason
        assert r.usage.completion_tokens == n


def test_chat_stream_equal_offline(server, offline):
    msg, (text, reason, n) = CHAT[0], offline["chat"][0]
    stream = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}],
                                                     max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                                     stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n


def test_sampling_fields_and_stop(server, offline):
    c = server.client()
    full = offline["plain"][0][0]
    stop = full.strip().split()[1]  # a word from the middle of the greedy output
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0.8, top_p=0.9, seed=7,
              extra_body={"top_k": 20})
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        a, b = pool.submit(c.completions.create, **kw), pool.submit(c.completions.create, **kw)
        r = pool.submit(c.completions.create, model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                        stop=[stop]).result()
        assert a.result().choices[0].text == b.result().choices[0].text  # same seed, same text
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[:full.index(stop)]


# ---------------------------------------------------------------------- structured output
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"], "additionalProperties": False}


def test_response_format_json_schema_gives_a_valid_object_streamed_and_not(server):
    import jsonschema

    c = server.client()
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], max_tokens=60,
              temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                                     "strict": True}})
    whole = c.chat.completions.create(**kw)
    assert whole.choices[0].finish_reason == "stop"
    obj = json.loads(whole.choices[0].message.content)
    jsonschema.validate(obj, PERSON)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    assert streamed == whole.choices[0].message.content


def test_vllm_structured_output_fields(server):
    c = server.client()
    choice = c.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    regex = c.completions.create(model=MODEL, prompt="The year the moon landing happened:", max_tokens=8,
                                 temperature=0.7, seed=3, extra_body={"guided_regex": "[12][0-9]{3}"})
    assert re.fullmatch("[12][0-9]{3}", regex.choices[0].text), regex.choices[0].text
    obj = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Any JSON object"}],
                                    max_tokens=40, temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # cut by max_tokens: a prefix of an object
        assert obj.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("kw, param", [
    (dict(extra_body={"structured_outputs": {"regex": "[ab"}}), "response_format"),
    (dict(extra_body={"guided_json": {"type": "nope"}}), "response_format"),
    (dict(extra_body={"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}), "structured_outputs"),
    (dict(extra_body={"structured_outputs": {"jsn": {}}}), "structured_outputs"),
    (dict(extra_body={"response_format": {"type": "xml"}}), "response_format"),
])
def test_bad_structured_output_is_400(server, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, **kw)
    err = _error(e.value)
    assert err["param"] == param and "\n" not in err["message"], err


# ---------------------------------------------------------------------- bad input
def _error(e: "openai.APIStatusError") -> dict:
    return e.response.json()["error"]


@pytest.mark.parametrize("kw, param", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(max_tokens="ten"), "max_tokens"),
    (dict(temperature=True), "temperature"),
    (dict(n=2), "n"),
    (dict(extra_body={"best_of": 3}), "best_of"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(model="no-such-model"), "model"),
    (dict(prompt="hello " * (MAX_MODEL_LEN + 10)), "prompt"),
])
def test_bad_completion_request_is_400(server, kw, param):
    args = dict(model=MODEL, prompt="Hi", max_tokens=4) | kw
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(**args)
    err = _error(e.value)
    assert e.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_chat_request_is_400(server):
    c = server.client()
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * MAX_MODEL_LEN}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=2)


def test_invalid_json_and_non_object_are_400(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b'{"model": "smollm2-135m", "prompt": ', b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(server.url + "/v1/completions", content=body, headers=h, timeout=30)
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    # curl -d sends a form Content-Type: the JSON body is still read
    r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   content=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_api_key_required(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(key="wrong-key").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401
    for headers in ({}, {"Authorization": "Basic dGVzdA=="}, {"Authorization": "Bearer"}):
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # no key needed


def test_still_serving_after_bad_input(server, offline):
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == offline["plain"][1][0]


# ---------------------------------------------------------------------- load and faults
def test_load_every_request_completes(server):
    """32 requests from 8 concurrent clients, sampled, under a total time bound."""
    c = server.client()
    before = server.metrics()

    def one(i: int):
        r = c.completions.create(model=MODEL, prompt=f"{PROMPTS[i % 3]} {i}", max_tokens=8, temperature=0.7,
                                 seed=i)
        return r.choices[0].finish_reason, r.usage.completion_tokens

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(32), timeout=240))
    assert time.monotonic() - t0 < 240
    assert len(results) == 32
    assert all(reason in ("stop", "length") and 1 <= n <= 8 for reason, n in results)
    after = server.metrics()
    done = sum(after[f'jspec:request_success_total{{finished_reason="{r}"}}'] -
               before[f'jspec:request_success_total{{finished_reason="{r}"}}'] for r in ("stop", "length"))
    assert done == 32
    generated = after["jspec:generation_tokens_total"] - before["jspec:generation_tokens_total"]
    assert generated == sum(n for _, n in results)


def _settled(server: Server, timeout: float = 60.0) -> dict:
    """Wait until nothing runs and every KV page is free again; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["jspec:num_requests_running"] == 0 and m["jspec:num_requests_waiting"] == 0
                and m["jspec:kv_cache_free_pages"] == m["jspec:kv_cache_total_pages"]):
            return m
        assert time.monotonic() < deadline, f"pages not freed: {m}"
        time.sleep(0.2)


def _abort_count(m: dict) -> float:
    return m['jspec:request_success_total{finished_reason="abort"}']


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    before = _settled(server)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 1.0, "seed": 0,
            "ignore_eos": True, "stream": True}
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=h, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        during = server.metrics()
        assert during["jspec:kv_cache_free_pages"] < during["jspec:kv_cache_total_pages"]
    # the connection is closed here, long before LONG tokens
    after = _settled(server)
    assert _abort_count(after) == _abort_count(before) + 1


def test_disconnect_while_waiting_aborts_non_streaming(server):
    before = _settled(server)
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": LONG, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before LONG tokens
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(30, read=1.0))
    after = _settled(server)
    assert _abort_count(after) == _abort_count(before) + 1


def test_sigterm_drains_then_exits_0(server):
    """Last test (it stops the shared server): a stream in flight finishes, new requests and
    /health get 503, then the process exits 0."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 1.0, "seed": 2,
            "ignore_eos": True, "stream": True}
    h = {"Authorization": f"Bearer {KEY}"}
    text, reasons = [], []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=h, timeout=120) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        text.append(json.loads(first[6:])["choices"][0]["text"])
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=30).status_code != 503:  # the signal was handled
            assert time.monotonic() < deadline
            time.sleep(0.02)
        late = httpx.post(server.url + "/v1/completions", headers=h, timeout=30,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                ch = json.loads(line[6:])
                if ch["choices"]:
                    text.append(ch["choices"][0]["text"])
                    reasons.append(ch["choices"][0]["finish_reason"])
                if ch.get("usage"):
                    usage = ch["usage"]
    assert reasons[-1] == "length" and usage["completion_tokens"] == 40
    assert server.proc.wait(60) == 0
