"""The `mlcc` command: compile, chat, targets."""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger("mlcc")

MODEL_HELP = ("Hugging Face model folder, .gguf file, or Hugging Face repo name (org/name, or org/name-GGUF:QUANT "
              "for one GGUF quantization), downloaded into the Hugging Face cache")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input: printed as one line, never as a traceback."""
    from mlcc.errors import MlccError

    return (MlccError, FileNotFoundError)


def cmd_compile(args: argparse.Namespace) -> int:
    from mlcc import hub
    from mlcc.compiler.build import compile_model
    from mlcc.options import CompileOptions
    from mlcc.targets import get_target

    preset = get_target(args.target)
    if preset.lib_ext != ".wasm" and not preset.can_run_here():
        log.warning("no %s device here: %s will run on another machine, not this one", preset.device, args.output)

    r = compile_model(hub.resolve(args.model), args.target, args.quant, args.output, context_window=args.context_window,
                      tuning_db=args.tuning_db, tensor_parallel=args.tensor_parallel,
                      options=CompileOptions.parse(args.option))
    print(f"wrote {r.output}  (library {r.library_bytes / 1e6:.1f} MB, weights {r.weight_bytes / 1e6:.1f} MB; "
          f"compile {r.seconds_compile:.1f}s, weights {r.seconds_weights:.1f}s)")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from mlcc import hub
    from mlcc.compiler.tune import default_tuning_db, format_report, tune_model
    from mlcc.options import CompileOptions

    db = args.db or default_tuning_db()
    reports = tune_model(hub.resolve(args.model), args.target, args.quant, args.trials, db, args.max_tasks,
                         options=CompileOptions.parse(args.option))
    print(format_report(reports))
    print(f"tuning database: {db} (use with `mlcc compile ... --tuning-db {db}`)")
    return 0


def cmd_targets(args: argparse.Namespace) -> int:
    from mlcc.targets import TARGETS

    print(f"{'target':14s} {'device':7s} {'here':12s} description")
    import shutil

    for name, p in TARGETS.items():
        if p.lib_ext == ".wasm":  # run by mlcc's JS engine: a browser, or node + Dawn
            here = "runs (node)" if shutil.which("node") else "browser"
        else:
            here = "runs" if p.can_run_here() else "compile-only"
        print(f"{name:14s} {p.device:7s} {here:12s} {p.description}")
        if p.notes:
            print(f"{'':35s}{p.notes}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from mlcc.options import EngineConfig
    from mlcc.runtime.serve.chat_cli import run_chat

    sampling = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k", "repetition_penalty")}
    return run_chat(args.model, EngineConfig.from_cli(args), prompt=args.prompt, max_tokens=args.max_tokens,
                    sampling=sampling)


def cmd_perplexity(args: argparse.Namespace) -> int:
    from mlcc.options import CompileOptions
    from mlcc.runtime.serve.perplexity import run_perplexity

    r = run_perplexity(args.model, args.text, target=args.target, quant=args.quant, context=args.context,
                       chunks=args.chunks, num_threads=args.num_threads,
                       options=CompileOptions.parse(args.option) if args.option else None)
    print(f"ppl {r.ppl:.4f} +/- {r.ppl_error:.4f}  ({r.scored_tokens} tokens scored in {r.chunks} chunks of "
          f"{r.context}; {r.tokens_per_second:.1f} tok/s)")
    return 0


def cmd_web(args: argparse.Namespace) -> int:
    from mlcc.web.site import build_site

    out = build_site(args.models, args.output, title=args.title)
    print(f"wrote {out}\n  browser: python -m http.server 8000 --bind 127.0.0.1 -d {out}  → http://127.0.0.1:8000/\n"
          f"  Node.js: cd {out} && npm install webgpu@0.6.2 && node node_chat.mjs models/<build> --prompt 'Hi'")
    return 0


def request_schema_js() -> str:
    """web/js/request_schema.js as runtime/api/protocol.py defines the request today. Rendered here, not in mlcc.web:
    the web layer may not import the runtime."""
    from mlcc.runtime.api import protocol
    from mlcc.web.request_schema import render_js

    return render_js(protocol.ChatCompletionRequest.model_json_schema(), dict(protocol._UNSUPPORTED),
                     protocol.MAX_DEPTH)


def cmd_export_request_schema(args: argparse.Namespace) -> int:
    from mlcc.web.request_schema import JS_FILE

    js = request_schema_js()
    if args.check:
        if JS_FILE.read_text() != js:
            print(f"{JS_FILE} is stale: run `mlcc export-request-schema`", file=sys.stderr)
            return 1
        print(f"{JS_FILE} is current")
        return 0
    JS_FILE.write_text(js)
    print(f"wrote {JS_FILE}")
    return 0


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it in words or there is none to show
    (None, an off switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0 or \
                action.default in (None, False, [], argparse.SUPPRESS):   # nargs 0: a switch, whose default is its off
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    from mlcc import __version__
    from mlcc.options import CompileOptions, EngineConfig

    p = argparse.ArgumentParser(prog="mlcc", description="Compile and run LLMs with Apache TVM",
                                formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"mlcc {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile",
                       help="compile an HF folder, .gguf file or Hugging Face repo into an artifacts folder")
    c.add_argument("model", help=MODEL_HELP)
    c.add_argument("--target", default="llvm", help="target preset (see `mlcc targets`)")
    c.add_argument("--quant", default="q4f16_1",
                   help="weight scheme: q0f32/q0f16 (float), q4f16_1/q4f32_1 (4-bit, groups of 32), q8f16_1/"
                        "q8f32_1 (int8 weight-only, groups of 32), q4f16_awq/q4f16_g128 (an AWQ/GPTQ "
                        "checkpoint's 4-bit codes kept), e4m3_e4m3_f16 (FP8)")
    c.add_argument("--output", "-o", required=True, help="artifacts folder to write")
    c.add_argument("--context-window", type=int, default=None, help="override the model's context window")
    c.add_argument("--tuning-db", default=None, help="apply tuned kernels from this database (see `mlcc tune`)")
    c.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard attention heads and MLP columns over N GPUs (TVM disco + NCCL)")
    CompileOptions.add_cli_argument(c)
    c.set_defaults(func=cmd_compile)

    tu = sub.add_parser("tune", help="tune the model's static-shape kernels (meta-schedule + xgboost) into a DB")
    tu.add_argument("model", help=MODEL_HELP)
    tu.add_argument("--target", default="llvm", help="target preset whose kernels are tuned (see `mlcc targets`)")
    tu.add_argument("--quant", default="q4f32_1", help="quantization of the model whose kernels are tuned")
    tu.add_argument("--trials", type=int, default=64, help="trials per kernel")
    tu.add_argument("--max-tasks", type=int, default=None, metavar="N",
                    help="tune only the N largest kernels (default: all)")
    tu.add_argument("--db", default=None, help="tuning database folder (default: ~/.cache/mlcc/tuning-db)")
    CompileOptions.add_cli_argument(tu)
    tu.set_defaults(func=cmd_tune)

    t = sub.add_parser("targets", help="list target presets")
    t.set_defaults(func=cmd_targets)

    ch = sub.add_parser("chat", help="chat in the terminal (default model: the bundled SmolLM2-135M-Instruct)")
    EngineConfig.add_cli_arguments(ch, max_batch=1)
    ch.add_argument("--prompt", default=None, help="answer one prompt and exit")
    ch.add_argument("--max-tokens", type=int, default=256, help="most tokens an answer may have (default: %(default)s)")
    ch.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature, 0 for greedy (default: the model's generation_config, else 0.8 with "
                         "top-p 0.9, top-k 40 and repetition penalty 1.1; any sampling flag given replaces them all)")
    ch.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: as --temperature says)")
    ch.add_argument("--top-k", type=int, default=None, help="top-k sampling (default: as --temperature says)")
    ch.add_argument("--repetition-penalty", type=float, default=None,
                    help="HF's repetition penalty (default: as --temperature says)")
    ch.set_defaults(func=cmd_chat)

    pp = sub.add_parser("perplexity", help="a model's perplexity on a text file, measured as llama.cpp's "
                                           "llama-perplexity does (chunks of --context tokens, second halves scored)")
    pp.add_argument("model", nargs="?", default=None,
                    help="what `mlcc chat` takes: artifacts folder, HF folder, .gguf, or Hugging Face repo name "
                         "(default: the bundled SmolLM2-135M-Instruct)")
    pp.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score (at least two chunks' worth)")
    pp.add_argument("--quant", default=None, help="quantization when compiling on first use (default: q4f32_1 on "
                                                  "CPUs, q4f16_1 on GPUs)")
    pp.add_argument("--target", default="auto", help="target preset (default: %(default)s, this machine)")
    pp.add_argument("--context", type=int, default=512, metavar="N",
                    help="tokens per chunk; the first half of each is context only (default: %(default)s)")
    pp.add_argument("--chunks", type=int, default=None, metavar="K",
                    help="score at most the first K chunks (default: as many as the text has)")
    pp.add_argument("--threads", dest="num_threads", type=int, default=None, metavar="N",
                    help="CPU threads (default: the physical cores this process may use)")
    CompileOptions.add_cli_argument(pp, "; what a model compiled on first use is built with: an artifacts folder "
                                        "must have been built with it")
    pp.set_defaults(func=cmd_perplexity)

    w = sub.add_parser("web", help="write a static chat site (browser + Node.js) for WebGPU builds")
    w.add_argument("models", nargs="+", help="artifacts folders compiled with --target webgpu (q4f16_1 and/or "
                                            "q4f32_1: the page falls back to f32 when the GPU lacks shader-f16)")
    w.add_argument("--output", "-o", required=True, help="site folder to write")
    w.add_argument("--title", default="mlcc chat", help="the page's title")
    w.set_defaults(func=cmd_web)

    rs = sub.add_parser("export-request-schema",
                        help="regenerate web/js/request_schema.js (the web engine's request checks) from the "
                             "runtime's request protocol; run after changing runtime/api/protocol.py")
    rs.add_argument("--check", action="store_true", help="write nothing; exit 1 if the committed file is stale")
    rs.set_defaults(func=cmd_export_request_schema)

    from mlcc.runtime.serve.loadgen import add_bench_parser
    from mlcc.runtime.serve.server_cli import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    _format_all(p)
    return p


def _format_all(parser: argparse.ArgumentParser) -> None:
    """Subcommands do not inherit the formatter: give every one of them, nested ones too, the top level's."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                sub.formatter_class = parser.formatter_class
                _format_all(sub)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.verbose:   # huggingface_hub's client logs every request at INFO; its progress bars say enough
        logging.getLogger("httpx2").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except _user_errors() as e:
        print(f"mlcc: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
