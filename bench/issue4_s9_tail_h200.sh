#!/usr/bin/env bash
# Issue 4, next session (NOT RUN YET: written after session 8's device budget was spent). A/B of the pipelined loop
# queuing the next step's KV metadata once the previous step has passed its last attention ("tail",
# MLCC_STEP_TAIL=1, runtime.model) against waiting for its end ("base"), and the synchronous loop ("sync"), on one
# library per shape. Every variant is checked first, including its pipelined greedy ids against the synchronous
# loop's (a metadata race shows there: session 8's first pipelined loop gave 4-37/101 equal ids on the 8B shape).
# Run the GPU tests of the loop first: bash bench/gpu_tests_h200.sh -k pipelined  (carry .gpu .whl-test).
# Prepare here:
#   (cd bench && python ab_decode.py build --out ../.dev/ab16 --variants base \
#      --model llama3-8b-q4f16_1,llama3-8b-q0f16,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1)
#   cp .dev/ref11/reference.npz .dev/ab16/
# Device: run(command="bash bench/issue4_s9_tail_h200.sh", carry=[".gpu-rt", ".dev/ab16"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab16 --out "$OUT" --variants base,tail,sync --rounds ${ROUNDS:-6})
