#!/usr/bin/env bash
# Prepare what a device (H200) call carries, from the checkout root. Writes git-ignored folders:
#   .gpu-rt/  runtime-only TVM (tvm python tree incl. libtvm_runtime*.so + tvm-ffi 0.1.14.post0 wheel), 5.7 MiB.
#             No libtvm_compiler.so: TVM drops into runtime-only mode, which is all a cross-compiled library needs
#             (mlcc registers its own NVRTC callback with the arch recorded at compile time).
#   .whl/     cp312 wheels the device image lacks: openai (+httpx2 stack), fastapi/uvicorn/prometheus-client, httpx.
# On the device: `source .gpu-rt/setup.sh` (puts mlcc and TVM on PYTHONPATH), then install .whl into /tmp/site2:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/*.whl
#   export PYTHONPATH=$PYTHONPATH:/tmp/site2
# Real weights (SmolLM2 q4f16_1 is 76 MB) do not fit next to these in one 64 MiB call: carry shard 0 in one call,
# copy it to /tmp, and the rest in the next call while the machine is warm (30 s). Speed runs use
# `compile_shape_only` libraries and `LoadedModel(..., weights="random")` instead.
set -euo pipefail
S=../shared/gpu
for p in /.gpu-rt/ /.whl/ /.dev/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
rm -rf .gpu-rt && mkdir -p .gpu-rt
cp "$S"/apache_tvm_ffi-*.whl "$S"/tvm-py.tar.xz .gpu-rt/
cat > .gpu-rt/setup.sh <<'SETUP'
_D=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_SITE=/tmp/site
if [ ! -f $_SITE/tvm/lib/libtvm_runtime.so ]; then
  mkdir -p $_SITE
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $_SITE $_D/apache_tvm_ffi-*.whl || return 1
  tar -C $_SITE -xJf $_D/tvm-py.tar.xz || return 1
fi
mkdir -p /tmp/mlccpkg && ln -sfn "$(cd $_D/.. && pwd)" /tmp/mlccpkg/mlcc
export PYTHONPATH=/tmp/mlccpkg:$_SITE${PYTHONPATH:+:$PYTHONPATH}
_CR=$(python3 -c "import nvidia.cuda_runtime as m, os; print(os.path.dirname(m.__file__))" 2>/dev/null)
export LD_LIBRARY_PATH=${_CR:+$_CR/lib:}/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
SETUP
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  openai jiter distro httpx2 httpcore2 anyio sniffio h11 idna truststore typing-extensions pydantic pydantic-core \
  typing-inspection annotated-types fastapi starlette uvicorn click prometheus-client annotated-doc \
  opentelemetry-api httpx==0.28.1 httpcore==1.0.9 certifi
du -sh .gpu-rt .whl
