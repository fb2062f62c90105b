"""Every error a user can fix, in one place: each names the problem and the fix, and the CLI prints it as one line.

`MlccError` is the base of all of them; `RequestError` (a bad API request) is also a `ValueError`, as a caller of
an OpenAI-shaped API expects. After any of them the engine stays usable.
"""

from __future__ import annotations


class MlccError(Exception):
    """Bad input or environment: the message says what is wrong and how to fix it."""


class ArtifactError(MlccError, RuntimeError):
    """An artifacts folder is incomplete, corrupted, or does not match this runtime or the options asked for."""


class ModelSourceError(MlccError, ValueError):
    """A model folder or GGUF file that cannot be read or converted."""


class ModelDownloadError(MlccError, RuntimeError):
    """A model named by its Hugging Face repo that cannot be found, reached or downloaded."""


class UnsupportedTokenizerError(ModelSourceError):
    """A GGUF file whose tokenizer kind mlcc cannot rebuild."""


class UnknownArchitectureError(MlccError, ValueError):
    """A model architecture no family in relax_models implements."""


class UnsupportedConfigError(ModelSourceError):
    """A model config with a feature of a known architecture that mlcc does not implement."""


class TensorParallelError(MlccError, ValueError):
    """A model that cannot be split over the requested number of GPUs."""


class UnknownQuantizationError(MlccError, ValueError):
    """A quantization name that is not one of mlcc's schemes."""


class UnsupportedQuantizationError(MlccError, ValueError):
    """A quantization scheme the chosen target or model cannot run: names which part cannot and the alternatives."""


class UnsupportedKVCacheDtypeError(MlccError, ValueError):
    """A --kv-cache-dtype the chosen target, model or feature cannot run with: names why and the alternative."""


class UnsupportedTargetError(MlccError, ValueError):
    """A target name that is not one of the presets."""


class ToolchainError(MlccError, RuntimeError):
    """An external build tool a target needs (lld, ROCm bitcode, emscripten, nvcc/NVRTC) is missing."""


class CompileOptionsError(MlccError, ValueError):
    """An unknown compile option or a value of the wrong type."""


class EngineConfigError(MlccError, ValueError):
    """An engine setting out of range or unknown (mlcc.options.EngineConfig)."""


class NpmError(MlccError, RuntimeError):
    """The web bundle's pinned JavaScript dependencies could not be installed."""


class SiteError(MlccError, ValueError):
    """`mlcc web` was given folders it cannot bundle."""


class NcclUnavailableError(MlccError, RuntimeError):
    """Tensor parallelism needs NCCL, which could not be found or built."""


class RequestError(MlccError, ValueError):
    """An invalid request (OpenAI's invalid_request_error): names the field and the fix."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.code = code


class ContextWindowExceededError(RequestError):
    def __init__(self, message: str):
        super().__init__(message, param="messages", code="context_length_exceeded")


class PerplexityError(MlccError, ValueError):
    """`mlcc perplexity` given a text too short for its --context, or a --context the model cannot take."""


class SpeculativeConfigError(MlccError, ValueError):
    """A speculative_config that names an unknown key or method, a bad value, or a draft model that cannot draft
    for the target (another tokenizer)."""


class LoraAdapterError(MlccError, ValueError):
    """A LoRA adapter that this model cannot serve (another base's shapes, a module it cannot adapt, a rank over
    the library's limit, a PEFT feature not served) or that is not loaded; or adapters asked of a build without
    LoRA."""
