"""`mlcc chat`: a terminal chat that streams tokens (or answers one --prompt and exits)."""

from __future__ import annotations

import sys
import time

from mlcc.options import EngineConfig
from mlcc.runtime.engine import Engine


def run_chat(model: str | None, config: EngineConfig | None = None, prompt: str | None = None,
             max_tokens: int = 256, temperature: float = 0.0) -> int:
    """config: the engine's settings (mlcc.options.EngineConfig; default: batch 1)."""
    t0 = time.time()
    engine = Engine(model, config=config or EngineConfig(max_batch=1))
    print(f"[{engine.model_name} on {engine.model.config['target']}, ready in {time.time() - t0:.1f}s]",
          file=sys.stderr)
    history: list[dict[str, str]] = []
    try:
        while True:
            if prompt is not None:
                text = prompt
            else:
                try:
                    text = input(">>> ")
                except EOFError:
                    return 0
                if text.strip() in ("/exit", "/quit"):
                    return 0
                if text.strip() == "/reset":
                    history.clear()
                    continue
                if not text.strip():
                    continue
            history.append({"role": "user", "content": text})
            answer, t1, n = "", time.time(), 0
            for chunk in engine.chat.completions.create(messages=history, stream=True, max_tokens=max_tokens,
                                                        temperature=temperature,
                                                        stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    answer += chunk.choices[0].delta.content
                    sys.stdout.write(chunk.choices[0].delta.content)
                    sys.stdout.flush()
                if chunk.usage:
                    n = chunk.usage.completion_tokens
            dt = time.time() - t1
            print()
            print(f"[{n} tokens, {n / dt:.1f} tok/s]", file=sys.stderr)
            history.append({"role": "assistant", "content": answer})
            if prompt is not None:
                return 0
    finally:
        engine.shutdown()
