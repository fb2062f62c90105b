#!/usr/bin/env bash
# mlcc's WebGPU build on a real GPU: the WebGPU library (WGSL in a .wasm) run in Node.js by Dawn's Vulkan backend
# (npm `webgpu`) on NVIDIA's Vulkan driver, against the CUDA build of the same model in the same run. SmolLM2-135M and
# the Qwen2.5-0.5B shape, q4f16_1 and q4f32_1, seeded random weights (bench/vulkan_bench.py says why and how they are
# checked against the CPU build). Run from the checkout root.
#
#   here:    bash bench/vulkan.sh prepare      # needs emscripten, npm, apt-get download; writes .vk/ (git-ignored)
#            (VK_BUILD=DIR VK_REUSE=1: the libraries and answers already in DIR, only the site and jobs again)
#   device:  run(command="bash bench/gpu.sh run bash bench/vulkan.sh run", carry=[".gpu-rt", ".vk"])
#            (bench/gpu.sh prepare writes .gpu-rt: runtime-only TVM for the CUDA builds and the weights writer)
#   here:    bash bench/vulkan.sh local        # the run stage on this machine's Vulkan (lavapipe / SwiftShader),
#                                              # web side only, SmolLM2 only and short: checks all but the driver
# Device run limits: CUDA_TIMEOUT_S (the CUDA builds, first), WEB_TIMEOUT_S (one web build), WEB_DEADLINE_S (no web
# build starts after this many seconds); VK_BUILDS picks builds; VK_DECODE, VK_PREFILL, VK_VARIANTS shorten the job.
#
# .vk/ holds payload.tar.xz: node (xz'd, static: no libnode to find there), npm webgpu's linux-x64 dawn.node, the
# Vulkan loader and libglvnd .debs (NVIDIA's ICD, libGLX_nvidia.so.0, needs libGLdispatch/libGLX: without them the
# loader reports "Could not get 'vkCreateInstance' via 'vk_icdGetInstanceProcAddr'"), the site (engine + the four
# .wasm, no weights: the device writes them, 0.5B in q4f32_1 is ~350 MB), the cuda libraries, the CPU's answers.
# The device run prints diagnostics first (driver, ICD json, unresolved libraries, Dawn's adapter), so one call
# says what failed; results: $OUT/vulkan_webgpu.json (rows: target, device, tok_per_s, cuda_tok_per_s, checks,
# per-token dispatch counts, shader time), $OUT/log.txt, $OUT/raw.tar.xz; the table on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
W=${VK_BUILD:-.dev/vkbench}   # build folder here
VK_BUDGET_MIB=45        # .vk's share of one call's 64 MiB (the tree and .gpu-rt travel beside it)
DEBS="libvulkan1 libglvnd0 libglx0 libgl1 libegl1 libgles2 libopengl0"

die() { echo "vulkan.sh: $*" >&2; exit 1; }

