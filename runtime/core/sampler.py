"""Sampling parameters and the sampler.

Without penalties, sampling runs in the compiled library on the model's device (argmax for greedy batches,
temperature/top-k/top-p otherwise, drawing with a uniform from each request's seeded generator), so only token
ids cross to the host. Penalties need each request's token history: those batches take the logits to the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

History = tuple[Sequence[int], Sequence[int]]   # (prompt ids, generated ids): what penalties look at


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                     # 0 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    @classmethod
    def from_request(cls, **kw: Any) -> "SamplingParams":
        """From a request validated by runtime.api.protocol (ranges and types are checked there); None: the default."""
        kw = {k: v for k, v in kw.items() if v is not None}
        stop = kw.pop("stop", [])
        return cls(stop=[stop] if isinstance(stop, str) else list(stop), **kw)

    @property
    def greedy(self) -> bool:
        # below ~1e-5, logits / T overflows float32: the limit of softmax(z / T) as T → 0 is the argmax anyway
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


class Sampler:
    """device_argmax(logits) -> ids (.numpy()); device_sample: ModelFunctions.sample_top_p_top_k; to_device(array)
    puts host values where those functions read them. host_greedy: greedy batches take numpy's argmax of the logits
    (on the CPU they already live on the host, and numpy beats a VM call there); the device argmax is still what
    device_draw uses."""

    def __init__(self, vocab_size: int, device_argmax=None, device_sample=None, to_device=None,
                 host_greedy: bool = False, upload=None):
        self.vocab_size = vocab_size
        self._argmax = device_argmax    # (logits) -> int32[n]
        self._sample = device_sample    # (logits, temperature, top_p, top_k, uniform, rows) -> int32[n]
        self._to_device = to_device
        # (name, array) -> the array in a device buffer kept for that name and shape: a step allocates nothing
        self._upload = upload or (lambda _name, a: to_device(a))
        self.host_greedy = host_greedy

    @classmethod
    def for_model(cls, model) -> "Sampler":
        """The sampler of a loaded model (runtime.device.model.PagedModel)."""
        def upload(name: str, a: np.ndarray):
            try:
                return model._upload(name, a)
            except NotImplementedError:   # a model without reusable buffers (tensor parallel)
                return model.to_device(a)

        return cls(model.vocab, model.argmax, model.sample, model.to_device, host_greedy=model.device_kind == "cpu",
                   upload=upload)

    def sample(self, logits, params: Sequence[SamplingParams], histories: Sequence[History],
               rngs: Sequence[np.random.Generator], rows: Sequence[int] | None = None) -> list[int]:
        """One id for each request i, drawn from logits row rows[i] (default: row i) with generator rngs[i];
        histories[i] = (prompt ids, generated ids), read only where penalties are set."""
        n = len(params)
        rows = list(range(n)) if rows is None else list(rows)
        if not any(p.penalised for p in params):
            if all(p.greedy for p in params):
                if self._argmax is not None and not self.host_greedy:
                    ids = self._argmax(logits).numpy()
                    return [int(ids[r]) for r in rows]
            elif self._sample is not None:
                if rows != list(range(int(logits.shape[0]))):   # the compiled sampler draws one sample per row
                    logits = self._to_device(np.ascontiguousarray(logits.numpy()[rows]))
                return self._sample_on_device(logits, params, rngs)
        host = logits.numpy() if hasattr(logits, "numpy") else np.asarray(logits)
        return [sample_row(host[rows[i]], params[i], histories[i], rngs[i]) for i in range(n)]

    def device_draw(self, p: SamplingParams, rng: np.random.Generator) -> "DeviceDraw | None":
        """How one request's next id is drawn on the device and left there (runtime.device.graph_decode), or None
        where that needs the host (penalties) or the library lacks the sampler."""
        if p.penalised:
            return None
        if p.greedy:
            return DeviceDraw(self._argmax) if self._argmax is not None else None
        if self._sample is None:
            return None
        dev = self._to_device
        consts = (dev(np.array([p.temperature], np.float32)), dev(np.array([p.top_p], np.float32)),
                  dev(np.array([p.top_k or self.vocab_size], np.int32)), dev(np.zeros(1, np.int32)))
        uniform = dev(np.zeros(1, np.float32))

        def prepare() -> None:
            # one uniform a step from the request's generator, as the synchronous path draws it
            uniform.copyfrom(np.array([rng.random()], np.float32))

        def sample(logits):
            t, top_p, top_k, rows = consts
            return self._sample(logits, t, top_p, top_k, uniform, rows)

        return DeviceDraw(sample, prepare)

    def _sample_on_device(self, logits, params: Sequence[SamplingParams], rngs) -> list[int]:
        n = len(params)
        # greedy rows ride along as top_k=1; the uniform is still drawn so each request's stream stays aligned
        temperature = np.array([1.0 if p.greedy else p.temperature for p in params], np.float32)
        top_k = np.array([1 if p.greedy else (p.top_k or self.vocab_size) for p in params], np.int32)
        top_p = np.array([p.top_p for p in params], np.float32)
        uniform = np.array([r.random() for r in rngs], np.float32)
        up = self._upload
        ids = self._sample(logits, up("temperature", temperature), up("top_p", top_p), up("top_k", top_k),
                           up("uniform", uniform), up("rows", np.arange(n, dtype=np.int32)))
        return [int(t) for t in ids.numpy()]


@dataclasses.dataclass
class DeviceDraw:
    """sample(logits) -> device int32[1] ids; prepare(), if any, runs before each step is queued, while the device
    has finished every earlier step (a synchronous upload there costs no overlap). after_token: sample reads state
    that the previous token sets (a grammar's mask), so that token is handed out before the draw is queued."""
    sample: Callable
    prepare: Callable[[], None] | None = None
    after_token: bool = False


def apply_penalties(row: np.ndarray, p: SamplingParams, history: History) -> np.ndarray:
    """HF's repetition penalty (CTRL's, RepetitionPenaltyLogitsProcessor) over every token seen, prompt included:
    a seen token's logit is divided by it when positive, multiplied by it otherwise. Then OpenAI's frequency and
    presence penalties over the generated tokens: logit[j] -= count[j] * frequency_penalty + presence_penalty for
    each token j generated count[j] > 0 times."""
    if not p.penalised:
        return row
    prompt, generated = history
    row = row.copy()
    if p.repetition_penalty != 1.0 and (len(prompt) or len(generated)):
        seen = np.unique(np.asarray([*prompt, *generated], dtype=np.int64))
        sel = row[seen]
        row[seen] = np.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
    if len(generated) and (p.frequency_penalty or p.presence_penalty):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        row[ids] -= p.frequency_penalty * counts + p.presence_penalty
    return row


def sample_row(row: np.ndarray, p: SamplingParams, history: History, rng: np.random.Generator) -> int:
    if p.greedy:
        return int(np.argmax(np.clip(apply_penalties(row.astype(np.float64), p, history), -1e300, 1e300)))
    probs = target_probs(row, p, history)
    return int(rng.choice(probs.size, p=probs))


def target_probs(row: np.ndarray, p: SamplingParams, history: History) -> np.ndarray:
    """The distribution a non-greedy request samples from (penalties, temperature, top-k, top-p), float64; the
    speculative acceptance (runtime.spec.rejection) compares drafts against it."""
    # float64 and a clip: extreme (but valid) penalties or temperatures must not turn into inf - inf = NaN
    row = np.clip(apply_penalties(row.astype(np.float64), p, history), -1e300, 1e300)
    z = np.clip(row / p.temperature, -1e300, 1e300)
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z >= kth, z, -np.inf)
    z = z - z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        csum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(csum, p.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return probs
