"""Session fixtures. Tests marked ``slow`` share one load of the real SmolLM2-135M model."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("JSPEC_COMPILE_CACHE", "0")  # the CLI runs in-process here; its cache is process-wide
# The suite's time is XLA compilation of many small programs, most of it LLVM optimizing code that
# then runs for milliseconds: the tests compile at -O0 (4-7x less compile time on these CPUs; the
# programs, their semantics and the tolerances are the same). JSPEC_TEST_XLA_OPT=1 keeps XLA's
# default, as the benchmarks and users run.
if os.environ.get("JSPEC_TEST_XLA_OPT", "0") != "1" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
# Many tests build their own engines and jitted closures over the same shapes, and the CLI, server
# and notebook subprocesses compile the real model's same steps: JAX's persistent compilation cache
# (keyed by the program's HLO, the compile options and XLA_FLAGS) makes each program compile once per
# session, in this process and in the subprocesses (they inherit the environment). A temporary
# directory, removed at the end; JSPEC_TEST_COMPILE_CACHE=0 turns it off.
_XLA_CACHE = None
if os.environ.get("JSPEC_TEST_COMPILE_CACHE", "1") != "0" and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="jspec-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
    if "jax" in sys.modules:  # imported before this file (a plugin): set it there too
        sys.modules["jax"].config.update("jax_compilation_cache_dir", _XLA_CACHE)


# XLA's CPU backend compiles each fusion with its MLIR fusion emitters, paying a fixed cost per
# fusion (an MLIR context with its dialects); its older elemental emitters cost, per fusion, a walk
# of the whole module. So the older ones compile a small program faster (a tiny model's step:
# ~40% less) and a large one slower (the real model's 30-layer step: +18%, quadratic). In this
# process a program of fewer than JSPEC_TEST_FUSION_EMITTER_OPS operations (default 10,000: a
# 4-layer tiny model's step is 5-7k, a 12-layer one's ~17k, the real model's 22-39k) compiles with
# the older emitters, through its compile's option overrides; larger ones compile exactly as XLA's
# defaults would, with no override, so their persistent-cache keys are the ones the CLI and server
# subprocesses (started with XLA's defaults) compute for the same programs. Subprocesses that run
# tiny models only (notebooks, tensor parallelism) get the older emitters through their XLA_FLAGS
# (helpers.tiny_subprocess_xla_flags). Both emitters emit the same operations. 0 turns this off.
_FUSION_EMITTER_OPS = int(os.environ.get("JSPEC_TEST_FUSION_EMITTER_OPS", "10000"))


def _small_programs_without_fusion_emitters(threshold: int) -> None:
    if threshold <= 0 or "xla_cpu_use_fusion_emitters" in os.environ.get("XLA_FLAGS", ""):
        return  # turned off, or set by hand
    from jax._src import compiler
    from jax._src.lib.mlir import ir

    original = compiler.compile_or_get_cached

    def is_small(module) -> bool:
        n = 0

        def count(op):  # stops at the threshold: a large module is not walked to its end
            nonlocal n
            n += 1
            return ir.WalkResult.INTERRUPT if n >= threshold else ir.WalkResult.ADVANCE

        module.operation.walk(count)
        return n < threshold

    def compile_or_get_cached(backend, computation, devices, compile_options, *args, **kwargs):
        if is_small(computation):  # XLA's older elemental emitters
            compile_options.env_option_overrides = [*compile_options.env_option_overrides,
                                                    ("xla_cpu_use_fusion_emitters", False)]
        return original(backend, computation, devices, compile_options, *args, **kwargs)

    compiler.compile_or_get_cached = compile_or_get_cached


_small_programs_without_fusion_emitters(_FUSION_EMITTER_OPS)


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def _num_memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _bounded_compiled_code():
    """Each XLA CPU executable holds hundreds of memory maps and jit keeps every executable it
    ever built; over the suite's thousands of compilations one process would pass Linux's
    ``vm.max_map_count`` (65530) and XLA would crash mid-compile (SIGSEGV/SIGABRT). Past a third
    of that, the compiled-function caches are dropped between tests."""
    yield
    if _num_memory_maps() > 20000:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="session")
def _jspec_cache_dir(tmp_path_factory):
    """Tokenizer/XLA caches go to a per-session temporary directory."""
    if "JSPEC_CACHE_DIR" not in os.environ:
        os.environ["JSPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("jspec-cache"))
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, loaded once (float32)."""
    import jspec

    return jspec.load_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF (PyTorch, float32, CPU)."""
    from transformers import AutoModelForCausalLM

    from jspec.loading import smollm2_path

    p = smollm2_path()
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name).eval()


@pytest.fixture(scope="session")
def tiny_hf_llama(tmp_path_factory):
    from helpers import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")
