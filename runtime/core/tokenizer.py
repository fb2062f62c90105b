"""Tokenizer (HF `tokenizers`) and chat template (jinja2, rendered the way transformers does)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from mlcc.errors import RequestError


class Tokenizer:
    def __init__(self, model_dir: Path, info: dict[str, Any]):
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: the artifacts folder has no tokenizer; recompile from a source that "
                                    "ships tokenizer.json (or a GGUF with tokenizer metadata)")
        self.tok = HFTokenizer.from_file(str(path))
        self.info = info
        self.bos_token = info.get("bos_token")
        self.eos_token = info.get("eos_token")
        eos = set(info.get("eos_token_ids") or [])
        if self.eos_token is not None and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        self.eos_ids = eos
        self.chat_template: str | None = info.get("chat_template") or None
        self._template = _compile_template(self.chat_template) if self.chat_template else None
        # add_bos_token (tokenizer_config.json, or the GGUF's tokenizer.ggml.add_bos_token): a raw prompt starts
        # with the BOS token. Chat templates write it into the text themselves ({{ bos_token }}).
        bos_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.prompt_bos_id = bos_id if info.get("add_bos_token") else None

    def encode(self, text: str) -> list[int]:
        """The text's ids, special tokens written in it included; nothing added (a rendered chat template)."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A completions prompt: the text's ids after the BOS token where the tokenizer wants one, unless the text
        already starts with it."""
        ids = self.encode(text)
        if self.prompt_bos_id is not None and ids[:1] != [self.prompt_bos_id]:
            ids.insert(0, self.prompt_bos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stream(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        """skip_special_tokens=False where a parser reads tags that are special tokens (Mistral's [TOOL_CALLS])."""
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """messages as validated by runtime.api.protocol (content a string or None); tools in OpenAI's form, given to
        templates that render them (`tools` in HF's apply_chat_template); template_kwargs: more variables for the
        template (a request's chat_template_kwargs, e.g. {"enable_thinking": false})."""
        if self._template is None:
            raise RequestError("this model has no chat template; use completions.create(prompt=...) instead",
                               param="messages")
        msgs = [{**m, "content": m.get("content") or ""} for m in messages]
        extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        extra.update(messages=msgs, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                     eos_token=self.eos_token or "")
        try:
            return self._template.render(**extra)
        except jinja2.TemplateError as e:
            raise RequestError(f"the model's chat template rejected these messages: {e}", param="messages") from e


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class StreamDecoder:
    """Incremental detokenisation that never emits half a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer.tok
        self._skip = skip_special_tokens
        self._ds = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._chars = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._ds.step(self._tok, token_id) or ""
        self._chars += len(text)
        return text

    def flush(self) -> str:
        """At the end: what is still held back (bytes of a character that never completed), as the whole
        decode shows it (U+FFFD)."""
        whole = self._tok.decode(self._ids, skip_special_tokens=self._skip)
        return whole[self._chars:] if len(whole) > self._chars else ""
