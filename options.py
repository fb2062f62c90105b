"""Every choice of a build and of an engine, each in one frozen value: `CompileOptions` (compile time) and
`EngineConfig` (run time).

`CompileOptions` goes from `compile_model` down the pass pipeline to the kernel generators, is written into the
library's ABI stamp and into `mlcc-config.json`, and is part of the JIT cache key: a library built with other
options is never reused silently, and the runtime refuses one whose options differ from those it is asked for.
Options a target cannot use (PDL off Hopper, the CUDA kernels on a CPU) are kept as given and simply have no
effect there. Kept free of TVM so the runtime can read it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from mlcc.errors import CompileOptionsError, EngineConfigError
from mlcc.kv_cache_format import KV_CACHE_DTYPES


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    # CUDA sm_90+: every kernel starts with programmatic dependent launch (it is queued while its predecessor drains)
    pdl: bool = True
    # CUDA, one GPU: batch-1 decode as one CUDA graph per step, the paged attention included
    decode_graph: bool = True
    # CUDA: mlcc's decode GEMV kernels for q4f16_1/float16 projections (False: dlight's GEMV rule)
    decode_gemv: bool = True
    # CUDA, with decode_gemv: the preceding RMSNorm and the SwiGLU folded into the GEMVs
    fuse_decode_gemv: bool = True
    # CUDA: split-KV paged decode attention (False: TVM's kernel)
    split_decode_attention: bool = True
    # split-KV attention: chunks each sequence's KV is split into (0: sized to fill the GPU)
    decode_attention_splits: int = 0
    # split-KV attention: most tokens a block scores per step (0: as many as its threads allow, up to 16)
    decode_attention_tokens: int = 0
    # CUDA: TVM's prefill attention rebuilt with a grid that fills the GPU
    wide_prefill_attention: bool = True
    # CUDA sm_80+: projections over several tokens (prefill, batched decode, speculative verify) of 2048 and wider
    # on mlcc's tensor-core GEMM (False: dlight's Matmul rule)
    prefill_gemm: bool = True
    # CUDA sm_80+: prefill self-attention on mlcc's tensor-core kernel (False: TVM's ragged prefill kernel)
    flash_prefill_attention: bool = True
    # CUDA: q4f16_1 projections over up to 8 tokens (speculative verify, a few streams) as one pass over the weights
    few_token_gemv: bool = True
    # CUDA: paged prefill attention of up to 32 query rows (a speculative verify's) on the split-KV kernel
    few_query_attention: bool = True
    # CUDA: float16/bfloat16 projections over more than 16 tokens on cuBLASLt (compiler/vendor_gemm.py), where the
    # shim builds on the compiling machine (g++, CUDA headers); False: mlcc's tensor-core GEMM
    vendor_gemm: bool = True
    # CUDA, with vendor_gemm: q4f16_1 projections over more than this many tokens decode their weights into a
    # float16 scratch and run on cuBLASLt (0: mlcc's q4 tensor-core GEMM at every size). Decoding all the weights
    # costs ~33 ms a forward on an H100 (8B), which cuBLASLt's speed repays from about 1,100 tokens (measured:
    # 0.69x at 512, 1.27x at 2,048, 1.58x at 8,192); batched decode stays on mlcc's GEMM.
    vendor_gemm_q4_tokens: int = 1024
    # what the paged KV cache stores K and V as: "auto" (the model's dtype), "int8" or "fp8_e4m3" (8-bit codes with
    # a float32 scale per token and KV head; mlcc/kv_cache_format.py)
    kv_cache_dtype: str = "auto"
    # LoRA adapters one step may mix (0: no LoRA): each projection adds its tokens' adapters' low-rank products,
    # read from a device pool of this many adapters that the runtime fills (relax_models/lora.py)
    max_loras: int = 0
    # with max_loras: the largest adapter rank the pool holds (smaller ranks are padded with zeros)
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            want = _KINDS.get(f.type, int)
            if type(v) is not want:
                raise CompileOptionsError(f"compile option {f.name} must be {want.__name__}, got {v!r}")
            if want is int and v < 0:
                raise CompileOptionsError(f"compile option {f.name} must be >= 0, got {v}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise CompileOptionsError(f"compile option kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                      f"got {self.kv_cache_dtype!r}")
        if self.max_loras and not self.max_lora_rank:
            raise CompileOptionsError("compile option max_lora_rank must be >= 1 with max_loras; the adapters' "
                                      "largest rank, e.g. max_lora_rank=16")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "CompileOptions":
        d = dict(d or {})
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise CompileOptionsError(f"unknown compile option(s) {', '.join(unknown)}; known: {cls.names()}")
        return cls(**d)

    @classmethod
    def parse(cls, items: list[str] | None) -> "CompileOptions":
        """From `KEY=VALUE` strings (the CLI's `--option`): booleans as 1/0/true/false/on/off, integers as digits."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        d: dict[str, Any] = {}
        for item in items or []:
            key, sep, raw = item.partition("=")
            key = key.strip().replace("-", "_")
            if not sep or key not in kinds:
                raise CompileOptionsError(f"--option {item!r}: expected KEY=VALUE with KEY one of {cls.names()}")
            raw = raw.strip().lower()
            if _KINDS.get(kinds[key]) is str:
                d[key] = raw
            elif kinds[key] in ("bool", bool):
                if raw not in _BOOLS:
                    raise CompileOptionsError(f"--option {item!r}: {key} takes 1/0, true/false or on/off")
                d[key] = _BOOLS[raw]
            else:
                if not raw.isdigit():
                    raise CompileOptionsError(f"--option {item!r}: {key} takes a non-negative integer")
                d[key] = int(raw)
        return cls(**d)

    def differences(self, other: "CompileOptions") -> dict[str, tuple[Any, Any]]:
        """{name: (self's value, other's value)} where they differ."""
        a, b = self.to_dict(), other.to_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}

    def as_cli(self) -> str:
        """The `--option` flags that rebuild these options (empty for the defaults)."""
        return " ".join(f"--option {k}={int(v) if isinstance(v, bool) else v}"
                        for k, (v, _) in self.differences(CompileOptions()).items())

    @classmethod
    def names(cls) -> str:
        return ", ".join(f.name for f in dataclasses.fields(cls))

    @classmethod
    def add_cli_argument(cls, parser: argparse.ArgumentParser, help_suffix: str = "") -> None:
        """`--option KEY=VALUE`, repeatable: the one declaration `compile`, `tune`, `chat` and `serve` share."""
        parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                            help=f"compile option, repeatable ({cls.names()}; see mlcc/options.py){help_suffix}")


