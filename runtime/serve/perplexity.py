"""`mlcc perplexity`: a model's perplexity on a text, measured the way llama.cpp's llama-perplexity does, so the two
tools' numbers (and mlcc's quantizations against each other) compare.

The whole text is tokenized once (BOS first where the model adds one), cut into non-overlapping chunks of
`context` tokens, and each chunk runs as one prefill returning the logits of every position. Only the second half of
a chunk is scored, so every scored token has at least context/2 tokens before it; where the model adds BOS, each
chunk's first token is replaced by BOS, as llama-perplexity does. ppl = exp(mean negative log-likelihood)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from mlcc.errors import PerplexityError, RequestError
from mlcc.options import CompileOptions

log = logging.getLogger(__name__)

SEQ = 0   # the one sequence every chunk runs as, in a KV cache of one chunk


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    ppl: float
    # llama-perplexity's uncertainty: ppl times the standard error of the mean NLL
    ppl_error: float
    scored_tokens: int
    chunks: int
    context: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        """Tokens run through the model (whole chunks, context included) per second."""
        return self.chunks * self.context / self.seconds if self.seconds > 0 else float("inf")


def split_chunks(ids: Sequence[int], context: int, max_chunks: int | None, bos_id: int | None) -> list[list[int]]:
    """The chunks llama-perplexity evaluates: as many whole `context`-token pieces as the text has (at most
    max_chunks), each starting with BOS where the model adds one. Refuses a text shorter than two chunks."""
    if context < 4:
        raise PerplexityError(f"--context {context}: too short to score anything; use at least 4 (512 compares "
                              "with llama.cpp's usual numbers)")
    if max_chunks is not None and max_chunks < 1:
        raise PerplexityError(f"--chunks {max_chunks}: must be at least 1 (leave it out for all of the text)")
    if len(ids) < 2 * context:
        raise PerplexityError(f"the text has {len(ids)} tokens, but --context {context} needs at least "
                              f"{2 * context} (two chunks); give a longer text or a smaller --context")
    n = len(ids) // context if max_chunks is None else min(max_chunks, len(ids) // context)
    chunks = [list(ids[i * context:(i + 1) * context]) for i in range(n)]
    if bos_id is not None:
        for c in chunks:
            c[0] = bos_id
    return chunks


def scored_rows(context: int) -> slice:
    """Rows of a chunk's logits that are scored: each predicts the token after it, from context/2 on."""
    return slice(context // 2, context - 1)


def chunk_nll(model, chunk: list[int], on_device: bool) -> np.ndarray:
    """Negative log-likelihood of each scored token of one chunk (float64 [context - context/2 - 1])."""
    model.add_sequence(SEQ)
    try:
        logits = model.prefill_all(SEQ, chunk)
    finally:
        model.remove_sequence(SEQ)
    rows = scored_rows(len(chunk))
    if on_device:   # only the picked log-probabilities cross to the host, not [context, vocab] logits
        lp = model.logprobs(logits, np.asarray(chunk[1:] + [0], np.int32))[0][rows]
    else:
        from scipy.special import logsumexp

        x = logits.numpy()[rows]
        lp = x[np.arange(len(x)), chunk[rows.start + 1:]] - logsumexp(x, axis=1)
    return -np.asarray(lp, np.float64)


def perplexity(model, chunks: list[list[int]],
               on_chunk: Callable[[int, float, float], None] | None = None) -> PerplexityResult:
    """Runs every chunk on a loaded model (runtime.device.model.PagedModel); on_chunk(i, running ppl, seconds) after
    each. The model's KV cache is (re)made for one chunk."""
    context = len(chunks[0])
    if context > model.context_window:
        raise PerplexityError(f"--context {context} is over the model's context window ({model.context_window}); "
                              f"use --context {model.context_window} or less")
    pages = 16
    model.create_kv_cache(1, -(-context // pages) * pages, context, pages)
    # GPUs score where the logits are; a CPU's logits are in host memory already, where numpy's log-softmax of
    # the scored rows is several times faster than the compiled logprobs (which also ranks the top 20 of every row)
    on_device = model.device_kind != "cpu"
    if on_device:
        try:
            model.require_logit_function("logprobs", "perplexity")
        except RequestError:   # tensor parallelism offers no logit functions
            on_device = False
    nll = np.empty(0)
    t0 = time.perf_counter()
    for i, chunk in enumerate(chunks):
        nll = np.concatenate([nll, chunk_nll(model, chunk, on_device)])
        if on_chunk is not None:
            on_chunk(i, math.exp(nll.mean()), time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    mean = float(nll.mean())
    stderr = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    return PerplexityResult(math.exp(mean), math.exp(mean) * stderr, len(nll), len(chunks), context, seconds)


def run_perplexity(model: str | Path | None, text_file: str | Path, *, target: str = "auto", quant: str | None = None,
                   context: int = 512, chunks: int | None = None, num_threads: int | None = None,
                   options: CompileOptions | None = None) -> PerplexityResult:
    """`mlcc perplexity`: model as `mlcc chat` takes it (artifacts folder, HF folder, .gguf, repo name, None for
    the bundled model), compiled on first use for target/quant; logs the running perplexity after each chunk."""
    from mlcc import artifact
    from mlcc.runtime.core.tokenizer import Tokenizer
    from mlcc.runtime.jit import resolve_model
    from mlcc.targets import detect_local

    text = Path(text_file).read_text(encoding="utf-8")
    model_dir = resolve_model(model, detect_local() if target == "auto" else target, quant, 1, options)
    if int(artifact.read_config(model_dir).get("tensor_parallel", 1)) > 1:
        from mlcc.runtime.device.tensor_parallel import TensorParallelModel

        loaded = TensorParallelModel(model_dir)
    else:
        from mlcc.runtime.device.model import LoadedModel

        loaded = LoadedModel(model_dir, num_threads=num_threads)
    tokenizer = Tokenizer(model_dir, loaded.config["tokenizer"])
    ids = tokenizer.encode_prompt(text)
    parts = split_chunks(ids, context, chunks, tokenizer.prompt_bos_id)
    log.info("%s: %d tokens, %d chunks of %d (the second half of each scored)", Path(text_file).name, len(ids),
             len(parts), context)

    def progress(i: int, ppl: float, seconds: float) -> None:
        log.info("[%d/%d] ppl %.4f  (%.0f tok/s)", i + 1, len(parts), ppl, (i + 1) * context / seconds)

    return perplexity(loaded, parts, progress)
