#!/usr/bin/env bash
# Issue 4, session 7: kernel-level profiles of the 8B shape's decode step (q0f16) with the session's
# kernels, built without PDL so that each kernel's time is its own (with PDL the profiler counts a kernel's wait for
# its predecessor as busy). Prepare here:
#   MLCC_CUDA_PDL=0 python bench/decode.py build --out .dev/prof7 --only llama3-8b/q0f16
# Device: run(command="bash bench/profiles_s7_h200.sh", carry=[".gpu-rt", ".dev/prof7"])
set -uo pipefail
source .gpu-rt/setup.sh
for m in llama3-8b-q0f16; do
  python3 bench/profile_decode.py --libs .dev/prof7 --model $m --out "$OUT"
done
