#!/usr/bin/env bash
# Issue 4, session 7, third A/B: the default build (RMSNorm prologue pass over x, then a barrier) against
# the float16 GEMV scaling its rows by 1/rms(x) at the end (8B and SmolLM2 q0f16; base from .dev/bench7).
# NOT RUN YET: session 7's attempt failed to load (the helper-group bug fixed in 9182ae4) and the device budget ran
# out. Prepare here (the deferred scale lives in commit 9182ae4, reverted in 7e8d903):
#   git worktree add /tmp/wt_defer 9182ae4 && mkdir -p /tmp/mlccdefer && ln -sfn /tmp/wt_defer /tmp/mlccdefer/mlcc
#   M=llama3-8b-q0f16,smollm2-135m-q0f16
#   (cd bench && python ab_decode.py build --out ../.dev/ab13 --variants base --model $M \
#      && PYTHONPATH=/tmp/mlccdefer python ab_decode.py build --out ../.dev/ab13d --variants base --model $M)
#   mv .dev/ab13d/base .dev/ab13/new && cp .dev/ref11/reference.npz .dev/ab13/   (decode.py reference --out .dev/ref11)
# The same recipe, from commit fccf695 (reverted in ccabf9d), A/Bs the q4f16_1 RMSNorm fold with x normalized once
# per block in shared memory (M=llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1); run
# `bash bench/gpu_tests_h200.sh` from that commit first (its q4 + norm cases test the staged kernel).
# Device: run(command="bash bench/issue4_s7c_h200.sh", carry=[".gpu-rt", ".dev/ab13"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab13 --out "$OUT" --variants base ${EXTRA:-} --rounds ${ROUNDS:-6})
