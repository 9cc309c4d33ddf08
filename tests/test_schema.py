"""Config contents that are the wrong type, out of range or inconsistent: one table per file kind
(HF config.json, generation_config.json, safetensors index, GGUF metadata), each case through the
library (typed error naming the file and the field) and through the CLI (exit 2, one line, no
traceback), plus hypothesis-generated values for every field of the schemas.

Mutation seen to fail: ``_number_ok`` in jspec/loading/schema.py always true (ranges unchecked).
"""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jspec
from helpers import hf_config_dict, write_hf_checkpoint
from hostile_helpers import assert_one_line, cli, copy_dir, edit_json, write_gguf_with
from jspec.config import INT32_MAX
from jspec.loading import schema
from jspec.loading.hf import config_from_hf

GOOD = dict(hf_config_dict("llama"), model_type="llama")  # vocab 300, hidden 64, 4 heads, 2 kv heads


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("schema-good"), "llama")


def _set(**kw):
    return lambda d: d.update(kw)


def _drop(key):
    def edit(d):
        del d[key]

    return edit


CE, UE = jspec.CheckpointError, jspec.UnsupportedModelError
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}

# (label, edit of config.json, exception, fragment the message must hold)
HF_CONFIG_CASES = [
    ("a list, not an object", lambda d: [d], CE, "expected a JSON object"),
    ("a string, not an object", lambda d: "llama", CE, "expected a JSON object"),
    ("size as a string", _set(hidden_size="64"), CE, "hidden_size"),
    ("size as a float", _set(intermediate_size=128.0), CE, "intermediate_size"),
    ("size as a bool", _set(num_key_value_heads=True), CE, "num_key_value_heads"),
    ("zero heads", _set(num_attention_heads=0), CE, "num_attention_heads"),
    ("negative layers", _set(num_hidden_layers=-1), CE, "num_hidden_layers"),
    ("layers past int32", _set(num_hidden_layers=2**31), CE, "num_hidden_layers"),
    ("vocab past int32", _set(vocab_size=2**40), CE, "vocab_size"),
    ("context past int32", _set(max_position_embeddings=10**12), CE, "max_position_embeddings"),
    ("zero context", _set(max_position_embeddings=0), CE, "max_position_embeddings"),
    ("missing vocab_size", _drop("vocab_size"), CE, "vocab_size"),
    ("missing hidden_size", _drop("hidden_size"), CE, "hidden_size"),
    ("kv heads do not divide heads", _set(num_key_value_heads=3), CE, "num_key_value_heads"),
    ("heads do not divide hidden", _set(num_attention_heads=5, num_key_value_heads=None), CE, "num_attention_heads"),
    ("odd head_dim", _set(head_dim=15), CE, "head_dim"),
    ("partial rope_scaling", _set(rope_scaling={"rope_type": "llama3", "factor": 8.0}), CE,
     "rope_scaling.low_freq_factor"),
    ("rope_scaling factor as a string", _set(rope_scaling=dict(LLAMA3, factor="8")), CE, "rope_scaling.factor"),
    ("rope_scaling high <= low", _set(rope_scaling=dict(LLAMA3, high_freq_factor=0.5)), CE,
     "rope_scaling.high_freq_factor"),
    ("rope_scaling not an object", _set(rope_scaling="llama3"), CE, "rope_scaling"),
    ("rope type unsupported", _set(rope_scaling={"rope_type": "yarn", "factor": 4.0}), UE, "yarn"),
    ("EOS as a string", _set(eos_token_id="</s>"), CE, "eos_token_id"),
    ("EOS outside the vocabulary", _set(eos_token_id=300), CE, "eos_token_id"),
    ("EOS list with a string", _set(eos_token_id=[1, "2"]), CE, "eos_token_id"),
    ("negative BOS", _set(bos_token_id=-1), CE, "bos_token_id"),
    ("rms_norm_eps NaN", _set(rms_norm_eps=float("nan")), CE, "rms_norm_eps"),
    ("rms_norm_eps zero", _set(rms_norm_eps=0), CE, "rms_norm_eps"),
    ("rope_theta infinite", _set(rope_theta=float("inf")), CE, "rope_theta"),
    ("rope_theta as a string", _set(rope_theta="1e4"), CE, "rope_theta"),
    ("tie_word_embeddings as a string", _set(tie_word_embeddings="yes"), CE, "tie_word_embeddings"),
    ("model_type as a number", _set(model_type=7), CE, "model_type"),
    ("hidden_act gelu", _set(hidden_act="gelu"), UE, "hidden_act"),
    ("sliding_window negative", _set(sliding_window=-4), CE, "sliding_window"),
]


