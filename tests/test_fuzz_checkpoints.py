"""Byte-level fuzzing of a small valid GGUF file and a small safetensors file: every mutation must
end in a clean refusal (a JspecError) or a correct load (the config's shapes, finite weights),
never another exception. Mutations are seeded (reproducible) and bounded in number and time;
most hit the header and metadata, where the structure is.

Seen to fail on: ``check_finite`` made a no-op (loads with NaN weights succeed), and on the code
before this change (GGUF mutations loaded NaN/Inf weights).
"""

import shutil
import struct
import time

import jax
import numpy as np
import pytest

import jspec
from helpers import write_hf_checkpoint
from hostile_helpers import write_gguf_with

MUTATIONS = int(__import__("os").environ.get("JSPEC_FUZZ_MUTATIONS", 300))
BUDGET_S = 120.0  # for all mutations of one file on 2 shared cores (typically ~10 s)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    # one layer, small vocabulary: a ~60 KB checkpoint whose header is a large share of the bytes
    return write_hf_checkpoint(tmp_path_factory.mktemp("fuzz-src"), "llama", tokenizer=False, vocab_size=64,
                               hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1)


def _pick(rng, values):
    return values[int(rng.integers(0, len(values)))]


def _mutate(data: bytes, rng: np.random.Generator, header_len: int) -> bytes:
    b = bytearray(data)
    kind = rng.integers(0, 6)
    hot = rng.random() < 0.8  # most mutations in the header / metadata
    pos = int(rng.integers(0, header_len if hot else len(b)))
    if kind == 0:  # flip one bit
        b[pos] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # random bytes
        n = int(rng.integers(1, 9))
        b[pos:pos + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    elif kind == 2:  # an extreme 64-bit count or length
        b[pos:pos + 8] = struct.pack("<Q", _pick(rng, [2**63 - 1, 2**40, 2**32, 2**31, 2**64 - 1, 0]))
    elif kind == 3:  # an extreme 32-bit value
        b[pos:pos + 4] = struct.pack("<I", _pick(rng, [0, 1, 2**31 - 1, 2**32 - 1, 10**9]))
    elif kind == 4:  # truncate
        del b[pos:]
    else:  # NaN / Inf in the data
        b[pos:pos + 4] = struct.pack("<f", _pick(rng, [np.nan, np.inf, -np.inf]))
    return bytes(b)


def _check_loaded(model) -> None:
    """A load that succeeded is a correct one: the parameters the config implies, all finite."""
    cfg = model.config
    per_layer = 7 if cfg.qkv_bias else 6
    leaves = jax.tree_util.tree_leaves(model.params)
    assert len(leaves) == 2 + (0 if cfg.tie_word_embeddings else 1) + per_layer * cfg.num_layers
    assert model.params["embed_tokens"]["embedding"].shape == (cfg.vocab_size, cfg.hidden_size)
    for leaf in leaves:
        assert np.isfinite(np.asarray(leaf)).all()


def _fuzz(original: bytes, header_len: int, load, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    outcome = {"refused": 0, "loaded": 0}
    start = time.time()
    for i in range(MUTATIONS):
        data = _mutate(original, rng, header_len)
        try:
            model = load(data)
        except jspec.JspecError:
            outcome["refused"] += 1
        except Exception as e:  # anything else is a bug: report the mutation that found it
            raise AssertionError(f"mutation {i} (seed {seed}) escaped as {type(e).__name__}: {e}") from e
        else:
            _check_loaded(model)
            outcome["loaded"] += 1
        assert time.time() - start < BUDGET_S, f"fuzzing too slow: {i} mutations in {BUDGET_S}s"
    return outcome


def test_fuzz_gguf(tmp_path, small_dir):
    path = write_gguf_with(tmp_path / "small.gguf", small_dir)
    original = path.read_bytes()
    header_len = original.index(b"output_norm.weight") + 200  # metadata + tensor infos
    target = tmp_path / "mutated.gguf"

    def load(data):
        target.write_bytes(data)
        return jspec.load_model(str(target), tokenizer=False)

    outcome = _fuzz(original, header_len, load, seed=1)
    print(outcome)
    assert outcome["refused"] > 50 and outcome["loaded"] > 10, outcome  # both ends were exercised


def test_fuzz_safetensors(tmp_path, small_dir):
    work = tmp_path / "mutated"
    shutil.copytree(small_dir, work)
    file = work / "model.safetensors"
    original = file.read_bytes()
    header_len = 8 + struct.unpack("<Q", original[:8])[0]

    def load(data):
        file.write_bytes(data)
        return jspec.load_model(str(work), tokenizer=False)

    outcome = _fuzz(original, header_len, load, seed=2)
    assert outcome["refused"] > 50 and outcome["loaded"] > 10, outcome
