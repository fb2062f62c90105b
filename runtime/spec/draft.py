"""A draft model: a second, smaller compiled model with the target's tokenizer that proposes the next tokens.

It has its own paged KV cache with one sequence per speculating request, kept in step with the target: each step
it reads what the request emitted since (one ragged prefill for all requests), then drafts k tokens (k - 1 batched
decode steps); once the target has verified them, the drafts it rejected are popped, so the draft's KV always holds
a prefix of the request's tokens. Greedy requests draft the argmax (a point mass); sampling requests draw from the
draft's distribution under the request's own sampling parameters, which the acceptance (runtime.spec.rejection) divides
by.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from mlcc.errors import SpeculativeConfigError
from mlcc.runtime.core.request import Request
from mlcc.runtime.core.sampler import target_probs

log = logging.getLogger(__name__)


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """The draft must encode text exactly as the target does: the same token -> id map, special tokens included."""
    from tokenizers import Tokenizer as HFTokenizer

    def vocab(d: Path) -> dict[str, int]:
        return HFTokenizer.from_file(str(Path(d) / "tokenizer.json")).get_vocab(with_added_tokens=True)

    a, b = vocab(target_dir), vocab(draft_dir)
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise SpeculativeConfigError(
            f"the draft model {draft_dir} has another tokenizer than the target {target_dir} ({len(b)} vs {len(a)} "
            f"tokens; first differences {json.dumps(diff)}): a draft must share the target's tokenizer, e.g. a "
            "smaller model of the same family")


class DraftProposer:
    """model: a runtime.device.model.PagedModel (the draft, loaded); target_vocab: the target's logit rows."""

    def __init__(self, model: Any, target_vocab: int, max_batch: int, kv_tokens: int, prefill_chunk: int,
                 page_size: int = 16):   # the page size only sizes this cache's pages, not the target's
        self.model, self.page_size, self.chunk = model, page_size, prefill_chunk
        self.vocab = min(int(model.vocab), int(target_vocab))
        model.create_kv_cache(max_batch, kv_tokens, prefill_chunk, page_size)
        self.total_pages = model.free_pages()
        self._ids = itertools.count()
        self._seqs: dict[Request, list[int]] = {}   # request -> [draft sequence id, tokens of it in the draft KV]
        self._pending: dict[Request, tuple[int, int]] = {}   # request -> (tokens before drafting, drafts fed)
        # A lone greedy request drafts on the device: each drafted id (the compiled argmax) is the next decode step's
        # input without coming back first, so the k steps are queued back to back and one read at the end returns
        # them all (not on the CPU: nothing waits there, and numpy's argmax beats a VM call). Not where the draft's
        # vocabulary is larger than the target's: its argmax could name an id the target does not have.
        self.chain_on_device = model.device_kind != "cpu" and getattr(model, "argmax", None) is not None and \
            hasattr(model, "decode_fed_back") and self.vocab == int(model.vocab)

    @property
    def context_window(self) -> int:
        return int(self.model.context_window)

    def release(self, r: Request) -> None:
        s = self._seqs.pop(r, None)
        self._pending.pop(r, None)
        if s is not None:
            self.model.remove_sequence(s[0])

    def propose(self, wanted: Sequence[tuple[Request, int]]) -> dict[Request, tuple[list[int], np.ndarray | None]]:
        """wanted: (request, k) pairs; each gets k drafted tokens and their distributions (None: greedy, a point
        mass), or nothing where the draft has no room for it."""
        ps, todo = self.page_size, []
        free = self.model.free_pages()
        for r, k in wanted:
            tokens = r.prompt_ids + r.output_ids
            if len(tokens) + k > self.context_window:
                continue
            s = self._seqs.get(r)
            if s is None:
                sid = next(self._ids)
                self.model.add_sequence(sid)
                s = self._seqs[r] = [sid, 0]
            need = math.ceil((len(tokens) + k) / ps) - math.ceil(s[1] / ps)
            if need > free:   # the draft's cache is full: this request decodes plainly this step
                continue
            free -= need
            todo.append((r, k, tokens, s))
        if not todo:
            return {}
        if len(todo) == 1 and todo[0][0].params.greedy and self.chain_on_device:
            r, k, tokens, s = todo[0]
            drafts = self._greedy_chain(s[0], self._catch_up(todo, host=False), k)
            s[1] = len(tokens) + k - 1
            self._pending[r] = (len(tokens), k - 1)
            return {r: (drafts, None)}
        logits = self._catch_up(todo)
        drafts: dict[Request, list[int]] = {r: [] for r, *_ in todo}
        dists: dict[Request, list[np.ndarray]] = {r: [] for r, *_ in todo}
        live = list(range(len(todo)))
        for step in range(max(k for _, k, _, _ in todo)):
            for row, i in enumerate(live):
                r, _, tokens, _ = todo[i]
                t, q = self._draw(logits[row], r, tokens + drafts[r])
                drafts[r].append(t)
                if q is not None:
                    dists[r].append(q)
            live = [i for i in live if len(drafts[todo[i][0]]) < todo[i][1]]
            if not live:
                break
            seqs = [todo[i][3][0] for i in live]
            logits = self.model.decode(seqs, [drafts[todo[i][0]][-1] for i in live]).numpy()[:, :self.vocab]
        out = {}
        for r, k, tokens, s in todo:
            s[1] = len(tokens) + k - 1
            self._pending[r] = (len(tokens), k - 1)
            out[r] = (drafts[r], np.stack(dists[r]) if dists[r] else None)
        return out

    def verified(self, r: Request, kept: int) -> None:
        """The target kept `kept` of r's drafts: the draft KV drops the rest it was fed."""
        s, pending = self._seqs.get(r), self._pending.pop(r, None)
        if s is None or pending is None:
            return
        before, fed = pending
        keep = min(kept, fed)
        if fed > keep:
            self.model.popn(s[0], fed - keep)
        s[1] = before + keep

    def _greedy_chain(self, seq_id: int, logits: Any, k: int) -> list[int]:
        ids = [self.model.argmax(logits)]
        for _ in range(k - 1):
            logits, _ = self.model.decode_fed_back(seq_id, ids[-1])
            ids.append(self.model.argmax(logits))
        return [int(t.numpy().reshape(-1)[0]) for t in ids]

    def _catch_up(self, todo: list, host: bool = True) -> Any:
        """Feed each request's tokens the draft KV lacks; the logits after each request's last token [n, vocab]
        (host=False, one request: the device tensor)."""
        rests = []
        for r, _, tokens, s in todo:
            rest = tokens[s[1]:]
            while len(rest) > self.chunk:   # a long first prompt goes through alone, in chunks
                self.model.prefill([s[0]], [rest[:self.chunk]])
                rest = rest[self.chunk:]
            rests.append(rest)
        if not host:
            return self.model.prefill([todo[0][3][0]], rests)
        rows: list[np.ndarray] = []
        group: list[int] = []
        for i in range(len(todo) + 1):
            if group and (i == len(todo) or sum(len(rests[j]) for j in group) + len(rests[i]) > self.chunk):
                out = self.model.prefill([todo[j][3][0] for j in group], [rests[j] for j in group]).numpy()
                rows.extend(out[:, :self.vocab])
                group = []
            if i < len(todo):
                group.append(i)
        return np.stack(rows)

    def _draw(self, row: np.ndarray, r: Request, history: list[int]) -> tuple[int, np.ndarray | None]:
        p = r.params
        if p.greedy:
            return int(np.argmax(row)), None
        q = target_probs(row, p, (r.prompt_ids, history[len(r.prompt_ids):]))
        return int(r.rng.choice(q.size, p=q)), q
