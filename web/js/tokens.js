// The vocabulary as tokenizer.json spells it: each token's raw bytes (logprobs show a token's text and bytes, and a
// token may hold part of a UTF-8 character) and the encoded strings a grammar engine (web-xgrammar) wants.

// GPT-2's byte <-> printable character table used by byte-level BPE vocabularies
function byteLevelDecoder() {
  const bs = [];
  for (let b = 33; b <= 126; b++) bs.push(b);
  for (let b = 161; b <= 172; b++) bs.push(b);
  for (let b = 174; b <= 255; b++) bs.push(b);
  const cs = bs.slice();
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!bs.includes(b)) {
      bs.push(b);
      cs.push(256 + n);
      n += 1;
    }
  }
  const m = new Map();
  bs.forEach((b, i) => m.set(String.fromCodePoint(cs[i]), b));
  return m;
}

function decoderTypes(dec) {
  if (!dec) return [];
  if (dec.type === "Sequence") return dec.decoders.flatMap(decoderTypes);
  return [dec.type];
}

export class Vocabulary {
  /** tok: tokenizer.json parsed; size: the model's (padded) vocabulary size. */
  constructor(tok, size) {
    this.size = size;
    this.strings = new Array(size).fill("");
    for (const [s, i] of Object.entries((tok.model && tok.model.vocab) || {})) if (i < size) this.strings[i] = s;
    this.special = new Set();
    for (const t of tok.added_tokens || []) {
      if (t.id < size) this.strings[t.id] = t.content;
      this.special.add(t.id);
    }
    const types = decoderTypes(tok.decoder);
    // xgrammar's vocabulary types: how an encoded token string maps to bytes
    this.kind = types.includes("ByteLevel") ? "byte_level" : types.includes("ByteFallback") ? "byte_fallback" : "raw";
    this._byteLevel = this.kind === "byte_level" ? byteLevelDecoder() : null;
    this._enc = new TextEncoder();
    this._dec = new TextDecoder("utf-8", { fatal: true });
    this._cache = new Map();
  }

  /** The token's bytes (added/special tokens: their text). */
  bytes(id) {
    let b = this._cache.get(id);
    if (b) return b;
    const s = this.strings[id] || "";
    if (!s) {
      b = this._enc.encode(`<[${id}]>`);   // a padded row the tokenizer lacks, named as llguidance names it
    } else if (this.special.has(id)) {
      b = this._enc.encode(s);
    } else if (this._byteLevel) {
      const out = [];
      for (const ch of s) {
        const v = this._byteLevel.get(ch);
        if (v === undefined) out.push(...this._enc.encode(ch)); else out.push(v);
      }
      b = Uint8Array.from(out);
    } else {
      const m = /^<0x([0-9A-Fa-f]{2})>$/.exec(s);
      b = m ? Uint8Array.of(parseInt(m[1], 16)) : this._enc.encode(s.replaceAll("\u2581", " "));
    }
    this._cache.set(id, b);
    return b;
  }

  /** As logprobs show a token (OpenAI's way, as the Python engine): {token: its text, or "bytes:\\xNN..." for
   * part of a character, bytes: [...]}. */
  entry(id) {
    const b = this.bytes(id);
    let token;
    try {
      token = this._dec.decode(b);
    } catch {
      token = "bytes:" + Array.from(b, (x) => "\\x" + x.toString(16).padStart(2, "0")).join("");
    }
    return { token, bytes: Array.from(b) };
  }
}
