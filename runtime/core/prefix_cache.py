"""Automatic prefix caching: a prompt that starts like an earlier sequence reuses that sequence's KV pages.

How it works. A request that ends (finished, aborted or preempted) leaves its KV-cache sequence in TVM's
`PagedKVCache` as a *cached entry* instead of removing it: the sequence stays under its id, referenced by nobody
running, with the token ids its KV holds. A new request looks up the longest cached prefix of its prompt and starts
as a fork of that entry at that position (`ForkSequence(entry, child, pos)`: the full pages below `pos` are shared,
a partly filled page at `pos` is copied), so only the rest of the prompt is prefilled; where the entry holds less
than a page beyond the match (a chat's next turn) the request continues the entry's own sequence instead, cut to
the match (`PopN`): no copy, and the sequence stays one block of pages. At least the last prompt token is always
prefilled: its logits give the first output token. When a step needs pages that are not free, the
least recently used entries are removed (LRU); TVM refcounts the blocks a fork shares, so removing an entry frees
only the pages no other sequence holds: pages a running request uses are never freed.

The index is a radix tree at page granularity over token ids, which is also a mirror of the physical pages: a node
is one full KV page (its `page_size` token ids, under the node of the page before it), held by the sequences whose
first pages it is. Two sequences share a node only where TVM shares the page (a fork); a page computed again
elsewhere with the same tokens is a node of its own, held but not indexed (lookups find the first). From the mirror
the cache knows exactly how many pages it alone holds (`evictable_pages`: the pages removing every entry would
free), which the scheduler counts as available: pages are evicted for a step only when the free ones run short.
A lookup walks the tree by whole pages, then extends the match token by token into the next page of the entries
found, up to one token before the prompt's end.

Keys include the LoRA adapter a sequence ran with (its load's unique key, 0 for none): each adapter has a tree of
its own, as the same tokens give other K/V under another adapter.

Keys also include the images of a prompt: an image's tokens are all the same id, so `image_keyed` replaces them
with negative keys drawn from the image's content hash (one per position, never a real token id): a prompt with
another image at the same place shares the cache only up to that image.

Models with sliding-window layers only continue sequences, never fork them (TVM's attention over a shared prefix
block windows each block on its own, which is exact only within the window). Requests that score their prompt
(echo with logprobs, which needs the logits of every prompt position) do not look up.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

_MAX_CANDIDATES = 64   # entries compared token by token inside the last matched page


def image_keyed(tokens: Sequence[int], images: Iterable[Any]) -> list[int]:
    """tokens with each image's run (runtime.core.request.PromptImage: start, length, digest) replaced by keys of
    its content: -1 - (62 bits of the digest + position in the run)."""
    out = list(tokens)
    for img in images:
        base = int(img.digest[:16], 16) >> 2
        for i in range(img.start, min(img.start + img.length, len(out))):
            out[i] = -1 - ((base + i - img.start) & ((1 << 62) - 1))
    return out


class _Page:
    """One full KV page of the mirror: refs = sequences (cached or running) holding it, running = those of them
    running, entries = the cached entries holding it (a lookup forks one of them)."""

    __slots__ = ("key", "parent", "children", "refs", "running", "entries", "indexed")

    def __init__(self, key: tuple[int, ...], parent: "_Page | None"):
        self.key, self.parent = key, parent
        self.children: dict[tuple[int, ...], _Page] = {}
        self.refs = self.running = 0
        self.entries: dict[Entry, None] = {}   # insertion-ordered set
        self.indexed = False


@dataclasses.dataclass(eq=False)
class Entry:
    """A cached sequence: its TVM sequence id, the token ids its KV holds (its request's prompt_len prompt tokens,
    then output), its full pages in the mirror."""
    seq_id: int
    tokens: list[int]
    pages: list[_Page]
    prompt_len: int = 0


@dataclasses.dataclass
class Hit:
    entry: Entry
    pos: int          # tokens reused: the request forks (or continues) the entry's sequence at this position


class PrefixCache:
    """remove(seq_id) removes a sequence from the KV cache; free_pages() -> pages free in it. forks: whether a
    request may fork an entry (False: it may only continue one, PrefixCache.takes_over)."""

    def __init__(self, page_size: int, remove: Callable[[int], None], free_pages: Callable[[], int],
                 forks: bool = True):
        self.page_size, self.forks = page_size, forks
        self._remove, self._free_pages = remove, free_pages
        self._roots: dict[int, _Page] = {}   # one tree per LoRA adapter key (0: the base model)
        self._entries: dict[Entry, None] = {}   # LRU order: least recently used first
        self.evictable_pages = 0   # pages only cached entries hold (full pages and partly filled last pages)
        self.queries = self.hits = self.prompt_tokens = self.cached_tokens = self.evictions = 0

    # -- accounting ----------------------------------------------------------------------------------------------
    def _adjust(self, page: _Page, refs: int, running: int) -> None:
        before = page.refs > 0 and page.running == 0
        page.refs += refs
        page.running += running
        after = page.refs > 0 and page.running == 0
        self.evictable_pages += int(after) - int(before)
        if page.refs == 0 and page.indexed:
            assert page.parent is not None
            del page.parent.children[page.key]
            page.indexed = False

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def hit_rate(self) -> float:
        """Prompt tokens served from the cache, of all prompt tokens looked up."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    # -- lookup --------------------------------------------------------------------------------------------------
    def _root(self, adapter: int) -> _Page:
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Page((), None)
        return root

    def match(self, tokens: Sequence[int], adapter: int = 0) -> Hit | None:
        """The longest prefix of `tokens` cached under LoRA adapter key `adapter`, leaving at least the last token to
        compute; None below a page."""
        ps, limit = self.page_size, len(tokens) - 1
        node, depth = self._root(adapter), 0
        while (depth + 1) * ps <= limit:
            child = node.children.get(tuple(tokens[depth * ps:(depth + 1) * ps]))
            if child is None or not child.entries:
                break
            node, depth = child, depth + 1
        if depth == 0:
            return None
        # the entry that matches furthest wins, the last token included (an identical prompt finds its own entry,
        # so the request adds none); ties go to the most recently cached
        best, best_len = None, -1
        for e in itertools.islice(reversed(node.entries), _MAX_CANDIDATES):
            pos, end = depth * ps, min(len(tokens), len(e.tokens), (depth + 1) * ps)
            while pos < end and e.tokens[pos] == tokens[pos]:
                pos += 1
            if pos > best_len:
                best, best_len = e, pos
        assert best is not None
        hit = Hit(best, min(best_len, limit))
        return hit if self.forks or self.takes_over(hit) else None

    def record_query(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.queries += 1
        self.hits += cached_tokens > 0
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    # -- sequences ----------------------------------------------------------------------------------------------
    def forked(self, hit: Hit, held: list) -> int:
        """A running sequence was forked from hit.entry at hit.pos: it holds the entry's full pages below pos
        (appended to `held`, the request's list of mirror pages). Returns the pages it shares."""
        shared = hit.entry.pages[:hit.pos // self.page_size]
        for p in shared:
            self._adjust(p, 1, 1)
        held[:] = shared
        self._touch(hit.entry)
        return len(shared)

    def takes_over(self, hit: Hit) -> bool:
        """Whether a request continues the entry's own sequence (what it holds beyond the match is popped off)
        instead of forking it: where the match covers the entry's whole prompt, as a chat's next turn does (its
        prompt is the previous turn's and the answer, re-encoded), or a preempted request re-admitted. The
        sequence keeps its one block of pages (a fork adds a block: CUDA's batch-1 decode graph serves
        single-block sequences only) and no page is copied; a prompt that shares less (another user's question
        after the same system prompt) forks, leaving the entry for its own next turn."""
        return hit.pos >= hit.entry.prompt_len

    def taken(self, hit: Hit, held: list) -> int:
        """hit.entry's sequence now runs a request, cut to hit.pos tokens: it is no longer cached. Returns the full
        pages it keeps (other sequences may share them)."""
        e, keep = hit.entry, hit.pos // self.page_size
        del self._entries[e]
        for p in e.pages:
            del p.entries[e]
        for p in e.pages[:keep]:
            self._adjust(p, 0, 1)
        for p in e.pages[keep:]:   # popped off (or a partly filled last page now)
            self._adjust(p, -1, 0)
        if len(e.tokens) % self.page_size:
            self.evictable_pages -= 1   # its partly filled page: popped, or the request's
        held[:] = e.pages[:keep]
        return keep

    def shared(self, parent_tokens: Sequence[int], parent_held: list, child_held: list, pos: int,
               adapter: int = 0) -> None:
        """A running sequence was forked from a running one at `pos` (n > 1): both hold the full pages below it."""
        self._materialize(parent_tokens, parent_held, pos // self.page_size, adapter)
        child_held[:] = parent_held[:pos // self.page_size]
        for p in child_held:
            self._adjust(p, 1, 1)

    def released(self, held: list) -> None:
        """A running sequence was removed from the KV cache (not cached)."""
        for p in held:
            self._adjust(p, -1, -1)
        held.clear()

    def insert(self, seq_id: int, tokens: list[int], held: list, source: Entry | None = None,
               fork_pos: int = 0, prompt_len: int = 0, adapter: int = 0) -> bool:
        """A running sequence whose KV holds exactly `tokens` ends: it becomes a cached entry (True), or is removed
        when it would add nothing a lookup could use (False): shorter than a page, or nothing computed beyond the
        prefix it was forked with from `source`, whose tokens already start with all of its own."""
        ps = self.page_size
        redundant = source is not None and source in self._entries and len(tokens) <= len(source.tokens) and \
            source.tokens[:len(tokens)] == tokens
        if len(tokens) < ps or redundant or (source is not None and len(tokens) <= fork_pos):
            self._remove(seq_id)
            self.released(held)
            if redundant:
                self._touch(source)
            return False
        self._materialize(tokens, held, len(tokens) // ps, adapter)
        e = Entry(seq_id, tokens, list(held), prompt_len)
        for p in e.pages:
            self._adjust(p, 0, -1)
            p.entries[e] = None
        held.clear()
        if len(tokens) % ps:
            self.evictable_pages += 1
        self._entries[e] = None
        return True

    def _materialize(self, tokens: Sequence[int], held: list, pages: int, adapter: int) -> None:
        """Mirror pages for a running sequence's own full pages up to `pages` (it holds them alone so far)."""
        ps = self.page_size
        for i in range(len(held), pages):
            parent = held[-1] if held else self._root(adapter)
            page = _Page(tuple(tokens[i * ps:(i + 1) * ps]), parent)
            page.refs = page.running = 1
            if page.key not in parent.children:
                parent.children[page.key] = page
                page.indexed = True
            held.append(page)

    def _touch(self, e: Entry) -> None:
        self._entries.pop(e, None)
        self._entries[e] = None

    # -- eviction ------------------------------------------------------------------------------------------------
    def evict_until(self, need_free: int, keep: Iterable[Entry] = ()) -> bool:
        """Remove least recently used entries (not those in `keep`) until `need_free` pages are free; False if
        that many cannot be freed."""
        keep = set(keep)
        free = self._free_pages()
        for e in list(self._entries):
            if free >= need_free:
                break
            if e in keep:
                continue
            self._evict(e)
            free = self._free_pages()
        return free >= need_free

    def clear(self) -> None:
        for e in list(self._entries):
            self._evict(e)

    def _evict(self, e: Entry) -> None:
        del self._entries[e]
        self._remove(e.seq_id)
        for p in e.pages:
            del p.entries[e]
            self._adjust(p, -1, 0)
        if len(e.tokens) % self.page_size:
            self.evictable_pages -= 1
        self.evictions += 1

    def stats(self) -> dict[str, Any]:
        return {"entries": self.num_entries, "evictable_pages": self.evictable_pages, "queries": self.queries,
                "hits": self.hits, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "evictions": self.evictions, "hit_rate": self.hit_rate()}
