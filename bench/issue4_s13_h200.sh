#!/usr/bin/env bash
# Issue 4, prepared in session 12 for the next device call (not run yet): stream_probe's tensor-core unit chain
# (chain_units_tc: compiled, its layout checked by a numpy emulation, never executed) beside the CUDA-core one
# (chain_units, 53.5 µs per 8B layer in session 12) and the model's four kernels (~42).
# Prepare here: cd bench && python stream_probe.py build --out ../.dev/stream
# Device: run(command="bash bench/issue4_s13_h200.sh", carry=[".gpu-rt", ".dev/stream"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd bench && MLCC_PROBE_ONLY=kernels,chain_units,chain_units_tc timeout 300 python3 stream_probe.py run \
  --libs ../.dev/stream --out "$OUT"
