// Structured outputs in the web engine through web-xgrammar (an optional dependency: vendor/xgrammar.js, a UMD
// script for the browser, .cjs for Node): response_format json_object / json_schema and vLLM's structured_outputs
// (json, choice, regex, GBNF grammar) compiled to a matcher whose bitmask (bit v%32 of word v/32, the layout of the
// library's apply_bitmask) masks each step's logits.
import { EngineError } from "./request_check.js";

const CACHE_SIZE = 32;

function ebnfString(s) {
  // an EBNF literal: JSON's escapes are ones xgrammar's parser reads
  return JSON.stringify(s);
}

export class WebGrammars {
  constructor(xgrammar, vocabulary, eosIds) {
    this.xg = xgrammar;
    this.vocabulary = vocabulary;
    this.eosIds = [...eosIds];
    this._compiler = null;
    this._cache = new Map();   // spec key -> CompiledGrammar (least recently used first)
  }

  async _getCompiler() {
    if (!this._compiler) {
      const info = await this.xg.TokenizerInfo.createTokenizerInfo(this.vocabulary.strings, this.vocabulary.kind, false,
        this.vocabulary.size, this.eosIds);
      this._compiler = await this.xg.GrammarCompiler.createGrammarCompiler(info, true);
    }
    return this._compiler;
  }

  /** The request's constraint as [param, key, compile(compiler)], or null for free text. */
  _spec(req) {
    const rf = req.response_format;
    const so = req.structured_outputs;
    if (rf && rf.type === "json_object") return ["response_format", "json", (c) => c.compileBuiltinJSONGrammar()];
    if (rf && rf.type === "json_schema") {
      const schema = JSON.stringify(rf.json_schema.schema || {});
      return ["response_format", "schema:" + schema, (c) => c.compileJSONSchema(schema)];
    }
    if (!so) return null;
    if (so.json != null) {
      const schema = JSON.stringify(so.json);
      return ["structured_outputs.json", "schema:" + schema, (c) => c.compileJSONSchema(schema)];
    }
    if (so.choice != null) {
      const ebnf = "root ::= " + so.choice.map(ebnfString).join(" | ");
      return ["structured_outputs.choice", "ebnf:" + ebnf, (c) => c.compileGrammar(ebnf, "root")];
    }
    if (so.regex != null) {
      const tag = { type: "structural_tag", format: { type: "regex", pattern: so.regex } };
      return ["structured_outputs.regex", "regex:" + so.regex, (c) => c.compileStructuralTag(tag)];
    }
    return ["structured_outputs.grammar", "ebnf:" + so.grammar, (c) => c.compileGrammar(so.grammar, "root")];
  }

  /** A fresh matcher for the request's constraint (null: none); an uncompilable one is an EngineError. */
  async matcher(req) {
    const spec = this._spec(req);
    if (!spec) return null;
    const [param, key, compile] = spec;
    let compiled = this._cache.get(key);
    if (compiled) {
      this._cache.delete(key);
    } else {
      try {
        compiled = await compile(await this._getCompiler());
      } catch (e) {
        // xgrammar's C++ checks abort its wasm with a bare "Aborted()" (the reason goes to the console); the
        // module stays usable for the next grammar
        const msg = String(e && e.message ? e.message : e);
        const why = msg.startsWith("Aborted(") ? "it is invalid or uses what xgrammar does not support (the reason " +
          "is on the console as [FATAL] ...)" : msg.split("\n")[0].slice(0, 300);
        throw new EngineError(`${param}: the grammar engine cannot compile it: ${why}`, param, "invalid_value");
      }
      if (this._cache.size >= CACHE_SIZE) {
        const [oldKey, old] = this._cache.entries().next().value;
        this._cache.delete(oldKey);
        old.dispose();
      }
    }
    this._cache.set(key, compiled);
    return await this.xg.GrammarMatcher.createGrammarMatcher(compiled);
  }
}
