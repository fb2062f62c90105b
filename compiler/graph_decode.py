"""`decode_graph`: batch-1 decode replayed as one CUDA graph per step, the paged-attention calls included.

TVM's RewriteCUDAGraph captures only the stretches between KV-cache calls, because `vm.builtin.*` calls and
function inputs are never static. That left 2 graph launches per layer (3-4 us of idle GPU each on an H200), and
without graphs the host spends ~54 us per layer launching kernels. Here the attention call is made capturable:

- the KV cache becomes a static parameter (it is one object for the model's life) and the attention is called
  through `GRAPH_ATTENTION`, an alias of TVM's builtin that RewriteCUDAGraph does not exclude;
- the step's input embedding (looked up first: the function takes the token id) is copied into a planned buffer
  (an opaque kernel outside the graph), so no kernel of the step reads a function input;
- the kernels the KV cache launches read its per-step metadata (positions, page tables) from one device buffer that
  BeginForward refills, at offsets that move when the sequence's page count (and with sliding-window layers, the count
  of pages their window spans) crosses a multiple of 4 (runtime.device.graph_decode.decode_layout). The caller passes
  `(kv_cache_id, kv_layout)`, a number it gives each KV cache object and that layout; RewriteCUDAGraph keys its graphs
  by both (a graph holds the addresses of one cache's buffers), so each layout of each cache is captured once (on its
  first step, which runs normally) and replayed.

Valid for one sequence whose pages form a single block (not forked), with the metadata already
on the device (`vm.builtin.attention_kv_cache_get_query_positions` before the call): runtime.device.model checks this and
uses `decode` otherwise. A build for several GPUs (disco) keeps plain decode.
"""

from __future__ import annotations

import tvm
from tvm import relax

from mlcc.artifact import GRAPH_ATTENTION
from mlcc.artifact import GRAPH_DECODE_FUNCTION as FUNCTION

ATTENTION_BUILTIN = "vm.builtin.attention_kv_cache_attention_with_fused_qkv"
LAYOUT_VAR = "kv_layout"
CACHE_VAR = "kv_cache_id"


def _copy_func(shape: list[int], dtype: str) -> tvm.tirx.PrimFunc:
    from tvm import te

    x = te.placeholder(shape, dtype, name="x")
    # A plain copy (even `x + 0`, which TE folds) is a reshape to RewriteDataflowReshape, which would turn it back
    # into a view of the input; a bit-level round trip is not. Opaque: FuseOps must not fold it into the first
    # RMSNorm either.
    bits = f"uint{tvm.DataType(dtype).bits}"
    y = te.compute(shape, lambda *i: tvm.tirx.reinterpret(dtype, tvm.tirx.reinterpret(bits, x(*i))), name="y")
    return te.create_prim_func([x, y]).with_attr("op_pattern", 8).without_attr("global_symbol")


@relax.expr_functor.mutator
class _Rewrite(relax.PyExprMutator):
    def __init__(self, mod, embeds: relax.Var, embeds_copy: relax.Var, key: list[tvm.tirx.Var]):
        super().__init__(mod)
        self.embeds, self.embeds_copy, self.key = embeds, embeds_copy, key
        self.attention_calls = 0

    def visit_var_(self, var: relax.Var) -> relax.Expr:
        return self.embeds_copy if var.same_as(self.embeds) else var

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if call.op.same_as(tvm.ir.Op.get("relax.call_dps_packed")) and isinstance(call.args[0], relax.ExternFunc) \
                and call.args[0].global_symbol == ATTENTION_BUILTIN:
            self.attention_calls += 1
            # the key's variables as arguments: RewriteCUDAGraph keys a graph by the variables its calls use
            args = list(call.args[1].fields) + [relax.prim_value(v) for v in self.key]
            return relax.call_dps_packed(relax.ExternFunc(GRAPH_ATTENTION), relax.Tuple(args), list(call.ty_args))
        return call


