#!/usr/bin/env bash
# Issue 4, session 6: kernel-level profiles of the 8B shape's decode step (q0f16 and q4f16_1) with the session's
# kernels, built without PDL so that each kernel's time is its own (with PDL the profiler counts a kernel's wait for
# its predecessor as busy). Prepare here:
#   MLCC_CUDA_PDL=0 python bench/decode.py build --out .dev/prof6 --only llama3-8b/q0f16,llama3-8b/q4f16_1
# Device: run(command="bash bench/profiles_s6_h200.sh", carry=[".gpu-rt", ".dev/prof6"])
set -uo pipefail
source .gpu-rt/setup.sh
for m in llama3-8b-q0f16 llama3-8b-q4f16_1; do
  python3 bench/profile_decode.py --libs .dev/prof6 --model $m --out "$OUT"
done
