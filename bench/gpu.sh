#!/usr/bin/env bash
# The GPU runs on the H200 (the device tool's nvidia-h200): the gpu-marked tests, then the decode table
# (bench/decode.py), results into $OUT. Run from the checkout root.
#
#   bash bench/gpu.sh prepare        here: writes .gpu-rt/ and .whl/ (below)
#   bash bench/gpu.sh [tests] [decode] [PYTEST_ARGS]   device: the stages named (default: both), in that order;
#                                    PYTEST_ARGS (e.g. -k "graph or split") go to the tests
#   bash bench/gpu.sh run CMD ...    device: CMD after the same setup (ab_decode.py, profile_decode.py, serve.py ...)
#
# What TVM travels (one device call carries at most 64 MiB, the working tree included):
#   .gpu/     full TVM, compiler included (~61 MiB; ../shared/gpu/pack.sh writes it). The tests compile, so they need
#             it, and it leaves room for nothing else: no openai wheels, so the Engine tests skip (unless an
#             earlier call on the same warm machine carried .whl: it stays there and setup uses it).
#   .gpu-rt/  runtime-only TVM (~6 MiB: the tvm python tree with libtvm_runtime*.so, no libtvm_compiler.so, plus the
#             tvm-ffi wheel). TVM drops into runtime-only mode, all that a library cross-compiled here needs (mlcc
#             registers NVRTC for the arch the library was built for). With .whl/: the cp312 wheels the device image
#             lacks (openai, fastapi, uvicorn, ...), for the Engine and `mlcc serve`.
# Either unpacks into /tmp/site once per machine; a warm machine keeps it between calls.
#
# The decode table, two calls on one machine (the way its committed results were made):
#   here:    ../shared/gpu/pack.sh && bash bench/gpu.sh prepare
#            python bench/decode.py build --out .dev/bench && python bench/decode.py reference --out .dev/bench
#   first:   run(command="bash bench/gpu.sh tests", carry=[".gpu"])
#   then:    run(command="bash bench/gpu.sh decode", carry=[".gpu-rt", ".whl", ".dev/bench"])
# Or one call, `bash bench/gpu.sh` with carry [".gpu"]: without .dev/bench the decode stage builds the libraries on
# the device (its compile column then is the device's), which with the tests may not fit one call's 10 minutes.
# Stage limits: TEST_S (default 300 s); LIBS (default .dev/bench) names the libraries folder.
# Results: $OUT/gpu-tests.txt, decode_mlcc.json, decode_hf.json, decode_table.md (commit them as
# bench/results/<date>-<commit>-<what>.*, see bench/results/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}

prepare() {   # here, needs ../shared/gpu (the TVM bundle) and pip's registry
  local S=../shared/gpu exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for p in /.gpu-rt/ /.whl/ /.dev/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
  rm -rf .gpu-rt && mkdir -p .gpu-rt
  cp "$S"/apache_tvm_ffi-*.whl "$S"/tvm-py.tar.xz .gpu-rt/ || return 1
  cat > .gpu-rt/setup.sh <<'SETUP'
_D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_SITE=/tmp/site
if [ ! -f $_SITE/tvm/lib/libtvm_runtime.so ]; then
  mkdir -p $_SITE
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $_SITE $_D/apache_tvm_ffi-*.whl || return 1
  tar -C $_SITE -xJf $_D/tvm-py.tar.xz || return 1
fi
export PYTHONPATH=$_SITE${PYTHONPATH:+:$PYTHONPATH}
_CR=$(python3 -c "import nvidia.cuda_runtime as m, os; print(os.path.dirname(m.__file__))" 2>/dev/null)
export LD_LIBRARY_PATH=${_CR:+$_CR/lib:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SETUP
  rm -rf .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    openai jiter distro httpx2 httpcore2 anyio sniffio h11 idna truststore typing-extensions pydantic pydantic-core \
    typing-inspection annotated-types fastapi starlette uvicorn click prometheus-client annotated-doc \
    opentelemetry-api httpx==0.28.1 httpcore==1.0.9 certifi "llguidance>=1.9" || return 1
  du -sh .gpu-rt .whl
}

setup() {     # device: TVM, mlcc (this checkout, as the package mlcc) and the carried wheels on the path
  command -v nvidia-smi > /dev/null || { echo "no NVIDIA GPU here: these stages run on the device (header)"; return 2; }
  if [ -f .gpu/setup.sh ]; then
    source .gpu/setup.sh || return 1
  elif [ -f .gpu-rt/setup.sh ]; then
    source .gpu-rt/setup.sh || return 1
  else
    echo "no TVM carried: carry .gpu (full) or .gpu-rt (runtime only), see the header of bench/gpu.sh"; return 2
  fi
  mkdir -p /tmp/mlccpkg && ln -sfn "$PWD" /tmp/mlccpkg/mlcc
  export PYTHONPATH=/tmp/mlccpkg:$PYTHONPATH
  if compgen -G ".whl/*.whl" > /dev/null; then
    [ -d /tmp/site2 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site2
  fi
  export HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
}

full_tvm() { python3 -c "import sys, tvm; sys.exit(0 if hasattr(tvm, 'relax') else 1)" 2>/dev/null; }

tests() {     # the gpu-marked tests (they compile: full TVM)
  full_tvm || { echo "tests: the tests compile; carry .gpu (full TVM)"; return 2; }
  timeout "${TEST_S:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_kernels.py \
    tests/test_gpu_*.py "$@" 2>&1 | tee "$OUT/gpu-tests.txt"
}

decode() {    # the decode table: mlcc on the libraries, transformers on the same shapes, the roofline
  local libs=${LIBS:-.dev/bench}
  if [ ! -f "$libs/build.json" ]; then
    full_tvm || { echo "decode: no libraries in $libs and no compiler: build them here (header) or carry .gpu"
                  return 2; }
    libs=/tmp/mlcc-bench
    echo "decode: building the libraries on the device into $libs"
    [ -f "$libs/reference.npz" ] || { python3 bench/decode.py build --out "$libs" \
                                      && python3 bench/decode.py reference --out "$libs"; } || return 1
  fi
  python3 bench/decode.py mlcc --libs "$libs" --out "$OUT" || return 1
  python3 bench/decode.py hf --out "$OUT"
  python3 bench/decode.py table "$OUT/decode_mlcc.json" "$OUT/decode_hf.json"
  python3 bench/decode.py table --markdown "$OUT/decode_mlcc.json" "$OUT/decode_hf.json" > "$OUT/decode_table.md"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; setup || exit $?; "$@" ;;
  *)
    stages=()
    while [ $# -gt 0 ] && { [ "$1" = tests ] || [ "$1" = decode ]; }; do stages+=("$1"); shift; done
    [ ${#stages[@]} -gt 0 ] || stages=(tests decode)
    if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then echo "unknown stage $1 (tests, decode; or: prepare, run CMD)"; exit 2; fi
    setup || exit $?
    rc=0; t0=$(date +%s)
    for s in "${stages[@]}"; do
      if [ "$s" = tests ]; then tests "$@" || rc=$?; else decode || rc=$?; fi
      echo "$s done at $(( $(date +%s) - t0 )) s, rc so far $rc"
    done
    exit $rc ;;
esac
