"""Source weights → our stored parameters, converted on a thread pool a slice at a time.

A big 2-D weight (an embedding, a projection) that needs no correction or combining is read, dequantized and
re-quantized a few rows at a time straight from the source's memory map, each slice on whichever worker is free, into
the output arrays: no float copy of the whole matrix exists at any time. Everything else (fused q/k/v, corrected
tensors, stacked experts, tensor-parallel shards) is converted whole, one parameter per task. numpy releases the GIL
in its loops, so the workers run in parallel with each other and with a TVM compile on the main thread.

Parameters come out in the family plan's order whatever order the workers finish in, so the shards written from
them are the same bytes as a one-at-a-time conversion's.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from mlcc.errors import ModelSourceError
from mlcc.quantization import MXFP4, Quantization
from mlcc.relax_models.weight_plans import _concat as plan_concat

from .int4_checkpoint import Int4Weight
from .quant_schemes import pack_codes, pack_zeros, quantize_weight, stored_names
from .weights import ModelSource, float_param, source_fixups

# a slice of ~4 MB of float32 per task: its temporaries stay in cache, and there are enough slices to keep every
# worker busy on one matrix
SLICE_ELEMENTS = 1 << 20
# weights (counted in source elements) being converted at once: bounds the converter's memory
IN_FLIGHT_ELEMENTS = 24 << 20


def default_workers() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


@dataclasses.dataclass
class _Job:
    """One parameter of the plan: start() allocates its outputs and returns its tasks (each returns the source
    elements it converted); outputs are complete once every task is done."""

    elements: int
    start: Callable[[], list[Callable[[], int]]]
    outputs: list[tuple[str, np.ndarray]] = dataclasses.field(default_factory=list)


def total_elements(built: Any) -> int:
    """Source elements the conversion goes through (the unit of its progress)."""
    return sum(_elements(built, p) for p in built.params if not p["name"].endswith((".q_scale", ".q_zero")))


def _elements(built: Any, spec: dict[str, Any]) -> int:
    n = int(np.prod(spec["shape"])) if spec["shape"] else 1
    return n * built.quant.per_word if spec["name"].endswith(".q_weight") else n


def converted_params(source: ModelSource, built: Any, rank: int = 0, workers: int | None = None,
                     progress: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
                     slots: threading.Semaphore | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters in their stored form (this rank's shard; quantized where expected), in plan order.

    slots: held by each task while it runs, where fewer tasks than workers may run at a time (fewer while another
    stage has a core, more once the caller releases it)."""
    jobs = collections.deque(_jobs(source, built, rank))
    lock = threading.Lock()

    def gated(task: Callable[[], int]) -> Callable[[], int]:
        if slots is None:
            return task

        def run() -> int:
            with slots:
                return task()

        return run

    def report(f: Future) -> None:
        if progress is not None and not f.cancelled() and f.exception() is None:
            with lock:
                progress(f.result())

    pool = ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="mlcc-weights")
    running: collections.deque[tuple[_Job, list[Future]]] = collections.deque()
    in_flight = 0
    try:
        while jobs or running:
            while jobs and (not running or in_flight + jobs[0].elements <= IN_FLIGHT_ELEMENTS):
                job = jobs.popleft()
                futures = [pool.submit(gated(task)) for task in job.start()]
                for f in futures:
                    f.add_done_callback(report)
                running.append((job, futures))
                in_flight += job.elements
            job, futures = running.popleft()
            for f in futures:
                f.result()
            in_flight -= job.elements
            if cancel is not None and cancel.is_set():
                return
            yield from job.outputs
            job.outputs.clear()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _jobs(source: ModelSource, built: Any, rank: int) -> Iterator[_Job]:
    wanted = {p["name"]: p for p in built.params}
    shards = built.cfg.tensor_parallel_shards
    fixups = source_fixups(source, built.family, built.cfg)
    for ours, (names, combine) in built.family.weight_plan(built.cfg, source.kind).items():
        base = ours.removesuffix(".weight")
        quantized = f"{base}.q_weight" in wanted
        if quantized and wanted.get(f"{base}.q_scale", {}).get("dtype") == MXFP4.scale_dtype:
            yield _mxfp4_job(source, built, rank, ours, names, combine, fixups, wanted)
            continue
        if quantized and keeps_int4(source, built.quant, names, combine, fixups):
            yield _int4_job(source, built, rank, ours, names, wanted)
            continue
        specs = [wanted[f"{base}.{s}"] for s in stored_names(built.quant)] if quantized else [wanted.get(ours)]
        reader = (source.row_reader(names[0]) if shards == 1 and len(names) == 1 and combine is None
                  and names[0] not in fixups and specs[0] is not None else None)
        if reader is not None and reader[0] == specs[0]["shape"][0] and len(specs[0]["shape"]) == 2:
            yield _sliced_job(built, base if quantized else ours, quantized, specs, *reader)
        else:
            yield _whole_job(source, built, rank, ours, names, combine, fixups, wanted)


