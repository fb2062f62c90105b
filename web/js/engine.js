// mlcc web engine: an mlcc WebGPU build (model.wasm + weights + tokenizer) behind an OpenAI-style
// `engine.chat.completions.create(...)`, in the browser or in Node.js (Dawn). Dependencies are injected so the
// same file runs in both: tvmjs (@mlc-ai/web-runtime), tokenizers (@mlc-ai/web-tokenizers), Template
// (@huggingface/jinja), a WebGPU `gpu` object and a `fetch`; optionally xgrammar (@mlc-ai/web-xgrammar) for
// structured outputs.
//
// Requests take the Python engine's shape (runtime/api/protocol.py's schema, request_check.js): temperature, top_p,
// top_k, seed, stop, stop_token_ids, max_tokens / max_completion_tokens, presence / frequency / repetition
// penalties, logit_bias, ignore_eos, logprobs / top_logprobs (of the model's own distribution, as the Python
// engine), stream / stream_options.include_usage, user, text content parts; with xgrammar: response_format
// json_object / json_schema and structured_outputs json / choice / regex / GBNF grammar. Refused with an
// EngineError naming the field: unknown fields, wrong types or values, n > 1, tools, Lark grammars.

import { EngineError, checkWebSupport, parseChatRequest } from "./request_check.js";
import { TOP_LOGPROBS, addBias, applyMask, argmaxOf, logprobsOf, makeRng, repetitionPenalty, topK } from "./logits.js";
import { Vocabulary } from "./tokens.js";
import { fetchBytes, fetchJSON, joinUrl } from "./download.js";
import { WebGrammars } from "./grammar.js";
import { SequenceKV } from "./kv_reuse.js";
import { cacheBindGroups } from "./bind_groups.js";

