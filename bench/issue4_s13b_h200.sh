#!/usr/bin/env bash
# Issue 4, session 13, call 2: (1) the model with its o/down q4 GEMVs on capped, contiguous grids ("add-cap",
# MLCC_GEMV_ADD_CAP=528: session 12's sweep best, o 4.93 vs 6.02 us, down 10.47 vs 11.12 alone) against the
# default build, interleaved A/B on the 8B and 0.5B shapes, each build checked first; (2) chain_units'
# diagnostics (no grid barrier / no math / neither) beside chain_units and the four kernels.
# Run with the working tree of bench/results/gemv_add_cap_rejected_s13.diff (the "add-cap" variant and
# cuda_gemv.residual_grid_rule, dropped after this call: no gain); apply it to build and run it again.
# Prepare here:
#   (cd bench && python ab_decode.py build --out ../.dev/ab13 --model llama3-8b-q4f16_1,qwen2.5-0.5b-q4f16_1 \
#     --variants base,add-cap) && python bench/decode.py reference --out .dev/ref13 && cp .dev/ref13/reference.npz .dev/ab13/
#   (cd bench && python stream_probe.py build --out ../.dev/stream)
# Device: run(command="bash bench/issue4_s13b_h200.sh", carry=[".gpu-rt", ".dev/ab13", ".dev/stream"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
T0=$(date +%s)
(cd bench && MLCC_PROBE_ONLY=kernels,chain_units,chain_units_no_barrier,chain_units_no_math,chain_units_neither \
  timeout 120 python3 stream_probe.py run --libs ../.dev/stream --out "$OUT")
echo "probe done at $(( $(date +%s) - T0 )) s"
(cd bench && timeout 400 python3 ab_decode.py run --libs ../.dev/ab13 --out "$OUT" --variants base,add-cap \
  --rounds ${ROUNDS:-6})
echo "all done at $(( $(date +%s) - T0 )) s"
