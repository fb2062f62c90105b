#!/usr/bin/env bash
# Issue 4, session 10, call 1: the tensor-core q4f16_1 GEMV (schedules/cuda_gemv_tc.py) against the CUDA-core kernel
# the model builds today, on the 8B projections, all configurations in one library per projection (built on the
# device: .gpu carries the compiler), each checked against numpy before it is timed (weights rotated through
# >= 320 MB so they come from DRAM; queued and CUDA-graph timings); then the GPU tests of the new kernel (every
# shape of the CUDA-core kernel's test, both code encodings) and of the pipelined loop (step tail, never run on
# the GPU since its fix in session 9).
# Device: run(command="bash bench/issue4_s10_h200.sh", carry=[".gpu", ".whl-test"])
set -uo pipefail
source .gpu/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
mkdir -p /tmp/mlccpkg && ln -sfn "$PWD" /tmp/mlccpkg/mlcc
export PYTHONPATH=/tmp/mlccpkg:$PYTHONPATH HF_HUB_OFFLINE=1
T0=$(date +%s)
(cd bench && python3 gemv_sweep.py build --out /tmp/tcsweep --tc && echo "sweep built in $(( $(date +%s) - T0 )) s" \
  && python3 gemv_sweep.py run --libs /tmp/tcsweep --out "$OUT" --graph)
echo "sweep done at $(( $(date +%s) - T0 )) s"
timeout ${TEST_S:-240} bash bench/gpu_tests_h200.sh -k "${TESTS:-tensor_core or pipelined}" -x
echo "all done at $(( $(date +%s) - T0 )) s"
