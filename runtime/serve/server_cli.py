"""`mlcc serve`: run the OpenAI-compatible server on a model."""

from __future__ import annotations

import argparse
import dataclasses

from mlcc.options import EngineConfig
from mlcc.runtime.serve.rayserve.launch import add_ray_arguments


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    EngineConfig.add_cli_arguments(s, max_batch=8)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    s.add_argument("--served-model-name", default=None, help="the model name clients see (default: the model's)")
    s.add_argument("--allow-runtime-lora", action="store_true",
                   help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies); a model "
                        "compiled on first use is then built with LoRA")
    s.add_argument("--shutdown-grace-seconds", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, refuse new requests (503) and give running ones S seconds to finish before "
                        "aborting them (a second signal exits at once) (default: %(default)s)")
    s.add_argument("--weights", choices=("files", "random"), default="files",
                   help="random: fill the parameters with seeded random values, for serving benchmarks of a "
                        "shape-only build (one with no weight files); the answers are noise (default: %(default)s)")
    add_ray_arguments(s)
    s.set_defaults(func=run_serve)


def check_port_free(host: str, port: int) -> None:
    """Refuses, in one line, a port another process already listens on."""
    import socket

    from mlcc.errors import EngineConfigError

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise EngineConfigError(f"cannot listen on {host}:{port} ({e.strerror}): another server holds it; "
                                    "choose another --port or stop that server") from None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mlcc.runtime.engine import Engine
    from mlcc.runtime.serve.lifecycle import DrainingServer
    from mlcc.runtime.serve.server import create_app

    check_port_free(args.host, args.port)   # before minutes of loading, not after
    config = dataclasses.replace(EngineConfig.from_cli(args), weights=args.weights)
    if args.allow_runtime_lora and config.lora is None:
        config = dataclasses.replace(config, lora={})   # LoRA served, the adapters loaded later
    if args.ray:
        from mlcc.errors import EngineConfigError
        from mlcc.runtime.serve.rayserve.launch import run_ray_serve

        if args.allow_runtime_lora:   # an adapter loaded through one replica would be missing on the others
            raise EngineConfigError("--allow-runtime-lora is not served with --ray; give the adapters with --lora")
        return run_ray_serve(args, config)
    engine = Engine(args.model, config=config)
    app = create_app(engine, api_key=args.api_key, served_name=args.served_model_name,
                     allow_runtime_lora=args.allow_runtime_lora, shutdown_grace_seconds=args.shutdown_grace_seconds)
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"),
                            app.state.lifecycle)
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
