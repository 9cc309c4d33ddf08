"""Tensor parallelism (jspec.parallel) on virtual CPU devices.

The tp runs happen in subprocesses (tests/parallel_helpers.py) started with
``--xla_force_host_platform_device_count=8``, so this process and the rest of the suite keep
one device; their tokens are compared here with the one-device engine's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import parallel_helpers as ph
from helpers import tiny_subprocess_xla_flags
from jspec import parallel
from jspec.errors import ConfigError
from jspec.models.tensor_parallel import _gate_up, _qkv, tp_config

HERE = Path(__file__).parent


def _env(devices: int) -> dict:
    env = dict(os.environ)
    flags = tiny_subprocess_xla_flags(env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    env.pop("JSPEC_COORDINATOR_ADDRESS", None)
    return env


def _result(proc_out: str) -> dict:
    line = [ln for ln in proc_out.splitlines() if ln.startswith("RESULT ")]
    assert line, proc_out[-3000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def reference():
    """tp = 1, plain greedy decoding, in this (one-device) process."""
    return ph.finish(ph.engine(1, "none"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs():
    """Three processes at once (compilation is single-threaded: they share the cores): tp 2/4
    engines on 8 virtual devices, and two processes of one device each joined by jax.distributed."""
    addr = f"127.0.0.1:{_free_port()}"
    script = str(HERE / "parallel_helpers.py")
    cmds = [([script, "engines"], 8)] + [([script, "distributed", addr, str(i)], 1) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, *cmd], env=_env(n), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for cmd, n in cmds]
    try:
        outs = [p.communicate(timeout=900)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"engines": _result(outs[0]), "distributed": [_result(o) for o in outs[1:]]}


@pytest.fixture(scope="module")
def tp_runs(runs):
    return runs["engines"]


def test_tp_greedy_tokens_identical_with_and_without_speculation(reference, tp_runs):
    assert len(reference[0]) == ph.MAX_TOKENS
    for tp, methods in ph.RUNS.items():
        for method in methods:
            assert tp_runs[f"{tp}/{method}"]["tokens"] == reference, (tp, method)
    # the drafters really drafted: the target as its own draft has every draft accepted
    assert tp_runs["4/self-draft"]["accepted"] > 10


def test_tp_qwen3_with_speculation_gives_the_one_device_tokens(tp_runs):
    """Qwen3's q/k norm gains are copied to every device; tp 2 with n-gram speculation decodes
    what one device decodes without it."""
    assert tp_runs["2/qwen3"]["tokens"] == ph.finish(ph.engine(1, "none", ph.qwen3_target()))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_tp_gemma_with_speculation_gives_the_one_device_tokens(tp_runs, arch):
    """Gemma's windows, caps and four norms per layer under tp 2 (the KV heads sharded, the
    attention options applied per device) with n-gram speculation: one device's plain tokens."""
    assert tp_runs[f"2/{arch}"]["tokens"] == ph.finish(ph.engine(1, "none", ph.gemma_target(arch)))


def test_tp_published_eagle3_head_gives_the_one_device_tokens(tp_runs):
    """A published-layout EAGLE-3 head sharded with its target (attention and MLP regrouped per
    device): tp 2 speculative tokens equal one device's plain greedy tokens."""
    assert tp_runs["2/published-eagle3"]["tokens"] == ph.finish(ph.published_eagle3_engine(1, speculate=False))


def test_tp_published_eagle1_head_gives_the_one_device_tokens(tp_runs):
    """A published EAGLE-1 head (fc and QKV biases, speculators' layernorms) sharded with its
    target: tp 2 speculative tokens equal one device's plain greedy tokens."""
    assert tp_runs["2/published-eagle1"]["tokens"] == ph.finish(ph.published_eagle3_engine(1, speculate=False,
                                                                                          eagle1=True))


