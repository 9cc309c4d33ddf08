"""``jspec bench``: decoding methods side by side on your prompts (:mod:`jspec.bench.run`).

    jspec bench [--prompts-file FILE | --suite humaneval] [--limit N] [--max-tokens N]
                [--preset spec | spec-quick]
                [--methods ar,ngram:4,ngram:8,eagle:NAME:4,draft:NAME:4] [--peers transformers]
                [--json OUT] [--plot OUT.png] [--model NAME_OR_PATH] [--profile]

``--preset`` names one of the project's method sweeps (:mod:`jspec.bench.presets`); options given
beside it win over the preset's.

Greedy (or sampled with ``--temperature``), batch 1, EOS respected. Prints a Markdown table on
stdout (a progress bar on stderr while it runs). Exit 0; 2 on bad input; **1 when a jspec
method's greedy tokens differ from jspec AR's** (one line per mismatch on stderr, naming the
method, prompt and position; the table and the JSON are still written). Sampled runs are not
compared token for token (other random draws); they report acceptance at that temperature.
"""

from __future__ import annotations

import argparse
import json
import sys

from jspec.bench.presets import DEFAULT, PRESETS, expand
from jspec.cli.guard import EXIT_BUG
from jspec.cli.numerics_args import add_numerics_arguments

SUITES = ("humaneval",)


def add_bench_parser(sub, default_model: str, attention_choices) -> None:
    b = sub.add_parser("bench", help="compare decoding methods (speed, acceptance) on the same prompts")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--prompts-file", help="one prompt per line, or JSON Lines with a 'prompt' field")
    src.add_argument("--suite", choices=SUITES, help="a bundled prompt set (default humaneval)")
    b.add_argument("--limit", type=int, default=10, help="first N prompts (default 10)")
    b.add_argument("--start", type=int, default=0, help="skip the first prompts (default 0)")
    b.add_argument("--preset", choices=sorted(PRESETS),
                   help="a method sweep of this project, with its peers and --profile (jspec.bench.presets); "
                   "options given beside it win")
    b.add_argument("--methods", default=None,
                   help="comma-separated: ar, ngram:K, layerskip:L:K, draft:NAME:K, eagle:NAME:K, hybrid:NAME:K; "
                   "ngram and hybrid also with +history (a lookup history over the earlier prompts), any "
                   "speculative one with +dynamic (the engine picks k per burst, 0..K), hybrid with +headN "
                   "(the head drafts at most N), draft / eagle / hybrid with +f32 (float32 drafter weights, "
                   "not Q8_0) "
                   f"(default {DEFAULT.methods}, or the preset's)")
    b.add_argument("--peers", default=None, help="transformers (greedy + prompt lookup), "
                   "transformers-assisted:DRAFT (also assisted generation with a small-llama draft)")
    b.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=128)
    b.add_argument("--model", default=default_model, help=f"name or path (default {default_model})")
    b.add_argument("--chat", action="store_true", help="apply the model's chat template")
    b.add_argument("--json", dest="json_out", metavar="OUT", help="write every number as JSON to OUT")
    b.add_argument("--plot", metavar="OUT.png", help="tokens/s and acceptance per position, as a PNG")
    b.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                   help="also time draft / verify / plain steps apart (default off, or the preset's)")
    b.add_argument("--attention", default="auto", choices=[a for a in attention_choices if a != "interpret"])
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_numerics_arguments(b)
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (default 0: greedy, and tokens are checked against AR)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--top-k", type=int, default=0)
    b.add_argument("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    b.set_defaults(func=cmd_bench)


def _peers(text: str) -> tuple[bool, str | None]:
    from jspec.errors import ConfigError

    want, assisted = False, None
    for p in (t.strip() for t in text.split(",") if t.strip()):
        if p == "transformers":
            want = True
        elif p.startswith("transformers-assisted:") and p.partition(":")[2]:
            want, assisted = True, p.partition(":")[2]
        else:
            raise ConfigError(f"--peers: unknown peer {p!r} (transformers, transformers-assisted:DRAFT)")
    return want, assisted


def _prompts(args) -> list[str]:
    from jspec.cli.generate import read_prompts_file
    from jspec.bench.run import humaneval_prompts
    from jspec.errors import ConfigError

    if args.limit < 1 or args.start < 0:
        raise ConfigError("--limit must be >= 1 and --start >= 0")
    if args.prompts_file:
        prompts = [it["prompt"] for it in read_prompts_file(args.prompts_file)][args.start:args.start + args.limit]
    else:
        prompts = humaneval_prompts(args.start, args.limit)
    if not prompts:
        raise ConfigError("no prompts left after --start / --limit")
    return prompts


def cmd_bench(args) -> int:
    from jspec.cli import checks, enable_compile_cache
    from jspec.config import CHECKPOINT_METHODS, CacheConfig, SamplingParams
    from jspec.bench.run import parse_methods, pyplot, run_bench
    from jspec.loading import open_checkpoint

    # checks that need no model first (jspec.cli.checks)
    options = expand(args.preset, methods=args.methods, peers=args.peers, profile=args.profile)
    methods = parse_methods(options.methods)
    want_peers, assisted = _peers(options.peers)
    prompts = _prompts(args)
    if args.plot:
        pyplot()  # without matplotlib, fail now rather than after the run
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    if sampling.temperature > 0 and want_peers:
        from jspec.errors import ConfigError

        raise ConfigError("--peers decode greedily: drop --temperature or --peers")
    checks._check_attention(args.attention)
    for m in methods:
        if m.spec.method in CHECKPOINT_METHODS:
            checks._check_draft_exists(m.spec)
    checkpoint = open_checkpoint(args.model, dtype=args.dtype)
    for m in methods:  # one prompt at a time: the longest prompt must fit, with each method's k
        checks.generate_fits(checkpoint.config, [max(prompts, key=len)], sampling, m.spec, CacheConfig(),
                             chat=args.chat)
    model = checkpoint.load()
    if model.tokenizer is None:
        from jspec.errors import CheckpointError

        raise CheckpointError(f"{model.source}: no tokenizer (tokenizer.json) to encode text prompts")
    if want_peers:
        from jspec.bench.peers import transformers_peers

        methods = methods + transformers_peers(model, assisted)
    enable_compile_cache()
    report = run_bench(model, prompts, methods, max_tokens=args.max_tokens, chat=args.chat,
                       attention=args.attention, profile=options.profile, sampling=sampling,
                       kv_cache_dtype=args.kv_cache_dtype, quantized_activations=args.quantized_activations)
    print(f"{report.meta['machine']}, {report.meta['date']}; {model.source.name} ({report.meta['dtype']}), "
          f"{report.meta['sampling']}, "
          f"batch 1, up to {args.max_tokens} new tokens, {report.num_prompts} prompts\n")
    print(report.markdown())
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=1)
    if args.plot:
        report.plot(args.plot)
    for m in report.mismatches:
        print(f"jspec: greedy mismatch: {m}", file=sys.stderr)
    return EXIT_BUG if report.mismatches else 0
