#!/usr/bin/env bash
# Issue 4, prepared in session 11 for the next device call (not run yet): bench/layer_probe.py with the cp.async
# variant (persistent_async: weights streamed into a 3-stage shared-memory ring per warp, 16 warps per SM, 64
# registers a thread; built and compiled here, never run) beside session 11's variants, and each projection alone —
# the model's kernel and the persistent_l1 loop without barriers (single_*) — to split the persistent kernels' 13 µs
# per layer (session 11) between their streaming and their grid barriers. Prepare here: cd bench && python layer_probe.py build --out ../.dev/probe
# Device: run(command="bash bench/issue4_s12_h200.sh", carry=[".gpu-rt", ".dev/probe"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd bench && timeout 300 python3 layer_probe.py run --libs ../.dev/probe --out "$OUT"