def test_params_and_cache_carry_the_rules_shardings(tp_runs):
    for key in ("2/none", "2/draft", "2/eagle", "4/none", "4/self-draft", "4/eagle"):
        rep = tp_runs[key]["shardings"]
        assert rep["bad"] == [], (key, rep["bad"])
        assert rep["qkv_spec"] == "P(None, 'tp')"
    four = tp_runs["4/none"]["shardings"]
    # 2 KV heads at tp 4: repeated to 4, one per device
    assert four["num_kv_heads"] == 4 and four["page_shape"][0] == 4 and four["local_page_shape"][0] == 1
    assert tp_runs["2/none"]["shardings"]["local_page_shape"][0] == 1  # 2 heads over 2 devices
    # drafts by their own rule: 3 heads do not split over 2 -> replicated; the target as draft
    # and EAGLE's layer (the target's shape) -> sharded over KV heads
    assert tp_runs["2/draft"]["shardings"]["draft_page_specs"] == ["P()"]
    assert tp_runs["4/self-draft"]["shardings"]["draft_page_specs"] == ["P('tp',)"]  # one layer
    assert tp_runs["4/eagle"]["shardings"]["draft_page_specs"] == ["P('tp',)"]


def test_pallas_kernel_runs_inside_shard_map(tp_runs):
    assert tp_runs["pallas_max_diff"] < 1e-4  # interpret mode, tp 2, vs reference on one device


def test_compiled_step_moves_no_kv_cache(tp_runs):
    for tp in (2, 4):
        rec = tp_runs[f"{tp}/eagle"]
        assert rec["cache_collectives"] == [], rec["cache_collectives"]
        # the detector fires on a program that does gather the pages
        assert any("all-gather" in ln for ln in rec["control_collectives"]), rec["control_collectives"]


def test_two_processes_form_one_mesh_through_jax_distributed(runs, reference):
    results = runs["distributed"]
    assert sorted(r["process"] for r in results) == [0, 1]
    for r in results:
        assert r["processes"] == 2 and len(r["mesh_devices"]) == 2
        assert r["tokens"] == reference


def test_kv_repeat_rule_and_bad_tp():
    cfg = ph.target().config  # 8 query / 2 KV heads
    assert tp_config(cfg, 2).num_kv_heads == 2
    assert tp_config(cfg, 4).num_kv_heads == 4
    assert tp_config(cfg, 8).num_kv_heads == 8
    with pytest.raises(ConfigError, match="8 query heads"):
        tp_config(cfg, 3)
    smol = dict(num_heads=9, num_kv_heads=3)  # SmolLM2: tp 3 works, tp 2 names the heads
    assert parallel.kv_heads_for(9, 3, 3) == 3
    with pytest.raises(ConfigError, match="9 query heads"):
        parallel.kv_heads_for(smol["num_heads"], smol["num_kv_heads"], 2)
    with pytest.raises(ConfigError, match="KV heads"):
        parallel.kv_heads_for(12, 4, 6)  # 6 divides 12 query heads, but neither 4 | 6 nor 6 | 4
    with pytest.raises(ConfigError, match="needs 2 devices; jax sees 1"):
        parallel.make_mesh(2)


def test_layout_regroups_columns_per_device():
    from helpers import tiny_config

    old = tiny_config(num_heads=4, num_kv_heads=1, head_dim=2, intermediate_size=4)
    new = tp_config(old, 2)  # KV head repeated to 2
    cols = np.arange(old.q_size + 2 * old.kv_size)[None]  # q 0..7, k 8..9, v 10..11
    assert _qkv(cols, old, new)[0].tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11]
    assert _gate_up(np.arange(8)[None], 2)[0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_cli_bad_tp_exits_2(tmp_path, capsys):
    from jspec.cli import main

    ckpt = tmp_path / "tiny"
    from helpers import write_hf_checkpoint

    write_hf_checkpoint(ckpt, num_attention_heads=4, num_key_value_heads=2)
    assert main(["generate", "hi", "--model", str(ckpt), "--tp", "3", "--max-tokens", "2"]) == 2
    assert "does not divide the 4 query heads" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(ckpt), "--tp", "2", "--max-tokens", "2"]) == 2
    assert "needs 2 devices; jax sees 1" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", str(ckpt), "--tp", "0"]) == 2
    assert "--tp must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--model", str(ckpt), "--tp", "3", "--port", "0", "--no-warmup"]) == 2
    assert "does not divide the 4 query heads" in capsys.readouterr().err
