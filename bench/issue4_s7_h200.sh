#!/usr/bin/env bash
# Issue 4, session 7, one device call: (1) interleaved A/B of decode between the session-6 kernels ("base", built
# from commit 8af160b) and this session's ("new": float16 decode GEMV with PDL preloading for q0f16, gate_up +
# SwiGLU in one kernel for both quantizations), every build checked first (argmax vs numpy, decode_graph vs decode,
# the small shapes' logits vs the CPU build, SmolLM2 q0f16 included); (2) the float16 GEMV launch sweep with the
# weights rotated past L2, dlight's kernel beside it. Prepare here:
#   bash bench/prepare_device.sh
#   git worktree add /tmp/wt_head 8af160b && mkdir -p /tmp/mlccbase && ln -sfn /tmp/wt_head /tmp/mlccbase/mlcc
#   M=llama3-8b-q4f16_1,llama3-8b-q0f16,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1,smollm2-135m-q0f16
#   (cd bench && PYTHONPATH=/tmp/mlccbase python ab_decode.py build --out ../.dev/ab11 --variants base --model $M \
#      && python ab_decode.py build --out ../.dev/ab11n --variants base --model $M \
#      && python decode.py reference --out ../.dev/ref11)
#   mv .dev/ab11n/base .dev/ab11/new && cp .dev/ref11/reference.npz .dev/ab11/
#   (cd bench && python gemv_sweep.py build --out ../.dev/sweep_f16 --weights float16)
# Device: run(command="bash bench/issue4_s7_h200.sh", carry=[".gpu-rt", ".dev/ab11", ".dev/sweep_f16"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab11 --out "$OUT" --variants base ${EXTRA:-} --rounds ${ROUNDS:-6})
(cd bench && python3 gemv_sweep.py run --libs ../.dev/sweep_f16 --out "$OUT")
