#!/usr/bin/env bash
# mlcc's Vulkan build on the H200: the WebGPU library (WGSL in a .wasm) run in Node.js by Dawn's Vulkan backend on
# NVIDIA's Vulkan driver, greedy output checked against the CPU target's, a table and $OUT/vulkan_nvidia.json.
# Run from the checkout root.
#
#   here:   bash bench/vulkan.sh prepare [MODEL]   # needs emscripten and npm (as `mlcc web` does); MODEL: HF folder
#                                                  # or .gguf, default the tests' tiny random Llama (small enough
#                                                  # to carry: a real model's weights are not)
#   device: run(command="bash bench/vulkan.sh run", carry=[".vk"])
#
# prepare compiles MODEL for `vulkan` (q4f16_1) and `webgpu` (q4f32_1) and, for the expected answers, for `llvm`
# with both quantizations; bundles a site (`mlcc web`); and packs .vk/ (git-ignored): node (xz), npm webgpu (Dawn,
# linux-x64 only), this machine's Vulkan loader, the site, expected.json.
set -uo pipefail
cd "$(dirname "$0")/.."
PROMPT="What is the capital of France?"
TOKENS=16

prepare() {
  local w=.dev/vk model=${1:-} out=.vk exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for p in /.vk/ /.dev/; do grep -qx "$p" "$exclude" 2>/dev/null || echo "$p" >> "$exclude"; done
  rm -rf "$w" && mkdir -p "$w"
  if [ -z "$model" ]; then
    model=$w/hf
    python -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests'); from conftest import make_hf_model
make_hf_model('llama', Path('$model'))" || return 1
  fi
  python -m mlcc compile "$model" --target vulkan --quant q4f16_1 --output "$w/vk-q4f16_1" || return 1
  python -m mlcc compile "$model" --target webgpu --quant q4f32_1 --output "$w/vk-q4f32_1" || return 1
  python -m mlcc web "$w/vk-q4f32_1" "$w/vk-q4f16_1" --output "$w/site" || return 1
  python - "$model" "$w" <<PY || return 1
import json, sys
from pathlib import Path
from mlcc.compiler.build import compile_model
from mlcc.runtime.engine import Engine
model, w = sys.argv[1], Path(sys.argv[2])
want = {}
for build, quant in (("vk-q4f32_1", "q4f32_1"), ("vk-q4f16_1", "q4f16_1")):
    compile_model(model, "llvm", quant, w / f"cpu-{quant}")
    with Engine(w / f"cpu-{quant}", target="llvm") as e:
        r = e.chat.completions.create(messages=[{"role": "user", "content": "$PROMPT"}], max_tokens=$TOKENS,
                                      temperature=0)
    want[build] = {"content": r.choices[0].message.content, "completion_tokens": r.usage.completion_tokens}
(w / "expected.json").write_text(json.dumps(want, indent=1))
PY
  rm -rf "$out" && mkdir -p "$out/node_modules/webgpu/dist/linux-x64"
  local nm
  nm=$(python -c "from mlcc.web.npm_deps import node_modules; print(node_modules())") || return 1
  cp "$nm/webgpu/package.json" "$nm/webgpu/index.js" "$out/node_modules/webgpu/"
  cp "$nm/webgpu/dist/linux-x64/dawn.node" "$out/node_modules/webgpu/dist/linux-x64/"
  xz -T2 -6 -c "$(command -v node)" > "$out/node.xz"
  cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$out/"
  cp -r "$w/site" "$out/site"
  rm -f "$out"/site/vendor/*.js "$out/site/index.html" "$out/site/app.js"   # Node needs only the .cjs copies
  cp "$w/expected.json" "$out/expected.json"
  du -sh "$out"
}

run() {
  local vk=$PWD/.vk results=() line build
  [ -d "$vk/site" ] || { echo "no .vk here: bash bench/vulkan.sh prepare, then carry .vk"; return 2; }
  xz -dc "$vk/node.xz" > /tmp/node && chmod +x /tmp/node
  export LD_LIBRARY_PATH="$vk${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NODE_PATH="$vk/node_modules"
  # NVIDIA's ICD: the driver's own folder where the image mounts it, else the system one
  local icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  [ -f "$icd" ] || icd=/usr/share/vulkan/icd.d/nvidia_icd.json
  export VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-$icd}
  cd "$vk/site" || return 1
  for build in vk-q4f32_1 vk-q4f16_1; do
    line=$(/tmp/node node_chat.mjs "models/$build" --prompt "$PROMPT" --max-tokens $TOKENS --json \
           --backend vulkan 2>/tmp/err.txt | tail -1)
    [ -n "$line" ] || line="{\"error\": $(python3 -c 'import json;print(json.dumps(open("/tmp/err.txt").read()[-800:]))')}"
    results+=("\"$build\": $line")
  done
  local json
  json="{$(IFS=,; echo "${results[*]}")}"
  mkdir -p "${OUT:-/tmp/out}"
  echo "$json" > "${OUT:-/tmp/out}/vulkan_nvidia.json"
  python3 - "$json" "$vk/expected.json" <<'PY'
import json, sys
got, want = json.loads(sys.argv[1]), json.load(open(sys.argv[2]))
print(f"{'build':12s} {'adapter':40s} {'match CPU':9s} {'prefill s':>9s} {'decode tok/s':>12s}")
for build, r in got.items():
    if "error" in r:
        print(f"{build:12s} ERROR {r['error'][:300]}"); continue
    ok = r["content"] == want[build]["content"]
    print(f"{build:12s} {r['adapter']['description'][:40]:40s} {str(ok):9s} {r['prefill_s']:9.3f} {r['decode_tok_s'] or 0:12.1f}")
PY
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) run ;;
  *) echo "usage: bash bench/vulkan.sh prepare [MODEL] | run"; exit 2 ;;
esac
