"""Every CLI path ends in one line: bad options exit 2 (before the model loads when they need no
model, before the weights load when they need only the config), invalid UTF-8 in argv exits 2,
a bug exits 1 with one line, and Ctrl-C exits 130 with one line whatever the run is doing.

Mutations seen to fail: ``text_argument`` not encoding (UTF-8 unchecked), the ``-k`` without
``--spec`` check removed (jspec/cli/checks.py), ``guard.interrupts`` made a no-op (the long
device-loop test: the run ended by SIGSEGV / only after the loop).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

import jspec
from helpers import write_hf_checkpoint
from hostile_helpers import ROOT, assert_one_line, cli

# options refused without any model: (arguments, fragment of the message)
NO_MODEL_CASES = [
    (["-k", "3"], "-k/--num-speculative-tokens needs --spec"),
    (["--num-speculative-tokens", "2", "--spec", "none"], "needs --spec"),
    (["--seed", str(2**64)], "seed"),
    (["--seed", "-1"], "seed"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "inf"], "temperature"),
    (["--temperature", "-inf"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--top-k", str(2**70)], "top_k"),
    (["--max-new-tokens", "2.5"], "invalid int value"),
    (["--max-new-tokens", str(2**64)], "max_tokens"),
    (["--page-size", "3"], "page_size"),
    (["--page-size", "0"], "page_size"),
    (["--page-size", str(1 << 30)], "page_size"),
    (["--attention", "pallas"], "--attention pallas"),
    (["--attention", "interpret"], "invalid choice"),
    (["--dtype", "float64"], "invalid choice"),
    (["--spec", "ngram", "-k", "17"], "num_speculative_tokens"),
    (["--spec", "ngram", "-k", "0"], "num_speculative_tokens"),
    (["--spec", "ngram:3"], "takes no argument"),
    (["--spec", "layerskip:x"], "layerskip:L needs an integer"),
    (["--spec", "layerskip:0"], "layerskip"),
    (["--spec", "eagle"], "needs a checkpoint path"),
    (["--spec", "eagle:/nonexistent/draft"], "no such EAGLE checkpoint"),
    (["--spec", "draft:/nonexistent/draft"], "no such model"),
    (["--spec", "bogus"], "--spec must be"),
]


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli-good"), "llama")


@pytest.mark.parametrize("args,fragment", NO_MODEL_CASES, ids=[" ".join(a) for a, _ in NO_MODEL_CASES])
def test_options_refused_before_the_model_is_opened(args, fragment, good_dir, monkeypatch):
    import jspec.loading

    def never(*a, **k):
        raise AssertionError("the model was opened before the options were checked")

    monkeypatch.setattr(jspec.loading, "open_checkpoint", never)
    assert_one_line(*cli("generate", "hello", "--model", good_dir, *args), fragment)


@pytest.mark.parametrize("args,fragment", [
    (["--max-new-tokens", "600"], "context of 512 tokens"),
    (["--max-new-tokens", "512"], "context of 512 tokens"),
    (["--spec", "layerskip:2"], "1 <= L < 2"),
    (["--spec", "layerskip:5"], "1 <= L < 2"),
])
def test_options_checked_against_the_config_before_the_weights_load(args, fragment, good_dir, monkeypatch):
    from jspec.loading import Checkpoint

    def never(self, *a, **k):
        raise AssertionError("the weights loaded before the options were checked")

    monkeypatch.setattr(Checkpoint, "load", never)
    assert_one_line(*cli("generate", "hello", "--model", good_dir, *args), fragment)


def test_prompt_edges(good_dir):
    assert_one_line(*cli("generate", "", "--model", good_dir), "empty")
    assert_one_line(*cli("generate", "caf\udce9", "--model", good_dir), "not valid UTF-8 (byte 0xe9 at position 3)")
    assert_one_line(*cli("generate", "hello", "--model", good_dir, "--chat", "--max-new-tokens", "511"), "context")


def test_invalid_utf8_in_argv_subprocess(good_dir):
    """The real argv path: bytes that are not UTF-8 reach Python as surrogates."""
    p = subprocess.run([sys.executable, "-m", "jspec", "generate", b"caf\xe9 \xff", "--model", str(good_dir)],
                       capture_output=True, timeout=120, cwd=str(ROOT))
    err = p.stderr.decode("utf-8", "replace")
    assert_one_line(p.returncode, p.stdout.decode(), err, "not valid UTF-8 (byte 0xe9")
    p = subprocess.run([sys.executable, "-m", "jspec", "generate", "hi", "--model", b"/no/such/\xff"],
                       capture_output=True, timeout=120, cwd=str(ROOT))
    assert_one_line(p.returncode, p.stdout.decode(), p.stderr.decode("utf-8", "replace"), "no such model")


def test_a_bug_is_one_line_exit_1(good_dir, monkeypatch):
    from jspec.cli import checks

    def boom(*a, **k):
        raise TypeError("boom\nsecond line")

    monkeypatch.setattr(checks, "generate_options", boom)
    line = assert_one_line(*cli("generate", "hello", "--model", good_dir), "internal error: TypeError: boom",
                           exit_code=1)
    assert "JSPEC_DEBUG" in line
    monkeypatch.setenv("JSPEC_DEBUG", "1")
    with pytest.raises(TypeError):
        cli("generate", "hello", "--model", good_dir)


def test_os_errors_are_one_line(tmp_path, good_dir):
    d = tmp_path / "unreadable"
    import shutil

    shutil.copytree(good_dir, d)
    (d / "config.json").chmod(0)
    if os.access(d / "config.json", os.R_OK):  # root reads anything: make it a directory instead
        (d / "config.json").chmod(0o644)
        (d / "config.json").unlink()
        (d / "config.json").mkdir()
    code, out, err = cli("generate", "hello", "--model", d)
    assert_one_line(code, out, err, "config.json")


def test_distill_numbers_refused_before_the_target_loads(tmp_path, monkeypatch):
    import jspec.loading

    def never(*a, **k):
        raise AssertionError("the target was opened before the options were checked")

    monkeypatch.setattr(jspec.loading, "open_checkpoint", never)
    out = tmp_path / "out"
    for args, fragment in [(["--learning-rate", "inf"], "--learning-rate"), (["--learning-rate", "nan"], "--learning-rate"),
                           (["--checkpoint-every", "0"], "--checkpoint-every"), (["--steps", "0"], "--steps"),
                           (["--prompts", str(2**40)], "--prompts"), (["--batch-size", "300"], "--batch-size"),
                           (["--weight-decay", "-1"], "--weight-decay"), (["--seed", str(2**64)], "--seed"),
                           (["--eval-prompts", "-1"], "--eval-prompts")]:
        assert_one_line(*cli("distill", "--out", out, *args), fragment)


def test_handlers_are_restored_after_main(good_dir):
    before = signal.getsignal(signal.SIGINT)
    cli("generate", "", "--model", good_dir)
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.set_wakeup_fd(-1) == -1


# ----------------------------------------------------------------------------- Ctrl-C

@pytest.fixture(scope="module")
def long_run_dir(tmp_path_factory):
    """A tiny model that never emits EOS, with room for thousands of tokens."""
    return write_hf_checkpoint(tmp_path_factory.mktemp("cli-long"), "llama", eos_token_id=None,
                               max_position_embeddings=32768)


def _interrupt(model_dir, delay: float | None, *extra):
    """Start ``jspec generate`` (6000 sampled tokens); SIGINT after ``delay`` seconds, or once
    text has streamed (None). Returns (exit code, stderr, seconds from the signal to the exit)."""
    p = subprocess.Popen([sys.executable, "-m", "jspec", "generate", "hello world", "--model", str(model_dir),
                          "--max-new-tokens", "6000", "--temperature", "1", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT))
    try:
        if delay is None:
            assert os.read(p.stdout.fileno(), 1), "no text streamed"
        else:
            time.sleep(delay)
        assert p.poll() is None, "the run ended before the signal"
        p.send_signal(signal.SIGINT)
        sent = time.time()
        _, err = p.communicate(timeout=60)
        return p.returncode, err.decode(), time.time() - sent
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("delay", [0.3, 1.5, 3.0, None], ids=["0.3s", "1.5s", "3s", "streaming"])
def test_ctrl_c_exits_130_with_one_line(long_run_dir, delay):
    """Whatever the run is doing (importing JAX, loading, compiling, in the device loop between
    streamed bursts), SIGINT ends it at once: exit 130, exactly one line, no traceback. Before the
    fix, a KeyboardInterrupt raised in JAX's garbage-collection callback was printed as
    "Exception ignored" and the run went on to the end (exit 0)."""
    code, err, seconds = _interrupt(long_run_dir, delay)
    assert code == 130, (code, err)
    assert err == "jspec: interrupted\n", err
    assert seconds < 10, seconds


def test_ctrl_c_during_a_long_device_loop(long_run_dir):
    """With ``--json`` the whole generation (here 30000 tokens, tens of seconds) is one call into
    XLA. A KeyboardInterrupt could only be raised when that call returns; the watcher thread exits
    at once. (Mutation check: with :func:`jspec.cli.guard.interrupts` made a no-op, this test fails:
    the run ends only after the loop.)"""
    code, err, seconds = _interrupt(long_run_dir, 8.0, "--json", "--max-new-tokens", "30000")
    assert code == 130, (code, err)
    assert err == "jspec: interrupted\n", err
    assert seconds < 3, seconds


@pytest.mark.parametrize("kw,fragment", [
    (dict(method="ngram", num_speculative_tokens=2.5), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens="4"), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=True), "num_speculative_tokens"),
    (dict(method="ngram", ngram_max=10**6), "ngram_max"),
    (dict(method="layerskip", layerskip_layers=1.5), "layerskip_layers"),
    (dict(method="draft", draft=7), "draft"),
    (dict(method=["ngram"]), "spec method"),
])
def test_spec_config_types(kw, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment):
        jspec.SpecConfig(**kw)


@pytest.mark.parametrize("kw,fragment", [
    (dict(page_size=16.0), "page_size"), (dict(page_size=True), "page_size"), (dict(prefill_chunk=0), "prefill_chunk"),
    (dict(prefill_chunk=2**40), "prefill_chunk"), (dict(shuffle_pages="yes"), "shuffle_pages"),
])
def test_cache_config_types(kw, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment):
        jspec.CacheConfig(**kw)