prepare() {
  local exclude nm stage=.dev/vkstage
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for p in /.vk/ /.dev/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
  command -v node > /dev/null || die "no node here: apt-get install nodejs npm (its binary is what travels)"
  echo "== prepare: libraries (webgpu, cuda, llvm), the CPU build's answers, the site into $W"
  if [ -n "${VK_REUSE:-}" ] && [ -f "$W/expected.json" ]; then   # an earlier build folder as it is
    python bench/vulkan_bench.py jobs --out "$W" || die "could not write the job files"
  else
    python bench/vulkan_bench.py build --out "$W" \
      || die "build failed (above): emscripten (apt-get install emscripten) and npm are needed, as for mlcc web"
  fi
  echo "== prepare: Vulkan loader + libglvnd .debs"
  mkdir -p .dev/vkdebs
  ( cd .dev/vkdebs && for d in $DEBS; do compgen -G "${d}_*.deb" > /dev/null || apt-get download "$d" 2>/dev/null \
      || { echo "apt-get download $d failed"; exit 1; }; done ) \
    || die "could not fetch the .debs: see /work/.library/device/README.md for apt-get download with amd64 lists"
  echo "== prepare: packing"
  nm=$(python -c "from mlcc.web.npm_deps import node_modules; print(node_modules())") || die "npm deps missing"
  rm -rf "$stage" && mkdir -p "$stage/webgpu/dist/linux-x64" "$stage/debs" "$stage/cuda"
  cp "$nm/webgpu/package.json" "$nm/webgpu/index.js" "$stage/webgpu/"
  cp "$nm/webgpu/dist/linux-x64/dawn.node" "$stage/webgpu/dist/linux-x64/"
  cp "$(readlink -f "$(command -v node)")" "$stage/node"
  ldd "$stage/node" | grep -q libnode && die "this node links libnode (Debian's): install nodesource's static node"
  cp .dev/vkdebs/*.deb "$stage/debs/"
  cp -r "$W/site" "$stage/site"
  # the browser-only files stay behind (Node uses the .cjs copies; xgrammar is optional), and so do the weights
  rm -f "$stage"/site/vendor/*.js "$stage"/site/vendor/xgrammar.cjs "$stage/site/index.html" "$stage/site/app.js" \
        "$stage"/site/models/*/params_shard_*.bin
  for d in "$W"/cuda/*/; do
    mkdir -p "$stage/cuda/$(basename "$d")" && cp "$d"/model.so "$d"/mlcc-config.json "$stage/cuda/$(basename "$d")/"
  done
  cp "$W"/expected.json "$W"/job-*.json "$stage/"
  rm -rf .vk && mkdir -p .vk
  tar -C "$stage" -cf - . | xz -T2 -9 > .vk/payload.tar.xz || die "packing failed"
  local mib
  mib=$(( $(stat -c %s .vk/payload.tar.xz) / 1048576 ))
  du -sh .vk .gpu-rt 2>/dev/null
  [ "$mib" -le "$VK_BUDGET_MIB" ] || die ".vk is ${mib} MiB, over its ${VK_BUDGET_MIB} MiB share of a call"
  [ -f .gpu-rt/setup.sh ] || echo "note: no .gpu-rt here yet: bash bench/gpu.sh prepare (the device run needs it)"
  echo "prepared: carry [\".gpu-rt\", \".vk\"]; command: bash bench/gpu.sh run bash bench/vulkan.sh run"
}

unpack() {   # payload -> $VK (once per machine: a warm one keeps /tmp)
  local sum
  [ -f .vk/payload.tar.xz ] || die "no .vk/payload.tar.xz here: bash bench/vulkan.sh prepare, then carry .vk"
  sum=$(sha256sum .vk/payload.tar.xz | cut -c1-16)
  if [ "$(cat "$VK/.payload" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$VK" && mkdir -p "$VK" && xz -dc .vk/payload.tar.xz | tar -C "$VK" -xf - || die "unpacking failed"
    echo "$sum" > "$VK/.payload"
  fi
  chmod +x "$VK/node"
  mkdir -p "$VK/node_modules" && ln -sfn "$VK/webgpu" "$VK/node_modules/webgpu"
  export NODE_PATH=$VK/node_modules
}

loaders() {  # the Vulkan loader and libglvnd where the image has none (README's recipe: into /, then ldconfig)
  [ -n "${VK_NO_LOADERS:-}" ] && return 0   # (local: this machine's own loader; never unpack into its /)
  if ! ldconfig -p | grep -q 'libvulkan.so.1 ' || ! ldconfig -p | grep -q 'libGLdispatch.so.0 '; then
    if [ -w / ]; then
      for f in "$VK"/debs/*.deb; do dpkg -x "$f" / || echo "dpkg -x $f failed"; done
      ldconfig
    else   # not root: a private copy on the library path
      for f in "$VK"/debs/*.deb; do dpkg -x "$f" "$VK/root"; done
      export LD_LIBRARY_PATH=$VK/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
  fi
}

diagnose() { # which driver, which ICD json, what the ICD library cannot resolve, what Dawn sees
  local icd="" glx lib ver
  echo "== diagnostics"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  ls -d /dev/nvidia* 2>/dev/null | tr '\n' ' '; echo
  for lib in libvulkan.so.1 libGLdispatch.so.0 libGLX.so.0 libEGL.so.1 libGLX_nvidia.so.0 libEGL_nvidia.so.0; do
    printf '  %-22s %s\n' "$lib" "$(ldconfig -p | grep -m1 "$lib " | sed 's/.*=> //' || true)"
  done
  [ -d /usr/local/nvidia/lib64 ] && export LD_LIBRARY_PATH=/usr/local/nvidia/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  glx=$(ldconfig -p | grep -m1 'libGLX_nvidia.so.0 ' | sed 's/.*=> //')
  [ -n "$glx" ] || glx=$(ls /usr/local/nvidia/lib64/libGLX_nvidia.so.0 /usr/lib/x86_64-linux-gnu/libGLX_nvidia.so.0 \
                         2>/dev/null | head -1)
  if [ -n "$glx" ]; then
    echo "  $glx: unresolved: $(ldd "$glx" 2>&1 | grep 'not found' | tr -s ' \t\n' ' ' || true)"
    echo "  driver libraries beside it: $(ls "$(dirname "$glx")" | grep -E 'nvidia-(glcore|glvkspirv|tls|gpucomp|eglcore)' \
      | tr '\n' ' ')"
  else
    echo "  no libGLX_nvidia.so.0 (NVIDIA's Vulkan ICD) anywhere: the image lacks the driver's graphics libraries"
  fi
  for f in ${VK_DRIVER_FILES:-} /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
           /usr/share/vulkan/icd.d/nvidia_icd.json; do
    [ -f "$f" ] && { icd=$f; break; }
  done
  if [ -z "$icd" ] && [ -n "$glx" ]; then   # the driver's libraries without its manifest: write one
    ver=$(ls /usr/lib/x86_64-linux-gnu/libnvidia-glcore.so.* /usr/local/nvidia/lib64/libnvidia-glcore.so.* 2>/dev/null \
          | head -1 | sed 's/.*\.so\.//')
    icd=$VK/nvidia_icd.json
    printf '{"file_format_version": "1.0.1", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$glx" > "$icd"
    echo "  no nvidia_icd.json found: wrote $icd (driver ${ver:-?})"
  fi
  if [ -n "$icd" ]; then
    echo "  ICD: $icd: $(tr -d '\n ' < "$icd")"
    export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
  fi
  for f in /usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json /usr/share/glvnd/egl_vendor.d/10_nvidia.json; do
    [ -f "$f" ] && { export __EGL_VENDOR_LIBRARY_FILENAMES=$f; break; }
  done
  if ! timeout 60 "$VK/node" bench/vulkan_probe.mjs; then
    echo "  Dawn found no adapter; the Vulkan loader's own account:"
    VK_LOADER_DEBUG=error,warn,driver timeout 60 "$VK/node" bench/vulkan_probe.mjs 2>&1 | grep -v '^\s*$' | tail -40
    return 1
  fi
}

web_runs() { # each build in its own node (a crash or hang costs one build), the 0.5B shape first
  local b m t
  for b in "${BUILDS[@]}"; do
    m=${b%-q4f*}
    t=$(( $(date +%s) - T0 ))
    if [ "$t" -gt "${WEB_DEADLINE_S:-200}" ]; then echo "web $b: skipped, ${t}s gone"; continue; fi
    echo "== web $b"
    timeout "${WEB_TIMEOUT_S:-80}" "$VK/node" bench/vulkan_bench.mjs "$VK/site" "$b" "$VK/job-$m.json" \
      --backend vulkan ${VK_DAWN:+--dawn "$VK_DAWN"} > "$R/web-$b.json" 2> "$R/web-$b.err"
    echo "   rc $? in $(( $(date +%s) - T0 - t ))s; $(grep -a 'vulkan_bench' "$R/web-$b.err" | tail -3 | cut -c1-300)"
    grep -a -v '^\[vulkan_bench' "$R/web-$b.err" | tail -5
    report > /dev/null   # after each build: a run cut short still brings back what it measured
  done
}

report() {
  local webs=() b
  for b in "${BUILDS[@]}"; do webs+=("$R/web-$b.json"); done
  python3 bench/vulkan_bench.py report --expected "$VK/expected.json" --cuda "$R/cuda.json" --site "$VK/site" \
    --web "${webs[@]}" --out "$OUT" 2>&1
}

run() {
  T0=$(date +%s)
  VK=${VK_DIR:-/tmp/vk}
  OUT=${OUT:-/tmp/out}; R=$VK/results
  mkdir -p "$OUT"
  unpack; rm -rf "$R"; mkdir -p "$R"
  # the 0.5B shape first: its ratio is the goal, should the time run out
  mapfile -t BUILDS < <(python3 -c "import json; m = json.load(open('$VK/expected.json'))['models']
print('\n'.join(sorted(m, key=lambda b: not b.startswith('qwen'))))")
  [ -n "${VK_BUILDS:-}" ] && read -r -a BUILDS <<< "$VK_BUILDS"
  loaders
  # (not in a pipeline: its exports, the driver's library path and ICD, are for the runs below too)
  diagnose > "$R/diag.txt" 2>&1
  local dawn_ok=$? tvm_ok=1
  cat "$R/diag.txt"
  python3 -c "import tvm, mlcc.runtime.device.model" 2>/dev/null || tvm_ok=0
  [ "$tvm_ok" = 1 ] || echo "no TVM runtime / mlcc on python3's path: run under bench/gpu.sh run (carry .gpu-rt)"
  echo "== weights (seeded random, written here) $(( $(date +%s) - T0 ))s"
  if [ "$tvm_ok" = 1 ]; then
    python3 bench/vulkan_bench.py weights "${BUILDS[@]/#/$VK/site/models/}" 2>&1 | tee "$R/weights.txt"
  fi
  # CUDA first: its timing is the predictable part, and a web run cut short still has its ratio
  if [ "$tvm_ok" = 1 ] && command -v nvidia-smi > /dev/null && [ -z "${VK_NO_CUDA:-}" ]; then
    echo "== cuda $(( $(date +%s) - T0 ))s"
    timeout "${CUDA_TIMEOUT_S:-150}" python3 bench/vulkan_bench.py cuda --libs "$VK/cuda" --expected "$VK/expected.json" \
      --out "$R" 2>&1 | grep -v Warning | tail -20
  fi
  [ "$dawn_ok" = 0 ] && [ "$tvm_ok" = 1 ] && web_runs
  echo "== report $(( $(date +%s) - T0 ))s"
  report
  local b
  # the raw outputs as one file (a call brings back at most 8)
  ( cd "$R" && for b in "${BUILDS[@]}"; do [ -f "web-$b.json" ] && mv "web-$b.json" "web-$b.txt"; done
    tar -cJf "$OUT/raw.tar.xz" . )
  cp "$R/diag.txt" "$OUT/diag.txt"
  echo "done in $(( $(date +%s) - T0 ))s: $OUT/vulkan_webgpu.json"
}

case "${1:-}" in
  prepare) prepare ;;
  run) mkdir -p "${OUT:-/tmp/out}"; run 2>&1 | tee "${OUT:-/tmp/out}/log.txt" ;;
  local)   # this machine's Vulkan: a short web-only pass over the same payload (SwiftShader/lavapipe are slow)
    # SmolLM2 only unless VK_BUILDS says otherwise: lavapipe takes over 20 minutes for one 0.5B build's checks
    export VK_BUILDS=${VK_BUILDS:-"smollm2-135m-q4f32_1 smollm2-135m-q4f16_1"}
    export VK_DIR=/tmp/vk-local VK_NO_CUDA=1 VK_NO_LOADERS=1 OUT=${OUT:-/tmp/vk-local-out} \
      WEB_TIMEOUT_S=${WEB_TIMEOUT_S:-900} WEB_DEADLINE_S=${WEB_DEADLINE_S:-100000} VK_DECODE=${VK_DECODE:-6} \
      VK_PREFILL=${VK_PREFILL:-64} VK_PREFILL_REPEATS=${VK_PREFILL_REPEATS:-1} VK_PROFILE_TOKENS=${VK_PROFILE_TOKENS:-2}
    mkdir -p "$OUT"; run 2>&1 | tee "$OUT/log.txt" ;;
  *) echo "usage: bash bench/vulkan.sh prepare | run | local"; exit 2 ;;
esac
