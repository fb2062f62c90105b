#!/usr/bin/env bash
# Issue 4, session 11, call 5: one persistent kernel per layer against one kernel per projection (bench/layer_probe.py,
# the o -> gate_up -> down -> qkv chain of the 8B shape, both checked against numpy first), then the GPU tests of the
# grid-capped GEMV (make_gemv max_blocks) and the default kernel's q4 cases with PDL.
# Prepare here: ../shared/gpu/pack.sh (.gpu), .whl-test (gpu_tests_h200.sh), python bench/layer_probe.py build --out .dev/probe
# Device: run(command="bash bench/issue4_s11b_h200.sh", carry=[".gpu", ".whl-test", ".dev/probe"])
set -uo pipefail
source .gpu/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
mkdir -p /tmp/mlccpkg && ln -sfn "$PWD" /tmp/mlccpkg/mlcc
T0=$(date +%s)
(cd bench && PYTHONPATH=/tmp/mlccpkg:$PYTHONPATH timeout 150 python3 layer_probe.py run --libs ../.dev/probe --out "$OUT")
echo "probe done at $(( $(date +%s) - T0 )) s"
timeout ${TEST_S:-200} bash bench/gpu_tests_h200.sh -k "grid_capped or (gemv_kernel_matches and q4f16_1 and True)"
echo "all done at $(( $(date +%s) - T0 )) s"
