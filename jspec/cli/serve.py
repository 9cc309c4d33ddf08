"""``jspec serve``: the OpenAI-compatible HTTP server (:mod:`jspec.server`) on one model.

    jspec serve [--model NAME_OR_PATH] [--host 127.0.0.1] [--port 8000]
                [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}']
                [--max-num-seqs 8] [--max-model-len N] [--kv-cache-tokens N] [--api-key KEY] ...

Checks run before anything slow, in the order of ``jspec generate``: the options (JSON,
ranges, the speculative config, the API key), then the address (the socket is bound before the
model loads, so a busy port is one line on stderr and exit 2), then the model's config against
``--max-model-len``, then the weights load, the engine compiles every step variant (unless
``--no-warmup``), and only then does the socket listen: while loading, connections are refused
(not left hanging), and once one is accepted the server answers; ``/health`` returning 200 means
ready. SIGTERM at any moment of start-up exits 0; while serving it drains, for at most
``--drain-timeout`` seconds, and exits 0 (:mod:`jspec.server.serve`); Ctrl-C exits 130.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys

from jspec.cli.numerics_args import add_numerics_arguments
from jspec.cli.parallel_args import add_parallel_arguments, check_tp_fits, check_tp_option
from jspec.server.limits import Limits

DEFAULT_MAX_MODEL_LEN = 2048  # when --max-model-len is not given (capped by the model's context)


def add_serve_parser(sub, default_model: str, attention_choices) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, metrics)")
    s.add_argument("--model", default=default_model, help=f"name or path (default {default_model})")
    s.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: --model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port, printed)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative_config, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"dynamic_k": true}\' (default: no speculation)')
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help=f"prompt + output tokens per request (default: the model's context, at most "
                        f"{DEFAULT_MAX_MODEL_LEN})")
    s.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV page pool in tokens (default: every slot at --max-model-len, or as many pages as fit "
                        "in --memory-utilization of the free memory)")
    s.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of the free memory the default KV page pool may take (default 0.9)")
    add_numerics_arguments(s)
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step: decode rows plus a prefill chunk (default: slots x (k+1) + 256)")
    s.add_argument("--max-burst-steps", type=int, default=8,
                   help="engine steps per device call; fewer = new requests join sooner (default 8)")
    s.add_argument("--api-key", default=os.environ.get("JSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /metrics and /openapi.json (default: "
                        "$JSPEC_API_KEY, else none)")
    s.add_argument("--public-metrics", action="store_true", help="leave /metrics open when --api-key is set")
    s.add_argument("--max-waiting-requests", type=int, default=Limits().max_waiting_requests,
                   help=f"requests queued for a slot before new ones get 429 with Retry-After (default "
                        f"{Limits().max_waiting_requests}; 0 = no bound)")
    s.add_argument("--drain-timeout", type=float, default=Limits().drain_timeout,
                   help=f"SIGTERM: seconds requests in flight get to finish before they are aborted and the "
                        f"server exits (default {Limits().drain_timeout:g})")
    s.add_argument("--body-timeout", type=float, default=Limits().body_timeout,
                   help=f"seconds for a request body to arrive, else 408 (default {Limits().body_timeout:g})")
    s.add_argument("--header-timeout", type=float, default=Limits().header_timeout,
                   help=f"seconds for a request's headers to arrive, else the connection is closed (default "
                        f"{Limits().header_timeout:g})")
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--attention", default="auto", choices=[a for a in attention_choices if a != "interpret"])
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--page-size", type=int, default=16)
    s.add_argument("--seed", type=int, default=0, help="seeds of requests that bring none derive from it")
    s.add_argument("--no-warmup", action="store_true", help="compile step variants on first use instead of at start")
    s.add_argument("--recalibrate", action="store_true",
                   help="dynamic k: time the step variants again instead of reusing the timings saved by an earlier "
                        "start of the same engine on this machine")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level; 'info' and 'debug' log each request (default info)")
    add_parallel_arguments(s, multi_host=False)
    s.set_defaults(func=cmd_serve)


def parse_speculative_config(text):
    """``--speculative-config`` JSON -> SpecConfig (none when not given)."""
    from jspec.config import SpecConfig
    from jspec.errors import ConfigError

    if text is None:
        return SpecConfig()
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--speculative-config is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--speculative-config must be a JSON object, got {text!r}")
    return SpecConfig.from_dict(d)


def serve_options(args):
    """Every check that needs no model: returns (SpecConfig, EngineConfig without the lengths)."""
    from jspec.cli import checks
    from jspec.config import CHECKPOINT_METHODS, EngineConfig
    from jspec.errors import ConfigError

    spec = parse_speculative_config(args.speculative_config)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    checks.text_argument(args.host, "--host")
    if not args.host:
        raise ConfigError("--host is empty")
    if args.api_key is not None:
        checks.text_argument(args.api_key, "--api-key")
        if not args.api_key.strip() or any(c.isspace() for c in args.api_key):
            raise ConfigError("--api-key must be a non-empty string without spaces")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty")
    if args.max_waiting_requests < 0:
        raise ConfigError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    for name in ("drain_timeout", "body_timeout", "header_timeout"):
        v = getattr(args, name)
        if not (v > 0 and v < 1e6):  # NaN too
            raise ConfigError(f"--{name.replace('_', '-')} must be a number of seconds in (0, 1e6), got {v}")
    for name in ("max_model_len", "kv_cache_tokens", "max_num_batched_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if os.environ.get("JSPEC_COORDINATOR_ADDRESS") or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        # only one process would receive the HTTP requests that every process must run
        raise ConfigError("jspec serve runs on one host (--tp over its devices); multi-host is for jspec generate "
                          "and the library (unset JSPEC_/JAX_COORDINATOR_ADDRESS)")
    check_tp_option(args)
    from jspec.engine.layout import batched_tokens  # after check_tp_option: it imports jax

    k = spec.drafts_per_step
    config = EngineConfig(max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens or batched_tokens(args.max_num_seqs, k),
                          page_size=args.page_size, enable_prefix_caching=not args.no_prefix_caching,
                          memory_utilization=args.memory_utilization,
                          max_burst_steps=args.max_burst_steps, attention=args.attention, seed=args.seed,
                          tensor_parallel_size=args.tp, kv_cache_dtype=args.kv_cache_dtype,
                          quantized_activations=args.quantized_activations)
    checks._check_attention(args.attention)
    if spec.method in CHECKPOINT_METHODS:
        checks._check_draft_exists(spec)
    return spec, config


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening (it listens once the server is ready:
    until then connections are refused); OSError (a busy port, an unknown host) is bad input."""
    from jspec.errors import ConfigError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.set_inheritable(True)
    return sock


