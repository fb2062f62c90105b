"""A host PrimFunc that calls one of two functions of the same library by a size: what the CUDA passes put in the
place of a kernel they give a small-size variant (cuda_few_query_attention, cuda_few_token_gemv). TVM's lowering
keeps one kernel schedule per PrimFunc, so the variants stay separate functions and the choice is made on the host,
by a direct call (call_cpacked) that costs what a C call does.
"""

from __future__ import annotations

from tvm import tirx


def host_dispatch(signature: tirx.PrimFunc, size: tirx.PrimExpr, limit: int, small: str, large: str,
                  attrs: dict | None = None) -> tirx.PrimFunc:
    """A PrimFunc with `signature`'s parameters (and the shape variables they bind) calling the library function
    `small` with all of them where `size` (an expression of those variables) is at most `limit`, else `large`."""
    params = list(signature.params)

    def call(name: str) -> tirx.Stmt:
        return tirx.Evaluate(tirx.call_cpacked(name, *params))

    body = tirx.IfThenElse(size <= limit, call(small), call(large))
    return tirx.PrimFunc(params, body, signature.ret_type).with_attrs({"tirx.is_scheduled": True, **(attrs or {})})
