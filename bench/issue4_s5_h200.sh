#!/usr/bin/env bash
# Issue 4, session 5, one device call: interleaved A/B of the default build (decode_graph + the swept GEMV
# configurations) against session 4's GEMV rule and against plain decode, then the issue's table on the default
# build (every shape checked first: decode_graph vs decode exactly, small shapes vs the CPU build), with
# transformers (eager, torch.compile) on the 8B shape in the same call. Prepare here:
#   bash bench/prepare_device.sh
#   (cd bench && python ab_decode.py build --out ../.dev/ab3 --variants base,gemv-s4 \
#       --model llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1) && cp .dev/ref/reference.npz .dev/ab3/
#   python bench/decode.py build --out .dev/bench5 && cp .dev/ref/reference.npz .dev/bench5/
# Device: run(command="bash bench/issue4_s5_h200.sh", carry=[".gpu-rt", ".dev/ab3", ".dev/bench5"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab3 --out "$OUT" --variants base,gemv-s4,no-graph)
python3 bench/decode.py mlcc --libs .dev/bench5 --out "$OUT"
python3 bench/decode.py hf --out "$OUT" --models llama3-8b --modes eager,compile-static --tag h200
python3 bench/decode.py table "$OUT"/decode_mlcc.json "$OUT"/decode_hf_h200.json
