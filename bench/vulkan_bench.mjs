// One mlcc WebGPU build timed in Node.js through Dawn (npm `webgpu`), with the web engine itself (engine.js of a
// site written by `mlcc web`): the adapter, teacher-forced logits for the check against the CPU build, greedy ids,
// prefill and decode speed, and where a decode step goes (dispatches, submits, buffer writes and host round trips
// per token; JS time encoding vs time waiting on the GPU; shader time per kernel from timestamp queries).
//
//   node bench/vulkan_bench.mjs SITE MODEL_ID JOB.json [--backend vulkan] [--dawn OPT ...]
//   node bench/vulkan_bench.mjs --probe [--backend vulkan] [--dawn OPT ...]
//
// JOB.json: {prompt: [ids], decode: N, prefill: [ids], prefill_repeats: R, check_prompt: [ids],
//            check_forced: [ids], sample_idx: [vocab indices], profile_tokens: T, variants: [names]}
// --probe: which adapter Dawn finds (vendor, device, driver, shader-f16, key limits), exit 1 if none.
// Prints one JSON line (the last line of stdout); progress goes to stderr. Bench code, not the engine: it reaches
// into the engine's _forward/_nextToken so that prompts are token ids (shape-only builds have no real tokenizer).
import { createRequire } from "node:module";
import { readFile } from "node:fs/promises";
import path from "node:path";
import { pathToFileURL } from "node:url";

const require = createRequire(import.meta.url);
const argv = process.argv.slice(2);
const probeOnly = argv[0] === "--probe";
const [site, modelId, jobFile] = probeOnly ? [] : argv;
const dawnOpts = [];
for (let i = probeOnly ? 1 : 3; i < argv.length; i++) {
  if (argv[i] === "--backend") dawnOpts.push(`backend=${argv[++i]}`);
  else if (argv[i] === "--dawn") dawnOpts.push(argv[++i]);
}
const log = (s) => process.stderr.write(`[vulkan_bench ${modelId}] ${s}\n`);
const now = () => performance.now();

const { create, globals } = require("webgpu");
Object.assign(globalThis, globals);

// --- instrumentation: counters are cheap pass-throughs; timestamps only while `prof.on` -------------------------
const counts = { submit: 0, writeBuffer: 0, mapAsync: 0, bindGroup: 0, pass: 0, realPass: 0 };
// host-side variants timed against the engine as it is (job.variants): without the engine's bind-group cache
// (web/js/bind_groups.js), and the dispatches of one command encoder in one compute pass (Dawn puts the barriers
// between dispatches either way)
const opt = { uncached: false, onePass: false };
const VARIANTS = { no_bind_group_cache: { uncached: true }, one_pass: { onePass: true } };
const openPass = new WeakMap();     // command encoder -> {real pass, the pass handed out}
function closePass(enc) {
  const p = openPass.get(enc);
  if (p) { openPass.delete(enc); p.real.end(); }
}
const prof = { on: false, qs: null, max: 0, n: 0, names: [], pipeName: new WeakMap(), perKernel: new Map(), gpuNs: 0 };
function wrap(proto, name, f) {
  if (!proto || typeof proto[name] !== "function") return false;
  const orig = proto[name];
  proto[name] = function (...a) { return f.call(this, orig, a); };
  return true;
}
const P = (cls) => globalThis[cls] && globalThis[cls].prototype;
wrap(P("GPUQueue"), "submit", function (o, a) { counts.submit++; return o.apply(this, a); });
wrap(P("GPUQueue"), "writeBuffer", function (o, a) { counts.writeBuffer++; return o.apply(this, a); });
wrap(P("GPUBuffer"), "mapAsync", function (o, a) { counts.mapAsync++; return o.apply(this, a); });
// (on the prototype: the engine's cache, an own property of the device, calls it only for a bind group it lacks)
wrap(P("GPUDevice"), "createBindGroup", function (o, a) { counts.bindGroup++; return o.apply(this, a); });
for (const m of ["createComputePipeline", "createComputePipelineAsync"]) {
  wrap(P("GPUDevice"), m, function (o, a) {
    const name = a[0] && a[0].compute && a[0].compute.entryPoint;
    const r = o.apply(this, a);
    if (r && typeof r.then === "function") return r.then((p) => { prof.pipeName.set(p, name); return p; });
    prof.pipeName.set(r, name);
    return r;
  });
}
for (const m of ["copyBufferToBuffer", "copyBufferToTexture", "copyTextureToBuffer", "copyTextureToTexture",
  "clearBuffer", "resolveQuerySet", "beginRenderPass", "finish"]) {
  wrap(P("GPUCommandEncoder"), m, function (o, a) { closePass(this); return o.apply(this, a); });
}
wrap(P("GPUCommandEncoder"), "beginComputePass", function (o, a) {
  counts.pass++;
  if (opt.onePass && !prof.on) {
    let p = openPass.get(this);
    if (!p) {
      const real = o.apply(this, a);
      p = { real, pass: { setPipeline: (x) => real.setPipeline(x), setBindGroup: (...x) => real.setBindGroup(...x),
        dispatchWorkgroups: (...x) => real.dispatchWorkgroups(...x), end() {} } };
      openPass.set(this, p);
      counts.realPass++;
    }
    return p.pass;
  }
  closePass(this);
  if (prof.on && prof.n < prof.max) {
    const i = prof.n++;
    prof.names[i] = "?";
    return o.call(this, { ...(a[0] || {}), timestampWrites: { querySet: prof.qs, beginningOfPassWriteIndex: 2 * i,
      endOfPassWriteIndex: 2 * i + 1 } });
  }
  return o.apply(this, a);
});
wrap(P("GPUComputePassEncoder"), "setPipeline", function (o, a) {
  if (prof.on && prof.n > 0) prof.names[prof.n - 1] = prof.pipeName.get(a[0]) || "?";
  return o.apply(this, a);
});
// the engine asks for shader-f16 only: ask for timestamps too where the adapter has them (unused until profiling)
wrap(P("GPUAdapter"), "requestDevice", function (o, a) {
  const d = { ...(a[0] || {}) };
  if (this.features.has("timestamp-query")) d.requiredFeatures = [...(d.requiredFeatures || []), "timestamp-query"];
  return o.call(this, d);
});

