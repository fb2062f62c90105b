"""The `vision` section of mlcc-config.json: how the runtime turns an image into the encoder's input and where its
tokens go in the prompt, read from the model's own processor files (preprocessor_config.json and the tokenizer) so
the runtime needs neither transformers nor torch."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mlcc.errors import ModelSourceError

log = logging.getLogger(__name__)

# PIL's resampling filters by the number transformers' PILImageResampling gives them
_RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


def vision_section(source_dir: Path, family_module: Any, cfg: Any) -> dict[str, Any] | None:
    """None for a text-only model; else {"preprocess": {...}, "placeholder", "expanded", "image_token_id",
    "tokens_per_image"}."""
    vision = getattr(cfg, "vision", None)
    if vision is None:
        return None
    pre_path, pre = _image_processor(source_dir)
    size = pre.get("size") or {}
    shortest = None
    if "shortest_edge" in size:   # (CLIP's processors: the short side resized, then a center crop)
        shortest, crop = int(size["shortest_edge"]), pre.get("crop_size") or {}
        if not pre.get("do_center_crop", True) or not crop or int(crop["height"]) > shortest or \
                int(crop["width"]) > shortest:
            raise ModelSourceError(f"{pre_path}: images resized to a {shortest}-pixel short side must be center-"
                                   f"cropped to at most that for the encoder's square input; crop_size is {crop}")
        height, width = int(crop["height"]), int(crop["width"])
    else:
        height, width = int(size.get("height", vision.image_size)), int(size.get("width", vision.image_size))
    if (height, width) != (vision.image_size, vision.image_size):
        raise ModelSourceError(f"{pre_path}: images resized to {height}x{width}, but the encoder takes "
                               f"{vision.image_size}x{vision.image_size}; the processor and config.json disagree")
    if pre.get("do_pan_and_scan"):
        log.warning("%s asks for pan-and-scan crops, which mlcc does not make: each image is encoded whole", pre_path)
    resample = int(pre.get("resample", 2))
    if resample not in _RESAMPLE:
        raise ModelSourceError(f"{pre_path}: resample {resample} is not one of PIL's filters {sorted(_RESAMPLE)}")
    channels = vision.num_channels
    preprocess = {
        "size": [height, width], "shortest_edge": shortest, "resample": _RESAMPLE[resample],
        "rescale_factor": float(pre.get("rescale_factor", 1 / 255)) if pre.get("do_rescale", True) else 1.0,
        "mean": [float(x) for x in _per_channel(pre.get("image_mean", 0.5), channels)]
        if pre.get("do_normalize", True) else [0.0] * channels,
        "std": [float(x) for x in _per_channel(pre.get("image_std", 0.5), channels)]
        if pre.get("do_normalize", True) else [1.0] * channels,
    }
    from tokenizers import Tokenizer

    tok_path = source_dir / "tokenizer.json"
    if not tok_path.exists():
        raise ModelSourceError(f"{source_dir}: no tokenizer.json to read the image tokens from")
    tok = Tokenizer.from_file(str(tok_path))

    def token_text(token_id: int) -> str:
        text = tok.id_to_token(token_id)
        if text is None:
            raise ModelSourceError(f"{tok_path}: config.json names image token {token_id}, which the tokenizer lacks")
        return text

    return {"preprocess": preprocess, **family_module.image_prompt(cfg, token_text)}


def _image_processor(source_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The image processor's settings: preprocessor_config.json (the Hub's files), or the "image_processor" of
    processor_config.json (where transformers 5 saves them)."""
    pre_path, proc_path = source_dir / "preprocessor_config.json", source_dir / "processor_config.json"
    if pre_path.exists():
        return pre_path, json.loads(pre_path.read_text())
    if proc_path.exists() and "image_processor" in (proc := json.loads(proc_path.read_text())):
        return proc_path, proc["image_processor"]
    raise ModelSourceError(f"{source_dir}: a vision-language model without preprocessor_config.json; download the "
                           "checkpoint's processor files too (they say how images are resized and normalised)")


def _per_channel(value: Any, channels: int) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value] * channels
