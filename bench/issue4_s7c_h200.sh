#!/usr/bin/env bash
# Issue 4, session 7, third A/B: the default build (RMSNorm prologue pass over x, then a barrier) against
# the float16 GEMV scaling its rows by 1/rms(x) at the end (8B and SmolLM2 q0f16; base from .dev/bench7).
# Device: run(command="bash bench/issue4_s7c_h200.sh", carry=[".gpu-rt", ".dev/ab13"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab13 --out "$OUT" --variants base ${EXTRA:-} --rounds ${ROUNDS:-6})
