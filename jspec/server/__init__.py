"""``jspec serve``: an OpenAI-compatible HTTP front door over the serving engine.

    POST /v1/completions        prompt (text, token ids, or a batch), stream or not
    POST /v1/chat/completions   messages through the model's chat template, stream or not
    GET  /v1/models             the one served model
    GET  /health                200 while serving; 503 while draining
    GET  /metrics               Prometheus text: vLLM's spec-decode counters, jspec: request,
                                token, latency and KV-page metrics

Pieces, each in its own module: :mod:`~jspec.server.protocol` (the OpenAI schemas, responses
and error objects), :mod:`~jspec.server.worker` (the thread that owns the engine),
:mod:`~jspec.server.metrics`, :mod:`~jspec.server.app` (the FastAPI app),
:mod:`~jspec.server.limits` (what one client may hold: queue bound, timeouts),
:mod:`~jspec.server.startup` (SIGTERM while starting) and :mod:`~jspec.server.serve` (uvicorn
with header timeouts and a bounded, draining SIGTERM). ``jspec serve`` in
:mod:`jspec.cli.serve` wires them to a loaded model. FastAPI, uvicorn and prometheus_client
are dependencies of jspec; importing this package alone imports none of them.

In a program::

    from jspec.server.app import create_app
    from jspec.server.worker import EngineWorker
    app = create_app(EngineWorker(engine), "smollm2-135m")   # any ASGI server runs it
    # create_app(..., limits=Limits(max_waiting_requests=64, body_timeout=10.0))
"""
