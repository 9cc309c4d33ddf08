"""``jspec generate``: one or many prompts through the engine.

    jspec generate PROMPT [PROMPT ...] | --prompts-file FILE   [sampling options] [engine options]

One prompt streams its text to stdout; several run together (continuous batching) with a
progress bar on stderr and print each completion in prompt order. ``--json`` prints one JSON
object per request (JSON Lines). ``--prompts-file`` reads one prompt per line, or JSON Lines
whose objects hold ``"prompt"`` and any per-request sampling field (``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``,
``num_speculative_tokens``) overriding the command-line values. A summary goes to stderr.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from jspec.cli.numerics_args import add_numerics_arguments
from jspec.cli.parallel_args import add_parallel_arguments, check_tp_fits, check_tp_option

PER_REQUEST_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos",
                      "num_speculative_tokens", "structured_outputs")


def add_generate_parser(sub, default_model: str, attention_choices) -> None:
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="raw prompt text (use --chat to wrap it in the chat template)")
    g.add_argument("--prompts-file", help="one prompt per line, or JSON Lines with per-request sampling fields")
    g.add_argument("--model", default=default_model, help=f"name or path (default {default_model})")
    g.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    g.add_argument("--seed", type=int, default=None, help="default: the prompt's index")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    so = g.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE", help="the output is JSON that follows this JSON schema (a file, "
                    "or the schema itself when it starts with '{')")
    so.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    so.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    so.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeatable)")
    so.add_argument("--grammar", metavar="FILE", help="the output follows this grammar (Lark or GBNF; a file)")
    g.add_argument("--json", action="store_true", help="print one JSON object per request instead of text")
    g.add_argument("--spec", default="none",
                   help="none | ngram | layerskip:L | draft:PATH_OR_NAME | eagle:PATH | hybrid:PATH "
                        "(n-gram lookup, else the EAGLE head) (default none)")
    g.add_argument("--num-speculative-tokens", "-k", type=int, default=None,
                   help="drafts per verification step, 1..16 (default 4; needs --spec)")
    g.add_argument("--dynamic-k", action="store_true", help="let the engine pick k per burst (0 .. k)")
    g.add_argument("--tree-nodes", type=int, default=0, metavar="N",
                   help="--spec eagle, hybrid, draft or ngram: draft token trees of up to N nodes (1..31), k deep "
                        "(default 0: a chain of k)")
    g.add_argument("--tree-width", type=int, default=None, metavar="W",
                   help="with --tree-nodes: each expansion keeps its W most probable tokens; ngram: W matches "
                        "(default 4)")
    g.add_argument("--head-tokens", type=int, default=None, metavar="N",
                   help="--spec hybrid: the head drafts at most N tokens where lookup finds no match (default: k)")
    g.add_argument("--ngram-history", type=int, default=0, metavar="TOKENS",
                   help="--spec ngram: also look up in the last TOKENS tokens of finished requests (default 0: off)")
    g.add_argument("--draft-quantization", default="q8_0", choices=["q8_0", "none"],
                   help="--spec draft / eagle / hybrid on the CPU: the drafter's weights as Q8_0 blocks (default) or "
                        "float32; the output is the same either way")
    g.add_argument("--max-num-seqs", type=int, default=None, help="slots decoded together (default: number of prompts, <= 32)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--kv-cache-tokens", type=int, default=None)
    add_numerics_arguments(g)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--attention", default="auto", choices=[a for a in attention_choices if a != "interpret"])
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--page-size", type=int, default=16)
    add_parallel_arguments(g)
    g.set_defaults(func=cmd_generate)


def read_prompts_file(path: str) -> list[dict]:
    """Requests of a prompts file: [{"prompt": str, <sampling overrides>}, ...]."""
    from jspec.cli.checks import text_argument
    from jspec.errors import ConfigError, PromptError

    p = Path(text_argument(path, "--prompts-file"))
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{path}: cannot read prompts file ({e.__class__.__name__}: {e})") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise PromptError(f"{path}: no prompts")
    jsonl = p.suffix == ".jsonl" or lines[0].lstrip().startswith("{")
    out = []
    for i, ln in enumerate(lines, 1):
        if not jsonl:
            out.append({"prompt": ln})
            continue
        try:
            obj = json.loads(ln)
        except ValueError as e:
            raise PromptError(f"{path}:{i}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise PromptError(f"{path}:{i}: each line must be an object with a string 'prompt'")
        unknown = sorted(set(obj) - {"prompt", *PER_REQUEST_FIELDS})
        if unknown:
            raise ConfigError(f"{path}:{i}: unknown fields {unknown} (known: prompt, {', '.join(PER_REQUEST_FIELDS)})")
        out.append(obj)
    return out


def _stream_printer(tokenizer):
    """Print text as tokens arrive, holding back incomplete multi-byte characters."""
    state = {"ids": [], "printed": 0}

    def on_tokens(new_ids):
        state["ids"].extend(new_ids)
        text = tokenizer.decode(state["ids"], skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[state["printed"]:])
        sys.stdout.flush()
        state["printed"] = len(text)

    return on_tokens


def cmd_generate(args) -> int:
    import jspec
    from jspec.cli import checks, enable_compile_cache
    from jspec.engine.engine import LLMEngine
    from jspec.loading import open_checkpoint

    # every check that needs no model runs before anything loads (jspec.cli.checks)
    prompts, params, base, spec, cache_config = _requests(args)
    seqs = args.max_num_seqs or min(len(prompts), 32)
    # the config, then the fit (context, layer-skip depth, memory), then the weights
    checkpoint = open_checkpoint(args.model, dtype=args.dtype)
    check_tp_fits(args, checkpoint.config)
    longest_budget = max(sp.max_tokens for sp in params)
    checks.generate_fits(checkpoint.config, prompts[:seqs], dataclasses.replace(base, max_tokens=longest_budget), spec,
                         cache_config, chat=args.chat, kv_cache_dtype=args.kv_cache_dtype)
    model = checkpoint.load()
    if model.tokenizer is None:
        raise jspec.CheckpointError(f"{model.source}: no tokenizer (tokenizer.json) to encode a text prompt")
    config = _engine_config(args, model, prompts, params, spec, seqs)
    enable_compile_cache()
    engine = LLMEngine(model, config, spec)
    reqs = [engine.add_request(str(i), p, sp, chat=args.chat) for i, (p, sp) in enumerate(zip(prompts, params))]
    total_s, compile_s, first = _run(engine, reqs, streaming=len(reqs) == 1 and not args.json)
    _print_results(args, engine, reqs, model, spec, total_s, compile_s, first)
    return 0


def _requests(args):
    """(prompts, their SamplingParams, the command line's SamplingParams, SpecConfig, CacheConfig):
    the prompts and every option checked before anything loads."""
    import jspec
    from jspec.cli import checks

    if bool(args.prompt) == bool(args.prompts_file):
        raise jspec.PromptError("give PROMPT arguments or --prompts-file (one of them)")
    items = read_prompts_file(args.prompts_file) if args.prompts_file else [{"prompt": p} for p in args.prompt]
    prompts = [it["prompt"] for it in items]
    check_tp_option(args)  # first: jax.distributed must start before anything touches a device
    base, spec, cache_config = checks.generate_options(args, prompts)
    if args.dynamic_k:
        if not spec.enabled:
            raise jspec.ConfigError("--dynamic-k needs --spec")
        spec = dataclasses.replace(spec, dynamic_k=True)
    if args.ngram_history:
        spec = dataclasses.replace(spec, ngram_history=args.ngram_history)  # checked by SpecConfig
    if args.head_tokens is not None:
        spec = dataclasses.replace(spec, head_tokens=args.head_tokens)  # checked by SpecConfig
    if args.draft_quantization == "none":
        spec = dataclasses.replace(spec, draft_quantization=None)
    spec = checks.with_tree(spec, args.tree_nodes, args.tree_width)
    params = []
    for i, it in enumerate(items):
        over = {k: (tuple(v) if k == "stop" and isinstance(v, list) else v) for k, v in it.items() if k != "prompt"}
        sp = dataclasses.replace(base, **over)
        params.append(sp if sp.seed is not None else dataclasses.replace(sp, seed=i))
    return prompts, params, base, spec, cache_config


def _engine_config(args, model, prompts, params, spec, seqs: int):
    """The engine for these requests: ``seqs`` slots, a ``max_model_len`` that holds the longest
    prompt (as tokenized, with room for a chat template) with its budget, the options' sizes."""
    from jspec.cli import checks
    from jspec.config import EngineConfig
    from jspec.engine.layout import batched_tokens

    k = spec.drafts_per_step
    longest = max(len(model.tokenizer(p)["input_ids"]) + sp.max_tokens for p, sp in zip(prompts, params))
    context = model.config.max_position_embeddings
    max_model_len = min(context, checks.run_tokens(0, longest, 0, args.page_size, context, args.chat))
    return EngineConfig(
        max_num_seqs=seqs, max_num_batched_tokens=args.max_num_batched_tokens or batched_tokens(seqs, k),
        max_model_len=max_model_len, kv_cache_tokens=args.kv_cache_tokens,
        page_size=args.page_size, enable_prefix_caching=not args.no_prefix_caching, attention=args.attention,
        max_burst_steps=8 if len(prompts) == 1 and not args.json else 16, tensor_parallel_size=args.tp,
        kv_cache_dtype=args.kv_cache_dtype, quantized_activations=args.quantized_activations)


def _run(engine, reqs, streaming: bool):
    """Run ``reqs`` to the end: one request's text streams to stdout, several show a progress
    bar on stderr. Returns (seconds, compile seconds, {id(request): seconds to its first token}),
    compilation excluded from both timings."""
    from jspec.engine.progress import Progress
    from jspec.timing import Stopwatch

    stream = _stream_printer(engine.tokenizer) if streaming else None
    bar = Progress(engine, len(reqs)) if len(reqs) > 1 else None
    watch = Stopwatch()
    emitted = 0
    first = {}
    for outs in engine.step_until_done():
        for r in reqs:
            if r.output_ids and id(r) not in first:
                first[id(r)] = watch.elapsed()
        if stream is not None and len(reqs[0].output_ids) > emitted:
            stream(reqs[0].output_ids[emitted:])
            emitted = len(reqs[0].output_ids)
        if bar is not None:
            for o in outs:
                if o.finished:
                    bar.finished(len(o.outputs[0].token_ids))
    total_s, compile_s = watch.elapsed(), watch.compile_s()
    if bar is not None:
        bar.close()
    return total_s, compile_s, first


def _print_results(args, engine, reqs, model, spec, total_s: float, compile_s: float, first: dict) -> None:
    """The completions on stdout (text, or JSON Lines with ``--json``), the summary on stderr."""
    n = len(reqs)
    tokens = sum(len(r.output_ids) for r in reqs)
    if args.json:
        for r in reqs:
            print(json.dumps(request_json(r, model, spec, total_s if n == 1 else None, compile_s, first.get(id(r)))))
    elif n == 1:
        print()  # after the streamed text
    else:
        for i, r in enumerate(reqs):
            print(f"--- [{i}] {r.finish_reason} ---")
            print(r.text)
    s = engine.stats
    line = (f"{n} request(s), {tokens} tokens in {total_s:.2f}s: {tokens / total_s if total_s else 0:.1f} tokens/s, "
            f"mean time to first token {1e3 * _mean(list(first.values())):.0f} ms (compile {compile_s:.1f}s excluded)")
    if spec.enabled and s.steps:
        k = spec.num_speculative_tokens
        acc = [a / p if p else 0.0 for a, p in zip(_sum_pos(reqs, "num_accepted_tokens_per_pos"),
                                                   _sum_pos(reqs, "num_draft_tokens_per_pos"))]
        line += (f"; {spec.method} k={k}{' (dynamic)' if spec.dynamic_k else ''}: mean accepted length "
                 f"{s.mean_acceptance_length:.2f}, acceptance per position [{', '.join(f'{a:.2f}' for a in acc)}]")
        if spec.tree and s.num_drafts:
            line += (f"; token trees of {spec.tree_nodes} nodes (width {spec.tree_width}): "
                     f"{s.accepted_per_verification:.2f} tokens and {s.draft_tokens_per_verification:.1f} nodes "
                     "per verification")
    if s.cached_prompt_tokens:
        line += f"; prefix cache hit rate {s.prefix_cache_hit_rate:.0%}"
    print(line, file=sys.stderr)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else 0.0


def _sum_pos(reqs, field):
    rows = [getattr(r.metrics, field) for r in reqs]
    return [sum(col) for col in zip(*rows)] if rows else []


def request_json(r, model, spec, total_s=None, compile_s=None, ttft_s=None) -> dict:
    m = r.metrics
    acc = [a / p if p else 0.0 for a, p in zip(m.num_accepted_tokens_per_pos, m.num_draft_tokens_per_pos)]
    d = {
        "text": r.text, "token_ids": list(r.output_ids), "num_tokens": len(r.output_ids),
        "prompt_tokens": len(r.prompt_ids), "finish_reason": "eos" if r.finish_reason == "stop" and r.stop_reason is None
        else r.finish_reason, "stop_reason": r.stop_reason,
        "ttft_s": m.ttft if ttft_s is None else ttft_s, "time_per_output_token_s": m.time_per_output_token, "queue_s": m.time_in_queue,
        "spec": spec.method, "num_speculative_tokens": spec.num_speculative_tokens if spec.enabled else 0,
        "mean_accepted_length": m.mean_acceptance_length if spec.enabled else None,
        "acceptance_per_position": acc if spec.enabled else None, "num_target_forwards": m.num_steps,
        "num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens, "cached_prompt_tokens": m.num_cached_tokens,
        "model": str(model.source),
    }
    if total_s is not None:
        d.update(tokens_per_second=len(r.output_ids) / total_s if total_s else 0.0, total_s=total_s,
                 compile_s=compile_s)
    return d
