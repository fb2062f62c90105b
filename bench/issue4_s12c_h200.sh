#!/usr/bin/env bash
# Issue 4, session 12: the model's q4 GEMV (make_gemv) with capped grids, each block's row blocks interleaved
# (bx, bx + grid, ...) or contiguous (one run): does the stream probe's contiguous-run gain carry over?
# Prepare here: cd bench && python gemv_sweep.py build --out ../.dev/contig --contiguous
# Device: run(command="bash bench/issue4_s12c_h200.sh", carry=[".gpu-rt", ".dev/contig"])
set -uo pipefail
source .gpu-rt/setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd bench && timeout 500 python3 gemv_sweep.py run --libs ../.dev/contig --out "$OUT" --graph
