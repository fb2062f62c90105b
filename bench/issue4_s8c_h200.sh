#!/usr/bin/env bash
# Issue 4, session 8, A/B: RMSNorm folded into the q4f16_1 projections with x normalized once per block in shared
# memory (commit fccf695's kernel on the current code) against the default build (the norm as its own kernel);
# pipelined loop for both. Each build is checked first (argmax, decode_graph vs decode, the small shapes' logits vs
# the CPU build). Prepare here (new = the working tree with the fold, base = a worktree of the commit before it):
#   M=llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1; cd bench
#   python ab_decode.py build --out ../.dev/ab15n --variants base --model $M
#   PYTHONPATH=/tmp/mlcchead python ab_decode.py build --out ../.dev/ab15 --variants base --model $M
#   mv ../.dev/ab15n/base ../.dev/ab15/new && cp ../.dev/ref11/reference.npz ../.dev/ab15/
# Device: run(command="bash bench/issue4_s8c_h200.sh", carry=[".gpu-rt", ".dev/ab15"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab15 --out "$OUT" --variants base --rounds ${ROUNDS:-6})
