// mlcc web engine: an mlcc WebGPU build (model.wasm + weights + tokenizer) behind an OpenAI-style
// `engine.chat.completions.create(...)`, in the browser or in Node.js (Dawn). Dependencies are injected so the
// same file runs in both: tvmjs (@mlc-ai/web-runtime), tokenizers (@mlc-ai/web-tokenizers), Template
// (@huggingface/jinja), a WebGPU `gpu` object and a `fetch`.

export class EngineError extends Error {
  constructor(message, param = null) {
    super(message);
    this.name = "EngineError";
    this.param = param;
  }
}

const WEIGHT_CACHE = "mlcc-weights-v1";

function joinUrl(base, name) {
  return base.endsWith("/") ? base + name : base + "/" + name;
}

function hex(buf) {
  return Array.from(new Uint8Array(buf), (b) => b.toString(16).padStart(2, "0")).join("");
}

// seeded uniform [0, 1) (mulberry32): same seed, same samples, on every platform
function makeRng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

/** Pick the first build this adapter can run: float16 builds need the shader-f16 feature. */
export function chooseModel(models, adapterFeatures) {
  for (const m of models) {
    if (m.dtype !== "float16" || adapterFeatures.has("shader-f16")) return m;
  }
  throw new EngineError(
    "no model build runs on this GPU: it lacks shader-f16 and no q4f32_1 build was bundled " +
      "(add one: mlcc compile MODEL --target webgpu --quant q4f32_1, then mlcc web with both folders)");
}

export class MLCEngine {
  constructor() {
    this.chat = { completions: { create: (req) => this._createChat(req) } };
  }

  /**
   * opts: {models: [{url, dtype}] | modelUrl, deps: {tvmjs, tokenizers, Template}, gpu, fetch,
   *        useCache (browser Cache API), onProgress({stage, loaded, total, text}), maxTotalTokens, logger}
   */
  static async create(opts) {
    const engine = new MLCEngine();
    await engine._load(opts);
    return engine;
  }

  _progress(stage, loaded, total, text) {
    if (this.onProgress) this.onProgress({ stage, loaded, total, text });
  }

  async _fetchJSON(url) {
    const res = await this.fetch(url);
    if (!res.ok) throw new EngineError(`${url}: HTTP ${res.status}; is the model folder complete?`);
    return await res.json();
  }

