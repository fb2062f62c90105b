"""Which replica last served a prompt starting like this one: the router's guess at whose prefix cache holds it.

Prompts are compared as text (the router has no tokenizer): a request body's messages or prompt, rendered in a fixed
way, cut into blocks of `block_chars` characters, each block's key a hash of it and of every block before it (so a
key stands for the whole prefix up to its block, as vLLM's KV block hashes do). The index keeps the most recent
`capacity` keys (least recently used dropped first) with the replica that last saw each.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Any


def prompt_text(body: dict[str, Any]) -> str:
    """The text a chat or completions request body starts its prompt with ("" where it has none): messages as
    role and content in order, a prompt as given (token ids as numbers)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)
                parts.append(f"<{m.get('role')}>{text}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):   # a batch: routed by its first
        return prompt[0]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return ""


def block_keys(text: str, block_chars: int) -> list[bytes]:
    """One key per whole block of `text`, each covering the prefix up to the end of its block."""
    keys, h = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h = hashlib.blake2b(h + text[start:start + block_chars].encode(), digest_size=16).digest()
        keys.append(h)
    return keys


class PrefixIndex:
    def __init__(self, block_chars: int = 64, capacity: int = 200_000):
        if block_chars < 1 or capacity < 1:
            raise ValueError("block_chars and capacity must be positive")
        self.block_chars = block_chars
        self.capacity = capacity
        self._owner: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, text: str, replicas: set[str] | None = None) -> tuple[str | None, int]:
        """(the replica holding the longest prefix of `text` among `replicas` (None: any), its length in
        characters); (None, 0) where no whole block matches."""
        best, length = None, 0
        for i, key in enumerate(block_keys(text, self.block_chars)):
            owner = self._owner.get(key)
            if owner is None:
                break   # a longer prefix cannot be indexed without this one (keys chain)
            if replicas is None or owner in replicas:
                best, length = owner, (i + 1) * self.block_chars
        return best, length

    def insert(self, text: str, replica: str) -> None:
        """`replica` now holds `text`'s prefix (it was sent there)."""
        for key in block_keys(text, self.block_chars):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, keep: set[str]) -> None:
        """Drop what replicas other than `keep` held (they died or were scaled away: their caches are gone)."""
        for key in [k for k, r in self._owner.items() if r not in keep]:
            del self._owner[key]