def _apply(edit, d):
    d = json.loads(json.dumps(d))
    new = edit(d)
    return d if new is None else new


@pytest.mark.parametrize("label,edit,exc,fragment", HF_CONFIG_CASES, ids=[c[0] for c in HF_CONFIG_CASES])
def test_hf_config_library(label, edit, exc, fragment):
    with pytest.raises(exc) as info:
        config_from_hf(_apply(edit, GOOD), "some/dir/config.json")
    assert fragment in str(info.value) and "some/dir/config.json" in str(info.value)


def test_hf_config_cli_table(tmp_path, good_dir):
    """Every case of the table as a file on the command line: exit 2, one line naming file and field."""
    d = copy_dir(good_dir, tmp_path / "good")
    (d / "config.json").write_text(json.dumps(GOOD))
    assert jspec.load_config(str(d)).num_layers == 2  # the unedited table base loads
    for i, (label, edit, _, fragment) in enumerate(HF_CONFIG_CASES):
        d = copy_dir(good_dir, tmp_path / f"case{i}")
        (d / "config.json").write_text(json.dumps(_apply(edit, GOOD)))
        line = assert_one_line(*cli("generate", "hello", "--model", d), fragment)
        assert "config.json" in line, (label, line)


@pytest.mark.parametrize("raw,fragment", [
    (b"{", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[" * 100000, "not valid JSON"),  # nesting deep enough to exhaust the parser's recursion
    (b"NaN", "expected a JSON object"),
], ids=["truncated", "not utf-8", "deep nesting", "a number"])
def test_config_json_unparsable(tmp_path, good_dir, raw, fragment):
    d = copy_dir(good_dir, tmp_path / "d")
    (d / "config.json").write_bytes(raw)
    with pytest.raises(jspec.CheckpointError, match=fragment):
        jspec.load_config(str(d))
    assert_one_line(*cli("generate", "hello", "--model", d), fragment)


GENERATION_CASES = [
    ("{", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"eos_token_id": "</s>"}', "eos_token_id"),
    ('{"eos_token_id": 1000000}', "eos_token_id"),
    ('{"eos_token_id": [1, null]}', "eos_token_id"),
    ('{"bos_token_id": 2.5}', "bos_token_id"),
]


@pytest.mark.parametrize("text,fragment", GENERATION_CASES)
def test_generation_config(tmp_path, good_dir, text, fragment):
    d = copy_dir(good_dir, tmp_path / "d")
    (d / "generation_config.json").write_text(text)
    with pytest.raises(jspec.CheckpointError, match="generation_config.json") as info:
        jspec.load_config(str(d))
    assert fragment in str(info.value)
    assert_one_line(*cli("generate", "hello", "--model", d), fragment)


def _index_cases(keys):
    full = {k: "model.safetensors" for k in keys}
    first = sorted(keys)[0]
    return [
        ("not JSON", "{", "not valid"),
        ("a list", "[]", "expected a JSON object"),
        ("no weight_map", "{}", "weight_map"),
        ("weight_map a list", json.dumps({"weight_map": []}), "weight_map"),
        ("weight_map of numbers", json.dumps({"weight_map": {first: 1}}), "weight_map"),
        ("empty weight_map", json.dumps({"weight_map": {}}), "weight_map"),
        ("shard outside the directory", json.dumps({"weight_map": dict(full, **{first: "../x.safetensors"})}),
         "weight_map." + first),
        ("shard missing", json.dumps({"weight_map": dict(full, **{first: "other.safetensors"})}), "other.safetensors"),
        ("tensor not in its shard", json.dumps({"weight_map": dict(full, ghost="model.safetensors")}), "ghost"),
    ]


def test_safetensors_index_table(tmp_path, good_dir):
    from jspec.loading.hf import SafetensorsDir

    keys = list(SafetensorsDir(good_dir).keys())
    for i, (label, text, fragment) in enumerate(_index_cases(keys)):
        d = copy_dir(good_dir, tmp_path / f"case{i}")
        (d / "model.safetensors.index.json").write_text(text)
        with pytest.raises(jspec.CheckpointError) as info:
            jspec.load_config(str(d))
        assert fragment in str(info.value), (label, str(info.value))
        assert_one_line(*cli("generate", "hello", "--model", d), fragment)


# ----------------------------------------------------------------------------- GGUF metadata

def _gguf_cases():
    import gguf

    T = gguf.GGUFValueType
    return [
        ("block_count 10^9", {"llama.block_count": (10**9, T.UINT32)}, (), CE, "llama.block_count"),
        ("head_count as an array", {"llama.attention.head_count": ([4, 4], T.ARRAY)}, (), CE, "attention.head_count"),
        ("head_count does not divide hidden", {"llama.attention.head_count": (5, T.UINT32)},
         ("llama.attention.head_count_kv",), CE, "llama.attention.head_count"),
        ("head_count_kv does not divide heads", {"llama.attention.head_count_kv": (3, T.UINT32)}, (), CE,
         "head_count_kv"),
        ("head count that does not fit the tensors", {"llama.attention.head_count": (8, T.UINT32)}, (), CE,
         "has shape"),
        ("context_length past int32", {"llama.context_length": (2**40, T.UINT64)}, (), CE, "context_length"),
        ("EOS as a string", {"tokenizer.ggml.eos_token_id": ("</s>", T.STRING)}, (), CE, "eos_token_id"),
        ("EOS outside the vocabulary", {"tokenizer.ggml.eos_token_id": (10**6, T.UINT32)}, (), CE, "eos_token_id"),
        ("no vocab_size and no tokens", {}, ("llama.vocab_size",), CE, "vocab_size"),
        ("rope scaling type linear", {"llama.rope.scaling.type": ("linear", T.STRING)}, (), CE, "rope.scaling.type"),
        ("odd key_length", {"llama.attention.key_length": (15, T.UINT32)}, (), CE, "key_length"),
        ("negative epsilon", {"llama.attention.layer_norm_rms_epsilon": (-1.0, T.FLOAT32)}, (), CE,
         "layer_norm_rms_epsilon"),
        ("feed_forward_length as a string", {"llama.feed_forward_length": ("128", T.STRING)}, (), CE,
         "feed_forward_length"),
        ("architecture as a number", {"general.architecture": (7, T.UINT32)}, (), CE, "general.architecture"),
        ("missing block_count", {}, ("llama.block_count",), CE, "block_count"),
    ]


def test_gguf_metadata_table(tmp_path, good_dir):
    for i, (label, set_fields, drop, exc, fragment) in enumerate(_gguf_cases()):
        path = write_gguf_with(tmp_path / f"case{i}.gguf", good_dir, set_fields, drop)
        with pytest.raises(exc) as info:
            jspec.load_model(str(path), tokenizer=False)
        assert fragment in str(info.value) and path.name in str(info.value), (label, str(info.value))
        line = assert_one_line(*cli("generate", "hello", "--model", path), fragment)
        assert path.name in line


def test_gguf_unsupported_architecture(tmp_path, good_dir):
    path = write_gguf_with(tmp_path / "gpt2.gguf", good_dir, arch="gpt2")
    with pytest.raises(jspec.UnsupportedModelError, match="gpt2"):
        jspec.load_config(str(path))


# ----------------------------------------------------------------------------- hypothesis

INT_FIELDS = [f.key for f in schema.HF_CONFIG if f.kind == "int"]
INVALID_INT = st.one_of(
    st.text(max_size=8), st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: x != int(x) if math.isfinite(x) else True),
    st.integers(max_value=0), st.integers(min_value=INT32_MAX + 1, max_value=2**80), st.booleans(),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
INVALID_INT_LO0 = INVALID_INT.filter(lambda v: v != 0 or isinstance(v, bool))  # BOS may be 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(INT_FIELDS), data=st.data())
def test_hf_int_fields_refuse_bad_values(field, data):
    """Any non-integer or out-of-range value of an integer field: CheckpointError naming the field."""
    value = data.draw(INVALID_INT_LO0 if field == "bos_token_id" else INVALID_INT)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return  # 64.0 is refused too, but it is not what this draws for
    d = dict(GOOD, **{field: value})
    with pytest.raises(jspec.CheckpointError) as info:
        config_from_hf(d, "cfg.json")
    assert field in str(info.value) and "cfg.json" in str(info.value)


SIZES = st.integers(min_value=1, max_value=INT32_MAX)


@settings(max_examples=200, deadline=None)
@given(vocab=SIZES, hidden=SIZES, inter=SIZES, layers=SIZES, heads=SIZES, kv=st.one_of(st.none(), SIZES),
       head_dim=st.one_of(st.none(), SIZES), ctx=SIZES, eos=st.one_of(st.none(), SIZES, st.lists(SIZES, max_size=3)))
def test_hf_any_sizes_give_a_config_or_a_typed_error(vocab, hidden, inter, layers, heads, kv, head_dim, ctx, eos):
    """Whatever in-range sizes a config.json states: a consistent ModelConfig or a CheckpointError,
    never another exception; a built config satisfies the consistency rules."""
    d = dict(GOOD, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
             num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, max_position_embeddings=ctx,
             eos_token_id=eos)
    try:
        cfg = config_from_hf(d, "cfg.json")
    except jspec.CheckpointError as e:
        assert "cfg.json" in str(e)
        return
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 2 == 0
    assert head_dim is not None or cfg.hidden_size == cfg.num_heads * cfg.head_dim
    assert all(0 <= t < cfg.vocab_size for t in cfg.eos_token_ids)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
GGUF_KEYS = [f.key for f in schema.gguf_fields("llama")]


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(GGUF_KEYS), value=JSON)
def test_gguf_metadata_any_value(field, value):
    """Any value (as the gguf reader could return it) in any GGUF field: a consistent result or a
    CheckpointError naming the file."""
    meta = {"llama.block_count": 2, "llama.embedding_length": 64, "llama.feed_forward_length": 128,
            "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2, "llama.vocab_size": 300}
    meta[field] = value
    fields = schema.gguf_fields("llama")
    try:
        m = schema.check(meta, fields, "x.gguf")
        sizes = schema.gguf_consistency(m, "llama", "x.gguf")
    except jspec.CheckpointError as e:
        assert "x.gguf" in str(e)
        return
    assert sizes["num_heads"] % sizes["num_kv_heads"] == 0 and sizes["head_dim"] % 2 == 0


@settings(max_examples=200, deadline=None)
@given(card=JSON, target=JSON, vocab=JSON)
def test_draft_card_any_json(card, target, vocab):
    """Any JSON as a card (or as its target / draft_vocab blocks): accepted or a CheckpointError."""
    variants = [card, {"format": "jspec-draft", "version": 1, "architecture": "eagle", "target": target},
                {"format": "jspec-draft", "version": 1, "architecture": "eagle", "target": {}, "draft_vocab": vocab}]
    for c in variants:
        try:
            schema.check_card(c, "card.json")
        except jspec.CheckpointError as e:
            assert "card.json" in str(e)


@pytest.mark.parametrize("kw,fragment", [
    (dict(vocab_size="96"), "vocab_size"), (dict(num_layers=2**31), "num_layers"), (dict(num_heads=0), "num_heads"),
    (dict(head_dim=16.0), "head_dim"), (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(rope_theta=-1.0), "rope_theta"), (dict(eos_token_ids=(96,)), "eos_token_ids"),
    (dict(eos_token_ids="1"), "eos_token_ids"), (dict(bos_token_id=-1), "bos_token_id"),
    (dict(rope_scaling={"factor": 8.0}), "rope_scaling"), (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(rope_freq_factors=(1.0,) * 7), "rope_freq_factors"), (dict(rope_freq_factors=(float("inf"),) * 8),
                                                                 "rope_freq_factors"),
])
def test_model_config_types(kw, fragment):
    """The library's own entry: ModelConfig checks type and range of every field (ConfigError)."""
    import dataclasses

    from helpers import TINY

    with pytest.raises(jspec.ConfigError, match=fragment):
        dataclasses.replace(TINY, **kw)


@pytest.mark.parametrize("kw,fragment", [
    (dict(factor=float("nan")), "factor"), (dict(low_freq_factor="1"), "low_freq_factor"),
    (dict(high_freq_factor=0.5), "high_freq_factor"), (dict(original_max_position_embeddings=1.5),
                                                       "original_max_position_embeddings"),
])
def test_rope_scaling_types(kw, fragment):
    with pytest.raises(jspec.ConfigError, match=fragment):
        jspec.RopeScaling(**kw)
