#!/usr/bin/env bash
# Issue 4, session 10, call 3: the model with MLCC_Q4_KERNEL=auto (tensor-core q4 GEMV for the short projections,
# now the default) against a build with the CUDA-core kernel everywhere (ab_decode's "cuda-core"), interleaved,
# four shapes; every variant checked first (argmax, decode_graph vs decode, pipelined vs synchronous ids, logits vs
# the CPU build for the small shapes). Prepare here:
#   M=llama3-8b-q4f16_1,llama3-8b-q0f16,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1
#   (cd bench && python ab_decode.py build --out ../.dev/ab18 --variants base,cuda-core --model $M)
#   cp .dev/ref11/reference.npz .dev/ab18/
# Device: run(command="bash bench/issue4_s10b_h200.sh", carry=[".gpu-rt", ".dev/ab18"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab18 --out "$OUT" --variants base,cuda-core --rounds ${ROUNDS:-6})