def listen(sock: socket.socket) -> None:
    from jspec.errors import ConfigError

    try:
        sock.listen(2048)
    except OSError as e:  # the port was taken while the model loaded
        host, port = sock.getsockname()[:2]
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def _return_freed_memory() -> None:
    """Serve large allocations from mmap and give them back when freed: glibc otherwise raises
    its mmap threshold after the first large free, and a refused multi-megabyte body would then
    stay in the heap for good. A no-op where glibc's mallopt is absent."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD: 1 MiB, fixed
    except (OSError, AttributeError):
        pass


def cmd_serve(args) -> int:
    from jspec.server import startup as startup_signals

    # a SIGTERM from here (or from main(), which installs it before building the parser) until
    # the server runs exits 0
    startup = startup_signals.active()
    own = startup is None
    if own:
        startup = startup_signals.StartupSignals.install()
    try:
        return _checked_serve(args, startup)
    finally:
        if own and startup is not None:
            startup.close()


def _checked_serve(args, startup) -> int:
    from jspec.errors import ConfigError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"jspec serve needs FastAPI, uvicorn and prometheus_client ({e.name} is missing): "
                          "pip install fastapi uvicorn prometheus_client") from None
    spec, config = serve_options(args)
    sock = bind(args.host, args.port)
    try:
        return _serve(args, spec, config, sock, startup)
    finally:
        sock.close()


def _serve(args, spec, config, sock, startup) -> int:
    from jspec.cli import enable_compile_cache
    from jspec.engine.engine import LLMEngine
    from jspec.errors import CheckpointError, ConfigError
    from jspec.loading import open_checkpoint
    from jspec.server import serve as server
    from jspec.server.app import create_app
    from jspec.server.worker import EngineWorker

    check = startup.check if startup is not None else (lambda: None)
    checkpoint = open_checkpoint(args.model, dtype=args.dtype)
    check_tp_fits(args, checkpoint.config)
    context = checkpoint.config.max_position_embeddings
    max_model_len = args.max_model_len or min(context, DEFAULT_MAX_MODEL_LEN)
    if max_model_len > context:
        raise ConfigError(f"--max-model-len {max_model_len} exceeds the model's context of {context} tokens")
    config = dataclasses.replace(config, max_model_len=max_model_len, kv_cache_tokens=args.kv_cache_tokens)
    enable_compile_cache()
    _return_freed_memory()
    model = checkpoint.load()
    check()
    if model.tokenizer is None:
        raise CheckpointError(f"{model.source}: no tokenizer (tokenizer.json): the server takes text")
    engine = LLMEngine(model, config, spec)
    check()
    name = args.served_model_name or args.model
    if not args.no_warmup:
        print(f"jspec serve: compiling the engine's step variants ({len(engine.prefill_shapes)} prefill "
              f"shape(s), decode at slot buckets {', '.join(map(str, engine.buckets))})...", file=sys.stderr,
              flush=True)
        engine.warmup(reuse_calibration=not args.recalibrate)
        check()
    limits = Limits(max_waiting_requests=args.max_waiting_requests or None, body_timeout=args.body_timeout,
                    header_timeout=args.header_timeout, drain_timeout=args.drain_timeout,
                    public_metrics=args.public_metrics)
    app = create_app(EngineWorker(engine), name, api_key=args.api_key, limits=limits)
    host, port = sock.getsockname()[:2]
    what = (f"{spec.method} k={spec.num_speculative_tokens}{' (dynamic)' if spec.dynamic_k else ''}"
            if spec.enabled else "no speculation")
    print(f"jspec serve: {name} ({what}, {config.max_num_seqs} slots, max_model_len {max_model_len}) on "
          f"http://{host}:{port}/v1", file=sys.stderr, flush=True)
    listen(sock)
    return server.run(app, sock, log_level=args.log_level, startup=startup)
