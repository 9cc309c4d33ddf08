"""The ``jspec`` command: thin wiring over the library.

    jspec generate PROMPT [--model NAME_OR_PATH] [--max-new-tokens N] [--temperature T]
                          [--top-k K] [--top-p P] [--seed S] [--chat] [--json]
                          [--spec {none,ngram,layerskip:L,draft:PATH,eagle:PATH}]
                          [--num-speculative-tokens K] [--attention {auto,reference,pallas}]
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
import json
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


def _enable_compile_cache() -> None:
    """Persist XLA executables across runs (a second ``jspec generate`` skips compilation)."""
    import jax

    from jspec.loading.tokenizer import cache_dir

    try:
        jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    except Exception:  # an optimisation only
        pass


def _stream_printer(tokenizer):
    """Print text as tokens arrive, holding back incomplete multi-byte characters."""
    state = {"ids": [], "printed": 0}

    def on_tokens(new):
        state["ids"].extend(new[0])
        text = tokenizer.decode(state["ids"], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[state["printed"]:])
        sys.stdout.flush()
        state["printed"] = len(text)

    return on_tokens


def cmd_generate(args) -> int:
    import jspec
    from jspec.loading import open_checkpoint

    sampling, spec, cache_config = checks.generate_options(args, [args.prompt])  # no model needed
    checkpoint = open_checkpoint(args.model, dtype=args.dtype)  # metadata and headers, no weights
    checks.generate_fits(checkpoint.config, [args.prompt], sampling, spec, cache_config, chat=args.chat)
    model = checkpoint.load()
    if model.tokenizer is None:
        raise jspec.CheckpointError(f"{model.source}: no tokenizer (tokenizer.json) to encode a text prompt")
    _enable_compile_cache()
    on_tokens = None if args.json else _stream_printer(model.tokenizer)
    result = jspec.generate(model, [args.prompt], sampling, spec=spec, chat=args.chat,
                            attention=args.attention, on_tokens=on_tokens,
                            cache_config=cache_config)
    if args.json:
        print(json.dumps({
            "text": result.texts[0],
            "token_ids": result.token_ids[0],
            "num_tokens": result.num_tokens,
            "prompt_tokens": result.prompt_lens[0],
            "finish_reason": result.finish_reasons[0],
            "tokens_per_second": result.tokens_per_second,
            "ttft_s": result.ttft_s,
            "total_s": result.total_s,
            "compile_s": result.compile_s,
            "spec": result.spec_method,
            "num_speculative_tokens": result.num_speculative_tokens,
            "mean_accepted_length": result.mean_accepted_length,
            "acceptance_per_position": result.acceptance_per_position,
            "num_target_forwards": result.num_target_forwards,
            "model": str(model.source),
        }))
    else:
        print()
    print(result.summary(), file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    import importlib.metadata as md

    import jax

    import jspec
    from jspec.loading import smollm2_path

    print(f"jspec {jspec.__version__}")
    for pkg in ("jax", "jaxlib", "flax", "optax", "chex", "transformers", "numpy", "gguf", "safetensors"):
        try:
            print(f"{pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"{pkg} not installed")
    print(f"backend {jax.default_backend()}")
    for d in jax.devices():
        print(f"device {d.id}: {d.platform} {getattr(d, 'device_kind', '')}")
    try:
        print(f"default model {jspec.DEFAULT_MODEL}: {smollm2_path()}")
    except jspec.JspecError as e:
        print(f"default model {jspec.DEFAULT_MODEL}: {e}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jspec.attention import ATTENTION_IMPLS
    from jspec.loading import DEFAULT_MODEL

    p = _ArgumentParser(prog="jspec", description="Speculative decoding on a paged KV cache, in JAX.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_ArgumentParser)

    g = sub.add_parser("generate", help="generate text for one prompt")
    g.add_argument("prompt", help="raw prompt text (use --chat to wrap it in the chat template)")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"name or path (default {DEFAULT_MODEL})")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--spec", default="none",
                   help="none | ngram | layerskip:L | draft:PATH_OR_NAME | eagle:PATH (default none)")
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help=f"drafts per verification step, 1..16 (default {checks.DEFAULT_K}; needs --spec)")
    g.add_argument("--attention", default="auto", choices=[a for a in ATTENTION_IMPLS if a != "interpret"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--page-size", type=int, default=16)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="versions, backend, devices and the default model's path")
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
        args = build_parser().parse_args(argv)
        return args.func(args)

    return guard.run(run)


if __name__ == "__main__":
    sys.exit(main())
