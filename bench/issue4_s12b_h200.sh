#!/usr/bin/env bash
# Issue 4, session 12: bench/stream_probe.py — a persistent kernel over 4 layers' o -> gate_up -> down -> qkv with one
# producer warp per SM streaming pre-tiled q4 weights into a 20-stage shared-memory ring (cp.async.bulk +
# mbarriers) and 16 consumer warps, against the model's 4 kernels per layer, same weights, one CUDA graph each.
# Prepare here: cd bench && python stream_probe.py build --out ../.dev/stream
# Device: run(command="bash bench/issue4_s12b_h200.sh", carry=[".gpu-rt", ".dev/stream"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd bench && timeout 400 python3 stream_probe.py run --libs ../.dev/stream --out "$OUT"
