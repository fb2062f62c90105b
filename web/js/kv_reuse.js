/**
 * The web engine's one KV-cache sequence, kept between requests: a request reuses what the previous one left as
 * far as their token ids agree (a chat's next turn starts with the whole previous conversation, so only the new
 * messages are prefilled), and the rest is popped off (TVM's kv_state_popn). With reuse off, every request starts
 * from an empty sequence.
 */
export class SequenceKV {
  /** fn: {kvAdd, kvRemove, kvPopn} (TVM's builtins), kv: the paged KV cache, tvm: the tvmjs instance. */
  constructor(fn, kv, tvm, reuse) {
    this.fn = fn;
    this.kv = kv;
    this.tvm = tvm;
    this.reuse = reuse;
    this.ids = null;   // the token ids the sequence holds; null: no sequence
  }

  _seq() {
    return this.tvm.scalar(0, "int64");
  }

  /** Keep the longest common prefix of what the sequence holds and `prompt`, never all of the prompt (its last
   * token's logits are needed); returns its length: the prompt tokens not to prefill. */
  start(prompt) {
    if (this.ids === null || !this.reuse) {
      this.drop();
      this.fn.kvAdd(this.kv, this._seq());
      this.ids = [];
      return 0;
    }
    const held = this.ids;
    const limit = Math.min(held.length, prompt.length - 1);
    let keep = 0;
    while (keep < limit && held[keep] === prompt[keep]) keep += 1;
    if (keep < held.length) this.fn.kvPopn(this.kv, this._seq(), this.tvm.scalar(held.length - keep, "int64"));
    held.length = keep;
    return keep;
  }

  /** `ids` went through a forward pass: the sequence holds them now. */
  push(ids) {
    this.ids.push(...ids);
  }

  /** Remove the sequence (a forward failed midway: what it holds is unknown; or reuse is off). */
  drop() {
    if (this.ids !== null) this.fn.kvRemove(this.kv, this._seq());
    this.ids = null;
  }
}