def _sliced_job(built: Any, name: str, quantized: bool, specs: list[dict[str, Any]], rows: int,
                read: Callable[[int, int], np.ndarray]) -> _Job:
    elements = _elements(built, specs[0])
    k = elements // rows
    step = max(1, SLICE_ELEMENTS // k)

    def start() -> list[Callable[[], int]]:
        outs = [np.empty(s["shape"], s["dtype"]) for s in specs]
        job.outputs[:] = (list(zip([f"{name}.{s}" for s in stored_names(built.quant)], outs)) if quantized
                          else [(name, outs[0])])

        def task(lo: int, hi: int) -> int:
            w = read(lo, hi)
            if quantized:
                for out, part in zip(outs, quantize_weight(w, built.quant)):
                    out[lo:hi] = part
            else:
                outs[0][lo:hi] = w
            return (hi - lo) * k

        return [lambda lo=lo: task(lo, min(lo + step, rows)) for lo in range(0, rows, step)]

    job = _Job(elements, start)
    return job


def _whole_job(source: ModelSource, built: Any, rank: int, ours: str, names: list[str], combine: Callable | None,
               fixups: dict[str, Callable], wanted: dict[str, dict[str, Any]]) -> _Job:
    base = ours[: -len(".weight")]
    spec = wanted.get(f"{base}.q_weight") or wanted.get(ours)
    elements = _elements(built, spec) if spec is not None else 0

    def task() -> int:
        w = float_param(source, names, combine, fixups)
        w = built.family.shard_weight(ours, w, built.cfg, rank, built.cfg.tensor_parallel_shards)
        if f"{base}.q_weight" in wanted:
            job.outputs[:] = list(zip([f"{base}.{s}" for s in stored_names(built.quant)],
                                      quantize_weight(w, built.quant)))
            return elements
        if spec is None:
            raise ValueError(f"weight plan produced '{ours}', which the model does not have")
        if list(w.shape) != spec["shape"]:
            raise ValueError(f"{source.path}: '{ours}' has shape {list(w.shape)}, the config implies "
                             f"{spec['shape']}; the checkpoint and config.json disagree")
        job.outputs[:] = [(ours, w.astype(spec["dtype"]))]
        return elements

    job = _Job(elements, lambda: [task])
    return job


# -- published 4-bit weights, kept as they are ------------------------------------------------------------------

def keeps_int4(source: ModelSource, q: Quantization, names: list[str], combine: Callable | None,
               fixups: dict[str, Callable]) -> bool:
    """Whether parameter sources `names` are a published 4-bit checkpoint's weights that scheme `q` stores as they
    are: q is one of the 4-bit group schemes such checkpoints map to (mlcc.quantization), and the plan joins the
    sources by rows and corrects none of them (a value change would mean re-rounding)."""
    if source.int4 is None or q.kind != "group" or q.bits != 4 or q.storage_dtype != "uint32" or \
            not (not q.symmetric or q.zero_code == 8):
        return False
    if not all(source.stored_int4(n) for n in names):
        return False
    return combine in (None, plan_concat) and not any(n in fixups for n in names)


def _int4_job(source: ModelSource, built: Any, rank: int, ours: str, names: list[str],
              wanted: dict[str, dict[str, Any]]) -> _Job:
    """One projection of a published 4-bit checkpoint into scheme built.quant: its codes, scales and zero points
    repacked (codes and zero points bit for bit, scales converted exactly into the scheme's dtype)."""
    q, base = built.quant, ours.removesuffix(".weight")
    specs = [wanted[f"{base}.{s}"] for s in stored_names(q)]
    elements = _elements(built, specs[0])

    def task() -> int:
        parts = [_regrouped(source, n, q) for n in names]
        codes = np.concatenate([p.codes for p in parts])
        scale = np.concatenate([p.scale for p in parts])
        zero = np.concatenate([np.full(p.scale.shape, 8, np.uint8) if p.zero is None else p.zero for p in parts])
        codes, scale, zero = (built.family.shard_weight(ours, a, built.cfg, rank, built.cfg.tensor_parallel_shards)
                              for a in (codes, scale, zero))
        if q.symmetric and (zero != q.zero_code).any():
            raise ModelSourceError(f"{source.path}: '{names[0]}' has zero points other than {q.zero_code}, which "
                                   f"{q.name} does not store; compile with --quant {q.name.replace('g128', 'awq')}")
        stored = scale.astype(q.scale_dtype)
        if not np.array_equal(stored.astype(np.float32), scale):
            raise ModelSourceError(f"{source.path}: the scales of '{names[0]}' are not all {q.scale_dtype} values "
                                   f"(too small or large for it); compile with --quant "
                                   f"{q.name.replace('f16', 'f32')}, whose scales are float32")
        arrays = [pack_codes(codes, q), stored] + ([] if q.symmetric else [pack_zeros(zero, q)])
        for spec, a in zip(specs, arrays):
            if list(a.shape) != spec["shape"]:
                raise ValueError(f"{source.path}: '{ours}' comes to {list(a.shape)}, the config implies "
                                 f"{spec['shape']}; the checkpoint and config.json disagree")
        job.outputs[:] = list(zip([f"{base}.{s}" for s in stored_names(q)], arrays))
        return elements

    job = _Job(elements, lambda: [task])
    return job


def _regrouped(source: ModelSource, name: str, q: Quantization) -> Int4Weight:
    try:
        return source.int4_weight(name).regrouped(q.group_size)
    except ValueError as e:
        raise ModelSourceError(f"{source.path}: '{name}' cannot be kept as published in {q.name}: {e}; compile "
                               f"with --quant q4{q.name[2:5]}_1 (re-quantized from its dequantized values) or "
                               f"q0{q.name[2:5]}") from None


# -- MXFP4 weights, kept as they are ----------------------------------------------------------------------------

def _mxfp4_job(source: ModelSource, built: Any, rank: int, ours: str, names: list[str], combine: Callable | None,
               fixups: dict[str, Callable], wanted: dict[str, dict[str, Any]]) -> _Job:
    """A parameter the model stores in MXFP4 (the family keeps a checkpoint's MXFP4 experts): the source's codes
    and exponents, arranged by the plan as its float values would be, and the codes packed eight a word."""
    base = ours.removesuffix(".weight")
    specs = [wanted[f"{base}.{s}"] for s in ("q_weight", "q_scale")]
    missing = [n for n in names if not source.stored_mxfp4(n) or n in fixups]
    if missing:
        raise ModelSourceError(f"{source.path}: '{missing[0]}' is not stored in MXFP4, but the model keeps '{ours}' "
                               "so; the checkpoint's quantization_config and its tensors disagree")
    elements = _elements(built, specs[0])

    def task() -> int:
        parts = [source.mxfp4_weight(n) for n in names]
        codes, exps = ((combine(list(ts)) if combine else ts[0]) for ts in zip(*parts))
        codes, exps = (built.family.shard_weight(ours, a, built.cfg, rank, built.cfg.tensor_parallel_shards)
                       for a in (codes, exps))
        words = pack_codes(codes.reshape(-1, codes.shape[-1]), MXFP4).reshape(*codes.shape[:-1], -1)
        arrays = [words, np.ascontiguousarray(exps, np.uint8)]
        for spec, a in zip(specs, arrays):
            if list(a.shape) != spec["shape"]:
                raise ValueError(f"{source.path}: '{ours}' comes to {list(a.shape)}, the config implies "
                                 f"{spec['shape']}; the checkpoint and config.json disagree")
        job.outputs[:] = list(zip([f"{base}.q_weight", f"{base}.q_scale"], arrays))
        return elements

    job = _Job(elements, lambda: [task])
    return job
