#!/usr/bin/env bash
# Issue 7, session 6, one device call: the prefill GEMMs the issue names, default schedules (no tuning) against
# cuBLAS fp16 — fp16 and mlcc's fused q4f16_1 dequantize-GEMM, 2048x4096x4096 and 2048x14336x4096 — outputs checked
# against torch first. Prepare here: ../shared/gpu/pack.sh (→ .gpu/).
# Device: run(command="bash bench/issue7_s6_h200.sh", carry=[".gpu"])
set -uo pipefail
source .gpu/setup.sh
mkdir -p /tmp/mlccpkg && ln -sfn "$PWD" /tmp/mlccpkg/mlcc
export PYTHONPATH=/tmp/mlccpkg:$PYTHONPATH
for shape in 2048x4096x4096 2048x14336x4096; do
  for kernel in fp16 q4f16_1; do
    python3 bench/gemm_tune_cuda.py --kernel $kernel --trials 0 --shape $shape --out "$OUT"
  done
done