  async _fetchBytes(url, expectedSha, label) {
    let cache = null;
    if (this.useCache && typeof caches !== "undefined") cache = await caches.open(WEIGHT_CACHE);
    const key = expectedSha ? `${url}#${expectedSha}` : url;
    if (cache) {
      const hit = await cache.match(key);
      if (hit) {
        const bytes = new Uint8Array(await hit.arrayBuffer());
        if (!expectedSha || (await this._sha256(bytes)) === expectedSha) return { bytes, cached: true };
        await cache.delete(key); // a damaged cache entry: fetch again
      }
    }
    const res = await this.fetch(url);
    if (!res.ok) throw new EngineError(`${url}: HTTP ${res.status} while downloading ${label}`);
    let bytes;
    if (res.body && res.body.getReader) {
      const total = Number(res.headers && res.headers.get && res.headers.get("content-length")) || 0;
      const reader = res.body.getReader();
      const chunks = [];
      let got = 0;
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        chunks.push(value);
        got += value.length;
        this._progress("download", this._doneBytes + got, this._totalBytes, `${label}: ${got}/${total || "?"} bytes`);
      }
      bytes = new Uint8Array(got);
      let off = 0;
      for (const c of chunks) {
        bytes.set(c, off);
        off += c.length;
      }
    } else {
      bytes = new Uint8Array(await res.arrayBuffer());
    }
    if (expectedSha) {
      const sha = await this._sha256(bytes);
      if (sha !== expectedSha) {
        throw new EngineError(`${url}: checksum mismatch (sha256 ${sha.slice(0, 12)}…, expected ` +
          `${expectedSha.slice(0, 12)}…): the file is corrupted or partial; re-copy the model folder or recompile`);
      }
    }
    if (cache) await cache.put(key, new Response(bytes));
    return { bytes, cached: false };
  }

  async _sha256(bytes) {
    return hex(await globalThis.crypto.subtle.digest("SHA-256", bytes));
  }

  async _load(opts) {
    const { tvmjs, tokenizers, Template } = opts.deps;
    this.fetch = opts.fetch || globalThis.fetch.bind(globalThis);
    this.onProgress = opts.onProgress;
    this.useCache = opts.useCache !== false;
    const gpu = opts.gpu || (typeof navigator !== "undefined" ? navigator.gpu : undefined);
    if (!gpu) throw new EngineError("WebGPU is not available here (no navigator.gpu); use a browser with WebGPU");
    const adapter = await gpu.requestAdapter({ powerPreference: "high-performance" });
    if (!adapter) throw new EngineError("no WebGPU adapter found");
    const models = opts.models || [{ url: opts.modelUrl, dtype: null }];
    const choice = chooseModel(models, adapter.features);
    const base = choice.url;
    this.config = await this._fetchJSON(joinUrl(base, "mlcc-config.json"));
    if (this.config.device !== "webgpu") {
      throw new EngineError(`${base} was compiled for ${this.config.target}, not webgpu; recompile with ` +
        "mlcc compile SOURCE --target webgpu --quant q4f32_1");
    }
    const needF16 = this.config.model_dtype === "float16";
    if (needF16 && !adapter.features.has("shader-f16")) {
      throw new EngineError(`${this.config.quantization} needs the shader-f16 WebGPU feature, which this GPU lacks; ` +
        "use a q4f32_1 build");
    }
    this.modelId = opts.modelId || choice.id || this.config.model_type;
    this.adapterInfo = adapter.info || {};
    const lim = adapter.limits;
    const device = await adapter.requestDevice({
      requiredFeatures: needF16 ? ["shader-f16"] : [],
      requiredLimits: {
        maxStorageBufferBindingSize: lim.maxStorageBufferBindingSize,
        maxBufferSize: lim.maxBufferSize,
        maxComputeWorkgroupStorageSize: lim.maxComputeWorkgroupStorageSize,
        maxStorageBuffersPerShaderStage: lim.maxStorageBuffersPerShaderStage,
        maxComputeInvocationsPerWorkgroup: lim.maxComputeInvocationsPerWorkgroup,
      },
    });

    // a kernel WebGPU rejects would otherwise fail silently and leave garbage logits
    this._gpuError = null;
    device.addEventListener("uncapturederror", (ev) => {
      if (!this._gpuError) this._gpuError = ev.error ? ev.error.message : String(ev);
    });
    const cache = await this._fetchJSON(joinUrl(base, "tensor-cache.json"));
    this._totalBytes = cache.records.reduce((s, r) => s + r.nbytes, 0);
    this._doneBytes = 0;

    this._progress("download", 0, this._totalBytes, "model library");
    const wasm = (await this._fetchBytes(joinUrl(base, this.config.library), null, "model library")).bytes;
    const tvm = await tvmjs.instantiate(wasm.buffer.slice(wasm.byteOffset, wasm.byteOffset + wasm.byteLength),
      tvmjs.createPolyfillWASI(), opts.logger || (() => {}));
    this.tvm = tvm;
    tvm.initWebGPU(device);
    this.dev = tvm.webgpu();
    tvm.beginScope();
    this.vm = tvm.detachFromCurrentScope(tvm.createVirtualMachine(this.dev));
    this._checkStamp(this.vm.getFunction("_metadata")());
    this.fn = {};
    for (const name of ["embed", "prefill", "decode", "create_paged_kv_cache", "argmax_logits"]) {
      this.fn[name] = tvm.detachFromCurrentScope(this.vm.getFunction(name));
    }
    for (const [key, name] of [["sampleTopP", "vm.builtin.sample_top_p_from_logits"],
      ["penalize", "vm.builtin.apply_presence_and_frequency_penalty"], ["kvAdd", "vm.builtin.kv_state_add_sequence"],
      ["kvRemove", "vm.builtin.kv_state_remove_sequence"], ["kvBegin", "vm.builtin.kv_state_begin_forward"],
      ["kvEnd", "vm.builtin.kv_state_end_forward"]]) {
      this.fn[key] = tvm.detachFromCurrentScope(tvm.getGlobalFunc(name));
    }

    // weights: shard by shard, each checked against its sha256, then copied to the GPU
    const byName = new Map();
    this.shardsFromCache = 0;
    for (const shard of cache.records) {
      const { bytes, cached } = await this._fetchBytes(joinUrl(base, shard.dataPath), shard.sha256, shard.dataPath);
      for (const rec of shard.records) {
        const t = tvm.detachFromCurrentScope(tvm.empty(rec.shape, rec.dtype, this.dev));
        t.copyFromRawBytes(bytes.subarray(rec.byteOffset, rec.byteOffset + rec.nbytes));
        byName.set(rec.name, t);
      }
      this._doneBytes += shard.nbytes;
      if (cached) this.shardsFromCache += 1;
      this._progress("download", this._doneBytes, this._totalBytes,
        `${shard.dataPath}${cached ? " (from cache)" : ""}`);
    }
    const missing = this.config.params.filter((p) => !byName.has(p.name)).map((p) => p.name);
    if (missing.length) throw new EngineError(`${base}: weights for ${missing.slice(0, 3)} are missing; recompile`);
    this.paramTensors = this.config.params.map((p) => byName.get(p.name));
    this.params = tvm.detachFromCurrentScope(tvm.makeTVMArray(this.paramTensors));

    const ctx = this.config.context_window_size;
    this.maxTotalTokens = Math.min(ctx, opts.maxTotalTokens || 4096);
    this.prefillChunk = Math.min(this.maxTotalTokens, 1024);
    const S = (a) => tvm.makeShapeTuple(a);
    this.kv = tvm.detachFromCurrentScope(this.fn.create_paged_kv_cache(
      S([1]), S([this.maxTotalTokens]), S([this.prefillChunk]), S([16]), S([0])));
    this.hidden = this.config.hidden_size;
    this.vocab = this.config.vocab_size;
    this.idOnCpu = tvm.detachFromCurrentScope(tvm.empty([1], "int32", tvm.cpu()));
    this.logitsOnCpu = tvm.detachFromCurrentScope(tvm.empty([1, this.vocab], "float32", tvm.cpu()));
    tvm.endScope();
    await this.dev.sync();

    this._progress("tokenizer", 0, 1, "tokenizer");
    const tokBytes = (await this._fetchBytes(joinUrl(base, "tokenizer.json"), null, "tokenizer")).bytes;
    this.tokenizer = await tokenizers.Tokenizer.fromJSON(tokBytes.buffer.slice(tokBytes.byteOffset,
      tokBytes.byteOffset + tokBytes.byteLength));
    const info = this.config.tokenizer || {};
    this.template = info.chat_template ? new Template(info.chat_template) : null;
    this.bosToken = info.bos_token || "";
    this.eosToken = info.eos_token || "";
    // web-tokenizers has no token->id lookup and decodes special tokens; tokenizer.json lists them
    const added = JSON.parse(new TextDecoder().decode(tokBytes)).added_tokens || [];
    this.specialIds = new Set(added.filter((t) => t.special).map((t) => t.id));
    this.eosIds = new Set(info.eos_token_ids || []);
    for (const t of added) if (t.content === this.eosToken) this.eosIds.add(t.id);
    this._busy = false;
    this._progress("ready", 1, 1, "ready");
  }

  _checkStamp(libStampJson) {
    const lib = JSON.parse(libStampJson);
    const want = this.config.stamp || {};
    for (const key of ["arch", "quantization", "param_hash", "format", "target", "tvm", "mlcc"]) {
      if (lib[key] !== want[key]) {
        throw new EngineError(`model.wasm was built for ${key}=${JSON.stringify(lib[key])} but the weights/config ` +
          `say ${JSON.stringify(want[key])}; recompile with mlcc compile SOURCE --target webgpu ` +
          `--quant ${want.quantization} and rebuild the site`);
      }
    }
  }

  /** One forward pass over `ids` (prefill or a single decode token); returns the logits tensor (scope-owned). */
  _forward(ids, isDecode) {
    const tvm = this.tvm;
    const S = (a) => tvm.makeShapeTuple(a);
    const idsT = tvm.empty([ids.length], "int32", this.dev).copyFrom(Int32Array.from(ids));
    const emb = this.fn.embed(idsT, this.params).view([1, ids.length, this.hidden]);
    this.fn.kvBegin(this.kv, S([0]), S([ids.length]));
    const out = (isDecode ? this.fn.decode : this.fn.prefill)(emb, this.kv, this.params);
    this.fn.kvEnd(this.kv);
    return out.get(0).view([1, this.vocab]);
  }

  async _nextToken(ids, isDecode, sampling) {
    const tvm = this.tvm;
    tvm.beginScope();
    let token;
    try {
      const logits = this._forward(ids, isDecode);
      const penalized = sampling.counts.size > 0 && (sampling.presence !== 0 || sampling.frequency !== 0);
      if (sampling.temperature < 1e-5 && !penalized) {
        this.idOnCpu.copyFrom(this.fn.argmax_logits(logits));
        await this.dev.sync();
        token = this.idOnCpu.toArray()[0];
      } else {
        // TVM's runtime samplers, inside the wasm, on the logits copied to wasm memory
        this.logitsOnCpu.copyFrom(logits);
        await this.dev.sync();
        if (penalized) {
          const ids = [...sampling.counts.keys()];
          const cpu = tvm.cpu();
          this.fn.penalize(this.logitsOnCpu, tvm.empty([ids.length], "int32", cpu).copyFrom(Int32Array.from(ids)),
            tvm.empty([ids.length], "int32", cpu).copyFrom(Int32Array.from(ids.map((i) => sampling.counts.get(i)))),
            sampling.presence, sampling.frequency);
        }
        token = sampling.temperature < 1e-5
          ? argmaxOf(this.logitsOnCpu.toArray())
          : this.fn.sampleTopP(this.logitsOnCpu, sampling.temperature, sampling.top_p, sampling.rng());
      }
    } finally {
      tvm.endScope();
    }
    if (this._gpuError) {
      throw new EngineError(`WebGPU error in the model's kernels: ${this._gpuError.split("\n").slice(0, 3).join(" ")}`);
    }
    return token;
  }

  _validate(req) {
    const err = (msg, param) => { throw new EngineError(msg, param); };
    if (!req || typeof req !== "object") err("the request must be an object", null);
    if (!Array.isArray(req.messages) || req.messages.length === 0) err("messages must be a non-empty array", "messages");
    const roles = new Set(["system", "user", "assistant", "developer", "tool"]);
    req.messages.forEach((m, i) => {
      if (!m || typeof m !== "object" || !roles.has(m.role)) {
        err(`messages[${i}].role must be one of ${[...roles].join(", ")}`, "messages");
      }
      if (Array.isArray(m.content)) {
        if (!m.content.every((p) => p && p.type === "text")) err("only text content parts are supported", "messages");
      } else if (m.content != null && typeof m.content !== "string") {
        err(`messages[${i}].content must be a string or a list of text parts`, "messages");
      }
    });
    const num = (name, lo, hi) => {
      const v = req[name];
      if (v == null) return;
      if (typeof v !== "number" || !Number.isFinite(v) || v < lo || v > hi) err(`${name} must be a number in [${lo}, ${hi}]`, name);
    };
    num("temperature", 0, 2);
    num("top_p", 0, 1);
    num("presence_penalty", -2, 2);
    num("frequency_penalty", -2, 2);
    if (req.top_p === 0) err("top_p must be > 0", "top_p");
    if (req.max_tokens != null && !(Number.isInteger(req.max_tokens) && req.max_tokens >= 1)) {
      err("max_tokens must be a positive integer", "max_tokens");
    }
    if (req.n != null && req.n !== 1) err("n must be 1 in the web engine", "n");
    if (req.seed != null && !Number.isInteger(req.seed)) err("seed must be an integer", "seed");
    const stop = req.stop == null ? [] : (typeof req.stop === "string" ? [req.stop] : req.stop);
    if (!Array.isArray(stop) || stop.some((s) => typeof s !== "string" || !s)) err("stop must be a string or a list of non-empty strings", "stop");
    return stop;
  }

  _promptIds(messages) {
    if (!this.template) throw new EngineError("this model has no chat template", "messages");
    const msgs = messages.map((m) => ({ ...m, content: Array.isArray(m.content) ? m.content.map((p) => p.text || "").join("") : (m.content || "") }));
    const text = this.template.render({ messages: msgs, add_generation_prompt: true, bos_token: this.bosToken, eos_token: this.eosToken });
    return Array.from(this.tokenizer.encode(text));
  }

  _createChat(req) {
    const stop = this._validate(req);
    const gen = this._generate(req, stop);
    if (req.stream) return gen;
    return (async () => {
      let content = "";
      let finish = null;
      let usage = null;
      for await (const chunk of gen) {
        if (chunk.choices.length) {
          content += chunk.choices[0].delta.content || "";
          finish = chunk.choices[0].finish_reason || finish;
        }
        if (chunk.usage) usage = chunk.usage;
      }
      return {
        id: this._lastId, object: "chat.completion", created: Math.floor(Date.now() / 1000), model: this.modelId,
        choices: [{ index: 0, message: { role: "assistant", content }, finish_reason: finish, logprobs: null }],
        usage,
      };
    })();
  }

  async *_generate(req, stop) {
    if (this._busy) throw new EngineError("the engine is already generating; wait for the previous request");
    this._busy = true;
    const id = "chatcmpl-" + Math.random().toString(36).slice(2);
    this._lastId = id;
    const created = Math.floor(Date.now() / 1000);
    const chunk = (delta, finish) => ({ id, object: "chat.completion.chunk", created, model: this.modelId,
      choices: [{ index: 0, delta, finish_reason: finish, logprobs: null }] });
    const prompt = this._promptIds(req.messages);
    const room = this.maxTotalTokens - prompt.length;
    if (room < 1) {
      this._busy = false;
      throw new EngineError(`the prompt is ${prompt.length} tokens but the context window here is ` +
        `${this.maxTotalTokens}; shorten the conversation`, "messages");
    }
    const maxTokens = Math.min(req.max_tokens || room, room);
    const sampling = { temperature: req.temperature == null ? 1.0 : req.temperature, top_p: req.top_p == null ? 1.0 : req.top_p,
      rng: makeRng(req.seed == null ? (Math.random() * 2 ** 32) >>> 0 : req.seed),
      presence: req.presence_penalty || 0, frequency: req.frequency_penalty || 0, counts: new Map() };
    const t0 = performance.now();
    this.fn.kvAdd(this.kv, this.tvm.scalar(0, "int64"));
    const out = [];
    let text = "";
    let sent = 0;
    let finish = "length";
    let tFirst = 0;
    try {
      yield chunk({ role: "assistant", content: "" }, null);
      let token = null;
      for (let off = 0; off < prompt.length; off += this.prefillChunk) {
        token = await this._nextToken(prompt.slice(off, off + this.prefillChunk), false, sampling);
      }
      tFirst = performance.now();
      while (true) {
        if (this.eosIds.has(token)) { finish = "stop"; break; }
        out.push(token);
        sampling.counts.set(token, (sampling.counts.get(token) || 0) + 1);
        text = this.tokenizer.decode(Int32Array.from(out.filter((t) => !this.specialIds.has(t))));
        let visible = text.endsWith("\uFFFD") ? text.slice(0, text.length - 1) : text;
        let hitStop = false;
        for (const s of stop) {
          const at = visible.indexOf(s);
          if (at >= 0) { visible = visible.slice(0, at); hitStop = true; }
        }
        if (visible.length > sent) {
          yield chunk({ content: visible.slice(sent) }, null);
          sent = visible.length;
        }
        if (hitStop) { finish = "stop"; break; }
        if (out.length >= maxTokens) break;
        token = await this._nextToken([token], true, sampling);
      }
    } finally {
      this.fn.kvRemove(this.kv, this.tvm.scalar(0, "int64"));
      this._busy = false;
    }
    const tEnd = performance.now();
    this.lastStats = { prompt_tokens: prompt.length, completion_tokens: out.length, prefill_s: (tFirst - t0) / 1000,
      decode_tok_s: out.length > 1 ? (out.length - 1) / ((tEnd - tFirst) / 1000) : null,
      token_ids: out.slice() };
    yield chunk({}, finish);
    const usage = { prompt_tokens: prompt.length, completion_tokens: out.length, total_tokens: prompt.length + out.length };
    if (!req.stream || (req.stream_options && req.stream_options.include_usage)) {
      yield { id, object: "chat.completion.chunk", created, model: this.modelId, choices: [], usage };
    }
  }
}

function argmaxOf(values) {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}
