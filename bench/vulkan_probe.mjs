// Which adapter Dawn (npm `webgpu`) finds on Vulkan: vendor, device, driver, shader-f16, key limits; exit 1 if none.
//   node bench/vulkan_probe.mjs [DAWN_OPTION ...]      (default: backend=vulkan)
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { create, globals } = require("webgpu");
Object.assign(globalThis, globals);
const opts = process.argv.length > 2 ? process.argv.slice(2) : ["backend=vulkan"];
const adapter = await create(opts).requestAdapter({ powerPreference: "high-performance" });
if (!adapter) {
  console.log(`  Dawn (${opts.join(" ")}): no adapter`);
  process.exit(1);
}
const i = adapter.info || {};
const l = adapter.limits;
console.log(`  Dawn adapter: ${i.vendor} | ${i.architecture} | ${i.device} | ${i.description}`);
console.log(`  shader-f16: ${adapter.features.has("shader-f16")}, timestamp-query: ${adapter.features.has("timestamp-query")}, ` +
  `subgroups: ${adapter.features.has("subgroups")}; maxStorageBufferBindingSize ${l.maxStorageBufferBindingSize}, ` +
  `maxBufferSize ${l.maxBufferSize}, workgroup storage ${l.maxComputeWorkgroupStorageSize}, ` +
  `invocations ${l.maxComputeInvocationsPerWorkgroup}, storage buffers/stage ${l.maxStorageBuffersPerShaderStage}`);
process.exit(0);
