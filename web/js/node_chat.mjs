// Run an mlcc WebGPU build in Node.js through Dawn (npm `webgpu`), with the same engine as the browser page.
//   node node_chat.mjs MODEL_DIR --prompt "..." [--max-tokens N] [--temperature T] [--seed S] [--json]
// tvmjs, the tokenizer and jinja come from ./vendor (written by `mlcc web`); Dawn from npm:
//   npm install webgpu@0.6.2   (or point NODE_PATH at a node_modules that has it)
import { createRequire } from "node:module";
import { readFile } from "node:fs/promises";
import { existsSync } from "node:fs";
import path from "node:path";
import { MLCEngine } from "./engine.js";

const require = createRequire(import.meta.url);
const SWIFTSHADER_ICD = "/usr/lib/chromium/vk_swiftshader_icd.json";
if (!process.env.VK_ICD_FILENAMES && existsSync(SWIFTSHADER_ICD)) {
  // Dawn rejects old Mesa lavapipe; Chromium's SwiftShader is a Vulkan driver that it accepts
  process.env.VK_ICD_FILENAMES = SWIFTSHADER_ICD;
}

function parseArgs(argv) {
  const args = { model: null, prompt: "Hello!", maxTokens: 32, temperature: 0, seed: 0, json: false, dawn: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--prompt") args.prompt = argv[++i];
    else if (a === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (a === "--temperature") args.temperature = Number(argv[++i]);
    else if (a === "--seed") args.seed = Number(argv[++i]);
    else if (a === "--json") args.json = true;
    else if (a === "--dawn") args.dawn.push(argv[++i]);
    else args.model = a;
  }
  if (!args.model) throw new Error("usage: node node_chat.mjs MODEL_DIR --prompt TEXT [--max-tokens N] [--json]");
  return args;
}

async function fileFetch(url) {
  try {
    const b = await readFile(url);
    return { ok: true, status: 200, arrayBuffer: async () => b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength),
      json: async () => JSON.parse(b.toString("utf8")) };
  } catch {
    return { ok: false, status: 404 };
  }
}

const args = parseArgs(process.argv.slice(2));
const { create, globals } = require("webgpu");
Object.assign(globalThis, globals);
const gpu = create(args.dawn);
const deps = { tvmjs: require("./vendor/tvmjs.cjs"), tokenizers: require("./vendor/tokenizers.cjs"),
  Template: require("./vendor/jinja.cjs").Template };
const t0 = performance.now();
let code = 0;
try {
  const engine = await MLCEngine.create({ modelUrl: path.resolve(args.model), deps, gpu, fetch: fileFetch,
    useCache: false, onProgress: (p) => { if (!args.json) process.stderr.write(`[${p.stage}] ${p.text}\n`); } });
  const loadS = (performance.now() - t0) / 1000;
  const reply = await engine.chat.completions.create({ messages: [{ role: "user", content: args.prompt }],
    max_tokens: args.maxTokens, temperature: args.temperature, seed: args.seed });
  const result = { content: reply.choices[0].message.content, finish_reason: reply.choices[0].finish_reason,
    usage: reply.usage, token_ids: engine.lastStats.token_ids, load_s: loadS,
    decode_tok_s: engine.lastStats.decode_tok_s, prefill_s: engine.lastStats.prefill_s, adapter: engine.adapterInfo };
  if (args.json) console.log(JSON.stringify(result));
  else console.log(result.content);
} catch (e) {
  console.error(`mlcc-web: error: ${e.message}`);
  code = 1;
}
process.exit(code);
