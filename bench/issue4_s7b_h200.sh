#!/usr/bin/env bash
# Issue 4, session 7, second A/B: base (8af160b) against the default build after the float16 launch rule and the
# RMSNorm prologue fusion; builds as in issue4_s7_h200.sh into .dev/ab12/{base,new}.
# Device: run(command="bash bench/issue4_s7b_h200.sh", carry=[".gpu-rt", ".dev/ab12"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab12 --out "$OUT" --variants base ${EXTRA:-} --rounds ${ROUNDS:-6})
