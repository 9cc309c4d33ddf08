"""``jspec bench`` and its library (jspec.bench.run) on a tiny random checkpoint: the table's
fields, method parsing, and the greedy check (a method whose tokens differ fails, exit 1)."""

import json

import pytest

import jspec
from jspec.bench import presets
from jspec.bench import run as bench
from jspec.engine.generate import run_requests
from jspec.loading.drafts import resolve_draft_path
from test_bad_input import _cli

PROMPTS = ["def add(a, b):", "hello world hello world hello"]


@pytest.fixture(scope="module")
def model(tiny_hf_llama):
    return jspec.load_model(str(tiny_hf_llama))


def test_methods_side_by_side(model, tmp_path):
    methods = bench.parse_methods("ngram:2")
    assert [m.name for m in methods] == ["jspec ar", "jspec ngram k=2"]  # AR added first
    report = bench.run_bench(model, PROMPTS, methods, max_tokens=12, progress=False, warmup_tokens=2)
    report.check()
    assert report.mismatches == [] and report.num_prompts == 2
    ar, ng = report.rows()
    assert ar["speedup_vs_ar"] == pytest.approx(1.0) and ar["mean_accepted_length"] is None
    assert ng["same_tokens_as_ar"] == 2 and ng["k"] == 2
    assert 1.0 <= ng["mean_accepted_length"] <= 3.0 and len(ng["acceptance_per_position"]) == 2
    for r in (ar, ng):
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["mean_ttft_ms"] > 0 and r["peak_rss_mb"] > 0
        assert r["speedup_vs_transformers_greedy"] is None  # no peers asked for
    table = report.markdown()
    assert table.count("\n") == 3 and "| jspec ngram k=2 |" in table and "2/2" in table
    report.plot(str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 0
    json.dumps(report.to_json())


def test_a_method_with_other_tokens_is_a_mismatch(model):
    plain = bench.EngineRunner(model, jspec.SpecConfig(), [bench.encode_prompt(model.tokenizer, PROMPTS[0], False)], 6)

    def broken(ids, n):
        r = plain(ids, n)
        r.tokens[3] = (r.tokens[3] + 1) % model.config.vocab_size
        return r

    methods = bench.parse_methods("ar") + [bench.Method("broken", jspec.SpecConfig(), run=broken)]
    report = bench.run_bench(model, PROMPTS[:1], methods, max_tokens=6, progress=False, warmup_tokens=4)
    assert [(m.method, m.prompt, m.position) for m in report.mismatches] == [("broken", 0, 3)]
    with pytest.raises(bench.GreedyMismatchError, match="prompt 0 at new token 3"):
        report.check()


def test_sampled_bench_reports_acceptance_and_skips_the_token_check(model):
    """--temperature: the jspec methods sample (AR's tokens depend on the seed), acceptance is
    reported, tokens are not compared with AR's (other random draws), and greedy peers refuse."""
    sp = jspec.SamplingParams(temperature=0.7, top_p=0.95, seed=3)
    methods = bench.parse_methods("ngram:2")
    report = bench.run_bench(model, PROMPTS, methods, max_tokens=12, progress=False, warmup_tokens=2,
                             sampling=sp)
    assert report.mismatches == [] and report.meta["sampling"] == "temperature 0.7, top-p 0.95, seed 3"
    ng = report.rows()[1]
    assert 1.0 <= ng["mean_accepted_length"] <= 3.0 and len(ng["acceptance_per_position"]) == 2
    assert "n/a (sampled)" in report.markdown()
    ids = bench.encode_prompt(model.tokenizer, PROMPTS[0], False)
    ar = [bench.EngineRunner(model, jspec.SpecConfig(), [ids], 12, sampling=jspec.SamplingParams(temperature=5.0, seed=s))(
        ids, 12).tokens for s in (1, 2)]
    assert ar[0] != ar[1]  # sampling really happens: two seeds, two continuations
    from jspec.bench.peers import transformers_peers

    with pytest.raises(jspec.ConfigError, match="greedily"):
        bench.run_bench(model, PROMPTS, bench.parse_methods("ar") + transformers_peers(model), max_tokens=4,
                        progress=False, sampling=sp)


@pytest.mark.parametrize("text,fragment", [
    ("ngram:x", "K must be an integer"), ("ngram:40", "1..16"), ("beam:4", "unknown method"),
    ("ar,ar", "twice"), ("layerskip:a:2", "integer L"), ("draft:", "needs a checkpoint"),
    ("eagle:x:3+history", "only ngram and hybrid"), ("ngram:3+fast", "K must be an integer"),
    ("ngram:3+dynamic+dynamic", "twice"), ("ar+dynamic", "unknown method"), ("ngram:3+f32", "only draft, eagle"),
])
def test_bad_methods_are_refused(text, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment):
        bench.parse_methods(text)


def test_dynamic_and_history_suffixes():
    m = bench.parse_method("ngram:4+dynamic")
    assert m.name == "jspec ngram k=4 +dynamic" and m.spec.dynamic_k and m.spec.ngram_history == 0
    m = bench.parse_method("hybrid:/tmp/h:3+history+dynamic")
    assert m.spec.dynamic_k and m.spec.ngram_history == bench.HISTORY_TOKENS and m.spec.draft == "/tmp/h"
    assert m.spec.num_speculative_tokens == 3 and m.name.endswith("k=3 +history +dynamic")
    assert not bench.parse_method("ngram:4").spec.dynamic_k
    m = bench.parse_method("eagle:/tmp/h:2+f32")
    assert m.spec.draft_quantization is None and m.name.endswith("k=2 +f32") and m.spec.draft == "/tmp/h"
    assert bench.parse_method("eagle:/tmp/h:2").spec.draft_quantization == "auto"
    assert bench.parse_method("layerskip:10:2+dynamic").spec.dynamic_k
    assert bench.parse_method("eagle:/tmp/a+b:2+dynamic").spec.draft == "/tmp/a+b"  # only known suffixes come off


def test_draft_names_keep_colons_and_default_k():
    assert bench.parse_method("eagle:smollm2-135m-eagle:6").spec.num_speculative_tokens == 6
    m = bench.parse_method("draft:/tmp/x:y")
    assert m.spec.draft == "/tmp/x:y" and m.spec.num_speculative_tokens == bench.DEFAULT_K


def test_the_spec_preset_is_the_projects_sweep():
    """``--preset spec`` (Makefile's bench): AR, n-gram k 2/4/8, layer skip, the shipped draft and
    EAGLE head at k 2/4/6, transformers with assisted generation, step times; spec-quick at k 4."""
    spec = presets.expand("spec")
    assert spec.methods.split(",") == [
        "ar", "ngram:2", "ngram:4", "ngram:8", "layerskip:15:2",
        "draft:smollm2-135m-draft:2", "draft:smollm2-135m-draft:4", "draft:smollm2-135m-draft:6",
        "eagle:smollm2-135m-eagle:2", "eagle:smollm2-135m-eagle:4", "eagle:smollm2-135m-eagle:6"]
    assert spec.peers == "transformers,transformers-assisted:smollm2-135m-draft" and spec.profile
    assert [m.name for m in bench.parse_methods(spec.methods)][:5] == [
        "jspec ar", "jspec ngram k=2", "jspec ngram k=4", "jspec ngram k=8", "jspec layerskip L=15 k=2"]
    quick = presets.expand("spec-quick")
    assert quick.methods == "ar,ngram:4,draft:smollm2-135m-draft:4,eagle:smollm2-135m-eagle:4"
    assert quick.peers == spec.peers and quick.profile
    for p in presets.PRESETS.values():  # every method parses, every draft is shipped
        for m in bench.parse_methods(p.methods):
            assert m.spec.draft is None or resolve_draft_path(m.spec.draft) is not None, m.name


def test_options_given_beside_a_preset_win():
    assert presets.expand() == presets.DEFAULT == presets.Preset("ar,ngram:4", "", False)
    got = presets.expand("spec", methods="ar,ngram:4", peers="", profile=False)  # e.g. --peers "" --no-profile
    assert (got.methods, got.peers, got.profile) == ("ar,ngram:4", "", False)
    assert presets.expand("spec", peers="transformers").methods == presets.PRESETS["spec"].methods


def test_cli_bench_preset_expands_before_loading(tiny_hf_llama, monkeypatch):
    """The CLI takes the preset's methods (checked before anything loads) and refuses an unknown one."""
    import jspec.loading
    from jspec.cli import checks

    def stop(*args, **kwargs):
        raise jspec.ConfigError("stop")

    drafts = []
    monkeypatch.setattr(checks, "_check_draft_exists", lambda spec: drafts.append(spec.draft))
    monkeypatch.setattr(jspec.loading, "open_checkpoint", stop)
    code, _, err = _cli("bench", "--preset", "spec-quick", "--model", str(tiny_hf_llama))
    assert code == 2 and "stop" in err and drafts == ["smollm2-135m-draft", "smollm2-135m-eagle"]
    drafts.clear()
    code, _, err = _cli("bench", "--preset", "spec", "--methods", "ar,ngram:2", "--model", str(tiny_hf_llama))
    assert code == 2 and "stop" in err and drafts == []  # --methods wins
    code, out, err = _cli("bench", "--preset", "nope", "--model", str(tiny_hf_llama))
    assert code == 2 and out == "" and "invalid choice: 'nope'" in err


def test_cli_bench_table_json_and_exit_1_on_mismatch(tiny_hf_llama, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    out_json = tmp_path / "b.json"
    args = ("bench", "--prompts-file", str(f), "--model", str(tiny_hf_llama), "--methods", "ar,ngram:2",
            "--max-tokens", "8", "--json", str(out_json))
    code, out, err = _cli(*args)
    assert code == 0, err
    assert "| jspec ngram k=2 |" in out and "| method | tok/s |" in out
    assert [m["method"] for m in json.loads(out_json.read_text())["methods"]] == ["jspec ar", "jspec ngram k=2"]

    real = bench.EngineRunner.__call__

    def off_by_one(self, ids, n):  # ngram: a wrong second token
        r = real(self, ids, n)
        if self.engine.spec.enabled and len(r.tokens) > 1:
            r.tokens[1] = (r.tokens[1] + 1) % self.engine.model.config.vocab_size
        return r

    monkeypatch.setattr(bench.EngineRunner, "__call__", off_by_one)
    code, out, err = _cli(*args)
    assert code == 1
    assert "| jspec ngram k=2 |" in out  # the table is still printed
    assert "greedy mismatch: jspec ngram k=2 differs from jspec ar on prompt 0 at new token 1" in err


def test_cli_bench_bad_options_exit_2_before_loading(tiny_hf_llama):
    code, out, err = _cli("bench", "--model", str(tiny_hf_llama), "--methods", "ngram:zero")
    assert code == 2 and out == "" and "K must be an integer" in err
    code, out, err = _cli("bench", "--model", str(tiny_hf_llama), "--peers", "vllm")
    assert code == 2 and "unknown peer" in err
    code, out, err = _cli("bench", "--model", str(tiny_hf_llama), "--peers", "transformers", "--temperature", "0.7")
    assert code == 2 and out == "" and "decode greedily" in err


def test_transformers_peers_rows(model):
    """transformers' greedy and prompt lookup on the same tiny checkpoint: their rows, the
    speedups against them, and no failure when their tokens differ (they are not lossless)."""
    from jspec.bench.peers import transformers_peers

    peers = transformers_peers(model)
    report = bench.run_bench(model, PROMPTS, bench.parse_methods("ar") + peers, max_tokens=6, progress=False,
                             warmup_tokens=2)
    report.check()
    rows = {r["method"]: r for r in report.rows()}
    assert set(rows) == {"jspec ar", bench.GREEDY, bench.PROMPT_LOOKUP}
    assert rows["jspec ar"]["speedup_vs_transformers_greedy"] > 0
    assert rows["jspec ar"]["speedup_vs_transformers_prompt_lookup"] > 0
    assert rows[bench.GREEDY]["tokens"] > 0 and rows[bench.GREEDY]["mean_ttft_ms"] is not None


def test_a_history_method_runs_the_prompts_through_one_engine(model):
    """``ngram:K+history``: one engine for all prompts, in order, so a prompt run again is
    drafted from its first run's text; the warm-up's text is forgotten; tokens equal AR's."""
    methods = bench.parse_methods("ngram:3,ngram:3+history")
    assert methods[2].name == "jspec ngram k=3 +history" and methods[2].spec.ngram_history == bench.HISTORY_TOKENS
    prompts = [PROMPTS[0], PROMPTS[0]]
    report = bench.run_bench(model, prompts, methods, max_tokens=16, progress=False, warmup_tokens=4)
    report.check()
    ar, plain, history = report.results
    assert history.same_as_ar == plain.same_as_ar == 2
    assert history.sequence_steps < plain.sequence_steps  # the repeat was drafted from the first run


def test_a_history_method_does_not_reuse_cached_prompt_pages(model):
    """Only the lookup history may carry over between a ``+history`` method's prompts: its engine's
    prefix cache is emptied before each one, or a repeated prompt's prefill would be skipped and
    counted as the history's speed."""
    spec = bench.parse_methods("ngram:3+history")[1].spec
    ids = model.tokenizer(" ".join(["hello world"] * 40))["input_ids"]
    runner = bench.EngineRunner(model, spec, [ids], max_tokens=4)
    runner(ids, 4)
    runner(ids, 4)
    assert runner.engine.stats.cached_prompt_tokens == 0
    run_requests(runner.engine, [ids], jspec.SamplingParams(max_tokens=4))  # without the reset: a hit
    assert runner.engine.stats.cached_prompt_tokens > 0


def test_one_engine_per_method_whatever_the_prompts(model, monkeypatch):
    """Every jspec method runs all prompts through one engine sized for the longest: an engine per
    prompt compiled its programs again per prompt length, kept them all, and a long bench ran
    the process out of memory maps. Prompts here span three 64-token shape buckets."""
    built = []

    class Counted(bench.LLMEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(bench, "LLMEngine", Counted)
    prompts = [PROMPTS[0], " ".join(["hello world"] * 40), " ".join(["add one"] * 70)]
    lengths = [len(bench.encode_prompt(model.tokenizer, p, False)) for p in prompts]
    assert len({(n + 6) // 64 for n in lengths}) == 3, lengths
    report = bench.run_bench(model, prompts, bench.parse_methods("ngram:2"), max_tokens=6, progress=False,
                             warmup_tokens=2)
    report.check()
    assert len(built) == 2 and [e.spec.enabled for e in built] == [False, True]
    assert all(e.config.max_model_len >= max(lengths) + 6 for e in built)
    assert all(e.stats.cached_prompt_tokens == 0 for e in built)  # emptied before each prompt


def test_bench_on_float16_kv_pages(model, monkeypatch):
    """``--kv-cache-dtype float16``: every jspec method's engine holds float16 pages, the greedy
    check still holds against AR on the same pages, and the report says which pages ran."""
    import jax.numpy as jnp

    engines = []
    real = bench.EngineRunner.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        engines.append(self.engine)

    monkeypatch.setattr(bench.EngineRunner, "__init__", spy)
    report = bench.run_bench(model, PROMPTS, bench.parse_methods("ngram:2"), max_tokens=12, progress=False,
                             warmup_tokens=2, kv_cache_dtype="float16")
    report.check()
    assert report.mismatches == [] and report.meta["kv_cache_dtype"] == "float16"
    assert len(engines) == 2 and all(e.runner.state.cache.k_pages[0].dtype == jnp.float16 for e in engines)
    code, out, err = _cli("bench", "--model", "unused", "--kv-cache-dtype", "fp4")
    assert code == 2 and out == "" and "--kv-cache-dtype" in err
