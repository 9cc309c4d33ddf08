"""``jspec plan``: what a ``jspec serve`` with the same options would hold on each device, and
whether it fits, from the model's config alone (no weights read, nothing allocated).

    jspec plan --model docs/configs/llama-3.1-70b.json --dtype bfloat16 --tp 4 --device-memory 80GiB
    jspec plan --model smollm2-135m --spec eagle:smollm2-135m-eagle3 --max-num-seqs 64 --json

``--model`` takes a ``config.json`` file, a Hugging Face directory, a GGUF file or a model name.
``--device-memory`` is one device's size (default: what is free on this machine now, as the
engine measures it). The numbers come from :func:`jspec.engine.plan.plan_run`, the arithmetic
the engine sizes itself with; a plan that cannot fit exits 2 with the reason.
"""

from __future__ import annotations

import dataclasses
import json
import sys


def add_plan_parser(sub, default_model: str) -> None:
    from jspec.cli.numerics_args import add_numerics_arguments
    from jspec.cli.serve import DEFAULT_MAX_MODEL_LEN

    p = sub.add_parser("plan", help="weights, KV cache and compiled programs per device, before loading anything")
    p.add_argument("--model", default=default_model,
                   help=f"config.json, Hugging Face directory, GGUF file or name (default {default_model})")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="devices (default 1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype in memory (default float32, as jspec serve)")
    p.add_argument("--device-memory", default=None, metavar="SIZE",
                   help="one device's memory, e.g. 192GiB or 80GB (default: what is free here now)")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of the memory the weights leave that the KV cache may take (default 0.9)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together (default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt + output tokens per request (default: the context, at most {DEFAULT_MAX_MODEL_LEN})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: slots x (k+1) + 256)")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="a fixed KV page pool in tokens")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--spec", default="none", help="none | ngram | layerskip:L | draft:PATH | eagle:PATH | hybrid:PATH")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=None, help="drafts per verification (default 4)")
    p.add_argument("--dynamic-k", action="store_true", help="the engine picks k per burst (more programs)")
    p.add_argument("--tree-nodes", type=int, default=0, metavar="N",
                   help="--spec eagle, hybrid, draft or ngram: token trees of N nodes")
    p.add_argument("--tree-width", type=int, default=None, metavar="W", help="with --tree-nodes (default 4)")
    add_numerics_arguments(p)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)


def _options(args):
    """Every option checked before the config is read: (SpecConfig, EngineConfig fields, bytes)."""
    from jspec.cli.checks import parse_spec, with_tree
    from jspec.errors import ConfigError
    from jspec.loading.memory import parse_bytes

    k = args.num_speculative_tokens
    if k is not None and args.spec == "none":
        raise ConfigError("--num-speculative-tokens needs --spec")
    spec = with_tree(parse_spec(args.spec, 4 if k is None else k), args.tree_nodes, args.tree_width)
    if args.dynamic_k:
        if not spec.enabled:
            raise ConfigError("--dynamic-k needs --spec")
        spec = dataclasses.replace(spec, dynamic_k=True)
    if args.tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {args.tp}")
    for name in ("max_num_seqs", "max_model_len", "kv_cache_tokens", "max_num_batched_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    device_memory = None
    if args.device_memory is not None:
        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as e:
            raise ConfigError(f"--device-memory: {e}") from None
    return spec, device_memory


def cmd_plan(args) -> int:
    from jspec.cli.serve import DEFAULT_MAX_MODEL_LEN
    from jspec.config import EngineConfig
    from jspec.engine.layout import batched_tokens
    from jspec.engine.plan import plan_run
    from jspec.errors import ConfigError
    from jspec.loading import read_config
    from jspec.loading.drafts import drafter_geometry
    from jspec.loading.memory import available_bytes

    spec, device_memory = _options(args)
    model = read_config(args.model, args.dtype)
    context = model.max_position_embeddings
    max_model_len = args.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > context:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens")
    k = spec.drafts_per_step
    draft, drafter_params = drafter_geometry(spec.method, spec.draft, model, args.dtype) if spec.enabled else (None, 0)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens or batched_tokens(args.max_num_seqs, k),
                          kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size,
                          memory_utilization=args.memory_utilization, tensor_parallel_size=args.tp,
                          kv_cache_dtype=args.kv_cache_dtype)
    if device_memory is None:
        import jax

        device = jax.local_devices()[0]
        device_memory = available_bytes(None if device.platform == "cpu" else device)
    plan = plan_run(model, config, k_max=k, dynamic_k=spec.dynamic_k, draft=draft, drafter_params=drafter_params,
                    device_memory=device_memory, tree_depth=spec.tree_depth)
    if args.json:
        print(json.dumps(dict(plan.to_dict(), model_source=args.model,
                              spec=dataclasses.asdict(spec) if spec.enabled else None)))
    else:
        print(f"plan of `jspec serve --model {args.model}` with these options:", file=sys.stderr)
        print(plan.describe())
    return 0
