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
    return size_dispatch(params, signature.ret_type, size, limit, tirx.call_cpacked(small, *params),
                         tirx.call_cpacked(large, *params), attrs)


def size_dispatch(params: list, ret_type, size: tirx.PrimExpr, limit: int, small: tirx.PrimExpr | list,
                  large: tirx.PrimExpr | list, attrs: dict | None = None) -> tirx.PrimFunc:
    """A scheduled host PrimFunc over `params` evaluating the call `small` where `size` is at most `limit`, else
    `large` (a library function's direct call, or a global function's packed call; a list: calls made in order)."""

    def calls(c: tirx.PrimExpr | list) -> tirx.Stmt:
        return tirx.SeqStmt([tirx.Evaluate(e) for e in c]) if isinstance(c, list) else tirx.Evaluate(c)

    body = tirx.IfThenElse(size <= limit, calls(small), calls(large))
    return tirx.PrimFunc(params, body, ret_type).with_attrs({"tirx.is_scheduled": True, **(attrs or {})})
