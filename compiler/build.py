"""`mlcc compile`: model source → Relax → quantized → library + weights + config in one folder."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mlcc import artifact
from mlcc.options import CompileOptions
from mlcc.relax_models import Family, family_for
from mlcc.targets import TargetPreset, get_target

from .quantize import Quantization, get_quantization, group_quantize, quantize_model
from .sampling import attach_sampler
from .weights import ModelSource, iter_float_params, load_source

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CompileReport:
    output: Path
    seconds_export: float
    seconds_compile: float
    seconds_weights: float
    library_bytes: int
    weight_bytes: int


@dataclasses.dataclass
class BuiltModule:
    """The exported Relax module and everything needed to pair it with weights."""

    mod: Any
    params: list[dict[str, Any]]   # name/shape/dtype in the VM's parameter order
    stamp: dict[str, Any]
    family: Family
    cfg: Any
    quant: Quantization
    preset: TargetPreset
    target: Any
    options: CompileOptions


def export_module(source: ModelSource, preset: TargetPreset, quant: Quantization,
                  context_window: int | None = None, tensor_parallel: int = 1,
                  options: CompileOptions | None = None) -> BuiltModule:
    options = options or CompileOptions()
    family = family_for(source.model_type, source.kind)
    cfg = family.config_cls.from_hf(source.config)
    if context_window:
        cfg.context_window_size = context_window
    family.check_tensor_parallel(cfg, tensor_parallel, quant.group_size if quant.kind == "group" else None)
    cfg.tensor_parallel_shards = tensor_parallel
    target = preset.tvm_target()
    if target.kind.name == "webgpu":
        quant = dataclasses.replace(quant, magic_int_to_float=False)
    model = family.model_cls(cfg, target)
    model = quantize_model(model, quant)
    _check_quantizable(model, quant)
    mod, named_params = model.export_tvm(spec=model.get_default_spec())
    params = [{"name": n, "shape": [int(d) for d in p.shape], "dtype": p.dtype} for n, p in named_params]
    stamp = artifact.make_stamp(family.name, quant.name, preset.name, params, options)
    mod = _attach_metadata(mod, stamp)
    # GPUs get a hand-scheduled argmax: dlight's generic reduction of relax's argmax took 93 us per token over a
    # 128k vocabulary on the H200 (profile_llama3-8b-q4f16_1_h200.json). WGSL needs the int32 index and keeps the
    # simple one-workgroup-per-row form; the others split each row over many blocks.
    gpu = "gpu" in target.keys
    mod = _attach_argmax(mod, cfg.vocab_size, int32_index=gpu, threads=256,
                         chunk=2048 if gpu and target.kind.name != "webgpu" else None)
    if target.kind.name != "webgpu":
        # TVM's GPU sort (top-p) needs blockIdx.z, which WGSL lacks; the JS engine samples from logits instead
        mod = attach_sampler(mod, cfg.vocab_size)
    return BuiltModule(mod, params, stamp, family, cfg, quant, preset, target, options)


def _check_quantizable(model, quant: Quantization) -> None:
    if quant.kind != "group":
        return
    for name, p in model.named_parameters():
        if name.endswith("q_scale") and p.shape[1] == 0:
            raise ValueError(f"{name}: input dim smaller than the {quant.name} group size {quant.group_size}")


def _attach_metadata(mod, stamp: dict[str, Any]):
    """A `_metadata()` function in the library itself, so a library cannot be paired silently with other weights."""
    import tvm
    from tvm import relax

    func = relax.Function([], tvm.ir.StringImm(json.dumps(stamp)), is_pure=True)
    mod["_metadata"] = func.with_attr("global_symbol", "_metadata")
    return mod


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


def _argmax_int32_func(vocab: int, threads: int = 256):
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


def _argmax_chunked_funcs(vocab: int, chunk: int, threads: int):
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


def _attach_argmax(mod, vocab: int, int32_index: bool = False, threads: int = 256, chunk: int | None = None):
    """`argmax_logits(logits[b, vocab]) -> int32[b]`: greedy sampling on the device, so only ids reach the host."""
    from tvm import relax, tirx

    bb = relax.BlockBuilder(mod)
    batch = tirx.Var("batch_size", "int64")
    logits = relax.Var("logits", relax.TensorType([batch, vocab], "float32"))
    with bb.function("argmax_logits", [logits]):
        with bb.dataflow():
            if chunk:
                stage1, stage2, chunks = _argmax_chunked_funcs(vocab, chunk, threads)
                parts = bb.emit(relax.call_tir(bb.add_func(stage1, "argmax_partial"), [logits],
                                               [relax.TensorType([batch, chunks], "int32"),
                                                relax.TensorType([batch, chunks], "float32")]))
                both = bb.emit(relax.call_tir(bb.add_func(stage2, "argmax_merge"),
                                              [relax.TupleGetItem(parts, 0), relax.TupleGetItem(parts, 1)],
                                              [relax.TensorType([batch], "int32"),
                                               relax.TensorType([batch], "float32")]))
                ids = bb.emit(relax.TupleGetItem(both, 0))
            elif int32_index:
                gv = bb.add_func(_argmax_int32_func(vocab, threads), "argmax_i32")
                both = bb.emit(relax.call_tir(gv, [logits], [relax.TensorType([batch], "int32"),
                                                             relax.TensorType([batch], "float32")]))
                ids = bb.emit(relax.TupleGetItem(both, 0))
            else:
                ids = bb.emit(relax.op.astype(relax.op.argmax(logits, axis=-1), "int32"))
            out = bb.emit_output(ids)
        bb.emit_func_output(out)
    return bb.get()


def builds_graph_decode(built: BuiltModule) -> bool:
    """CUDA, one GPU: batch-1 decode gets a whole-step CUDA graph (compiler/graph_decode.py). Disco workers (tensor
    parallel) keep plain decode: the graph's attention alias is registered by runtime.model, not in their processes."""
    return built.options.decode_graph and built.target.kind.name == "cuda" and built.cfg.tensor_parallel_shards == 1