async function resolveTimestamps(device) {
  const n = prof.n;
  prof.n = 0;
  if (!n) return;
  const res = device.createBuffer({ size: 16 * n, usage: GPUBufferUsage.QUERY_RESOLVE | GPUBufferUsage.COPY_SRC });
  const read = device.createBuffer({ size: 16 * n, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  const enc = device.createCommandEncoder();
  enc.resolveQuerySet(prof.qs, 0, 2 * n, res, 0);
  enc.copyBufferToBuffer(res, 0, read, 0, 16 * n);
  device.queue.submit([enc.finish()]);
  await read.mapAsync(GPUMapMode.READ);
  const t = new BigUint64Array(read.getMappedRange().slice(0));
  read.unmap();
  res.destroy();
  read.destroy();
  for (let i = 0; i < n; i++) {
    const ns = t[2 * i + 1] > t[2 * i] ? Number(t[2 * i + 1] - t[2 * i]) : 0;
    const k = prof.names[i];
    const e = prof.perKernel.get(k) || { ns: 0, calls: 0 };
    e.ns += ns;
    e.calls += 1;
    prof.perKernel.set(k, e);
    prof.gpuNs += ns;
  }
}

// --- the run -----------------------------------------------------------------------------------------------------
async function fileFetch(url) {
  try {
    const b = await readFile(url);
    return { ok: true, status: 200, arrayBuffer: async () => b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength),
      json: async () => JSON.parse(b.toString("utf8")) };
  } catch {
    return { ok: false, status: 404 };
  }
}

async function main() {
  const job = JSON.parse(await readFile(jobFile, "utf8"));
  // shorter runs where the adapter is a CPU one (bench/vulkan_bench.py run --short)
  if (process.env.VK_DECODE) job.decode = Number(process.env.VK_DECODE);
  if (process.env.VK_PREFILL) job.prefill = job.prefill.slice(0, Number(process.env.VK_PREFILL));
  if (process.env.VK_PREFILL_REPEATS) job.prefill_repeats = Number(process.env.VK_PREFILL_REPEATS);
  if (process.env.VK_PROFILE_TOKENS) job.profile_tokens = Number(process.env.VK_PROFILE_TOKENS);
  if (process.env.VK_VARIANTS !== undefined) job.variants = process.env.VK_VARIANTS.split(",").filter(Boolean);
  const out = { model_id: modelId, dawn: dawnOpts };
  const gpu = create(dawnOpts);
  const adapter = await gpu.requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) {
    throw new Error("Dawn found no GPU adapter (Vulkan loader or driver missing: `--probe` says more)");
  }
  const info = adapter.info || {};
  out.adapter = { vendor: info.vendor, architecture: info.architecture, device: info.device,
    description: info.description, backend: info.backendType ?? null, type: info.adapterType ?? null,
    features: [...adapter.features].sort(),
    limits: { maxStorageBufferBindingSize: adapter.limits.maxStorageBufferBindingSize,
      maxBufferSize: adapter.limits.maxBufferSize,
      maxComputeWorkgroupStorageSize: adapter.limits.maxComputeWorkgroupStorageSize } };
  log(`adapter: ${info.vendor} | ${info.architecture} | ${info.description}`);

  const siteDir = path.resolve(site);
  const meta = JSON.parse(await readFile(path.join(siteDir, "site.json"), "utf8")).models.find((m) => m.id === modelId);
  if (!meta) throw new Error(`${modelId} is not in ${siteDir}/site.json`);
  const { MLCEngine } = await import(pathToFileURL(path.join(siteDir, "engine.js")).href);
  const deps = { tvmjs: require(path.join(siteDir, "vendor/tvmjs.cjs")),
    tokenizers: require(path.join(siteDir, "vendor/tokenizers.cjs")),
    Template: require(path.join(siteDir, "vendor/jinja.cjs")).Template, xgrammar: null };
  let t = now();
  const engine = await MLCEngine.create({ models: [{ ...meta, url: path.join(siteDir, meta.url) }], deps, gpu,
    fetch: fileFetch, useCache: false, prefixCache: false });
  out.load_s = (now() - t) / 1000;
  log(`loaded in ${out.load_s.toFixed(1)} s`);
  const tvm = engine.tvm;
  const device = engine.device;
  const ctx = tvm.lib && tvm.lib.webGPUContext;
  const dispatches = () => (ctx ? ctx.shaderSubmitCounter : NaN);
  const st = { bias: [], matcher: null, counts: new Map(), presence: 0, frequency: 0, repetition: 1, topK: 0,
    greedy: true, logprobs: false, seen: new Set() };
  const step = async (ids, isDecode) => {
    const r = await engine._nextToken(ids, isDecode, st);
    engine.sequence.push(ids);
    return r.token;
  };

  // 1. teacher-forced logits (the check prompt, then each forced token): argmax and sampled values per row
  const rowOf = async (ids, isDecode) => {
    tvm.beginScope();
    try {
      engine.logitsOnCpu.copyFrom(engine._forward(ids, isDecode));
      await engine.dev.sync();
      return engine.logitsOnCpu.toArray();
    } finally {
      tvm.endScope();
    }
  };
  engine.sequence.start(job.check_prompt);
  const rows = [await rowOf(job.check_prompt, false)];
  engine.sequence.push(job.check_prompt);
  for (const f of job.check_forced) {
    rows.push(await rowOf([f], true));
    engine.sequence.push([f]);
  }
  const argmax = (r) => { let b = 0; for (let i = 1; i < r.length; i++) if (r[i] > r[b]) b = i; return b; };
  out.check = { argmax: rows.map(argmax), max_abs: rows.map((r) => r.reduce((m, v) => Math.max(m, Math.abs(v)), 0)),
    sampled: rows.map((r) => job.sample_idx.map((i) => r[i])),
    finite: rows.every((r) => r.every(Number.isFinite)) };
  log(`check rows: argmax ${out.check.argmax.join(",")}`);

  // 2. greedy: the prompt, then `decode` steps, every id read back (the engine's loop for a greedy request)
  const dec = async (n) => {
    engine.sequence.start(job.prompt);
    let t0 = now();
    let tok = await step(job.prompt, false);
    const prefillS = (now() - t0) / 1000;
    const ids = [tok];
    const c0 = { ...counts, dispatch: dispatches() };
    let waitMs = 0;
    const origSync = engine.dev.sync.bind(engine.dev);
    engine.dev.sync = async () => { const w = now(); await origSync(); waitMs += now() - w; };
    t0 = now();
    for (let i = 1; i < n; i++) {
      tok = await step([tok], true);
      ids.push(tok);
    }
    const s = (now() - t0) / 1000;
    engine.dev.sync = origSync;
    const steps = n - 1;
    const per = {};
    for (const k of Object.keys(c0)) per[k] = ((k === "dispatch" ? dispatches() : counts[k]) - c0[k]) / steps;
    return { ids, prefillS, decodeTokS: steps / s, stepMs: (s * 1000) / steps, waitMs: waitMs / steps, per };
  };
  await dec(8);   // warm-up: pipelines, pools, the driver's caches
  const g = await dec(job.decode);
  out.greedy_ids = g.ids;
  out.decode_tok_s = g.decodeTokS;
  out.prompt_prefill_s = g.prefillS;
  out.per_token = { ...g.per, step_ms: g.stepMs, sync_wait_ms: g.waitMs, js_encode_ms: g.stepMs - g.waitMs };
  log(`decode ${g.decodeTokS.toFixed(1)} tok/s; per token ${JSON.stringify(out.per_token)}`);

  // 2b. the host-side variants, decode only, each against the same greedy ids
  out.variants = {};
  const cached = Object.prototype.hasOwnProperty.call(device, "createBindGroup") ? device.createBindGroup : null;
  out.engine_caches_bind_groups = cached !== null;
  for (const v of job.variants || []) {
    if (!VARIANTS[v]) { out.variants[v] = { error: "unknown variant" }; continue; }
    Object.assign(opt, VARIANTS[v]);
    if (opt.uncached && cached) delete device.createBindGroup;
    try {
      await dec(8);
      const r = await dec(job.decode);
      out.variants[v] = { decode_tok_s: r.decodeTokS, ids_equal: r.ids.join() === g.ids.join(),
        per_token: { ...r.per, step_ms: r.stepMs, sync_wait_ms: r.waitMs, js_encode_ms: r.stepMs - r.waitMs } };
      log(`variant ${v}: decode ${r.decodeTokS.toFixed(1)} tok/s, ids equal: ${out.variants[v].ids_equal}`);
    } catch (e) {
      out.variants[v] = { error: String(e && e.message || e) };
    } finally {
      if (opt.uncached && cached) device.createBindGroup = cached;
      opt.uncached = false;
      opt.onePass = false;
    }
  }

  // 3. prefill speed: a cold sequence of `prefill` ids (one chunk), best of the repeats after a warm-up
  let best = Infinity;
  for (let r = 0; r <= (job.prefill_repeats || 3); r++) {
    engine.sequence.start(job.prefill);
    t = now();
    await step(job.prefill, false);
    const s = (now() - t) / 1000;
    if (r) best = Math.min(best, s);
  }
  out.prefill_tokens = job.prefill.length;
  out.prefill_tok_s = job.prefill.length / best;
  log(`prefill ${out.prefill_tok_s.toFixed(1)} tok/s over ${job.prefill.length} tokens`);

  // 4. shader time: timestamps around every compute pass of a few decode steps (a separate run: they slow it)
  if (device.features.has("timestamp-query") && job.profile_tokens > 0) {
    try {
      prof.max = 2048;
      prof.qs = device.createQuerySet({ type: "timestamp", count: 2 * prof.max });
      engine.sequence.start(job.prompt);
      let tok = await step(job.prompt, false);
      let wall = 0;
      for (let i = 0; i < job.profile_tokens; i++) {
        prof.on = true;
        const w = now();
        tok = await step([tok], true);
        wall += now() - w;
        prof.on = false;
        await resolveTimestamps(device);
      }
      const T = job.profile_tokens;
      const kernels = [...prof.perKernel.entries()].map(([k, e]) => ({ kernel: k, us_per_token: e.ns / 1e3 / T,
        calls_per_token: e.calls / T })).sort((a, b) => b.us_per_token - a.us_per_token);
      out.profile = { tokens: T, shader_ms_per_token: prof.gpuNs / 1e6 / T, wall_ms_per_token: wall / T,
        kernels: kernels.slice(0, 25) };
      log(`shader time ${out.profile.shader_ms_per_token.toFixed(3)} ms/token of ${(wall / T).toFixed(3)} ms wall`);
    } catch (e) {
      out.profile = { error: String(e && e.message || e) };
    }
  } else {
    out.profile = { error: "the adapter has no timestamp-query feature" };
  }
  if (engine._gpuError) out.gpu_error = engine._gpuError;
  console.log(JSON.stringify(out));
}

