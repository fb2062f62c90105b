"""Kernels of the logit functions compiled into every library (compiler/sampler.py): the grammar bitmask, the
logit-bias scatter, and log-softmax with the K most likely tokens.

The top-K is K rounds of an argmax, not a sort of the vocabulary: round r picks the largest (value, lowest index)
strictly after round r-1's pick in the order "value descending, index ascending", so ties come out in index order
(like numpy's stable argsort of -x) and -inf tokens (masked out) still fill the list in index order once the finite
ones are used up. TVM lowers a reduction across threads only for the reducers it knows, so a round is the argmax of
schedules/argmax.py (identity (-1, lowest float)) over keys where -inf is raised to NEG_KEY, above that identity;
the final kernel turns NEG_KEY back into -inf. An ineligible element is the identity itself. On GPUs each round runs
over chunks of the row in parallel (every block one chunk, as the chunked argmax does) and a second set of rounds
picks the row's K from the chunks' K each; reductions use TVM's cross-thread reduction, the same lowering the device
argmax uses on every GPU target, WebGPU included. CPUs run plain loops over the whole row.

WGSL has no infinity literal (TVM would print `-inff`), so -inf is the bit pattern 0xff800000 reinterpreted.
"""

from __future__ import annotations

# the key of a -inf logit: above the argmax identity (the lowest float), below any logit a model produces
NEG_KEY = -3.0e38


def neg_inf():
    from tvm import tirx

    return tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))


def _finish(func, scheduled: bool):
    func = func.without_attr("global_symbol")
    return func.with_attr("tirx.is_scheduled", True) if scheduled else func


def _rows_reduction(tensors, block: str, threads: int | None):
    """GPU (threads given): one thread group per output element, the reduction over its lanes; CPU: as written."""
    from tvm import te

    from .argmax import _one_group_per_row

    if threads is None:
        return _finish(te.create_prim_func(tensors), False)
    return _one_group_per_row(tensors, block, threads)


