"""Argmax over the vocabulary as GPU kernels scheduled by hand (greedy sampling on the device).

dlight's generic reduction of relax's argmax took 93 us per token over a 128k vocabulary on the H200; one block
per row still left all but one SM idle (46 us). WGSL has no 64-bit integers (relax's argmax carries an int64
index) and dlight's schedule leaves a batch-sized local buffer WebGPU cannot allocate. Ties go to the lower index,
like numpy.
"""

from __future__ import annotations


def _argmax_reducer():
    from tvm import te, tirx

    def combine(x, y):
        # this exact form is what TVM's cross-thread reduction recognizes as argmax
        take_x = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(take_x, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(t_idx, t_val):
        return tirx.const(-1, t_idx), te.min_value(t_val)

    return te.comm_reducer(combine, identity, name="argmax_i32")


def _one_group_per_row(tensors, block_name: str, threads: int):
    """Schedule a row reduction as one thread group per output element, the reduction spread over its lanes."""
    from tvm import s_tir, te

    sch = s_tir.Schedule(te.create_prim_func(tensors))
    block = sch.get_sblock(block_name) if hasattr(sch, "get_sblock") else sch.get_block(block_name)
    *rows, col = sch.get_loops(block)
    _, lane = sch.split(col, [None, threads])
    for loop, axis in zip(reversed(rows), ("blockIdx.x", "blockIdx.y")):
        sch.bind(loop, axis)
    sch.bind(lane, "threadIdx.x")
    return sch.mod["main"].without_attr("global_symbol").with_attr("tirx.is_scheduled", True)


def argmax_int32_func(vocab: int, threads: int = 256):
    """argmax over the vocabulary with an int32 index, scheduled by hand as one workgroup per row.
    WGSL has no 64-bit integers (relax's argmax carries an int64 index), and dlight's generic reduction schedule
    leaves a batch-sized local buffer WebGPU cannot allocate. Ties go to the lower index, like numpy."""
    from tvm import te, tirx

    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    k = te.reduce_axis((0, vocab), name="k")
    idx, val = te.compute((batch,), lambda i: _argmax_reducer()((k.var.astype("int32"), logits[i, k]), axis=k),
                          name="argmax")
    # the max value is an output too: as an internal buffer it would be a batch-sized allocation
    return _one_group_per_row([logits, idx, val], "argmax", threads)


def argmax_chunked_funcs(vocab: int, chunk: int, threads: int):
    """The same argmax in two kernels for big GPUs: (1) one block per `chunk` of a row → its best (index, value),
    (2) one block per row over those. A single block per row left all but one SM idle (46 us per token on an
    H200 over 128k logits)."""
    from tvm import te, tirx

    chunks = -(-vocab // chunk)
    batch = tirx.Var("batch_size", "int64")
    logits = te.placeholder((batch, vocab), "float32", name="logits")
    k = te.reduce_axis((0, chunk), name="k")

    def partial(i, c):
        j = c * chunk + k
        # past the end of the row: -inf, never chosen (a `where` clause would stop TVM lowering this to a
        # cross-thread reduction)
        val = tirx.Select(j < vocab, logits[i, tirx.min(j, vocab - 1)], te.min_value("float32"))
        return _argmax_reducer()((j.astype("int32"), val), axis=k)

    p_idx, p_val = te.compute((batch, chunks), partial, name="argmax_partial")
    stage1 = _one_group_per_row([logits, p_idx, p_val], "argmax_partial", threads)

    batch2 = tirx.Var("batch_size", "int64")
    q_idx = te.placeholder((batch2, chunks), "int32", name="p_idx")
    q_val = te.placeholder((batch2, chunks), "float32", name="p_val")
    c = te.reduce_axis((0, chunks), name="c")
    idx, val = te.compute((batch2,), lambda i: _argmax_reducer()((q_idx[i, c], q_val[i, c]), axis=c),
                          name="argmax_merge")
    stage2 = _one_group_per_row([q_idx, q_val, idx, val], "argmax_merge", min(threads, 32 * -(-chunks // 32)))
    return stage1, stage2, chunks
