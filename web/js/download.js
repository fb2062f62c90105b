// How the web engine fetches a model's files: checked against their sha256, kept in the browser's Cache API
// (a second visit reads the weights from there), with progress per chunk.
import { EngineError } from "./request_check.js";

const WEIGHT_CACHE = "mlcc-weights-v1";

export function joinUrl(base, name) {
  return base.endsWith("/") ? base + name : base + "/" + name;
}

function hex(buf) {
  return Array.from(new Uint8Array(buf), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function sha256(bytes) {
  return hex(await globalThis.crypto.subtle.digest("SHA-256", bytes));
}

export async function fetchJSON(fetch, url) {
  const res = await fetch(url);
  if (!res.ok) throw new EngineError(`${url}: HTTP ${res.status}; is the model folder complete?`);
  return await res.json();
}

/** {bytes, cached}: the file at url (from the cache where useCache and it is there); onProgress(got, total). */
export async function fetchBytes(fetch, useCache, url, expectedSha, label, onProgress) {
  let cache = null;
  if (useCache && typeof caches !== "undefined") cache = await caches.open(WEIGHT_CACHE);
  const key = expectedSha ? `${url}#${expectedSha}` : url;
  if (cache) {
    const hit = await cache.match(key);
    if (hit) {
      const bytes = new Uint8Array(await hit.arrayBuffer());
      if (!expectedSha || (await sha256(bytes)) === expectedSha) return { bytes, cached: true };
      await cache.delete(key); // a damaged cache entry: fetch again
    }
  }
  const res = await fetch(url);
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
      onProgress(got, total);
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
    const sha = await sha256(bytes);
    if (sha !== expectedSha) {
      throw new EngineError(`${url}: checksum mismatch (sha256 ${sha.slice(0, 12)}…, expected ` +
        `${expectedSha.slice(0, 12)}…): the file is corrupted or partial; re-copy the model folder or recompile`);
    }
  }
  if (cache) await cache.put(key, new Response(bytes));
  return { bytes, cached: false };
}
