#!/usr/bin/env bash
# Issue 4, session 9, call 3: q4 GEMVs with x quantized to int8 per 32 values (DP4A; MLCC_Q4_INT8_X=1) against the
# default build (one-shift unpacking, step-tail pipelined loop), three q4 shapes, interleaved rounds in one process.
# Every variant is checked before it is timed; the small shapes' logits against the CPU build (ref11).
# Prepare here:
#   mkdir -p .dev/ab17/base && for m in llama3-8b-q4f16_1 qwen2.5-0.5b-q4f16_1 smollm2-135m-q4f16_1; do
#     cp -r .dev/ab16/one-shift/$m .dev/ab17/base/; done      # = today's default build
#   (cd bench && python ab_decode.py build --out ../.dev/ab17 --variants int8-x \
#     --model llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1)
#   cp .dev/ref11/reference.npz .dev/ab17/
# Device: run(command="bash bench/issue4_s9b_h200.sh", carry=[".gpu-rt", ".dev/ab17"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab17 --out "$OUT" --variants base,int8-x --rounds ${ROUNDS:-6})
