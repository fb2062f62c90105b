#!/usr/bin/env bash
# Pack what the device machine needs to run mlcc's Vulkan build through Dawn on NVIDIA's Vulkan driver:
# node (xz), npm webgpu (Dawn, linux-x64 only), the Vulkan loader, a site with the tiny model's vulkan builds,
# and the CPU target's answers for parity. Writes .vk/ (git-ignored; carry it).
#   bash bench/prepare_vulkan_device.sh SITE_DIR EXPECTED_JSON
set -euo pipefail
site=$1; expected=$2
out=.vk; rm -rf "$out"; mkdir -p "$out/node_modules/webgpu/dist/linux-x64"
nm=$(python -c "from mlcc.web.npm_deps import node_modules; print(node_modules())")
cp "$nm/webgpu/package.json" "$nm/webgpu/index.js" "$out/node_modules/webgpu/"
cp "$nm/webgpu/dist/linux-x64/dawn.node" "$out/node_modules/webgpu/dist/linux-x64/"
xz -T2 -6 -c "$(command -v node)" > "$out/node.xz"
cp -L /usr/lib/x86_64-linux-gnu/libvulkan.so.1 "$out/"
cp -r "$site" "$out/site"
rm -f "$out"/site/vendor/*.js "$out/site/index.html" "$out/site/app.js"   # Node needs only the .cjs copies
cp "$expected" "$out/expected.json"
du -sh "$out"