def compile_library(built: BuiltModule, out_path: Path, tuning_db: str | Path | None = None):
    import tvm

    from .pipeline import build_pipeline

    config = {}
    if built.target.kind.name != "llvm" and built.cfg.rope_scaling:
        # TVM 0.27 bug: TIR CSE breaks the GPU tree-attention kernel under scaled RoPE ("cse_v21 has been used
        # before definition"). nvcc/NVRTC run their own CSE, so the kernels lose little without it.
        config["tirx.disable_cse_tir"] = True
    from mlcc.schedules.cuda_pdl import tir_pipeline_for
    from mlcc.targets.toolchains import toolchain_for

    mod = built.mod  # (for a wasm host, relax.build itself marks the module as a system library for tvmjs)
    if builds_graph_decode(built):
        from .graph_decode import add_graph_decode

        mod = add_graph_decode(mod)
    with toolchain_for(built.target.kind.name), tvm.transform.PassContext(config=config):
        ex = tvm.compile(mod, built.target, relax_pipeline=build_pipeline(built.target, tuning_db, built.options),
                         tir_pipeline=tir_pipeline_for(built.target, built.options))
        if built.target.kind.name == "webgpu":
            from mlcc.web.wasm_link import export_wasm

            export_wasm(ex, out_path)
        else:
            ex.export_library(str(out_path))
    return ex


