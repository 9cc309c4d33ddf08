"""The ``jspec`` command: thin wiring over the library.

    jspec generate PROMPT [PROMPT ...] | --prompts-file FILE [--model NAME_OR_PATH] [--max-tokens N]
                          [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop STR]
                          [--chat] [--json] [--spec {none,ngram,layerskip:L,draft:PATH,eagle:PATH,hybrid:PATH}]
                          [--num-speculative-tokens K] [--dynamic-k] [--max-num-seqs N] ...
    jspec serve [--model NAME] [--host 127.0.0.1] [--port 8000] [--speculative-config JSON]
                [--max-num-seqs N] [--max-model-len N] [--kv-cache-tokens N] [--api-key KEY] ...
    jspec bench [--prompts-file FILE | --suite humaneval] [--limit N] [--methods ar,ngram:4,...]
                [--peers transformers] [--json OUT] [--plot OUT.png]   (see ``jspec bench --help``)
    jspec plan [--model NAME_OR_PATH_OR_CONFIG] [--tp N] [--dtype bfloat16] [--device-memory 192GiB] [--spec ...]
    jspec info
    jspec distill ...   (see ``jspec distill --help``)

Bad input (a missing checkpoint, a prompt longer than the context, an out-of-range option)
prints one line on stderr and exits with code 2, without a traceback; nothing is written to
stdout before every check has passed. Options that need no model are checked before anything
loads, those that need the config before the weights load (:mod:`jspec.cli.checks`). Ctrl-C
prints one line and exits 130 (:mod:`jspec.cli.guard`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from jspec.cli import checks, guard
from jspec.cli.checks import parse_spec  # noqa: F401  (public: --spec syntax -> SpecConfig)
from jspec.cli.guard import EXIT_BAD_INPUT  # noqa: F401


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own usage dump is multi-line)
        raise SystemExit(guard.fail(f"{self.prog}: {message}"))


def _quiet() -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


def enable_compile_cache() -> None:
    """Persist XLA executables across runs (a second ``jspec generate`` skips compilation).
    ``JSPEC_COMPILE_CACHE=0`` turns it off (the test suite does: it calls the CLI in-process, and
    the setting is process-wide)."""
    if os.environ.get("JSPEC_COMPILE_CACHE", "1") == "0":
        return
    import jax

    from jspec.loading.tokenizer import cache_dir

    try:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # an optimisation only
        pass




def cmd_info(args) -> int:
    import importlib.metadata as md

    import jax

    import jspec
    from jspec.loading import smollm2_path
    from pallas_kernels.cpu import build as cpu_kernels

    print(f"jspec {jspec.__version__}")
    for pkg in ("jax", "jaxlib", "flax", "optax", "chex", "transformers", "numpy", "gguf", "safetensors"):
        try:
            print(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg} not installed")
    print(f"backend {jax.default_backend()}")
    for d in jax.devices():
        print(f"device {d.id}: {d.platform} {getattr(d, 'device_kind', '')}")
    print(f"cpu kernels {cpu_kernels.status()}")  # read, never built, here
    try:
        print(f"default model {jspec.DEFAULT_MODEL}: {smollm2_path()}")
    except jspec.JspecError as e:
        print(f"default model {jspec.DEFAULT_MODEL}: {e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jspec.attention import ATTENTION_IMPLS
    from jspec.cli.bench import add_bench_parser
    from jspec.cli.generate import add_generate_parser
    from jspec.cli.plan import add_plan_parser
    from jspec.cli.serve import add_serve_parser
    from jspec.loading import DEFAULT_MODEL

    p = _ArgumentParser(prog="jspec", description="Speculative decoding on a paged KV cache, in JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    add_generate_parser(sub, DEFAULT_MODEL, ATTENTION_IMPLS)
    add_serve_parser(sub, DEFAULT_MODEL, ATTENTION_IMPLS)
    add_bench_parser(sub, DEFAULT_MODEL, ATTENTION_IMPLS)
    add_plan_parser(sub, DEFAULT_MODEL)

    i = sub.add_parser("info", help="versions, backend, devices, the CPU kernels' build and the default model's path")
    i.set_defaults(func=cmd_info)

    try:
        from jspec.cli.distill import add_distill_parser
    except ImportError:
        pass
    else:
        add_distill_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The ``jspec`` command; returns the exit code (0, 2 bad input, 130 interrupted, 1 a bug)."""
    _quiet()

    def run() -> int:
        startup = None
        if list(sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
            from jspec.server.startup import StartupSignals

            startup = StartupSignals.install()  # before the parser imports JAX: SIGTERM exits 0 from here on
        try:
            args = build_parser().parse_args(argv)
            return args.func(args)
        finally:
            if startup is not None:
                startup.close()

    return guard.run(run)


if __name__ == "__main__":
    sys.exit(main())
