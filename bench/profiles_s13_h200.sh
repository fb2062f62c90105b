#!/usr/bin/env bash
# Issue 4, session 13: where the 8B q4f16_1 decode step goes with today's default kernels (unchanged since session
# 10's table): a build without PDL (each kernel's time its own) and the default build (with PDL the profiler counts
# a kernel's wait for its predecessor as busy, so its idle gaps are what is left between kernels). Prepare here:
#   MLCC_CUDA_PDL=0 python bench/decode.py build --out .dev/prof13 --only llama3-8b/q4f16_1
#   default build in .dev/prof13pdl/llama3-8b-q4f16_1 (e.g. a copy of ab_decode's base build)
# Device: run(command="bash bench/profiles_s13_h200.sh", carry=[".gpu-rt", ".dev/prof13", ".dev/prof13pdl"])
set -uo pipefail
source .gpu-rt/setup.sh
python3 bench/profile_decode.py --libs .dev/prof13 --model llama3-8b-q4f16_1 --out "$OUT/nopdl"
python3 bench/profile_decode.py --libs .dev/prof13pdl --model llama3-8b-q4f16_1 --out "$OUT/pdl"