def iter_params(source: ModelSource, built: BuiltModule, rank: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Our parameters in their stored form, one at a time (this rank's shard; quantized where expected)."""
    wanted = {p["name"]: p for p in built.params}
    shards = built.cfg.tensor_parallel_shards
    for name, w in iter_float_params(source, built.family, built.cfg):
        w = built.family.shard_weight(name, w, built.cfg, rank, shards)
        base = name[: -len(".weight")]
        if f"{base}.q_weight" in wanted:
            qw, qs = group_quantize(w, built.quant)
            yield f"{base}.q_weight", qw
            yield f"{base}.q_scale", qs
        else:
            spec = wanted.get(name)
            if spec is None:
                raise ValueError(f"weight plan produced '{name}', which the model does not have")
            if list(w.shape) != spec["shape"]:
                raise ValueError(f"{source.path}: '{name}' has shape {list(w.shape)}, the config implies "
                                 f"{spec['shape']}; the checkpoint and config.json disagree")
            yield name, w.astype(spec["dtype"])


def write_weights(source: ModelSource, built: BuiltModule, out: Path, rank: int = 0) -> None:
    from tqdm import tqdm
    from tvm.contrib import tvmjs

    shards = built.cfg.tensor_parallel_shards
    desc = "converting weights" + (f" (shard {rank + 1}/{shards})" if shards > 1 else "")
    params = tqdm(iter_params(source, built, rank), total=len(built.params), desc=desc, unit="tensor",
                  file=sys.stderr)
    # TVM's writer prints one line per tensor to stdout; keep stdout for the program's own output.
    with contextlib.redirect_stdout(io.StringIO()):
        tvmjs.dump_tensor_cache(params, str(out), encode_format="raw", show_progress=False)
    artifact.add_shard_checksums(out)
    cache = json.loads((out / artifact.TENSOR_CACHE_FILE).read_text())
    have = {r["name"] for s in cache["records"] for r in s["records"]}
    missing = [p["name"] for p in built.params if p["name"] not in have]
    if missing:
        raise ValueError(f"weights for {missing[:3]}... were not produced; the checkpoint is incomplete")


def _config_json(built: BuiltModule, lib_name: str, tok: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
    return {
        "model_type": built.family.name,
        "model_config": dataclasses.asdict(built.cfg),
        "quantization": built.quant.name,
        "model_dtype": built.quant.model_dtype,
        "target": built.preset.name,
        "device": built.preset.device,
        "library": lib_name,
        "cuda_arch": str(built.target.attrs["arch"]) if built.target.kind.name == "cuda" else None,
        "context_window_size": built.cfg.context_window_size,
        "tensor_parallel": built.cfg.tensor_parallel_shards,
        "vocab_size": built.cfg.vocab_size,
        "hidden_size": built.cfg.hidden_size,
        "params": built.params,
        "tokenizer": tok,
        "source": source,
        "stamp": built.stamp,
    }


def compile_shape_only(model_type: str, hf_config: dict[str, Any], target: str, quant: str,
                       output: str | Path, tensor_parallel: int = 1, options: CompileOptions | None = None) -> float:
    """Library + config for a config with no checkpoint (benchmarks fill the weights with random values)."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    source = ModelSource("config", out, model_type, hf_config, {})
    t0 = time.time()
    built = export_module(source, get_target(target), get_quantization(quant), tensor_parallel=tensor_parallel,
                          options=options)
    lib_name = "model" + built.preset.lib_ext
    compile_library(built, out / lib_name)
    seconds = time.time() - t0
    cfg = _config_json(built, lib_name, {}, {"kind": "config", "path": str(out)})
    cfg["weights"] = "none"
    (out / artifact.CONFIG_FILE).write_text(json.dumps(cfg, indent=1))
    return seconds


def compile_model(model: str | Path, target: str, quant: str, output: str | Path,
                  context_window: int | None = None, tuning_db: str | Path | None = None,
                  tensor_parallel: int = 1, options: CompileOptions | None = None) -> CompileReport:
    """Compile `model` (HF folder or .gguf) for `target` with `quant` into the artifacts folder `output`."""
    if target == "auto":
        from mlcc.targets import detect_local

        target = detect_local()
    preset, q = get_target(target), get_quantization(quant)   # fail fast on bad names, before loading anything
    if preset.lib_ext == ".wasm":
        from mlcc.web.wasm_runtime import emcc_path

        emcc_path()  # the link step needs emscripten: say so before minutes of compiling
    out = Path(output)
    source = load_source(model)
    t0 = time.time()
    built = export_module(source, preset, q, context_window, tensor_parallel, options)
    t1 = time.time()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lib_name = "model" + preset.lib_ext
    log.info("compiling %s (%s, %s) for %s ...", source.path.name, built.family.name, q.name, preset.name)
    if tuning_db is not None and not (Path(tuning_db) / "database_tuning_record.json").exists():
        raise FileNotFoundError(f"{tuning_db}: no tuning database there (create one with `mlcc tune`)")
    compile_library(built, tmp / lib_name, tuning_db)
    t2 = time.time()
    log.info("compiled in %.1fs; converting weights ...", t2 - t1)
    if tensor_parallel == 1:
        write_weights(source, built, tmp)
    else:
        for rank in range(tensor_parallel):  # one tensor cache per GPU, each loaded by its own disco worker
            write_weights(source, built, tmp / artifact.shard_dir(rank), rank)
    t3 = time.time()
    from .tokenizer_files import write_tokenizer

    tok = write_tokenizer(source.kind, source.path, tmp)
    config = _config_json(built, lib_name, tok, {"kind": source.kind, "path": str(source.path)})
    (tmp / artifact.CONFIG_FILE).write_text(json.dumps(config, indent=1))
    # Replace the output only once everything is written: an interrupted compile leaves the old folder intact.
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    lib_bytes = (out / lib_name).stat().st_size
    weight_bytes = sum(f.stat().st_size for f in out.rglob("params_shard_*.bin"))
    report = CompileReport(out, t1 - t0, t2 - t1, t3 - t2, lib_bytes, weight_bytes)
    log.info("wrote %s: library %.1f MB, weights %.1f MB", out, lib_bytes / 1e6, weight_bytes / 1e6)
    return report
