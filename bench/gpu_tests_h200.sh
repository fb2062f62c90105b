#!/usr/bin/env bash
# The GPU-marked tests on the H200 with the full TVM (compiles there). Prepare here: ../shared/gpu/pack.sh (→ .gpu/)
# and pytest's wheels in .whl-test/ (pip download pytest pluggy iniconfig packaging, cp312).
# Device: run(command="bash bench/gpu_tests_h200.sh", carry=[".gpu", ".whl-test"])
set -uo pipefail
source .gpu/setup.sh
mkdir -p /tmp/mlccpkg && ln -sfn "$PWD" /tmp/mlccpkg/mlcc
python3 -m pip install -q --no-index --no-deps --target /tmp/site3 .whl-test/*.whl
PYTHONPATH=/tmp/mlccpkg:/tmp/site3:$PYTHONPATH HF_HUB_OFFLINE=1 \
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_kernels.py -m gpu "$@"