def add_graph_decode(mod: tvm.IRModule) -> tvm.IRModule:
    """`decode_graph(input_ids[1], (kv_cache_id, kv_layout), kv_cache, params)`: `embed` then a copy of `decode`,
    ready for RewriteCUDAGraph. Taking the token id (not its embedding) saves the step a VM call from Python."""
    decode = relax.utils.copy_with_new_vars(mod["decode"])
    embeds, kv_cache, params = decode.params
    key_vars = [tvm.tirx.Var(CACHE_VAR, "int64"), tvm.tirx.Var(LAYOUT_VAR, "int64")]
    key = relax.Var("graph_key", relax.ShapeType(key_vars))
    ids = relax.Var("input_ids", relax.TensorType([1], "int32"))
    sinfo = embeds.ty
    shape = [int(d) for d in sinfo.shape]
    bb = relax.BlockBuilder(mod)
    gv_copy = bb.add_func(_copy_func(shape, sinfo.dtype), "graph_input_copy")
    mod = bb.get()
    looked_up = relax.DataflowVar("looked_up", relax.TensorType([1, shape[-1]], sinfo.dtype))
    embeds_copy = relax.DataflowVar("embeds_copy", sinfo)

    rewrite = _Rewrite(mod, embeds, embeds_copy, key_vars)
    body = rewrite.visit_expr(decode.body)
    if rewrite.attention_calls == 0:
        raise ValueError("decode has no paged-attention call to capture; the model is not built on PagedKVCache")
    first = body.blocks[0]
    if not isinstance(first, relax.DataflowBlock):
        raise ValueError("decode does not start with a dataflow block")
    lookup = relax.VarBinding(looked_up, relax.BlockBuilder(mod).normalize(
        relax.Call(mod.get_global_var("embed"), [ids, params])))
    reshaped = relax.BlockBuilder(mod).normalize(relax.op.reshape(looked_up, shape))
    copy = relax.VarBinding(embeds_copy, relax.call_tir(gv_copy, [reshaped], sinfo))
    blocks = [relax.DataflowBlock([lookup, copy] + list(first.bindings))] + list(body.blocks[1:])
    func = relax.Function([ids, key, kv_cache, params], relax.SeqExpr(blocks, body.body),
                          decode.ret_ty, decode.is_pure, decode.attrs)
    # inputs: the id and the key; the KV cache (for the graphs of one key) and the weights are fixed
    func = func.with_attr("num_input", 2).with_attr("global_symbol", FUNCTION) \
        .with_attr("relax.rewrite_cuda_graph.capture_symbolic_vars", [CACHE_VAR, LAYOUT_VAR])
    mod[FUNCTION] = func
    return mod


def rewrite_cuda_graph_pass() -> tvm.transform.Pass:
    """RewriteCUDAGraph on decode_graph alone: the other functions keep launching their kernels from the VM (for
    batched decode and prefill that costs little; TVM's partial graphs of plain decode cost more than they save
    on big layers, see bench/results)."""

    @tvm.transform.module_pass(opt_level=0, name="mlcc_rewrite_cuda_graph")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        if FUNCTION not in [gv.name_hint for gv in mod.functions]:
            return mod
        # (decode_graph calls embed, which has nothing to capture: its shapes are symbolic)
        others = {gv: f for gv, f in mod.functions.items()
                  if isinstance(f, relax.Function) and gv.name_hint not in (FUNCTION, "embed")}
        sub = tvm.IRModule({gv: f for gv, f in mod.functions.items() if gv not in others}, attrs=mod.attrs)
        config = dict(_ctx.config)
        config["relax.backend.use_cuda_graph"] = True
        with tvm.transform.PassContext(opt_level=_ctx.opt_level, config=config):
            sub = relax.transform.RewriteCUDAGraph()(sub)
        for gv, f in others.items():
            sub[gv] = f
        return sub

    return _pass
