"""Models named by their Hugging Face repo: `Qwen/Qwen2.5-0.5B-Instruct`, or `user/repo-GGUF:Q4_K_M` (llama.cpp's
`-hf` form: the tag picks the GGUF quantization), also written `hf.co/user/repo:TAG`.

The files mlcc needs are downloaded through huggingface_hub into its cache, as `vllm serve`, `ollama run hf.co/...`
and `llama-server -hf` do, so HF_HOME / HF_HUB_CACHE, HF_ENDPOINT, HF_TOKEN and HF_HUB_OFFLINE mean what they mean
there. A local path that exists always wins over a name. Every failure is one `ModelDownloadError` line that names
the problem and the local-path alternative.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import re
from pathlib import Path

from mlcc.errors import ModelDownloadError

log = logging.getLogger(__name__)

# an HF repo's files mlcc reads: the config, and what compiler/tokenizer_files.py copies next to the build
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja",
            # a vision-language model's image processing (compiler/vision_files.py)
            "preprocessor_config.json", "processor_config.json", "chat_template.json")
# what a GGUF repo without a tag is run at (llama.cpp's and Ollama's default)
DEFAULT_GGUF_TAG = "Q4_K_M"
LOCAL_ALTERNATIVE = "or pass a local path: `mlcc chat path/to/model-folder-or.gguf`"

_NAME = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)"
                   r"(?::(?P<tag>[\w.+-]+))?$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# the HF cache's layout: models--{org}--{name}/snapshots/{commit}
_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]{40}$")


@dataclasses.dataclass(frozen=True)
class HubModel:
    """`repo_id[:tag]`: a Hugging Face model repo, and for a GGUF repo the quantization to run."""

    repo_id: str
    tag: str | None = None

    def __str__(self) -> str:
        return f"{self.repo_id}:{self.tag}" if self.tag else self.repo_id


def parse_name(model: str | Path) -> HubModel | None:
    """The repo `model` names, or None where it is a local path (one that exists, or that does not look like
    `org/name[:tag]`: `./x`, `/x`, `a/b/c`, `dir/model.gguf`)."""
    text = str(model)
    if Path(text).exists():
        return None
    m = _NAME.match(text)
    if m is None or m["repo"].lower().endswith((".gguf", ".safetensors", ".json")) or ".." in m["repo"]:
        return None
    return HubModel(m["repo"], m["tag"])


def resolve(model: str | Path) -> Path:
    """`model` as a local path: itself where it exists or is not a repo name, else the repo's files downloaded (or
    found in the cache) — the snapshot folder of an HF repo, the chosen (first) .gguf file of a GGUF repo."""
    ref = parse_name(model)
    return Path(model) if ref is None else download(ref)


def source_name(path: Path) -> str:
    """A model's name for builds and the API: `org/name` for a folder in the HF cache (its own name is a commit
    hash), else the file or folder name without its suffix (a split GGUF's parts: without their part number)."""
    m = _SNAPSHOT.search(Path(path).as_posix())
    return f"{m['org']}/{m['name']}" if m else Path(_model_key(Path(path).name)).stem


def _model_key(name: str) -> str:
    """A GGUF file's model, the same for every part of a split file."""
    return _SPLIT.sub(".gguf", name)


def _tag_matches(name: str, tag: str) -> bool:
    """`tag` is in `name` as a whole word (`Q4_K` is not in `model-Q4_K_M.gguf`), case-insensitive."""
    return re.search(rf"(?:^|[-._/]){re.escape(tag)}(?=[-./]|$)", _model_key(name)[:-len(".gguf")],
                     re.IGNORECASE) is not None


def pick_files(ref: HubModel, files: list[str]) -> list[str]:
    """The files of `ref`'s repo (listed as `files`) that mlcc downloads: the config, tokenizer and safetensors
    weights of an HF repo (not the .bin/.pth/ONNX/GGUF copies), or, of a GGUF repo, every part of the one model the
    tag names (no tag: Q4_K_M, or the repo's only model). The chosen GGUF (its first part) comes first."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower())
    has_config = "config.json" in files
    if ref.tag is None and has_config or not ggufs:
        if ref.tag is not None:
            raise ModelDownloadError(f"{ref}: a :TAG picks a GGUF quantization, and {ref.repo_id} has no .gguf "
                                     f"files; name the repo alone ({ref.repo_id})")
        return _hf_files(ref, files)
    models = sorted({_model_key(f) for f in ggufs})
    available = ", ".join(models)
    if ref.tag is not None:
        chosen = [m for m in models if _tag_matches(m, ref.tag)]
        if not chosen:
            raise ModelDownloadError(f"{ref}: no GGUF file of {ref.repo_id} is tagged {ref.tag} (it has: "
                                     f"{available})")
    elif len(models) == 1:
        chosen = models
    else:
        chosen = [m for m in models if _tag_matches(m, DEFAULT_GGUF_TAG)]
        if not chosen:
            raise ModelDownloadError(f"{ref}: which of its GGUF files? name one with {ref.repo_id}:QUANT (it has: "
                                     f"{available})")
    if len(chosen) > 1:
        raise ModelDownloadError(f"{ref}: the tag names several GGUF files ({', '.join(chosen)}); name one with a "
                                 "longer tag")
    return sorted(f for f in ggufs if _model_key(f) == chosen[0])


def _hf_files(ref: HubModel, files: list[str]) -> list[str]:
    if "config.json" not in files:
        raise ModelDownloadError(f"{ref}: the repo has neither a config.json nor .gguf files, so it is no model mlcc "
                                 "can compile")
    top = [f for f in files if "/" not in f]   # subfolders hold other formats (original/, onnx/)
    weights = [f for f in top if f.endswith(".safetensors")]
    # Mistral's repos carry consolidated.safetensors beside the transformers shards: the same weights twice
    if any(f.startswith("model") for f in weights):
        weights = [f for f in weights if f.startswith("model")]
    if not weights:   # older repos: PyTorch pickles only, which the compiler reads through torch
        weights = [f for f in top if re.fullmatch(r"pytorch_model(-\d+-of-\d+)?\.bin", f)]
    if not weights:
        raise ModelDownloadError(f"{ref}: the repo has no *.safetensors (or pytorch_model*.bin) weights")
    # model-00001-of-00004.safetensors → model.safetensors.index.json
    index = sorted({i for w in weights if (i := re.sub(r"-\d+-of-\d+", "", w) + ".index.json") in top})
    return [f for f in HF_FILES if f in files] + sorted(weights) + index


def _one_line(e: BaseException) -> str:
    """huggingface_hub's messages run over several lines; the first that says something."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return next((line for line in lines if not re.fullmatch(r"\d{3} Client Error\.?", line)), type(e).__name__)


def _list_files(ref: HubModel) -> tuple[list[str], bool]:
    """The repo's files, and whether the Hub gave them: from the Hub, else (offline, unreachable, the Hub failing)
    from the listing cached by an earlier download."""
    import httpx2
    from huggingface_hub import HfApi, constants, get_cached_repo_tree
    from huggingface_hub.errors import (
        CachedRepoTreeNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
    )

    try:
        info = HfApi().model_info(ref.repo_id)
        return [s.rfilename for s in info.siblings or []], True
    except GatedRepoError:
        raise ModelDownloadError(f"{ref.repo_id} is gated: accept its terms at {constants.ENDPOINT}/{ref.repo_id} "
                                 "and log in (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelDownloadError(f"{ref.repo_id}: no such local folder or file, and no Hugging Face repo of that "
                                 "name (a private one needs `hf auth login` or HF_TOKEN)") from None
    except (OfflineModeIsEnabled, httpx2.TransportError, HfHubHTTPError) as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, HfHubHTTPError) and status is not None and status < 500:
            raise ModelDownloadError(f"{ref.repo_id}: the Hub refused ({_one_line(e)})") from None
        if isinstance(e, OfflineModeIsEnabled):
            why = "HF_HUB_OFFLINE is set"
            fix = "unset HF_HUB_OFFLINE to download it"
        else:
            why = f"{constants.ENDPOINT} cannot be reached ({_one_line(e)})"
            fix = "check the network (or HF_ENDPOINT)"
        try:
            files = [f.path for f in get_cached_repo_tree(ref.repo_id)]
        except CachedRepoTreeNotFoundError:
            raise ModelDownloadError(f"{ref}: not downloaded yet and {why}; {fix}, {LOCAL_ALTERNATIVE}") from None
        log.info("%s: %s; using the Hugging Face cache", ref.repo_id, why)
        return files, False


