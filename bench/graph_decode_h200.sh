#!/usr/bin/env bash
# Whole-step CUDA graph for batch-1 decode (compiler/graph_decode.py) on the H200, one device call:
# decode_graph checked against plain decode (exact logits, 200 steps, several metadata layouts) and against the CPU
# build (small shapes), then interleaved A/B of decode_graph vs plain decode in one process, the host cost of each
# piece of a step (graph_launch_probe.py), then the 8B profile.
# Prepare here:
#   bash bench/prepare_device.sh
#   (cd bench && python ab_decode.py build --out ../.dev/ab2 \
#       --model llama3-8b-q4f16_1,llama3-8b-q0f16,qwen2.5-0.5b-q4f16_1,smollm2-135m-q4f16_1)
#   python bench/decode.py reference --out .dev/ref && cp .dev/ref/reference.npz .dev/ab2/
# Device: run(command="bash bench/graph_decode_h200.sh", carry=[".gpu-rt", ".dev/ab2"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
(cd bench && python3 ab_decode.py run --libs ../.dev/ab2 --out "$OUT" --variants base,no-graph)
python3 bench/graph_launch_probe.py --libs .dev/ab2/base --out "$OUT"
python3 bench/profile_decode.py --libs .dev/ab2/base --model llama3-8b-q4f16_1 --out "$OUT"