def _elementwise(tensors, threads: int | None):
    """GPU: every block's loops fused and spread over blocks of `threads` threads; CPU: as written."""
    from tvm import s_tir, te

    func = te.create_prim_func(tensors)
    if threads is None:
        return _finish(func, False)
    sch = s_tir.Schedule(func)
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        fused = sch.fuse(*sch.get_loops(block))
        bx, tx = sch.split(fused, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return _finish(sch.mod["main"], True)


def group_threads(n: int, threads: int) -> int:
    """Lanes for a reduction over n elements: a whole number of warps, at most `threads`."""
    return min(threads, 32 * -(-n // 32))


def bitmask_func(vocab: int, threads: int | None, finite: bool = False):
    """(logits [b, vocab], bitmask int32 [b, ceil(vocab/32)]) -> logits with -inf where the token's bit is 0.
    finite: the lowest float instead (WebGPU: Tint evaluates the constant -inf bit pattern at compile time and
    refuses it, "value -inf cannot be represented as 'f32'"; a sampler treats both as probability 0)."""
    from tvm import te, tirx

    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    mask = te.placeholder((batch, -(-vocab // 32)), "int32", name="bitmask")

    def f(i, v):
        bit = tirx.bitwise_and(tirx.shift_right(mask[i, v // 32], (v % 32).astype("int32")), 1)
        masked = tirx.const(-3.4028234663852886e38, "float32") if finite else neg_inf()
        return tirx.Select(bit != 0, logits[i, v], masked)

    out = te.compute((batch, vocab), f, name="masked")
    return _elementwise([logits, mask, out], threads)


def copy_func(vocab: int, threads: int | None):
    from tvm import te, tirx

    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    # a plain copy is a reshape to RewriteDataflowReshape, which makes it a view of the input (the scatter would
    # then write into the caller's logits); a bit-level round trip is not
    out = te.compute((batch, vocab), lambda i, v: tirx.reinterpret("float32", tirx.reinterpret("uint32", logits[i, v])),
                     name="copy")
    return _elementwise([logits, out], threads)


def bias_scatter_func(vocab: int, threads: int | None):
    """In place: logits[rows[j], ids[j]] += bias[j]. Pairs are unique (the runtime guarantees it), so the GPU's one
    thread per pair never races."""
    from tvm.script import tirx as T

    if threads is None:
        @T.prim_func(s_tir=True)
        def scatter(var_x: T.handle, var_rows: T.handle, var_ids: T.handle, var_bias: T.handle):
            b = T.int64()
            m = T.int64()
            x = T.match_buffer(var_x, (b, vocab), "float32")
            rows = T.match_buffer(var_rows, (m,), "int32")
            ids = T.match_buffer(var_ids, (m,), "int32")
            bias = T.match_buffer(var_bias, (m,), "float32")
            for j in range(m):
                with T.sblock("scatter"):
                    vj = T.axis.opaque(m, j)
                    T.reads(rows[vj], ids[vj], bias[vj], x[rows[vj], ids[vj]])
                    T.writes(x[rows[vj], ids[vj]])
                    x[rows[vj], ids[vj]] = x[rows[vj], ids[vj]] + bias[vj]

        return scatter.without_attr("global_symbol")

    @T.prim_func(s_tir=True)
    def scatter_gpu(var_x: T.handle, var_rows: T.handle, var_ids: T.handle, var_bias: T.handle):
        T.func_attr({"tirx.is_scheduled": True})
        b = T.int64()
        m = T.int64()
        x = T.match_buffer(var_x, (b, vocab), "float32")
        rows = T.match_buffer(var_rows, (m,), "int32")
        ids = T.match_buffer(var_ids, (m,), "int32")
        bias = T.match_buffer(var_bias, (m,), "float32")
        for bx in T.thread_binding((m + threads - 1) // threads, thread="blockIdx.x"):
            for tx in T.thread_binding(threads, thread="threadIdx.x"):
                with T.sblock("scatter"):
                    T.reads()
                    T.writes()
                    if bx * threads + tx < m:
                        x[rows[bx * threads + tx], ids[bx * threads + tx]] = (
                            x[rows[bx * threads + tx], ids[bx * threads + tx]] + bias[bx * threads + tx])

    return scatter_gpu.without_attr("global_symbol")


def topk_round_func(n: int, group: int, first: bool, with_index: bool, threads: int | None):
    """One selection round over rows of n values split into groups of `group`:
    (values [b, n], [indices int32 [b, n] if with_index], [prev_idx int32 [b, G], prev_val [b, G] unless first])
    -> (idx int32 [b, G], val [b, G]): per group, the best element strictly after the previous pick (see the
    module docstring), as (index, key). Exhausted groups give (-1, lowest float)."""
    from tvm import te, tirx

    from .argmax import _argmax_reducer

    groups = -(-n // group)
    batch = tirx.Var("batch_size", "int64")
    values = te.placeholder((batch, n), "float32", name="values")
    inputs = [values]
    if with_index:
        indices = te.placeholder((batch, n), "int32", name="indices")
        inputs.append(indices)
    if not first:
        prev_idx = te.placeholder((batch, groups), "int32", name="prev_idx")
        prev_val = te.placeholder((batch, groups), "float32", name="prev_val")
        inputs += [prev_idx, prev_val]
    k = te.reduce_axis((0, group), name="k")

    def pick(i, c):
        j = c * group + k
        jj = tirx.min(j, n - 1) if groups * group != n else j
        x = values[i, jj]
        if not with_index:   # the logits themselves: -inf gets its key (candidates already hold keys)
            x = tirx.max(x, tirx.const(NEG_KEY, "float32"))
        idx = indices[i, jj] if with_index else jj.astype("int32")
        ok = tirx.const(True)
        if groups * group != n:
            ok = j < n
        if not first:
            pv, pi = prev_val[i, c], prev_idx[i, c]
            ok = tirx.And(ok, tirx.Or(x < pv, tirx.And(x == pv, idx > pi)))
        # a Select, not a `where`: TVM lowers only an unconditional reduction to a cross-thread one
        lowest = te.min_value("float32")
        return _argmax_reducer()((tirx.Select(ok, idx, tirx.const(-1, "int32")), tirx.Select(ok, x, lowest)), axis=k)

    out_idx, out_val = te.compute((batch, groups), pick, name="topk_round")
    return _rows_reduction(inputs + [out_idx, out_val], "topk_round",
                           None if threads is None else group_threads(group, threads))


def sum_exp_func(vocab: int, k: int, threads: int | None):
    """(logits [b, vocab], top keys [b, K]) -> sum(exp(logits - row max)) [b]; the row max is the top key."""
    from tvm import te, tirx

    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    top = te.placeholder((batch, k), "float32", name="top_val")
    r = te.reduce_axis((0, vocab), name="r")
    s = te.compute((batch,), lambda i: te.sum(te.exp(logits[i, r] - top[i, 0]), axis=r), name="sum_exp")
    return _rows_reduction([logits, top, s], "sum_exp", threads)


def logprob_func(vocab: int, k: int, threads: int | None):
    """(logits [b, vocab], ids int32 [b], top values [b, K], sum_exp [b]) -> (logprob of ids [b], top logprobs [b, K]):
    value - (row max + log(sum_exp))."""
    from tvm import te, tirx

    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    ids = te.placeholder((batch,), "int32", name="ids")
    top = te.placeholder((batch, k), "float32", name="top_val")
    s = te.placeholder((batch,), "float32", name="sum_exp")
    token = te.compute((batch,), lambda i: logits[i, ids[i]] - (top[i, 0] + te.log(s[i])), name="token_logprob")
    top_lp = te.compute((batch, k), lambda i, j: tirx.Select(top[i, j] > tirx.const(NEG_KEY, "float32"),
                                                             top[i, j] - (top[i, 0] + te.log(s[i])), neg_inf()),
                        name="top_logprobs")
    return _elementwise([logits, ids, top, s, token, top_lp], threads)