def download(ref: HubModel) -> Path:
    """The files of `ref` that mlcc needs (see pick_files), in the HF cache: downloaded where missing, with
    huggingface_hub's progress bars. Returns the snapshot folder of an HF repo, the (first) GGUF file of a GGUF
    repo."""
    import httpx2
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    listed, online = _list_files(ref)
    files = pick_files(ref, listed)
    if online:   # files already in the cache are not fetched again
        log.info("%s: fetching %s from %s into %s", ref, ", ".join(files), constants.ENDPOINT, constants.HF_HUB_CACHE)
    try:
        folder = Path(snapshot_download(ref.repo_id, allow_patterns=[glob.escape(f) for f in files]))
    except LocalEntryNotFoundError as e:   # offline, or the Hub gone, with files missing from the cache
        raise ModelDownloadError(f"{ref}: some of its files are not in the Hugging Face cache and the Hub cannot be "
                                 f"reached ({_one_line(e)}); {LOCAL_ALTERNATIVE}") from None
    except (httpx2.TransportError, HfHubHTTPError) as e:
        raise ModelDownloadError(f"{ref}: the download failed ({_one_line(e)}); run again to resume it, "
                                 f"{LOCAL_ALTERNATIVE}") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        raise ModelDownloadError(f"{ref}: {', '.join(missing)} did not arrive in {folder}; run again to resume")
    return folder / files[0] if files[0].lower().endswith(".gguf") else folder
