#!/usr/bin/env bash
# On the device machine (after bench/prepare_vulkan_device.sh): run the tiny model's vulkan builds through Dawn on
# NVIDIA's Vulkan driver, check greedy output against the CPU target's, print a table, write JSON to $OUT.
set -uo pipefail
vk=$(pwd)/.vk
xz -dc "$vk/node.xz" > /tmp/node && chmod +x /tmp/node
export LD_LIBRARY_PATH="$vk${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" NODE_PATH="$vk/node_modules"
export VK_ICD_FILENAMES=${VK_ICD_FILENAMES:-/usr/share/vulkan/icd.d/nvidia_icd.json}
cd "$vk/site"
results=()
for build in vk-q4f32_1 vk-q4f16_1; do
  line=$(/tmp/node node_chat.mjs "models/$build" --prompt "What is the capital of France?" --max-tokens 16 --json \
         --backend vulkan 2>/tmp/err.txt | tail -1)
  [ -n "$line" ] || line="{\"error\": $(python3 -c 'import json,sys;print(json.dumps(open("/tmp/err.txt").read()[-800:]))')}"
  results+=("\"$build\": $line")
done
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
