// Host-side logits processing of the web engine, on the copy of a step's logits in wasm memory: what the model
// library does on the GPU where a build lacks its logit functions (older builds), plus the steps the Python
// engine's sampler does on the host too (repetition penalty, top-k). Semantics as runtime/core/sampler.py.

export const TOP_LOGPROBS = 20;

// seeded uniform [0, 1) (mulberry32): same seed, same samples, on every platform
export function makeRng(seed) {
  let a = Number(BigInt.asUintN(32, BigInt(seed)));
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

export function argmaxOf(values) {
  let best = 0;
  for (let i = 1; i < values.length; i++) if (values[i] > values[best]) best = i;
  return best;
}

/** logits[id] += bias for each [id, bias]. */
export function addBias(row, bias) {
  for (const [id, b] of bias) row[id] += b;
}

/** -inf where the token's bit (bit v%32 of word v/32) is 0. */
export function applyMask(row, mask) {
  for (let v = 0; v < row.length; v++) if (!((mask[v >> 5] >>> (v & 31)) & 1)) row[v] = -Infinity;
}

/** HF's repetition penalty over every token seen (prompt included): divide a positive logit, multiply a negative. */
export function repetitionPenalty(row, seen, penalty) {
  for (const id of seen) row[id] = row[id] > 0 ? row[id] / penalty : row[id] * penalty;
}

/** Keep the k largest logits (ties at the k-th kept), -inf elsewhere. */
export function topK(row, k) {
  if (!k || k >= row.length) return;
  const sorted = Float32Array.from(row).sort();
  const kth = sorted[row.length - k];
  for (let v = 0; v < row.length; v++) if (row[v] < kth) row[v] = -Infinity;
}

/** log-softmax of row (max-subtracted log-sum-exp): [logprob of id, [[id, logprob] x k best, descending]]. */
export function logprobsOf(row, id, k = TOP_LOGPROBS) {
  let max = -Infinity;
  for (let v = 0; v < row.length; v++) if (row[v] > max) max = row[v];
  let sum = 0;
  for (let v = 0; v < row.length; v++) sum += Math.exp(row[v] - max);
  const lse = max + Math.log(sum);
  const best = [];   // k best ids, kept sorted descending (k is small)
  for (let v = 0; v < row.length; v++) {
    if (best.length === k && row[v] <= row[best[k - 1]]) continue;
    let at = best.length;
    while (at > 0 && row[best[at - 1]] < row[v]) at--;
    best.splice(at, 0, v);
    if (best.length > k) best.pop();
  }
  return [row[id] - lse, best.map((v) => [v, row[v] - lse])];
}
