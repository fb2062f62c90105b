#!/usr/bin/env bash
# Issue 4, prepared in session 10 for the next device call (not run yet):
# 1. the per-kernel floor: empty kernels back to back in one CUDA graph, with and without PDL, by grid size
#    (bench/kernel_floor.py): how much of an 8B q4f16_1 step (~260 kernels, 1.84 ms against a 1.00 ms roofline) no
#    kernel body can remove;
# 2. transformers on the 8B shape (eager with a static cache, torch.compile reduce-overhead), the columns session
#    10's table took from session 8 (bench/results/decode_mlcc_h200_s10.json has mlcc's).
# Prepare here: python bench/kernel_floor.py build --out .dev/floor
# Device: run(command="bash bench/issue4_s11_h200.sh", carry=[".gpu-rt", ".dev/floor"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 kernel_floor.py run --libs ../.dev/floor --out "$OUT")
python3 bench/decode.py hf --out "$OUT" --models llama3-8b --modes eager,compile-static --tag h200
python3 bench/decode.py table bench/results/decode_mlcc_h200_s10.json "$OUT"/decode_hf_h200.json
