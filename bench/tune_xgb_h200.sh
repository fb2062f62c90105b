#!/usr/bin/env bash
# Issue 7 on the H200 with meta-schedule's xgboost cost model. TVM (.gpu, 61 MiB) and xgboost-cpu (.gpu-extra)
# do not fit in one 64 MiB call, so this is the SECOND of two calls on one warm machine:
#   here:   bash ../shared/gpu/pack.sh --extra
#   call 1: run(command="source .gpu/setup.sh && <anything that needs TVM, e.g. the GPU tests>", carry=[".gpu", ...])
#   call 2 (within the machine's warm window): run(command="bash bench/tune_xgb_h200.sh", carry=[".gpu-extra"])
# .gpu stays on the machine between the calls (ignored paths are kept) and setup.sh installs .gpu-extra's wheel.
set -uo pipefail
source .gpu/setup.sh || exit 1
python3 -c "import xgboost; print('xgboost', xgboost.__version__)" || exit 1
python3 bench/gemm_tune_cuda.py --trials "${TRIALS:-64}" --cost-model xgb --out "$OUT"
