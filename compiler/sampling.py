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
