// Bind groups reused across decode steps. tvmjs creates a bind group for every dispatch, and a decode step runs the
// same kernels on the same buffers each time (weights, the KV cache, the memory pool's activations, the runtime's
// per-dispatch uniform buffers), so the step rebuilds the same bind groups: on a real GPU that is the largest part
// of the host's time per token (Dawn's createBindGroup is tens of microseconds in Node.js). A bind group refers to
// buffers, not their contents, so one made earlier with the same layout and the same buffer ranges is equivalent.

let nextId = 1;
const ids = new WeakMap();
const idOf = (o) => {
  let i = ids.get(o);
  if (!i) {
    i = nextId++;
    ids.set(o, i);
  }
  return i;
};

/** Past this many bind groups for one layout, that layout's cache starts again (buffers that come and go, like a
 *  step's token ids, would otherwise keep destroyed buffers' bind groups alive). */
export const PER_LAYOUT = 4096;

/**
 * Make `device.createBindGroup` return an equivalent bind group made earlier where there is one (own property on
 * the device: tvmjs calls it as a method). Returns counters {calls, created}.
 */
export function cacheBindGroups(device) {
  const create = device.createBindGroup;
  const byLayout = new WeakMap();
  const stats = { calls: 0, created: 0 };
  device.createBindGroup = function (desc) {
    stats.calls++;
    let key = "";
    for (const e of desc.entries) {
      const r = e.resource;
      if (!r || !r.buffer) return create.call(device, desc);   // textures, samplers: not cached
      key += `${e.binding}:${idOf(r.buffer)}:${r.offset || 0}:${r.size ?? -1};`;
    }
    let cached = byLayout.get(desc.layout);
    if (!cached) {
      cached = new Map();
      byLayout.set(desc.layout, cached);
    }
    let group = cached.get(key);
    if (!group) {
      if (cached.size >= PER_LAYOUT) cached.clear();
      group = create.call(device, desc);
      cached.set(key, group);
      stats.created++;
    }
    return group;
  };
  return stats;
}
