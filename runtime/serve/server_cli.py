"""`mlcc serve`: run the OpenAI-compatible server on a model."""

from __future__ import annotations

import argparse


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("model", nargs="?", default=None, help="artifacts folder, HF folder or .gguf (default: bundled)")
    s.add_argument("--target", default="auto")
    s.add_argument("--quant", default=None)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    s.add_argument("--max-batch", type=int, default=8)
    s.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads (default: the physical cores this process may use)")
    s.add_argument("--kv-cache-tokens", type=int, default=None, help="KV cache size (default: from memory)")
    s.add_argument("--prefill-chunk", type=int, default=512)
    s.add_argument("--policy", choices=["no_evict", "max_util"], default="no_evict",
                   help="no_evict: admit only what can finish; max_util: admit eagerly, preempt and recompute")
    s.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep finished requests' KV pages for reuse by later prompts (runtime.core.prefix_cache)")
    s.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 5, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft", "model": PATH, '
                        '"num_speculative_tokens": 4}\' (runtime.spec.speculative)')
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="GPUs the model is sharded over (must match how it was compiled; default: as compiled)")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="compile option, repeatable (mlcc.options.CompileOptions): what a model compiled on first "
                        "use is built with; an artifacts folder must have been built with it")
    s.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from mlcc.options import CompileOptions
    from mlcc.runtime.engine import Engine
    from mlcc.runtime.serve.server import create_app

    engine = Engine(args.model, target=args.target, quant=args.quant, max_batch=args.max_batch,
                    kv_cache_tokens=args.kv_cache_tokens, prefill_chunk=args.prefill_chunk, policy=args.policy,
                    tensor_parallel=args.tensor_parallel, num_threads=args.threads, prefix_cache=args.prefix_cache,
                    options=CompileOptions.parse(args.option) if args.option else None,
                    speculative_config=args.speculative_config)
    app = create_app(engine, api_key=args.api_key, served_name=args.served_model_name)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.shutdown()
    return 0
