"""``jspec generate`` with several prompts: through the engine, JSON Lines out, a prompts file
with per-request sampling fields, old flags still accepted."""

import json

import pytest

import jspec
from test_bad_input import _cli


@pytest.fixture(scope="module")
def model_dir(tiny_hf_llama):
    return str(tiny_hf_llama)


def test_several_prompts_print_one_json_line_each_in_order(model_dir):
    code, out, err = _cli("generate", "def add(a, b):", "hello world", "for i in", "--model", model_dir,
                          "--max-tokens", "6", "--json", "--max-num-seqs", "2")
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert len(rows) == 3
    model = jspec.load_model(model_dir)
    for prompt, row in zip(["def add(a, b):", "hello world", "for i in"], rows):
        alone = jspec.generate(model, [prompt], jspec.SamplingParams(max_tokens=6))
        assert row["token_ids"] == alone.token_ids[0] and row["text"] == alone.texts[0]
        assert row["num_tokens"] == len(row["token_ids"]) <= 6 and row["finish_reason"] in ("eos", "length")
    assert "3 request(s)" in err


def test_prompts_file_jsonl_with_per_request_fields(model_dir, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in [
        {"prompt": "def add(a, b):", "max_tokens": 3},
        {"prompt": "hello world", "max_tokens": 5, "temperature": 0.8, "seed": 3},
        {"prompt": "for i in"}]) + "\n")
    code, out, err = _cli("generate", "--prompts-file", str(f), "--model", model_dir, "--max-new-tokens", "4",
                          "--json", "--ignore-eos")
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["num_tokens"] for r in rows] == [3, 5, 4]  # per-request budgets; the flag is the default
    again = [json.loads(line) for line in _cli("generate", "--prompts-file", str(f), "--model", model_dir,
                                               "--max-new-tokens", "4", "--json", "--ignore-eos")[1].splitlines()]
    assert again[1]["token_ids"] == rows[1]["token_ids"]  # the seed makes the sampled one reproducible


def test_plain_prompts_file_and_text_output(model_dir, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("def add(a, b):\n\nhello world\n")
    code, out, err = _cli("generate", "--prompts-file", str(f), "--model", model_dir, "--max-tokens", "4",
                          "--spec", "ngram", "-k", "2")
    assert code == 0, err
    assert out.count("--- [") == 2 and "ngram k=2" in err
    assert "2/2" in err and "out tok/s=" in err  # the progress bar on stderr, with tokens per second


@pytest.mark.parametrize("args,fragment", [
    ([], "PROMPT arguments or --prompts-file"),
    (["--prompts-file", "/nonexistent/p.txt"], "cannot read prompts file"),
    (["x", "--dynamic-k"], "--dynamic-k needs --spec"),
    (["x", "--ngram-history", "64"], "ngram_history applies to spec methods 'ngram' and 'hybrid'"),
    (["x", "--spec", "ngram", "--ngram-history", "-5"], "ngram_history must be a non-negative integer"),
    (["x", "--spec", "ngram", "--head-tokens", "1"], "head_tokens applies to spec method 'hybrid'"),
])
def test_bad_generate_options_exit_2(model_dir, args, fragment):
    code, out, err = _cli("generate", *args, "--model", model_dir)
    assert code == 2 and out == "" and fragment in err and len(err.strip().splitlines()) == 1


def test_bad_prompts_file_lines_exit_2(model_dir, tmp_path):
    for text, fragment in [('{"prompt": 5}\n', "string 'prompt'"), ('{"prompt": "a", "beam": 2}\n', "unknown fields"),
                           ('{"prompt": "a"\n', "not valid JSON"), ('{"prompt": "a", "max_tokens": -1}\n', "max_tokens")]:
        f = tmp_path / "bad.jsonl"
        f.write_text(text)
        code, out, err = _cli("generate", "--prompts-file", str(f), "--model", model_dir)
        assert code == 2 and out == "" and fragment in err, (text, err)


@pytest.mark.parametrize("spec", [[], ["--spec", "ngram", "-k", "3"]])
def test_one_prompt_compiles_two_step_programs(tmp_path, spec):
    """A one-prompt ``jspec generate`` builds two step programs, the prefill burst and the
    decode burst, whatever its length (the goal: two or fewer before the first token). The
    checkpoint's shape is this test's own (an MLP width no other test uses), so no program an
    earlier test compiled in this process is reused."""
    import jax

    from helpers import write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "model", "llama", intermediate_size=72)
    traced = []
    listener = lambda event, duration, **kw: traced.append(kw.get("fun_name")) if event.endswith(  # noqa: E731
        "jaxpr_trace_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        code, out, err = _cli("generate", "def add(a, b):", "--model", str(path), "--max-tokens", "20",
                              "--ignore-eos", *spec)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert code == 0, err
    assert "20 tokens" in err
    assert traced.count("run_burst") == 2, traced
