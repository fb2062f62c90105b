// Run an mlcc WebGPU build in Node.js through Dawn (npm `webgpu`), with the same engine as the browser page.
//   node node_chat.mjs MODEL_DIR|SITE_DIR --prompt "..." [--max-tokens N] [--temperature T] [--top-p P] [--seed S]
//                      [--json]
//                      [--requests FILE]    (a JSON list of create() requests, run in turn on one loaded engine:
//                                            prints one JSON list of {reply | chunks | error, token_ids} results)
//                      [--backend vulkan]   (Dawn's backend; Vulkan is its default on Linux)
// tvmjs, the tokenizer and jinja come from ./vendor (written by `mlcc web`); Dawn from npm:
//   npm install webgpu@0.6.2   (or point NODE_PATH at a node_modules that has it)
import { createRequire } from "node:module";
import { readFile } from "node:fs/promises";
import { existsSync } from "node:fs";
import path from "node:path";
import { MLCEngine } from "./engine.js";

const require = createRequire(import.meta.url);
// Chromium ships SwiftShader, a CPU Vulkan driver: the fallback when the system has no driver Dawn accepts
// (e.g. Mesa lavapipe older than ~24 lacks shaderUniform*ArrayDynamicIndexing)
const SWIFTSHADER_ICD = "/usr/lib/chromium/vk_swiftshader_icd.json";

function parseArgs(argv) {
  const args = { model: null, prompt: "Hello!", maxTokens: 32, temperature: 0, topP: 1, seed: 0, json: false,
    dawn: [] };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === "--prompt") args.prompt = argv[++i];
    else if (a === "--max-tokens") args.maxTokens = Number(argv[++i]);
    else if (a === "--temperature") args.temperature = Number(argv[++i]);
    else if (a === "--seed") args.seed = Number(argv[++i]);
    else if (a === "--top-p") args.topP = Number(argv[++i]);
    else if (a === "--json") args.json = true;
    else if (a === "--requests") args.requests = argv[++i];
    else if (a === "--dawn") args.dawn.push(argv[++i]);
    else if (a === "--backend") args.dawn.push(`backend=${argv[++i]}`);
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
async function openGpu() {
  let gpu = create(args.dawn);
  if (await gpu.requestAdapter()) return gpu;
  if (!process.env.VK_ICD_FILENAMES && existsSync(SWIFTSHADER_ICD)) {
    process.env.VK_ICD_FILENAMES = SWIFTSHADER_ICD;
    gpu = create(args.dawn);
    if (await gpu.requestAdapter()) return gpu;
  }
  throw new Error("Dawn found no GPU adapter: install a Vulkan driver (GPU vendor's, or Mesa >= 24 lavapipe: " +
    "mesa-vulkan-drivers) or chromium (its SwiftShader)");
}

const deps = { tvmjs: require("./vendor/tvmjs.cjs"), tokenizers: require("./vendor/tokenizers.cjs"),
  Template: require("./vendor/jinja.cjs").Template,
  xgrammar: existsSync(new URL("./vendor/xgrammar.cjs", import.meta.url)) ? require("./vendor/xgrammar.cjs") : null };

async function runRequests(engine, file) {
  const results = [];
  for (const req of JSON.parse(await readFile(file, "utf8"))) {
    try {
      const reply = await engine.chat.completions.create(req);
      if (req.stream) {
        const chunks = [];
        for await (const c of reply) chunks.push(c);
        results.push({ chunks, token_ids: engine.lastStats.token_ids });
      } else {
        results.push({ reply, token_ids: engine.lastStats.token_ids, host_fallbacks: engine.hostFallbacks });
      }
    } catch (e) {
      results.push({ error: { name: e.name, message: e.message, param: e.param ?? null, code: e.code ?? null } });
    }
  }
  return results;
}
const t0 = performance.now();
let code = 0;
try {
  const gpu = await openGpu();
  // a site folder offers several builds (site.json); the engine takes the first this adapter can run
  const siteJson = path.join(args.model, "site.json");
  const models = existsSync(siteJson)
    ? JSON.parse(await readFile(siteJson, "utf8")).models.map((m) => ({ ...m, url: path.resolve(args.model, m.url) }))
    : [{ url: path.resolve(args.model), dtype: null }];
  const engine = await MLCEngine.create({ models, deps, gpu, fetch: fileFetch,
    useCache: false, onProgress: (p) => { if (!args.json) process.stderr.write(`[${p.stage}] ${p.text}\n`); } });
  const loadS = (performance.now() - t0) / 1000;
  if (args.requests) {
    // which logit functions this device could not run (they work on the host copy of the logits instead)
    process.stderr.write(`[logit functions on the host] ${JSON.stringify(engine.hostFallbacks || {})}\n`);
    console.log(JSON.stringify(await runRequests(engine, args.requests)));
    process.exit(0);
  }
  const reply = await engine.chat.completions.create({ messages: [{ role: "user", content: args.prompt }],
    max_tokens: args.maxTokens, temperature: args.temperature, top_p: args.topP, seed: args.seed });
  const result = { content: reply.choices[0].message.content, finish_reason: reply.choices[0].finish_reason,
    usage: reply.usage, token_ids: engine.lastStats.token_ids, load_s: loadS,
    decode_tok_s: engine.lastStats.decode_tok_s, prefill_s: engine.lastStats.prefill_s, model: engine.modelId,
    adapter: { vendor: engine.adapterInfo.vendor, architecture: engine.adapterInfo.architecture,
      description: engine.adapterInfo.description } };
  if (args.json) console.log(JSON.stringify(result));
  else console.log(result.content);
} catch (e) {
  console.error(`mlcc-web: error: ${e.message}`);
  code = 1;
}
process.exit(code);
