"""The command line the device benchmarks share: `build` here (libraries into --out), `run` on the device."""

from __future__ import annotations

import argparse
from typing import Callable


def build_and_run(cmd_build: Callable, cmd_run: Callable, run_input: str = "--libs",
                  configure: Callable[[argparse.ArgumentParser, argparse.ArgumentParser], None] | None = None) -> None:
    """`build --out DIR` and `run RUN_INPUT DIR --out DIR`; `configure(build_parser, run_parser)` adds the rest."""
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument(run_input, required=True)
    r.add_argument("--out", required=True)
    if configure is not None:
        configure(b, r)
    a = p.parse_args()
    {"build": cmd_build, "run": cmd_run}[a.cmd](a)
