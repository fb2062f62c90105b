"""Sampling compiled into the model library (argmax and top-k/top-p draws), so a token id, not a logits row, is
what crosses to the host."""

from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import Tensor, op


class DeviceSampler(nn.Module):
    """temperature → softmax → sort → top-k/top-p → draw with a host-provided uniform (seeded per request)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def sample_top_p_top_k(self, logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                           uniform: Tensor, rows: Tensor) -> Tensor:
        """rows[i] = which logits row sample i draws from (arange(batch) for one sample per sequence)."""
        b = logits.shape[0]
        probs = op.softmax(logits / op.reshape(temperature, (b, 1)), axis=-1)
        sorted_probs = op.sort(probs, axis=-1, descending=True)
        sorted_index = op.argsort(probs, axis=-1, descending=True, dtype="int32")
        ids = op.sample_top_p_top_k_from_sorted_prob(sorted_probs, sorted_index, op.reshape(top_p, (b, 1)),
                                                     op.reshape(top_k, (b, 1)), op.reshape(uniform, (b, 1)),
                                                     op.reshape(rows, (b, 1)))
        return op.reshape(ids, (b,))

    def get_default_spec(self) -> dict:
        b = "batch_size"
        return {"sample_top_p_top_k": {
            "logits": nn.spec.Tensor([b, self.vocab_size], "float32"),
            "temperature": nn.spec.Tensor([b], "float32"), "top_p": nn.spec.Tensor([b], "float32"),
            "top_k": nn.spec.Tensor([b], "int32"), "uniform": nn.spec.Tensor([b], "float32"),
            "rows": nn.spec.Tensor([b], "int32"),
            "$": {"param_mode": "none", "effect_mode": "none"}}}


def attach_sampler(mod, vocab_size: int):
    sampler = DeviceSampler(vocab_size)
    smod, _ = sampler.export_tvm(spec=sampler.get_default_spec())
    mod.update(smod)
    return mod


def attach_argmax(mod, vocab: int, int32_index: bool = False, threads: int = 256, chunk: int | None = None):
    """`argmax_logits(logits[b, vocab]) -> int32[b]`: greedy sampling on the device, so only ids reach the host."""
    from tvm import relax, tirx

    from mlcc.schedules.argmax import argmax_chunked_funcs, argmax_int32_func

    bb = relax.BlockBuilder(mod)
    batch = tirx.Var("batch_size", "int64")
    logits = relax.Var("logits", relax.TensorType([batch, vocab], "float32"))
    with bb.function("argmax_logits", [logits]):
        with bb.dataflow():
            if chunk:
                stage1, stage2, chunks = argmax_chunked_funcs(vocab, chunk, threads)
                parts = bb.emit(relax.call_tir(bb.add_func(stage1, "argmax_partial"), [logits],
                                               [relax.TensorType([batch, chunks], "int32"),
                                                relax.TensorType([batch, chunks], "float32")]))
                both = bb.emit(relax.call_tir(bb.add_func(stage2, "argmax_merge"),
                                              [relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 1)],
                                              [relax.TensorType([batch], "int32"),
                                               relax.TensorType([batch], "float32")]))
                ids = bb.emit(relax.TupleGetItem(both, 0))
            elif int32_index:
                gv = bb.add_func(argmax_int32_func(vocab, threads), "argmax_i32")
                both = bb.emit(relax.call_tir(gv, [logits], [relax.TensorType([batch], "int32"),
                                                             relax.TensorType([batch], "float32")]))
                ids = bb.emit(relax.TupleGetItem(both, 0))
            else:
                ids = bb.emit(relax.op.astype(relax.op.argmax(logits, axis=-1), "int32"))
            out = bb.emit_output(ids)
        bb.emit_func_output(out)
    return bb.get()


LOGPROBS_K = 20  # top_logprobs is at most 20 in OpenAI's API


def attach_logit_functions(mod, vocab: int, target, threads: int = 256, chunk: int | None = None,
                           logprobs: bool = True):
    """The logit functions the runtime applies between the forward pass and sampling, all on the device:
    `apply_bitmask(logits [b, V], bitmask int32 [b, ceil(V/32)]) -> [b, V]` (-inf where the token's bit is 0),
    `apply_logit_bias(logits, rows int32[m], token_ids int32[m], bias f32[m]) -> [b, V]` (pairs unique) and
    `logprobs(logits, ids int32[b]) -> (f32[b], int32[b, K], f32[b, K])`: log-softmax at ids and the K best
    (schedules/logit_processing.py). Top-K rounds run over `chunk`-sized pieces of a row, then over the pieces' picks: 2048 on
    GPUs (every block one piece), the whole row on CPUs; `logprobs=False` leaves the last function out."""
    from tvm import relax, tirx

    from mlcc.schedules import logit_processing as L

    gpu = "gpu" in target.keys
    t = threads if gpu else None
    chunk = chunk or (2048 if gpu else vocab)
    bb = relax.BlockBuilder(mod)
    batch = tirx.Var("batch_size", "int64")
    f32 = "float32"

    def tensor(shape, dtype=f32):
        return relax.TensorType(shape, dtype)

    logits = relax.Var("logits", tensor([batch, vocab]))
    bitmask = relax.Var("bitmask", tensor([batch, -(-vocab // 32)], "int32"))
    with bb.function("apply_bitmask", [logits, bitmask]):
        with bb.dataflow():
            masking = bb.add_func(L.bitmask_func(vocab, t, finite=target.kind.name == "webgpu"), "apply_bitmask_tir")
            out = bb.emit_output(bb.emit(relax.call_tir(masking, [logits, bitmask], tensor([batch, vocab]))))
        bb.emit_func_output(out)

    m = tirx.Var("m", "int64")
    logits = relax.Var("logits", tensor([batch, vocab]))
    rows, ids, bias = (relax.Var(n, tensor([m], d)) for n, d in (("rows", "int32"), ("token_ids", "int32"),
                                                                  ("bias", f32)))
    with bb.function("apply_logit_bias", [logits, rows, ids, bias]):
        with bb.dataflow():
            copy = bb.emit(relax.call_tir(bb.add_func(L.copy_func(vocab, t), "logits_copy"), [logits],
                                          tensor([batch, vocab])))
            out = bb.emit(relax.call_tir_inplace(bb.add_func(L.bias_scatter_func(vocab, t), "logit_bias_scatter"),
                                                 [copy, rows, ids, bias], [0], tensor([batch, vocab])))
            out = bb.emit_output(out)
        bb.emit_func_output(out)

    if logprobs:
        logits = relax.Var("logits", tensor([batch, vocab]))
        ids = relax.Var("ids", tensor([batch], "int32"))
        with bb.function("logprobs", [logits, ids]):
            with bb.dataflow():
                top_idx, top_val = _top_k(bb, logits, batch, vocab, LOGPROBS_K, chunk, t)
                s = bb.emit(relax.call_tir(bb.add_func(L.sum_exp_func(vocab, LOGPROBS_K, t), "logprobs_sum_exp"),
                                           [logits, top_val], tensor([batch])))
                lp = bb.emit(relax.call_tir(bb.add_func(L.logprob_func(vocab, LOGPROBS_K, t), "logprobs_finish"),
                                            [logits, ids, top_val, s],
                                            [tensor([batch]), tensor([batch, LOGPROBS_K])]))
                out = bb.emit_output(relax.Tuple([relax.TupleGetItem(lp, 0), top_idx, relax.TupleGetItem(lp, 1)]))
            bb.emit_func_output(out)
    return bb.get()


def _top_k(bb, values, batch, n: int, k: int, chunk: int, threads: int | None):
    """K selection rounds over groups of `chunk` (schedules/logit_processing.py), then, where a row had several groups, K
    rounds over the groups' picks. -> (idx int32 [b, K], val [b, K]) as Relax values."""
    from tvm import relax

    from mlcc.schedules import logit_processing as L

    def rounds(inputs, n_in, group, with_index, name):
        groups = -(-n_in // group)
        sinfo = [relax.TensorType([batch, groups], "int32"), relax.TensorType([batch, groups], "float32")]
        first = bb.add_func(L.topk_round_func(n_in, group, True, with_index, threads), f"{name}_first")
        rest = bb.add_func(L.topk_round_func(n_in, group, False, with_index, threads), f"{name}_next")
        picks = [bb.emit(relax.call_tir(first, inputs, sinfo))]
        for _ in range(k - 1):
            prev = picks[-1]
            picks.append(bb.emit(relax.call_tir(rest, inputs + [relax.TupleGetItem(prev, 0),
                                                                relax.TupleGetItem(prev, 1)], sinfo)))
        idx = bb.emit(relax.op.concat([relax.TupleGetItem(p, 0) for p in picks], axis=1))
        val = bb.emit(relax.op.concat([relax.TupleGetItem(p, 1) for p in picks], axis=1))
        return idx, val, groups

    idx, val, groups = rounds([values], n, chunk, False, "topk_chunk")
    if groups == 1:
        return idx, val
    # candidates are [b, K * groups], round-major; the second rounds only need their values and indices
    idx, val, _ = rounds([val, idx], k * groups, k * groups, True, "topk_merge")
    return idx, val