export { EngineError };

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
   *        useCache (browser Cache API), onProgress({stage, loaded, total, text}), maxTotalTokens, logger,
   *        prefixCache (default true: a request reuses the KV of the previous one as far as their tokens agree, so
   *        a chat's next turn prefills only the new messages)}
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
    return await fetchJSON(this.fetch, url);
  }

  async _fetchBytes(url, expectedSha, label) {
    return await fetchBytes(this.fetch, this.useCache, url, expectedSha, label, (got, total) =>
      this._progress("download", this._doneBytes + got, this._totalBytes, `${label}: ${got}/${total || "?"} bytes`));
  }

  async _load(opts) {
    const { tvmjs, tokenizers, Template } = opts.deps;
    this.fetch = opts.fetch || globalThis.fetch.bind(globalThis);
    this.onProgress = opts.onProgress;
    this.useCache = opts.useCache !== false;
    this.prefixCache = opts.prefixCache !== false;
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
    this.bindGroups = cacheBindGroups(device);
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
    // the logit functions (logit_bias, grammar masks, logprobs on the GPU): absent from builds made before them,
    // where the host does the same on the logits' copy
    for (const name of ["apply_logit_bias", "apply_bitmask", "logprobs"]) {
      let f = null;
      try {
        f = tvm.detachFromCurrentScope(this.vm.getFunction(name));
      } catch {
        f = null;
      }
      this.fn[name] = f;
    }
    for (const [key, name] of [["sampleTopP", "vm.builtin.sample_top_p_from_logits"],
["kvAdd", "vm.builtin.kv_state_add_sequence"],
      ["kvRemove", "vm.builtin.kv_state_remove_sequence"], ["kvBegin", "vm.builtin.kv_state_begin_forward"],
      ["kvEnd", "vm.builtin.kv_state_end_forward"], ["kvPopn", "vm.builtin.kv_state_popn"]]) {
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
    this.lpOnCpu = [tvm.empty([1], "float32", tvm.cpu()), tvm.empty([1, TOP_LOGPROBS], "int32", tvm.cpu()),
      tvm.empty([1, TOP_LOGPROBS], "float32", tvm.cpu())].map((t) => tvm.detachFromCurrentScope(t));
    tvm.endScope();
    await this.dev.sync();
    this.device = device;
    await this._probeLogitFunctions();

    this._progress("tokenizer", 0, 1, "tokenizer");
    const tokBytes = (await this._fetchBytes(joinUrl(base, "tokenizer.json"), null, "tokenizer")).bytes;
    this.tokenizer = await tokenizers.Tokenizer.fromJSON(tokBytes.buffer.slice(tokBytes.byteOffset,
      tokBytes.byteOffset + tokBytes.byteLength));
    const info = this.config.tokenizer || {};
    this.template = info.chat_template ? new Template(info.chat_template) : null;
    this.bosToken = info.bos_token || "";
    this.eosToken = info.eos_token || "";
    // web-tokenizers has no token->id lookup and decodes special tokens; tokenizer.json lists them
    const tokJson = JSON.parse(new TextDecoder().decode(tokBytes));
    const added = tokJson.added_tokens || [];
    this.vocabulary = new Vocabulary(tokJson, this.vocab);
    this.specialIds = new Set(added.filter((t) => t.special).map((t) => t.id));
    this.eosIds = new Set(info.eos_token_ids || []);
    for (const t of added) if (t.content === this.eosToken) this.eosIds.add(t.id);
    this.grammars = opts.deps.xgrammar ? new WebGrammars(opts.deps.xgrammar, this.vocabulary, this.eosIds) : null;
    this._busy = false;
    this.sequence = new SequenceKV(this.fn, this.kv, tvm, this.prefixCache);
    this._progress("ready", 1, 1, "ready");
  }

  /** Run each logit function once on scratch tensors inside an error scope: a kernel this device cannot run (more
   * storage buffers than its limit, say) would otherwise poison every later step; those fall back to the host. */
  async _probeLogitFunctions() {
    const tvm = this.tvm;
    const V = this.vocab;
    this.hostFallbacks = {};
    for (const name of ["apply_logit_bias", "apply_bitmask", "logprobs"]) {
      if (!this.fn[name]) continue;
      this.device.pushErrorScope("validation");
      let thrown = null;
      tvm.beginScope();
      try {
        const logits = tvm.empty([1, V], "float32", this.dev);
        const ids = this._toDev(Int32Array.of(0), "int32");
        if (name === "apply_logit_bias") this.fn[name](logits, ids, ids, this._toDev(Float32Array.of(0), "float32"));
        else if (name === "apply_bitmask") this.fn[name](logits, tvm.empty([1, Math.ceil(V / 32)], "int32", this.dev));
        else this.fn[name](logits, ids);
      } catch (e) {
        thrown = e;
      } finally {
        tvm.endScope();
      }
      await this.dev.sync();
      const gpuError = await this.device.popErrorScope();
      if (thrown || gpuError) {
        this.hostFallbacks[name] = String((gpuError && gpuError.message) || thrown).split("\n")[0];
        this.fn[name] = null;
      }
    }
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

  _toDev(values, dtype) {
    return this.tvm.empty([values.length], dtype, this.dev).copyFrom(values);
  }

  _readLogprobs() {
    const [lp, ids, vals] = this.lpOnCpu.map((t) => t.toArray());
    return [lp[0], Array.from(ids, (id, k) => [id, vals[k]])];
  }

  /**
   * One forward pass over `ids` and, where `sample`, the next token: logit_bias and the grammar's mask (on the GPU
   * where the library has the functions), then the penalties, top-k and sampling on the host copy (greedy without
   * them: argmax on the GPU). Logprobs are of the model's own distribution (before bias and mask, as the Python
   * engine reports them). Returns {token, lp: [logprob, [[id, logprob] x 20]] | null}.
   */
  async _nextToken(ids, isDecode, st, sample = true) {
    const tvm = this.tvm;
    const fn = this.fn;
    tvm.beginScope();
    let token = null;
    let lp = null;
    try {
      const raw = this._forward(ids, isDecode);
      if (!sample) return { token, lp };
      let logits = raw;
      const hostBias = st.bias.length > 0 && !fn.apply_logit_bias;
      if (st.bias.length && fn.apply_logit_bias) {
        logits = fn.apply_logit_bias(logits, this._toDev(new Int32Array(st.bias.length), "int32"),
          this._toDev(Int32Array.from(st.bias, (b) => b[0]), "int32"),
          this._toDev(Float32Array.from(st.bias, (b) => b[1]), "float32"));
      }
      let hostMask = null;
      if (st.matcher) {
        const mask = await st.matcher.getNextTokenBitmask();
        if (fn.apply_bitmask) {
          logits = fn.apply_bitmask(logits, tvm.empty([1, mask.length], "int32", this.dev).copyFrom(mask));
        } else {
          hostMask = mask;
        }
      }
      const counted = st.counts.size > 0 && (st.presence !== 0 || st.frequency !== 0);
      const onHost = hostBias || hostMask || counted || st.repetition !== 1 || (st.topK > 0 && !st.greedy);
      const deviceLogprobs = st.logprobs && fn.logprobs;
      if (st.greedy && !onHost) {
        const idT = fn.argmax_logits(logits);
        this.idOnCpu.copyFrom(idT);
        await this.dev.sync();
        token = this.idOnCpu.toArray()[0];
      } else {
        this.logitsOnCpu.copyFrom(logits);
        await this.dev.sync();
        if (onHost) {
          const row = this.logitsOnCpu.toArray();
          if (hostBias) addBias(row, st.bias);
          if (hostMask) applyMask(row, hostMask);
          if (st.repetition !== 1) repetitionPenalty(row, st.seen, st.repetition);
          if (counted) for (const [id, c] of st.counts) row[id] -= c * st.frequency + st.presence;
          if (!st.greedy) topK(row, st.topK);
          this.logitsOnCpu.copyFrom(row);
          token = st.greedy ? argmaxOf(row) : null;
        }
        if (token === null) token = fn.sampleTopP(this.logitsOnCpu, st.temperature, st.top_p, st.rng());
      }
      if (deviceLogprobs) {
        const out = fn.logprobs(raw, this._toDev(Int32Array.of(token), "int32"));
        this.lpOnCpu.forEach((t, i) => t.copyFrom(out.get(i)));
        await this.dev.sync();
        lp = this._readLogprobs();
      } else if (st.logprobs) {
        this.logitsOnCpu.copyFrom(raw);
        await this.dev.sync();
        lp = logprobsOf(this.logitsOnCpu.toArray(), token);
      }
    } finally {
      tvm.endScope();
    }
    if (this._gpuError) {
      throw new EngineError(`WebGPU error in the model's kernels: ${this._gpuError.split("\n").slice(0, 3).join(" ")}`);
    }
    if (st.matcher && !this.eosIds.has(token) && !st.matcher.acceptToken(token)) {
      throw new EngineError(`the grammar refused token ${token}, which its own mask allowed`, null, "grammar_error");
    }
    return { token, lp };
  }

  _promptIds(messages) {
    if (!this.template) throw new EngineError("this model has no chat template", "messages");
    const msgs = messages.map((m) => ({ ...m, content: Array.isArray(m.content) ? m.content.map((p) => p.text || "").join("") : (m.content || "") }));
    const text = this.template.render({ messages: msgs, add_generation_prompt: true, bos_token: this.bosToken, eos_token: this.eosToken });
    return Array.from(this.tokenizer.encode(text));
  }

  /** chat.completions.create: the request checked against protocol's schema and rules, then what this engine
   * supports (EngineError naming the field otherwise); a stream (async iterator of chunks) or the completion. */
  _createChat(request) {
    const req = parseChatRequest(request);
    checkWebSupport(req, { vocab: this.vocab, grammars: this.grammars !== null });
    const gen = this._generate(req);
    if (req.stream) return gen;
    return (async () => {
      let content = "";
      let finish = null;
      let usage = null;
      const lps = [];
      for await (const chunk of gen) {
        if (chunk.choices.length) {
          content += chunk.choices[0].delta.content || "";
          finish = chunk.choices[0].finish_reason || finish;
          if (chunk.choices[0].logprobs) lps.push(...chunk.choices[0].logprobs.content);
        }
        if (chunk.usage) usage = chunk.usage;
      }
      return {
        id: this._lastId, object: "chat.completion", created: Math.floor(Date.now() / 1000), model: this.modelId,
        choices: [{ index: 0, message: { role: "assistant", content }, finish_reason: finish,
          logprobs: req.logprobs ? { content: lps, refusal: null } : null }],
        usage,
      };
    })();
  }

  _logprobEntry(token, lp, top) {
    const alt = (id, logprob) => ({ ...this.vocabulary.entry(id), logprob });
    const e = alt(token, lp[0]);
    return { token: e.token, logprob: e.logprob, bytes: e.bytes,
      top_logprobs: lp[1].slice(0, top).map(([id, l]) => alt(id, l)) };
  }

  async *_generate(req) {
    if (this._busy) throw new EngineError("the engine is already generating; wait for the previous request");
    this._busy = true;
    const id = "chatcmpl-" + Math.random().toString(36).slice(2);
    this._lastId = id;
    const created = Math.floor(Date.now() / 1000);
    const chunk = (delta, finish, lps) => ({ id, object: "chat.completion.chunk", created, model: this.modelId,
      choices: [{ index: 0, delta, finish_reason: finish, logprobs: lps ? { content: lps, refusal: null } : null }] });
    const stop = req.stop == null ? [] : (typeof req.stop === "string" ? [req.stop] : req.stop);
    const stopIds = new Set(req.stop_token_ids || []);
    let prompt;
    let st;
    try {
      prompt = this._promptIds(req.messages);
      const room = this.maxTotalTokens - prompt.length;
      if (room < 1) {
        throw new EngineError(`the prompt is ${prompt.length} tokens but the context window here is ` +
          `${this.maxTotalTokens}; shorten the conversation`, "messages");
      }
      const temperature = req.temperature == null ? 1.0 : req.temperature;
      const topK = req.top_k > 0 ? Math.min(req.top_k, this.vocab) : 0;
      st = { temperature, top_p: req.top_p == null ? 1.0 : req.top_p, topK, greedy: temperature < 1e-5 || topK === 1,
        rng: makeRng(req.seed == null ? (Math.random() * 2 ** 32) >>> 0 : req.seed),
        presence: req.presence_penalty || 0, frequency: req.frequency_penalty || 0, counts: new Map(),
        repetition: req.repetition_penalty == null ? 1 : req.repetition_penalty, seen: new Set(prompt),
        bias: Object.entries(req.logit_bias || {}).map(([k, b]) => [Number(k), b]), logprobs: !!req.logprobs,
        maxTokens: Math.min(req.max_completion_tokens ?? req.max_tokens ?? room, room), matcher: null };
      if (this.grammars) st.matcher = await this.grammars.matcher(req);
    } catch (e) {
      this._busy = false;
      throw e;
    }
    const t0 = performance.now();
    const cached = this.sequence.start(prompt);
    const out = [];
    let pendingLps = [];
    let text = "";
    let sent = 0;
    let finish = "length";
    let tFirst = 0;
    let stopped = false;   // by a stop string: the text after it is never shown
    try {
      yield chunk({ role: "assistant", content: "" }, null);
      let step = null;
      for (let off = cached; off < prompt.length; off += this.prefillChunk) {
        const last = off + this.prefillChunk >= prompt.length;
        const ids = prompt.slice(off, off + this.prefillChunk);
        step = await this._nextToken(ids, false, st, last);
        this.sequence.push(ids);
      }
      tFirst = performance.now();
      while (true) {
        const token = step.token;
        if ((this.eosIds.has(token) && !req.ignore_eos) || stopIds.has(token)) { finish = "stop"; break; }
        out.push(token);
        if (step.lp) pendingLps.push(this._logprobEntry(token, step.lp, req.top_logprobs || 0));
        st.counts.set(token, (st.counts.get(token) || 0) + 1);
        st.seen.add(token);
        text = this.tokenizer.decode(Int32Array.from(out.filter((t) => !this.specialIds.has(t))));
        let visible = text.endsWith("\uFFFD") ? text.slice(0, text.length - 1) : text;
        let hitStop = false;
        for (const s of stop) {
          const at = visible.indexOf(s);
          if (at >= 0) { visible = visible.slice(0, at); hitStop = true; }
        }
        if (visible.length > sent) {
          yield chunk({ content: visible.slice(sent) }, null, st.logprobs ? pendingLps : null);
          pendingLps = [];
          sent = visible.length;
        }
        if (hitStop) { finish = "stop"; stopped = true; break; }
        if (out.length >= st.maxTokens) break;
        step = await this._nextToken([token], true, st);
        this.sequence.push([token]);
      }
    } catch (e) {
      this.sequence.drop();   // a forward that failed midway: what the sequence holds is unknown
      throw e;
    } finally {
      if (!this.prefixCache) this.sequence.drop();
      if (st.matcher) st.matcher.dispose();
      this._busy = false;
    }
    const tEnd = performance.now();
    this.lastStats = { prompt_tokens: prompt.length, cached_tokens: cached, completion_tokens: out.length,
      prefill_s: (tFirst - t0) / 1000,
      decode_tok_s: out.length > 1 ? (out.length - 1) / ((tEnd - tFirst) / 1000) : null,
      token_ids: out.slice() };
    if (!stopped && text.length > sent) {
      // a partial character held back for the next token's bytes: at the end it shows as U+FFFD, as in Python
      yield chunk({ content: text.slice(sent) }, null, st.logprobs ? pendingLps : null);
      pendingLps = [];
    }
    yield chunk({}, finish, st.logprobs && pendingLps.length ? pendingLps : null);
    const usage = { prompt_tokens: prompt.length, completion_tokens: out.length,
      total_tokens: prompt.length + out.length, prompt_tokens_details: { cached_tokens: cached } };
    if (!req.stream || (req.stream_options && req.stream_options.include_usage)) {
      yield { id, object: "chat.completion.chunk", created, model: this.modelId, choices: [], usage };
    }
  }
}
