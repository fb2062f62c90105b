#!/usr/bin/env bash
# Issue 4, session 9, call 3 (run at 6859041, when tail and one-shift were still off by default; results
# bench/results/ab_decode_h200_tail_oneshift_s9.json). Since cd76ce6 both are the default, so the same comparison is
# now base against ab_decode's "no-tail" / "two-shift" variants. One A/B call, four shapes:
#   base      the default build, pipelined loop (waits for the previous step's end before queuing the next one)
#   tail      base's library, the next step's KV metadata queued once the previous step has passed its last
#             attention (MLCC_STEP_TAIL=1, runtime.model)
#   one-shift a build whose q4 GEMVs unpack with one shift per word (MLCC_Q4_ONE_SHIFT=1; 10% fewer SASS
#             instructions in the 8B down_proj kernel)
#   sync      base's library, the synchronous loop
# Every variant is checked first, including its pipelined greedy ids against the synchronous loop's (a metadata race
# shows there: session 8's first pipelined loop gave 4-37/101 equal ids on the 8B shape). Before it, run the GPU
# tests of both: bash bench/gpu_tests_h200.sh -k "pipelined or one_shift"  (carry .gpu .whl-test).
# Prepare here:
#   M=llama3-8b-q4f16_1,llama3-8b-q0f16,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1
#   (cd bench && python ab_decode.py build --out ../.dev/ab16 --variants base,one-shift --model $M)
#   cp .dev/ref11/reference.npz .dev/ab16/
# Device: run(command="bash bench/issue4_s9_h200.sh", carry=[".gpu-rt", ".dev/ab16"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab16 --out "$OUT" --variants base,tail,sync --rounds ${ROUNDS:-6})