_KINDS = {"bool": bool, bool: bool, "int": int, int: int, "str": str, str: str}
_BOOLS = {"1": True, "true": True, "on": True, "yes": True, "0": False, "false": False, "off": False, "no": False}


POLICIES = ("no_evict", "max_util")
# the <think> splitters of runtime/api/reasoning.py and the harmony one (gpt-oss), named as vLLM's --reasoning-parser
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Every run-time choice of an `Engine`, built once (from keyword arguments or from the CLI's flags) and passed
    down whole: the engine, its core and the KV cache read what they need from it."""

    # compile target and quantization of a model compiled on first use ("auto": this machine's device)
    target: str = "auto"
    quant: str | None = None
    # requests decoded together in one step
    max_batch: int = 4
    # at most the model's own context window (None: the model's)
    context_window: int | None = None
    # KV-cache capacity in tokens (None: from memory: enough for max_batch full contexts, within the budget below)
    kv_cache_tokens: int | None = None
    # GPUs: the fraction of the device's memory the weights, the KV cache and the activations may take together
    gpu_memory_utilization: float = 0.85
    # most prompt tokens one prefill step reads
    prefill_chunk: int = 512
    device_id: int = 0
    # "no_evict": admit only what can finish; "max_util": admit eagerly, preempt and recompute
    policy: str = "no_evict"
    # GPUs the model is sharded over (None: as compiled)
    tensor_parallel: int | None = None
    # the compile options a model compiled on first use is built with; for an artifacts folder, those it must have
    options: CompileOptions | None = None
    # decode a lone request pipelined (None: where the device reads ids back without waiting, i.e. CUDA)
    pipeline: bool | None = None
    # "files", or "random" for a shape-only build (speed benchmarks)
    weights: str = "files"
    # a CPU build's threads (None: the physical cores this process may use)
    num_threads: int | None = None
    # keep finished requests' KV pages and reuse the longest cached prefix of each new prompt
    prefix_cache: bool = True
    # vLLM's speculative_config keys, as a dict or JSON text (None: off); parsed and checked by the engine
    speculative_config: dict[str, Any] | str | None = None
    # tokens a KV-cache page holds
    page_size: int = 16
    # how <think>...</think> is split from the answer (runtime/api/reasoning.py; vLLM's names; None: not split)
    reasoning_parser: str | None = None
    # what the KV cache stores K and V as ("auto": the model's dtype, "int8", "fp8_e4m3"): a compile-time choice,
    # so a model compiled on first use is built with it and an artifacts folder must have been (None: as compiled)
    kv_cache_dtype: str | None = None
    # LoRA adapters loaded at start, {name: PEFT adapter folder} ({}: LoRA served, adapters loaded later with
    # Engine.load_lora); a request picks one by its `model` field
    lora: dict[str, str] | None = None
    # LoRA adapters one step may mix and their largest rank: compile-time choices (CompileOptions.max_loras,
    # max_lora_rank), so a model compiled on first use is built with them and an artifacts folder must have been
    # (None: as compiled; when compiling with adapters, at least 4 and at least 16 or the adapters' largest rank)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    # images in chat messages (vision-language models): the hosts whose https URLs may be fetched (a domain allows its
    # subdomains; none: data: URLs only), and the limits each request's images must keep
    allowed_media_domains: tuple[str, ...] = ()
    max_images_per_request: int = 8
    max_image_pixels: int = 25_000_000      # width x height of one image, checked before its pixels are decoded
    max_image_bytes: int = 20 << 20         # one image's encoded bytes (base64-decoded, or downloaded)

    def __post_init__(self) -> None:
        positive = ("max_batch", "prefill_chunk", "page_size", "context_window", "kv_cache_tokens",
                    "tensor_parallel", "num_threads", "max_loras", "max_lora_rank", "max_images_per_request",
                    "max_image_pixels", "max_image_bytes")
        for name in positive:
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise EngineConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.device_id < 0:
            raise EngineConfigError(f"device_id must be >= 0, got {self.device_id}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.policy not in POLICIES:
            raise EngineConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.weights not in ("files", "random"):
            raise EngineConfigError(f"weights must be 'files' or 'random', got {self.weights!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise EngineConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                                    f"{self.reasoning_parser!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                    f"{self.kv_cache_dtype!r}")
        if self.lora is not None and (not isinstance(self.lora, dict) or
                                      not all(isinstance(k, str) and k for k in self.lora)):
            raise EngineConfigError(f"lora must be a dict of adapter name to PEFT adapter folder, got {self.lora!r}")
        if self.options is not None and not isinstance(self.options, CompileOptions):
            raise EngineConfigError(f"options must be a CompileOptions, got {type(self.options).__name__}")

    @classmethod
    def of(cls, config: "EngineConfig | None" = None, **kwargs: Any) -> "EngineConfig":
        """config with the keyword arguments set on it (unknown names refused, naming the known ones)."""
        unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise EngineConfigError(f"unknown engine setting(s) {', '.join(unknown)}; known: {cls.names()}")
        return dataclasses.replace(config or cls(), **kwargs)

    @classmethod
    def names(cls) -> str:
        return ", ".join(f.name for f in dataclasses.fields(cls))

    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser, max_batch: int) -> None:
        """The flags of `mlcc chat` and `mlcc serve`, declared once (max_batch: the command's default)."""
        d = cls()
        parser.add_argument("model", nargs="?", default=None,
                            help="artifacts folder, HF folder, .gguf, or Hugging Face repo name (org/name, or "
                                 "org/name-GGUF:QUANT for one GGUF quantization: downloaded into the Hugging Face "
                                 "cache) (default: the bundled SmolLM2-135M-Instruct)")
        parser.add_argument("--target", default=d.target, help="target preset (default: %(default)s, this machine)")
        parser.add_argument("--quant", default=d.quant, help="quantization when compiling on first use (default: "
                            "q4f32_1 on CPUs, q4f16_1 on GPUs)")
        parser.add_argument("--max-batch", type=int, default=max_batch, help="requests decoded together "
                            "(default: %(default)s)")
        parser.add_argument("--context-window", type=int, default=None,
                            help="at most the model's context window (default: the model's)")
        parser.add_argument("--kv-cache-tokens", type=int, default=None,
                            help="KV-cache capacity in tokens (default: from memory)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                            help="GPUs: fraction of device memory for weights, KV cache and activations "
                                 "(default: %(default)s)")
        parser.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk,
                            help="most prompt tokens one prefill step reads (default: %(default)s)")
        parser.add_argument("--policy", choices=POLICIES, default=d.policy,
                            help="no_evict: admit only what can finish; max_util: admit eagerly, preempt and "
                                 "recompute (default: %(default)s)")
        parser.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                            help="do not keep finished requests' KV pages for reuse by later prompts")
        parser.add_argument("--threads", dest="num_threads", type=int, default=None, metavar="N",
                            help="CPU threads (default: the physical cores this process may use)")
        parser.add_argument("--speculative-config", default=None, metavar="JSON",
                            help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", '
                                 '"num_speculative_tokens": 5, "prompt_lookup_max": 4}\' or '
                                 '\'{"method": "draft", "model": PATH, "num_speculative_tokens": 4}\'')
        parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                            help="GPUs the model is sharded over (must match how it was compiled; default: as "
                                 "compiled)")
        parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                            help="return <think>...</think> as message.reasoning_content (deepseek_r1: up to "
                                 "</think>, the template may open <think>; qwen3: only where the reply opens <think>; "
                                 "openai_gptoss: harmony's analysis channel, the default for a harmony template)")
        parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                            help="what the KV cache stores K and V as: auto (the model's dtype), int8 or fp8_e4m3 "
                                 "(8-bit codes with a scale per token and head: about half a float16 cache, a "
                                 "quarter of a float32 one); an artifacts folder must have been compiled with it "
                                 "(default: as compiled, auto when compiling on first use)")
        parser.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                            help="a PEFT LoRA adapter served as model NAME (repeatable): requests pick it by their "
                                 "`model` field; needs a build with LoRA (compiled on first use with it)")
        parser.add_argument("--max-loras", type=int, default=None, metavar="N",
                            help="LoRA adapters one step may mix (a compile-time choice; default: as compiled, 4 when "
                                 "compiling with --lora)")
        parser.add_argument("--max-lora-rank", type=int, default=None, metavar="R",
                            help="the largest LoRA rank served (a compile-time choice; default: as compiled, 16 or "
                                 "the --lora adapters' largest when compiling)")
        parser.add_argument("--allowed-media-domains", nargs="*", default=[], metavar="DOMAIN",
                            help="hosts whose https image URLs may be fetched (a domain allows its subdomains); "
                                 "without it only data: URLs are taken")
        parser.add_argument("--max-images-per-request", type=int, default=d.max_images_per_request, metavar="N",
                            help="images one request may carry (default: %(default)s)")
        parser.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels, metavar="N",
                            help="width x height of one image (default: %(default)s)")
        parser.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes, metavar="N",
                            help="one image's encoded size in bytes (default: %(default)s)")
        CompileOptions.add_cli_argument(parser, "; what a model compiled on first use is built with: an artifacts "
                                                "folder must have been built with it")

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> "EngineConfig":
        """The config of parsed `add_cli_arguments` flags."""
        return cls(target=args.target, quant=args.quant, max_batch=args.max_batch,
                   context_window=args.context_window, kv_cache_tokens=args.kv_cache_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization, prefill_chunk=args.prefill_chunk,
                   policy=args.policy, prefix_cache=args.prefix_cache, num_threads=args.num_threads,
                   speculative_config=args.speculative_config, tensor_parallel=args.tensor_parallel,
                   reasoning_parser=args.reasoning_parser, kv_cache_dtype=args.kv_cache_dtype,
                   lora=_parse_lora(args.lora) or None, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   allowed_media_domains=tuple(args.allowed_media_domains),
                   max_images_per_request=args.max_images_per_request, max_image_pixels=args.max_image_pixels,
                   max_image_bytes=args.max_image_bytes,
                   options=CompileOptions.parse(args.option) if args.option else None)

    def describe(self) -> str:
        """One line for logs: the settings that differ from the defaults."""
        d = EngineConfig()
        diff = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(d, f.name)}
        return json.dumps(diff, default=str) if diff else "defaults"


def _parse_lora(items: list[str]) -> dict[str, str]:
    """`--lora NAME=PATH` flags as {name: path}."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise EngineConfigError(f"--lora {item!r}: expected NAME=PATH (a PEFT adapter folder)")
        if name.strip() in out:
            raise EngineConfigError(f"--lora: adapter name {name.strip()!r} given twice")
        out[name.strip()] = path.strip()
    return out
