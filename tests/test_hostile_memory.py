"""Memory bombs: sizes in a checkpoint or an option that would allocate without bound are refused
before anything is allocated. Each bomb runs the CLI in a subprocess under an address-space
limit (``RLIMIT_AS`` = what the process holds once JAX is up + 1 GiB) and must exit 2 with one
line, in seconds, instead of running out of memory; a plain generation fits the same limit.

Mutations seen to fail: the layer-count check in ``check_checkpoint`` removed (the 10^9-layer
case then ends in "out of memory" after building layers), ``check_gguf_header`` skipped,
``check_fits`` made a no-op.
"""

import json
import struct

import pytest

import jspec
from helpers import TINY, tiny_config, write_hf_checkpoint
from hostile_helpers import assert_one_line, cli, cli_subprocess, copy_dir, edit_json, write_gguf_with
from jspec.config import INT32_MAX
from jspec.loading import memory

HEADROOM = 1 << 30
FAST_S = 15.0  # seconds main() may take to refuse (2 shared cores; a refusal takes well under 1 s)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("mem-tiny"), "llama")


@pytest.fixture(scope="module")
def wide_kv_dir(tmp_path_factory):
    """8 KiB of KV per token (2 layers x 4 KV heads x 64 dims) and a context of 2^31 - 1."""
    d = write_hf_checkpoint(tmp_path_factory.mktemp("mem-wide"), "llama", hidden_size=256, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=128)
    edit_json(d / "config.json", lambda c: c.update(max_position_embeddings=INT32_MAX))
    return d


def _gguf_with_tokens(tmp_path, tiny_dir):
    import gguf

    return write_gguf_with(tmp_path / "tokens.gguf", tiny_dir,
                           {"tokenizer.ggml.tokens": (["a", "b", "c"], gguf.GGUFValueType.ARRAY)})


def _patch(path, needle: bytes, offset: int, fmt: str, value) -> None:
    """Overwrite ``struct.pack(fmt, value)`` at ``offset`` bytes after the first ``needle``."""
    data = bytearray(path.read_bytes())
    at = data.index(needle) + len(needle) + offset
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))


def bombs(tmp_path, tiny_dir, wide_kv_dir):
    """(label, CLI arguments, fragment of the one-line message)."""
    out = []

    def hf(label, fragment, **config):
        d = copy_dir(tiny_dir, tmp_path / label.replace(" ", "-"))
        edit_json(d / "config.json", lambda c: c.update(config))
        out.append((label, ["generate", "hello", "--model", d], fragment))

    hf("layer count 1e9", "num_hidden_layers is 1000000000 but the weights hold 2 layers", num_hidden_layers=10**9)
    hf("layer count int32 max", "num_hidden_layers", num_hidden_layers=INT32_MAX)
    hf("layer count past int32", "num_hidden_layers", num_hidden_layers=2**62)
    hf("intermediate size 1e9", "has shape", intermediate_size=10**9)
    hf("vocab int32 max", "has shape", vocab_size=INT32_MAX)
    hf("heads past int32", "num_attention_heads", num_attention_heads=2**40)

    import gguf

    g = write_gguf_with(tmp_path / "blocks.gguf", tiny_dir, {"llama.block_count": (10**9, gguf.GGUFValueType.UINT32)})
    out.append(("gguf block_count 1e9", ["generate", "hello", "--model", g], "llama.block_count is 1000000000"))

    arr = _gguf_with_tokens(tmp_path, tiny_dir)  # key, u32 ARRAY, u32 STRING, u64 count
    _patch(arr, b"tokenizer.ggml.tokens", 8, "<Q", 2**40)
    out.append(("gguf array of 2^40 strings", ["generate", "hello", "--model", arr], "claims"))

    dims = write_gguf_with(tmp_path / "dims.gguf", tiny_dir)  # name, u32 n_dims, u64 dims...
    _patch(dims, b"token_embd.weight", 4 + 8, "<Q", 2**40)
    out.append(("gguf tensor of 2^46 values", ["generate", "hello", "--model", dims], "runs past the end"))

    st = copy_dir(tiny_dir, tmp_path / "st-header")
    raw = bytearray((st / "model.safetensors").read_bytes())
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = "model.embed_tokens.weight"
    header[name]["shape"] = [10**9, 64]
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    (st / "model.safetensors").write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    out.append(("safetensors header claims 1e9 rows", ["generate", "hello", "--model", st], "model.safetensors"))

    out.append(("KV cache for 2^20 new tokens", ["generate", "hello", "--model", wide_kv_dir, "--max-new-tokens",
                                                 str(1 << 20)], "KV cache of 1,048,640 tokens needs 4.0 GiB"))
    out.append(("page size 2^30", ["generate", "hello", "--model", tiny_dir, "--page-size", str(1 << 30)], "page_size"))
    return out


def test_memory_bombs_fail_fast_under_a_memory_limit(tmp_path, tiny_dir, wide_kv_dir):
    code, out, err, seconds = cli_subprocess(["generate", "hello", "--model", tiny_dir, "--max-new-tokens", "8"],
                                             headroom=HEADROOM)
    assert code == 0, err  # the limit leaves room for a real (tiny) run
    for label, args, fragment in bombs(tmp_path, tiny_dir, wide_kv_dir):
        code, out, err, seconds = cli_subprocess(args, headroom=HEADROOM)
        line = assert_one_line(code, out, err, fragment)
        assert seconds < FAST_S, (label, seconds)
        if "KV cache" in label:
            assert "available" in line and "GiB" in line, line


def test_kv_cache_bytes_formula():
    cfg = tiny_config(num_layers=3, num_kv_heads=2, head_dim=16)
    assert memory.kv_cache_bytes(cfg, 100) == 2 * 3 * 2 * 16 * 100 * 4
    assert memory.kv_cache_bytes(cfg, 100, "bfloat16") == 2 * 3 * 2 * 16 * 100 * 2
    assert memory.weights_bytes(TINY) == TINY.num_params() * 4


def test_check_fits_names_both_numbers():
    memory.check_fits(10, "x", available=10)
    with pytest.raises(jspec.InsufficientMemoryError, match=r"the KV cache needs 3\.0 GiB \(3221225472 bytes\), "
                                                             r"but only 1\.0 GiB is available"):
        memory.check_fits(3 << 30, "the KV cache", available=1 << 30)
    assert issubclass(jspec.InsufficientMemoryError, MemoryError)


def test_available_bytes_sees_the_address_space_limit():
    code, out, err, _ = cli_subprocess(["info"], headroom=HEADROOM)
    assert code == 0, err
    import subprocess
    import sys

    script = ("import resource, sys\nfrom jspec.loading.memory import host_available_bytes\n"
              "vm = [int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmSize:')][0]\n"
              "resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 29), vm + (1 << 29)))\n"
              "print(host_available_bytes())")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert 0 < int(p.stdout) <= 1 << 29, p.stderr


def test_a_load_that_cannot_fit_is_refused_before_it_starts(tiny_dir, monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 100 << 10)
    with pytest.raises(jspec.InsufficientMemoryError, match=r"parameters in float32\) needs .* but only 100.0 KiB"):
        jspec.load_model(str(tiny_dir), tokenizer=False)
    line = assert_one_line(*cli("generate", "hello", "--model", tiny_dir), "needs")
    assert "100.0 KiB is available" in line
