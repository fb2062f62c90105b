#!/usr/bin/env bash
# Issue 4, session 13, call 3: after call 2 put ~18 of chain_units' 59 us per layer on its grid barriers: the unit
# chains without every warp's fence at a projection's end (only the barrier's own, by thread 0 after the block
# barrier, as cooperative groups' grid sync does), so the next projection's first weights stay in flight across
# the barrier; CUDA-core and tensor-core units, and the tensor-core one without barriers (diagnostic).
# Prepare here: (cd bench && python stream_probe.py build --out ../.dev/stream)
# Device: run(command="bash bench/issue4_s13c_h200.sh", carry=[".gpu-rt", ".dev/stream"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd bench && MLCC_PROBE_ONLY=${ONLY:-kernels,chain_units,chain_units_block_fence,chain_units_tc,chain_units_tc_block_fence,chain_units_tc_no_barrier,chain_units_no_barrier} \
  timeout 200 python3 stream_probe.py run --libs ../.dev/stream --out "$OUT"