async function probe() {
  const opts = dawnOpts.length ? dawnOpts : ["backend=vulkan"];
  const adapter = await create(opts).requestAdapter({ powerPreference: "high-performance" });
  if (!adapter) {
    console.log(`  Dawn (${opts.join(" ")}): no adapter`);
    process.exit(1);
  }
  const i = adapter.info || {};
  const l = adapter.limits;
  console.log(`  Dawn adapter: ${i.vendor} | ${i.architecture} | ${i.device} | ${i.description}`);
  console.log(`  shader-f16: ${adapter.features.has("shader-f16")}, ` +
    `timestamp-query: ${adapter.features.has("timestamp-query")}, subgroups: ${adapter.features.has("subgroups")}; ` +
    `maxStorageBufferBindingSize ${l.maxStorageBufferBindingSize}, maxBufferSize ${l.maxBufferSize}, ` +
    `workgroup storage ${l.maxComputeWorkgroupStorageSize}, invocations ${l.maxComputeInvocationsPerWorkgroup}, ` +
    `storage buffers/stage ${l.maxStorageBuffersPerShaderStage}`);
}

(probeOnly ? probe() : main()).then(() => process.exit(0), (e) => {
  console.error(`vulkan_bench: error: ${e && e.stack || e}`);
  process.exit(1);
});
