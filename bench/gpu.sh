#!/usr/bin/env bash
# mlcc's CUDA side on a machine with an NVIDIA GPU: the gpu-marked tests, the decode table, or any benchmark command,
# after one setup. mlcc and TVM are whatever python3 imports (`pip install -e .[test]` in this checkout, or
# `pip install mlcc`, which brings TVM); where python3 cannot import mlcc, this checkout goes on the path as the
# package mlcc.
#
#   bash bench/gpu.sh [--out DIR] [tests] [decode] [PYTEST_ARGS]
#       the stages named, in that order (none named: both). tests: the gpu-marked tests (PYTEST_ARGS, e.g.
#       -k "graph or split", go to pytest), their log in DIR/gpu-tests.txt. decode: the decode table
#       (bench/decode.py): mlcc on the shape-only libraries in $MLCC_BENCH_LIBS (default .dev/bench; built there
#       first when missing, a few minutes), transformers on the same shapes, the roofline; DIR/decode_mlcc.json,
#       decode_hf.json, decode_table.md.
#   bash bench/gpu.sh [--out DIR] run CMD ...
#       CMD after the same setup, e.g. `run python3 bench/decode.py ab-run --libs .dev/ab --out out/bench`.
#
# DIR: --out, else $MLCC_BENCH_OUT, else out/bench (git-ignored); CMD sees it as $MLCC_BENCH_OUT. A result worth
# keeping goes into bench/results/ under the naming of bench/results/README.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${MLCC_BENCH_OUT:-out/bench}
if [ "${1:-}" = --out ]; then
  [ $# -ge 2 ] || { echo "--out needs a folder"; exit 2; }
  OUT_DIR=$2; shift 2
fi

setup() {
  command -v nvidia-smi > /dev/null || { echo "no NVIDIA driver here (nvidia-smi): these stages need a CUDA GPU"; return 2; }
  python3 -c "import tvm" 2>/dev/null || { echo "python3 cannot import tvm: pip install mlcc (or apache-tvm)"; return 2; }
  if ! python3 -c "import mlcc" 2>/dev/null; then   # the checkout root is the package itself
    local pkg
    pkg=$(mktemp -d)
    ln -s "$PWD" "$pkg/mlcc"
    export PYTHONPATH=$pkg${PYTHONPATH:+:$PYTHONPATH}
  fi
  # NVLink multicast (NVLS) off unless set: the tensor-parallel results were measured without it
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} PYTHONUNBUFFERED=1
  mkdir -p "$OUT_DIR" || return 1
  OUT_DIR=$(cd "$OUT_DIR" && pwd)
  export MLCC_BENCH_OUT=$OUT_DIR
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import mlcc, tvm; print('mlcc', mlcc.__file__, '| tvm', tvm.__version__, tvm.__file__)"
}

has_compiler() { python3 -c "import sys, tvm; sys.exit(0 if hasattr(tvm, 'relax') else 1)" 2>/dev/null; }

tests() {     # the gpu-marked tests; they compile, so they need TVM's compiler, not only its runtime
  has_compiler || { echo "tests: this TVM is runtime-only, and the tests compile"; return 2; }
  python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_*.py tests/test_gpu_*.py tests/test_*_gpu.py \
    "$@" 2>&1 | tee "$OUT_DIR/gpu-tests.txt"
}

decode() {    # the decode table: mlcc on the libraries, transformers on the same shapes, the roofline
  local libs=${MLCC_BENCH_LIBS:-.dev/bench} step file
  # reference: the small shapes' logits from the CPU build, which the CUDA builds are checked against
  for step in build:build.json reference:reference.npz; do
    file=${step#*:}; step=${step%%:*}
    [ -f "$libs/$file" ] && continue
    has_compiler || { echo "decode: $libs lacks its $step and this TVM is runtime-only: run, where TVM compiles,"
                      echo "  python bench/decode.py $step --out $libs"; return 2; }
    echo "decode: $step into $libs"
    python3 bench/decode.py $step --out "$libs" || return 1
  done
  python3 bench/decode.py mlcc --libs "$libs" --out "$OUT_DIR" || return 1
  python3 bench/decode.py hf --out "$OUT_DIR"
  python3 bench/decode.py table "$OUT_DIR/decode_mlcc.json" "$OUT_DIR/decode_hf.json"
  python3 bench/decode.py table --markdown "$OUT_DIR/decode_mlcc.json" "$OUT_DIR/decode_hf.json" \
    > "$OUT_DIR/decode_table.md"
}

case "${1:-}" in
  run)
    shift
    [ $# -gt 0 ] || { echo "run: which command?"; exit 2; }
    setup || exit $?
    "$@" ;;
  -h|--help|help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//' ;;
  *)
    stages=()
    while [ $# -gt 0 ] && { [ "$1" = tests ] || [ "$1" = decode ]; }; do stages+=("$1"); shift; done
    [ ${#stages[@]} -gt 0 ] || stages=(tests decode)
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then echo "unknown stage $1 (tests, decode; or: run CMD ...)"; exit 2; fi
    setup || exit $?
    rc=0; t0=$(date +%s)
    for s in "${stages[@]}"; do
      if [ "$s" = tests ]; then tests "$@" || rc=$?; else decode || rc=$?; fi
      echo "$s done at $(( $(date +%s) - t0 )) s, rc so far $rc"
    done
    echo "results: $OUT_DIR"
    exit $rc ;;
esac
